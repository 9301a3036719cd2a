"""kvpress's generic press checks on pagekv's presses; run INSIDE kvpress's venv:
``PYTHONPATH=<repo> <kvpress venv>/bin/python tests/kvpress_generic/checks.py OUT.json``.

The checks of kvpress's tests/presses/test_presses.py, test_press_call.py, test_pipeline.py and
test_generate.py, on tiny random models saved to a temporary folder that stands in for the hub
model they load. Each case writes ``ok``, its facts or its traceback to OUT.json;
tests/test_kvpress_generic.py asserts every case."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from kvpress import (
    AdaKVPress,
    BasePress,
    ComposedPress,
    KeyRerotationPress,
    KnormPress,
    ScorerPress,
)

from experiments.peer.kvpress_peer import kvpress_kept
from pagekv import EvictionConfig, plan
from pagekv.integrations.kvpress_press import (
    KVPRESS_BASE,
    MeanPoolPagePress,
    PageEntroKVPress,
)
from pagekv.runtime.reconstruct import (
    REPEAT_PROMPT,
    as_profiles,
    reconstruction_masses,
    reconstruction_scores,
)

VOCAB = 1024  # kvpress's tests draw ids from randint(0, 1024)
LOGGER = "pagekv.integrations.kvpress_press"


def byte_tokenizer():
    """Byte-level BPE, no merges: bytes are ids 3..258, <unk> <s> </s> = 0 1 2, no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_models(root: Path) -> dict[str, Path]:
    """Folders of tiny random models with the byte tokenizer: ``llama_mha`` (4 = 4 heads),
    ``qwen2_gqa`` (8 over 2 KV heads), ``llama_eager``."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=2048,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    specs = {
        "llama_mha": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            dict(num_attention_heads=4, num_key_value_heads=4),
        ),
        "qwen2_gqa": (
            transformers.Qwen2Config,
            transformers.Qwen2ForCausalLM,
            dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
        ),
    }
    tok = byte_tokenizer()
    out = {}
    for name, (cfg_cls, model_cls, heads) in specs.items():
        torch.manual_seed(0)
        model = model_cls(cfg_cls(**common, **heads)).eval()
        folder = root / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out[name] = folder
    out["llama_eager"] = out["llama_mha"]
    return out


def load(folder: Path, eager: bool = False):
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": "eager"} if eager else {}
    return AutoModelForCausalLM.from_pretrained(str(folder), **kw).eval()


#: The pagekv presses every generic check runs: (id, class, scorer).
VARIANTS = (
    ("entropy-window", PageEntroKVPress, "window"),
    ("entropy-reconstruct", PageEntroKVPress, "reconstruct"),
    ("meanpool-window", MeanPoolPagePress, "window"),
    ("meanpool-reconstruct", MeanPoolPagePress, "reconstruct"),
)
RATIOS = (0.2, 0.8)  # kvpress's default_presses: every press at these two ratios


def make(cls, scorer: str, **kw):
    return cls(scorer=scorer, record=True, backend="torch", **kw)


def expected_kept(n: int, ratio: float, page_size: int, window: int, n_sink: int = 4) -> int:
    """Tokens a dense page plan keeps (``page_size`` divides ``n``): protected pages, then whole
    pages up to kvpress's k; the protected pages alone when they exceed k."""
    assert n % page_size == 0
    k = kvpress_kept(n, ratio)
    pages = n // page_size
    protected = set(range(-(-n_sink // page_size))) | set(
        range((n - min(window, n)) // page_size, pages)
    )
    kept = len(protected) * page_size
    if kept > k:
        return kept
    return kept + ((k - kept) // page_size) * page_size


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def capture_logs(name: str) -> Records:
    h = Records()
    lg = logging.getLogger(name)
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    return h


def release(h: Records, name: str) -> None:
    logging.getLogger(name).removeHandler(h)


def prefill_plain(model, ids: torch.Tensor):
    """The uncompressed prefill's cache (the reference the kept keys are gathered from)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


def check_kept_keys(press, cache, ref) -> None:
    """Every layer holds exactly the reference keys and values at ``press.plans``' indices."""
    assert set(press.plans) == set(range(len(cache.layers))), sorted(press.plans)
    for i, (la, rl) in enumerate(zip(cache.layers, ref.layers, strict=True)):
        idx = press.plans[i].kept_indices()  # [B, G, k']
        B, G, k = idx.shape
        gather = idx[..., None].expand(B, G, k, rl.keys.shape[-1])
        assert torch.equal(la.keys, rl.keys.gather(2, gather)), f"keys of layer {i}"
        assert torch.equal(la.values, rl.values.gather(2, gather)), f"values of layer {i}"


CASES: dict = {}  # case id -> a function returning the facts it measured


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


def presses_run_cases(models):
    """test_presses_run (no wrapper), ratios 0.2/0.8: the cache shrank to the planned whole pages in
    every layer, holding exactly the planned keys and values."""
    from transformers import DynamicCache

    for model_name in ("llama_mha", "qwen2_gqa"):
        for vid, cls, scorer in VARIANTS:
            for ratio in RATIOS:

                def run(model_name=model_name, cls=cls, scorer=scorer, ratio=ratio):
                    model = models[model_name]()
                    gen = torch.Generator().manual_seed(0)
                    ids = torch.randint(0, VOCAB, (1, 128), generator=gen)
                    press = make(cls, scorer, compression_ratio=ratio)
                    press.post_init_from_model(model)
                    logs = capture_logs(LOGGER)
                    try:
                        cache = DynamicCache()
                        with torch.no_grad(), press(model):
                            out = model(ids, past_key_values=cache).past_key_values
                    finally:
                        release(logs, LOGGER)
                    assert out is cache
                    assert hasattr(press, "compression_ratio")
                    want = expected_kept(128, ratio, press.page_size, press.window)
                    got = [int(la.keys.shape[2]) for la in cache.layers]
                    assert got == [want] * len(cache.layers), (got, want)
                    assert cache.get_seq_length() == want
                    check_kept_keys(press, cache, prefill_plain(model, ids))
                    warned = sum("keeps only the protected pages" in m for m in logs.messages)
                    infeasible = want > kvpress_kept(128, ratio)
                    assert warned == (1 if infeasible else 0), logs.messages
                    return {"kept": want, "k": kvpress_kept(128, ratio), "warned": warned}

                CASES[f"presses_run[{model_name}-{vid}-{ratio}]"] = run


def composed_wrapper_cases(models):
    """test_presses_run under ComposedPress: the window scorer keeps the same pages; the reconstruct
    scorer (like KVzipPress) refuses to run layer by layer."""
    from transformers import DynamicCache

    for vid, cls, scorer in VARIANTS:
        for ratio in RATIOS:

            def run(cls=cls, scorer=scorer, ratio=ratio):
                model = models["qwen2_gqa"]()
                ids = torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(1))
                press = make(cls, scorer, compression_ratio=ratio)
                composed = ComposedPress(presses=[press])
                composed.post_init_from_model(model)
                if scorer == "reconstruct":
                    try:
                        with torch.no_grad(), composed(model):
                            model(ids, past_key_values=DynamicCache())
                    except ValueError as e:
                        assert "one layer at a time" in str(e), str(e)
                        return {"refused": str(e)[:120]}
                    raise AssertionError("ComposedPress ran scorer='reconstruct' per layer")
                cache = DynamicCache()
                with torch.no_grad(), composed(model):
                    model(ids, past_key_values=cache)
                want = expected_kept(128, ratio, press.page_size, press.window)
                assert [int(la.keys.shape[2]) for la in cache.layers] == [want] * 2
                assert abs(composed.compression_ratio - ratio) < 1e-12
                check_kept_keys(press, cache, prefill_plain(model, ids))
                return {"kept": want, "composed_ratio": composed.compression_ratio}

            CASES[f"presses_run_composed[{vid}-{ratio}]"] = run


@case("presses_run_other_wrappers")
def other_wrappers():
    """test_presses_run's ScorerPress-only wrappers refuse pagekv's presses."""
    facts = {}
    for vid, cls, scorer in VARIANTS:
        press = make(cls, scorer, compression_ratio=0.5)
        assert isinstance(press, BasePress) and not isinstance(press, ScorerPress)
        facts[vid] = "not a ScorerPress"
    for wrapper in (AdaKVPress, KeyRerotationPress):
        try:
            wrapper(press=PageEntroKVPress(compression_ratio=0.5))
        except AssertionError:
            facts[wrapper.__name__] = "refuses a non-ScorerPress"
        else:
            raise AssertionError(f"{wrapper.__name__} accepted a non-ScorerPress")
    return facts


@case("composed_press")
def composed_press():
    """test_composed_press: PageEntroKVPress then KnormPress (0.5 each), on the dummy inputs (all
    protected) and on 128 tokens (64 kept in pages, then 32)."""
    from transformers import DynamicCache

    model = MODELS["llama_mha"]()
    facts = {}
    for label, ids in (
        ("dummy", model.dummy_inputs["input_ids"]),
        ("128", torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(2))),
    ):
        page = PageEntroKVPress(compression_ratio=0.5, backend="torch")
        composed = ComposedPress([page, KnormPress(compression_ratio=0.5)])
        cache = DynamicCache()
        with torch.no_grad(), composed(model):
            model(ids, past_key_values=cache)
        n = ids.shape[1]
        first = n if label == "dummy" else expected_kept(n, 0.5, 16, 32)
        want = kvpress_kept(first, 0.5)
        got = [int(la.keys.shape[2]) for la in cache.layers]
        assert got == [want] * len(got), (label, got, want)
        assert abs(composed.compression_ratio - 0.75) < 1e-12
        facts[label] = {"n": n, "after_page_press": first, "after_knorm": want}
    return facts


def hook_cases(models):
    """test_context_manager_adds_and_removes_hook: one hook per attention module inside the block,
    none after (the reconstruct scorer wraps ``model.model.forward`` instead)."""
    for vid, cls, scorer in VARIANTS:

        def run(cls=cls, scorer=scorer):
            model = models["llama_mha"]()
            press = make(cls, scorer, compression_ratio=0.2)
            attn = [layer.self_attn for layer in model.model.layers]
            with press(model):
                inside = [len(a._forward_hooks) for a in attn]
                wrapped = "forward" in vars(model.model)
            after = [len(a._forward_hooks) for a in attn]
            assert after == [0] * len(attn)
            assert "forward" not in vars(model.model)
            if scorer == "window":
                assert inside == [1] * len(attn) and not wrapped
            else:
                assert inside == [0] * len(attn) and wrapped
            return {"hooks_inside": inside, "forward_wrapped_inside": wrapped}

        CASES[f"context_manager_adds_and_removes_hook[{vid}]"] = run


def applies_compression_cases(models):
    """test_context_manager_applies_compression: inside the block every layer holds the kept count,
    after it nothing is compressed; the reconstruct scorer refuses a batch."""
    from transformers import DynamicCache

    for vid, cls, scorer in VARIANTS:

        def run(cls=cls, scorer=scorer):
            model = models["llama_mha"]()
            facts = {}
            dummy = model.dummy_inputs["input_ids"]
            press = make(cls, scorer, compression_ratio=0.2)
            if scorer == "window":
                with torch.no_grad(), press(model):
                    cache = model(dummy, past_key_values=DynamicCache()).past_key_values
                n = dummy.shape[-1]
                for la in cache.layers:
                    assert la.keys.shape[2] == la.values.shape[2] == n == cache.get_seq_length()
                facts["dummy_kept"] = n
            else:
                try:
                    with torch.no_grad(), press(model):
                        model(dummy, past_key_values=DynamicCache())
                except ValueError as e:
                    assert "batch size 1" in str(e), str(e)
                    facts["dummy"] = "refused: batch size 1"
                else:
                    raise AssertionError("reconstruct ran a batch of 3")
            ids = torch.randint(0, VOCAB, (1, 128), generator=torch.Generator().manual_seed(3))
            with torch.no_grad(), press(model):
                cache = model(ids, past_key_values=DynamicCache()).past_key_values
            want = expected_kept(128, 0.2, 16, 32)
            for la in cache.layers:
                assert la.keys.shape[2] == la.values.shape[2] == want == cache.get_seq_length()
            with torch.no_grad():
                cache = model(ids, past_key_values=DynamicCache()).past_key_values
            assert all(la.keys.shape[2] == 128 for la in cache.layers)
            facts["kept_of_128"] = want
            return facts

        CASES[f"context_manager_applies_compression[{vid}]"] = run


def pipeline_cases(folders):
    """test_pipeline.py: the pipeline answers strings and logs the compressed context (the
    reconstruct scorer compresses after that log line, so it is read on the cache)."""
    from transformers import DynamicCache, pipeline

    for model_name in ("llama_mha", "qwen2_gqa"):
        for vid, cls, scorer in VARIANTS:

            def run(model_name=model_name, cls=cls, scorer=scorer):
                pipe = pipeline("kv-press-text-generation", model=str(folders[model_name]))
                context = "This is a test article. It was written on 2022-01-01."
                question = "When was this article written?"
                facts = {}
                for label, call in (
                    ("questions", {"questions": [question]}),
                    ("two_questions", {"questions": [question, question]}),
                    ("question", {"question": question}),
                    ("no_question", {"question": ""}),
                ):
                    press = make(cls, scorer, compression_ratio=0.4, page_size=4, window=8)
                    cache = DynamicCache()
                    logs = capture_logs("kvpress.pipeline")
                    try:
                        out = pipe(context, press=press, cache=cache, max_new_tokens=5, **call)
                    finally:
                        release(logs, "kvpress.pipeline")
                    answers = out["answers"] if "questions" in call else [out["answer"]]
                    assert len(answers) == len(call.get("questions", [None]))
                    assert all(isinstance(a, str) for a in answers)
                    n = int(pipe.preprocess(context, [""], "", 10**9)["context_ids"].shape[1])
                    kept = int(press.plans[0].kept_indices().shape[-1])
                    assert kept <= kvpress_kept(n, 0.4), (kept, n)
                    assert kept < n, (kept, n)
                    assert f"Context Length: {n}" in logs.messages, logs.messages
                    logged = n if scorer == "reconstruct" else kept
                    assert f"Compressed Context Length: {logged}" in logs.messages, logs.messages
                    # the answer was cut off the cache: it holds the compressed context
                    assert [int(la.keys.shape[2]) for la in cache.layers] == [kept] * len(
                        cache.layers
                    )
                    facts[label] = {"n": n, "kept": kept, "answers": answers}
                return facts

            CASES[f"pipeline[{model_name}-{vid}]"] = run


def generate_cases(models):
    """test_generate: ``generate`` under the press equals greedy decoding on the cache the press
    compressed; the reconstruct scorer refuses decoding inside the block."""
    from transformers import DynamicCache

    for vid, cls, scorer in VARIANTS:

        def run(cls=cls, scorer=scorer):
            model = models["qwen2_gqa"]()
            ids = torch.randint(3, VOCAB, (1, 96), generator=torch.Generator().manual_seed(4))
            press = make(cls, scorer, compression_ratio=0.4)
            if scorer == "reconstruct":
                try:
                    with torch.no_grad(), press(model):
                        model.generate(ids, max_new_tokens=4, do_sample=False)
                except ValueError as e:
                    assert "one forward" in str(e), str(e)
                    return {"generate_inside_block": "refused"}
                raise AssertionError("reconstruct ran generate's decoding inside the block")
            with torch.no_grad(), press(model):
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False
                )
            got = out[0, ids.shape[1] :].tolist()
            cache = DynamicCache()
            with torch.no_grad():
                with press(model):
                    logits = model(ids, past_key_values=cache).logits[0, -1]
                n, tokens = ids.shape[1], [int(logits.argmax())]
                for step in range(5):
                    logits = model(
                        torch.tensor([[tokens[-1]]]),
                        past_key_values=cache,
                        position_ids=torch.tensor([[n + step]]),
                    ).logits[0, -1]
                    tokens.append(int(logits.argmax()))
            assert got == tokens, (got, tokens)
            return {"tokens": got}

        CASES[f"generate[{vid}]"] = run


def observed_attention_cases(models):
    """test_presses_run_observed_attention: an eager model on the dummy inputs."""
    from transformers import DynamicCache

    for vid, cls, scorer in VARIANTS:
        for ratio in RATIOS:

            def run(cls=cls, scorer=scorer, ratio=ratio):
                model = models["llama_eager"]()
                assert model.config._attn_implementation == "eager"
                ids = model.dummy_inputs["input_ids"]
                if scorer == "reconstruct":
                    ids = ids[:1]
                press = make(cls, scorer, compression_ratio=ratio)
                with torch.no_grad(), press(model):
                    cache = model(ids, past_key_values=DynamicCache()).past_key_values
                assert cache.get_seq_length() == ids.shape[1]  # 5 tokens: all protected
                return {"batch": int(ids.shape[0]), "kept": cache.get_seq_length()}

            CASES[f"observed_attention[{vid}-{ratio}]"] = run


def keep_planned_cases(models):
    """test_presses_keep_highest_score: at ratios 0.0 to 0.8 on 5 x 256 ids the kept keys are each
    sequence's planned pages (window scorer)."""
    from transformers import DynamicCache

    for vid, cls, scorer in VARIANTS:
        if scorer != "window":
            continue

        def run(cls=cls, scorer=scorer):
            model = models["llama_mha"]()
            ids = torch.randint(0, VOCAB, (5, 256), generator=torch.Generator().manual_seed(5))
            ref = prefill_plain(model, ids)
            facts = {}
            for ratio in (0.0, 0.2, 0.4, 0.6, 0.8):
                press = make(cls, scorer, compression_ratio=ratio)
                cache = DynamicCache()
                with torch.no_grad(), press(model):
                    model(ids, past_key_values=cache)
                if ratio == 0.0:  # kvpress's default: no compression
                    assert not press.plans and cache.get_seq_length() == 256
                    for la, rl in zip(cache.layers, ref.layers, strict=True):
                        assert torch.equal(la.keys, rl.keys)
                else:
                    check_kept_keys(press, cache, ref)
                facts[str(ratio)] = cache.get_seq_length()
            return facts

        CASES[f"keep_planned[{vid}]"] = run


def reconstruct_reference_cases(models):
    """Not kvpress's: the reconstruct scorer under BasePress keeps per layer the pages pagekv plans
    from its own reconstruction pass; the window scorer keeps others."""
    from transformers import AutoTokenizer, DynamicCache

    for model_name in ("llama_mha", "qwen2_gqa"):
        for vid, cls, scorer in VARIANTS:
            if scorer != "reconstruct":
                continue

            def run(model_name=model_name, cls=cls):
                model = models[model_name]()
                ids = torch.randint(3, VOCAB, (1, 200), generator=torch.Generator().manual_seed(6))
                press = make(cls, "reconstruct", budget=0.4, page_size=8, window=16)
                cache = DynamicCache()
                with torch.no_grad(), press(model):
                    model.model(input_ids=ids, past_key_values=cache)
                tok = AutoTokenizer.from_pretrained(model.config.name_or_path)
                instr = tok.encode(REPEAT_PROMPT, add_special_tokens=False)
                assert instr and press.instruction_ids(model) == instr
                ref = prefill_plain(model, ids)
                keep = prefill_plain(model, ids)
                scores = reconstruction_scores(model, ref, ids[0].tolist(), instr)
                prof = as_profiles(scores["max"])
                cfg = EvictionConfig(
                    policy=press.policy, budget=0.4, page_size=8, window=16, scorer="reconstruct"
                )
                want = plan(prof, cache.layers[0].keys.shape[1], cfg,
                            masses=reconstruction_masses(scores, prof, cfg.n_sink))  # fmt: skip
                idx = want.kept_indices()  # [L, G, k']
                for i, la in enumerate(cache.layers):
                    assert torch.equal(press.plans[i].page_keep[0], want.page_keep[i]), i
                    g = idx[i][None, :, :, None].expand(1, -1, -1, la.keys.shape[-1])
                    assert torch.equal(la.keys, keep.layers[i].keys.gather(2, g)), i
                    assert torch.equal(la.values, keep.layers[i].values.gather(2, g)), i
                assert cache.get_seq_length() == idx.shape[-1]
                window = make(cls, "window", budget=0.4, page_size=8, window=16)
                with torch.no_grad(), window(model):
                    model.model(input_ids=ids, past_key_values=DynamicCache())
                differs = [
                    not torch.equal(window.plans[i].page_keep, press.plans[i].page_keep)
                    for i in range(len(cache.layers))
                ]
                assert any(differs), "the window scorer kept the same pages everywhere"
                return {"kept": int(idx.shape[-1]), "window_differs": differs}

            CASES[f"reconstruct_matches_pagekv[{model_name}-{vid}]"] = run


MODELS: dict = {}


def main(out_path: str, only: list[str]) -> int:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    assert KVPRESS_BASE, "kvpress does not import here: run this in kvpress's venv"
    tmp = tempfile.TemporaryDirectory()
    folders = build_models(Path(tmp.name))
    cache: dict = {}

    def loader(name):
        def get():
            if name not in cache:
                cache[name] = load(folders[name], eager=name == "llama_eager")
            return cache[name]

        return get

    MODELS.update({name: loader(name) for name in folders})
    presses_run_cases(MODELS)
    composed_wrapper_cases(MODELS)
    hook_cases(MODELS)
    applies_compression_cases(MODELS)
    pipeline_cases(folders)
    generate_cases(MODELS)
    observed_attention_cases(MODELS)
    keep_planned_cases(MODELS)
    reconstruct_reference_cases(MODELS)
    results = {}
    for name, fn in CASES.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            results[name] = {"ok": True, "facts": fn()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        print(("ok   " if results[name]["ok"] else "FAIL ") + name, flush=True)
    Path(out_path).write_text(json.dumps(results, indent=1, default=str))
    tmp.cleanup()
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
