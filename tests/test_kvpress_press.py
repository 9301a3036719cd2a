"""Page-EntroKV as a kvpress press (`pagekv.integrations.kvpress_press`).

Default suite (no kvpress): settings, budget accounting and the hook on tiny random models,
against `plan`, the runner and pagekv's own reconstruction pass. Opt-in
(``PAGEKV_TEST_KVPRESS=1``): parity with the runner on the bundled model, docs/kvpress.md's
example as written, and ``scorer="reconstruct"`` through kvpress's pipeline."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from experiments.peer import kvpress_peer as kp
from pagekv import BudgetError, EvictionConfig, plan
from pagekv.integrations import kvpress_press as kpp
from pagekv.integrations.kvpress_press import MeanPoolPagePress, PageEntroKVPress
from tests.test_runner import stored_layers
from tests.test_wheel import build_wheel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    """A random Llama: 3 layers, H = 6 query heads, G = 2 KV heads (r = 3), d = 8."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _prefill(model, ids, press=None):
    """The cache of one prefill of `ids`, under `with press(model):` when given."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with torch.inference_mode(), ctx:
        model.model(input_ids=torch.tensor([ids]), cache=cache)
    return cache


def _random_ids(n, seed=0):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


needs_protocol = pytest.mark.skipif(
    kpp.KVPRESS_BASE, reason="kvpress imports here: its own hook needs transformers < 5.3"
)


def test_module_imports_without_kvpress_and_pagekv_stays_light():
    code = (
        "import sys, pagekv, pagekv.integrations; "
        "bad = [m for m in ('kvpress', 'transformers', 'triton', 'gradio') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run(
        [os.sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_defaults_follow_kvpress_and_pagekv():
    p = PageEntroKVPress()
    assert not p.compresses and p.budget_tokens(100) == 100  # kvpress's default: no press
    assert (p.policy, p.page_size, p.n_sink, p.window, p.tau) == ("entropy", 16, 4, 32, 1.0)
    assert MeanPoolPagePress().policy == "mean"
    assert isinstance(MeanPoolPagePress(), PageEntroKVPress)
    assert not PageEntroKVPress(budget=0.5, policy="full").compresses
    assert not PageEntroKVPress(compression_ratio=0.0).compresses


@pytest.mark.parametrize("beta", [0.05, 0.1, 0.2, 0.29, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("n", [1, 7, 63, 100, 129, 1000, 4097])
def test_budget_and_ratio_give_our_k_and_kvpress_k(beta, n):
    k = EvictionConfig(budget=beta).budget_tokens(n)
    by_budget = PageEntroKVPress(budget=beta)
    assert by_budget.budget_tokens(n) == k
    assert by_budget.eviction_config(n).budget_tokens(n) == k
    ratio = 1.0 - beta
    if ratio < 1.0 and k >= 1:
        # kvpress's own count at this ratio, which the naive 1 - beta can put 1 below k
        by_ratio = PageEntroKVPress(compression_ratio=ratio) if ratio > 0 else None
        if by_ratio is not None:
            kv = kp.kvpress_kept(n, ratio)
            assert by_ratio.budget_tokens(n) == kv
            assert by_ratio.eviction_config(n).budget_tokens(n) == kv
            assert kv in (k, k - 1) or kv == 1  # the rounding trap, or kvpress's floor of 1
        exact = PageEntroKVPress(compression_ratio=kp.ratio_for_budget(beta, n))
        if exact.compresses:
            assert exact.budget_tokens(n) == k
            assert exact.eviction_config(n).budget_tokens(n) == k


def test_rounding_trap_is_kvpress_not_ours():
    # 1 - (1 - 0.1) = 0.0999...: kvpress keeps 9 of 100, our budget 0.1 keeps 10.
    assert PageEntroKVPress(compression_ratio=1 - 0.1).budget_tokens(100) == 9
    assert PageEntroKVPress(budget=0.1).budget_tokens(100) == 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget": 0.2, "compression_ratio": 0.8}, "not both"),
        ({"budget": 0.0}, "budget must be"),
        ({"budget": 1.5}, "budget must be"),
        ({"budget": "0.2"}, "budget must be"),
        ({"budget": True}, "budget must be"),
        ({"budget": float("nan")}, "budget must be"),
        ({"compression_ratio": 1.0}, "compression_ratio must be"),
        ({"compression_ratio": -0.1}, "compression_ratio must be"),
        ({"budget": 0.2, "policy": "head_independent"}, "dense kvpress cache"),
        ({"budget": 0.2, "policy": "h2o"}, "policy must be one of"),
        ({"budget": 0.2, "page_size": 0}, "page_size"),
        ({"budget": 0.2, "window": 0}, "window"),
        ({"budget": 0.2, "n_sink": -1}, "n_sink"),
        ({"budget": 0.2, "tau": 0.0}, "tau"),
        ({"budget": 0.2, "backend": "cuda"}, "backend must be one of"),
    ],
)
def test_bad_settings_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageEntroKVPress(**kwargs)


def test_ratio_set_after_construction_is_checked_in_compress(tiny):
    # kvpress's evaluation registers a press, then assigns press.compression_ratio.
    press = PageEntroKVPress(page_size=4, window=8)
    press.compression_ratio = 0.5
    cache = _prefill(tiny, list(range(1, 41)), press) if not kpp.KVPRESS_BASE else None
    if cache is not None:
        assert cache.layers[0].keys.shape[2] <= 20
    press.budget = 0.5  # now both: the next compress refuses
    attn = tiny.model.layers[0].self_attn
    keys = torch.zeros(1, 2, 40, 8)
    with pytest.raises(ValueError, match="not both"):
        press.compress(attn, torch.zeros(1, 40, 48), keys, keys, None, {})


def _layer_inputs(model, ids):
    """Layer 1's hidden states, keys, values and rotary tables for the prompt `ids`."""
    attn = model.model.layers[1].self_attn
    captured = {}

    def hook(module, args, kwargs, output):
        captured["hidden"], captured["pe"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    h = attn.register_forward_hook(hook, with_kwargs=True)
    try:
        cache = _prefill(model, ids)
    finally:
        h.remove()
    la = cache.layers[1]
    return attn, captured["hidden"], la.keys, la.values, captured["pe"]


def _profiles_by_hand(attn, hidden, keys, pe, w):
    """The definition, written out: mean causal softmax of the last w queries."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, n, _ = hidden.shape
    H, d = attn.config.num_attention_heads, attn.head_dim
    G = keys.shape[1]
    q = attn.q_proj(hidden[:, -w:]).view(B, w, H, d).transpose(1, 2)
    cos, sin = pe
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -w:], sin[:, -w:])
    k = keys.repeat_interleave(H // G, dim=1)  # [B, H, n, d]
    logits = (q.float() @ k.float().transpose(2, 3)) * attn.scaling  # [B, H, w, n]
    pos_q = torch.arange(n - w, n)[:, None]
    logits = logits.masked_fill(torch.arange(n)[None, :] > pos_q, float("-inf"))
    return logits.softmax(-1).mean(2)  # [B, H, n]


@pytest.mark.parametrize(
    "n, budget, P, policy",
    [
        (63, 0.5, 4, "entropy"),
        (100, 0.7, 16, "entropy"),
        (129, 0.3, 8, "mean"),
        (64, 0.5, 1, "entropy"),
        (90, 0.4, 4, "max"),
        (77, 0.6, 8, "entropy_nosink"),
        (80, 0.5, 8, "streaming"),
    ],
    ids=lambda v: str(v),
)
def test_compress_keeps_what_plan_keeps(tiny, n, budget, P, policy):
    attn, hidden, keys, values, pe = _layer_inputs(tiny, _random_ids(n))
    press = PageEntroKVPress(budget=budget, page_size=P, window=16, policy=policy, record=True)
    with torch.inference_mode():
        k2, v2 = press.compress(attn, hidden, keys, values, None, {"position_embeddings": pe})
    cfg = EvictionConfig(policy=policy, budget=budget, page_size=P, window=16)
    with torch.inference_mode():
        prof = _profiles_by_hand(attn, hidden, keys, pe, min(16, n))
    ref = plan(prof, n_groups=2, config=cfg)
    idx = ref.kept_indices()[0]  # [G, k']
    assert torch.equal(press.plans[1].page_keep, ref.page_keep), "page_keep"
    # exact accounting: k' = the kept pages' sizes, <= floor(budget * n), equal per KV head
    kept = int(ref.union_tokens[0, 0])
    assert kept <= cfg.budget_tokens(n) and bool((ref.union_tokens == kept).all())
    assert kept == int((ref.page_keep[0, 0].long() * ref.page_sizes).sum())
    assert k2.shape == (1, 2, kept, keys.shape[3]) and v2.shape == k2.shape
    gather = idx[None, :, :, None].expand(1, 2, kept, keys.shape[3])
    assert torch.equal(k2, keys.gather(2, gather)), "keys"
    assert torch.equal(v2, values.gather(2, gather)), "values"


def test_compress_negative_control_other_policy_differs(tiny):
    # The check above can fail: mean pooling keeps other pages than max pooling here.
    attn, hidden, keys, values, pe = _layer_inputs(tiny, _random_ids(129, 3))
    kw = {"position_embeddings": pe}
    got = {}
    for pol in ("mean", "max"):
        press = PageEntroKVPress(budget=0.3, page_size=4, window=8, policy=pol, record=True)
        with torch.inference_mode():
            press.compress(attn, hidden, keys, values, None, kw)
        got[pol] = press.plans[1].page_keep
    assert not torch.equal(got["mean"], got["max"])


def test_batch_gets_pages_per_sequence(tiny):
    a = _layer_inputs(tiny, _random_ids(64, 1))
    b = _layer_inputs(tiny, _random_ids(64, 2))
    attn = a[0]
    hidden = torch.cat([a[1], b[1]])
    keys, values = torch.cat([a[2], b[2]]), torch.cat([a[3], b[3]])
    pe = tuple(torch.cat([x, y]) for x, y in zip(a[4], b[4], strict=True))
    press = PageEntroKVPress(budget=0.5, page_size=4, window=8)
    with torch.inference_mode():
        k2, v2 = press.compress(attn, hidden, keys, values, None, {"position_embeddings": pe})
        for i, one in enumerate((a, b)):
            kw = {"position_embeddings": one[4]}
            k1, v1 = press.compress(attn, one[1], one[2], one[3], None, kw)
            assert torch.equal(k2[i : i + 1], k1) and torch.equal(v2[i : i + 1], v1), i


def test_infeasible_budget_names_the_smallest(tiny, caplog):
    # The module docstring's example: n = 100, P = 16, window 32: 52 protected tokens.
    attn, hidden, keys, values, pe = _layer_inputs(tiny, _random_ids(100))
    kw = {"position_embeddings": pe}
    strict = PageEntroKVPress(budget=0.3, page_size=16, window=32, strict=True)
    with pytest.raises(BudgetError, match="0.52"):
        strict.compress(attn, hidden, keys, values, None, kw)
    # By default (a kvpress pipeline never aborts): exactly the protected pages, and ONE
    # warning that names the smallest feasible budget, however many layers ask.
    press = PageEntroKVPress(budget=0.3, page_size=16, window=32, record=True)
    caplog.set_level(logging.WARNING, logger="pagekv")
    for _ in range(3):
        k2, v2 = press.compress(attn, hidden, keys, values, None, kw)
        assert k2.shape[2] == v2.shape[2] == 52
    pages = press.plans[1].page_keep[0]  # [G, 7]: pages 0, 4, 5, 6 and no other
    assert pages[:, [0, 4, 5, 6]].all() and int(pages.sum()) == 4 * pages.shape[0]
    warned = [r for r in caplog.records if "protected pages" in r.getMessage()]
    assert len(warned) == 1 and "0.52" in warned[0].getMessage()
    ok = PageEntroKVPress(budget=0.7, page_size=16, window=32, record=True)
    k2, _ = ok.compress(attn, hidden, keys, values, None, {"position_embeddings": pe})
    assert k2.shape[2] == 68
    pages = ok.plans[1].page_keep[0]  # [G, 7]
    assert pages[:, [0, 4, 5, 6]].all() and int(pages.sum(-1).max()) == 5


def test_missing_rotary_tables_is_a_clear_error(tiny):
    attn, hidden, keys, values, _ = _layer_inputs(tiny, _random_ids(40))
    with pytest.raises(ValueError, match="position_embeddings"):
        PageEntroKVPress(budget=0.5, page_size=4, window=8).compress(
            attn, hidden, keys, values, None, {}
        )


@needs_protocol
@pytest.mark.parametrize(
    "P, budget, policy", [(8, 0.5, "entropy"), (1, 0.3, "entropy"), (4, 0.4, "mean")]
)
def test_press_prefill_equals_runner_evict(tiny, P, budget, policy):
    from pagekv.runtime.runner import Runner

    ids = _random_ids(150, seed=5)
    press = PageEntroKVPress(budget=budget, page_size=P, window=16, policy=policy, record=True)
    cache = _prefill(tiny, ids, press)
    runner = Runner(tiny, None, backend="torch")
    pre = runner.prefill(ids, window_max=32, question_ids=[1, 2, 3])
    cfg = EvictionConfig(policy=policy, budget=budget, page_size=P, window=16)
    ev = runner.evict(pre, cfg)
    stored = stored_layers(runner, pre, ev)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(press.plans[i].page_keep[0], ev.plan.page_keep[i]), f"layer {i}"
        assert torch.equal(layer.keys, stored[i][0]), f"keys of layer {i}"
        assert torch.equal(layer.values, stored[i][1]), f"values of layer {i}"
    # negative control: another budget keeps other pages
    other = runner.evict(pre, cfg.replace(budget=budget + 0.2))
    assert not torch.equal(press.plans[0].page_keep[0], other.plan.page_keep[0])


@needs_protocol
def test_decoding_steps_are_not_pressed(tiny):
    from transformers import DynamicCache

    press = PageEntroKVPress(budget=0.5, page_size=4, window=8)
    cache = DynamicCache()
    ids = list(range(1, 65))
    with torch.inference_mode(), press(tiny):
        tiny.model(input_ids=torch.tensor([ids]), cache=cache)
        k = cache.layers[0].keys.shape[2]
        tiny.model(
            input_ids=torch.tensor([[5, 6]]), cache=cache, position_ids=torch.tensor([[64, 65]])
        )
    assert k <= 32 and cache.layers[0].keys.shape[2] == k + 2


@needs_protocol
def test_unsupported_model_is_refused():
    class NotAModel(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="model.layers"):
        with PageEntroKVPress(budget=0.5)(NotAModel()):
            pass


@pytest.fixture(scope="module")
def gqa():
    """Random GQA decoders from a config (tests/test_runner.py): 8 query heads over 2 KV
    heads (r = 4), 3 layers; Llama and Qwen2 (biased projections)."""
    from .test_runner import tiny_model

    return {"llama": tiny_model("llama"), "qwen2": tiny_model("qwen2")}


def _ids(n: int, seed: int) -> list[int]:
    from .test_runner import prompt

    return prompt(n, seed=seed)


def _reference_plan(model, ids, instr, cfg, chunk=None):
    """pagekv's reconstruction picks computed without the press (scores on a copy of an uncompressed
    prefill, profiles, masses, `plan`), with that prefill's cache."""
    from pagekv.runtime.reconstruct import (
        CHUNK,
        as_profiles,
        reconstruction_masses,
        reconstruction_scores,
    )
    from pagekv.runtime.runner import _new_cache

    full = _prefill(model, ids)
    copy = _new_cache([(la.keys.clone(), la.values.clone()) for la in full.layers])
    scores = reconstruction_scores(model, copy, ids, instr, chunk=chunk or CHUNK)
    prof = as_profiles(scores["max"])
    G = int(full.layers[0].keys.shape[1])
    return plan(prof, G, cfg, masses=reconstruction_masses(scores, prof, cfg.n_sink)), full


def _assert_kept(press, cache, ref, full):
    """Per layer: ref's pages, and exactly the prefill's keys and values at its indices."""
    idx = ref.kept_indices()  # [L, G, k']
    k = int(idx.shape[-1])
    assert cache.get_seq_length() == k
    for i, la in enumerate(cache.layers):
        assert torch.equal(press.plans[i].page_keep[0], ref.page_keep[i]), f"pages of layer {i}"
        assert la.keys.shape[2] == la.values.shape[2] == k, f"length of layer {i}"
        g = idx[i][None, :, :, None].expand(1, -1, -1, la.keys.shape[-1])
        assert torch.equal(la.keys, full.layers[i].keys.gather(2, g)), f"keys of layer {i}"
        assert torch.equal(la.values, full.layers[i].values.gather(2, g)), f"values of {i}"


@pytest.mark.parametrize(
    "arch, n, budget, P, policy, chunk",
    [
        ("llama", 150, 0.4, 8, "entropy", None),
        ("qwen2", 150, 0.4, 8, "entropy", None),
        ("llama", 203, 0.3, 16, "mean", 64),
        ("qwen2", 96, 0.5, 1, "entropy", 7),
        ("llama", 120, 0.5, 4, "max", None),
    ],
    ids=lambda v: str(v),
)
def test_reconstruct_keeps_what_plan_picks(gqa, arch, n, budget, P, policy, chunk):
    model, ids, instr = gqa[arch], _ids(n, seed=7), _ids(6, seed=8)
    kw = {} if chunk is None else {"reconstruct_chunk": chunk}
    press = PageEntroKVPress(
        budget=budget, page_size=P, window=16, policy=policy, scorer="reconstruct",
        reconstruct_prompt_ids=instr, record=True, backend="torch", **kw,
    )  # fmt: skip
    cache = _prefill(model, ids, press)
    cfg = EvictionConfig(policy=policy, budget=budget, page_size=P, window=16, scorer="reconstruct")
    ref, full = _reference_plan(model, ids, instr, cfg, chunk)
    assert press.plans[0].config == cfg
    _assert_kept(press, cache, ref, full)
    assert int(ref.union_tokens[0, 0]) <= cfg.budget_tokens(n)
    # negative control: the window scorer keeps other pages
    window = PageEntroKVPress(budget=budget, page_size=P, window=16, policy=policy, record=True)
    _prefill(model, ids, window)
    assert any(
        not torch.equal(window.plans[i].page_keep, press.plans[i].page_keep) for i in range(3)
    )


def test_reconstruct_reads_the_given_instruction(gqa):
    """Another instruction keeps other tokens, so a misread one would fail above."""
    model, ids = gqa["llama"], _ids(120, seed=7)
    cfg = EvictionConfig(budget=0.3, page_size=1, window=16, scorer="reconstruct")
    press = PageEntroKVPress(
        budget=0.3, page_size=1, window=16, scorer="reconstruct",
        reconstruct_prompt_ids=_ids(6, seed=8), record=True,
    )  # fmt: skip
    cache = _prefill(model, ids, press)
    ref, full = _reference_plan(model, ids, _ids(6, seed=8), cfg)
    _assert_kept(press, cache, ref, full)
    other, _ = _reference_plan(model, ids, _ids(6, seed=9), cfg)
    assert not torch.equal(other.page_keep, ref.page_keep)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("P, budget", [(8, 0.5), (4, 0.3)])
def test_reconstruct_equals_runner_evict(gqa, arch, P, budget):
    """With ``reconstruct_prompt_ids=[]`` (the runner without a tokenizer reads none) the press
    keeps `Runner.evict`'s pages, keys and values."""
    from pagekv.runtime.runner import Runner

    model, ids = gqa[arch], _ids(150, seed=5)
    press = PageEntroKVPress(
        budget=budget, page_size=P, window=16, scorer="reconstruct",
        reconstruct_prompt_ids=[], record=True, backend="torch",
    )  # fmt: skip
    cache = _prefill(model, ids, press)
    runner = Runner(model, None, backend="torch")
    pre = runner.prefill(ids, window_max=32)
    cfg = EvictionConfig(budget=budget, page_size=P, window=16, scorer="reconstruct")
    ev = runner.evict(pre, cfg)
    stored = stored_layers(runner, pre, ev)
    assert cache.get_seq_length() == stored[0][0].shape[2] < 150
    for i, layer in enumerate(cache.layers):
        assert torch.equal(press.plans[i].page_keep[0], ev.plan.page_keep[i]), f"layer {i}"
        assert torch.equal(layer.keys, stored[i][0]), f"keys of layer {i}"
        assert torch.equal(layer.values, stored[i][1]), f"values of layer {i}"
    window = runner.evict(pre, cfg.replace(scorer="window"))  # negative control
    assert not torch.equal(window.plan.page_keep, ev.plan.page_keep)


def test_window_scorer_is_unchanged(gqa):
    """``scorer="window"`` (explicit) is the default press: same pages, same cache."""
    model, ids = gqa["llama"], _ids(150, seed=5)
    a = PageEntroKVPress(budget=0.4, page_size=8, window=16, record=True)
    b = PageEntroKVPress(budget=0.4, page_size=8, window=16, record=True, scorer="window")
    assert a.scorer == "window" and a == b
    ca, cb = _prefill(model, ids, a), _prefill(model, ids, b)
    for i in range(3):
        assert torch.equal(a.plans[i].page_keep, b.plans[i].page_keep)
        assert torch.equal(ca.layers[i].keys, cb.layers[i].keys)
    assert a.plans[0].config == EvictionConfig(budget=0.4, page_size=8, window=16)


def test_reconstruct_cache_then_decodes_after_the_block(gqa):
    """The cache ends at the kept length, and decoding after the block appends to it untouched."""
    model, ids = gqa["llama"], _ids(128, seed=3)
    press = PageEntroKVPress(
        budget=0.5, page_size=8, window=16, scorer="reconstruct", reconstruct_prompt_ids=[5, 6]
    )
    cache = _prefill(model, ids, press)
    k = cache.get_seq_length()
    assert k == 64 and all(la.keys.shape[2] == 64 for la in cache.layers)
    assert "forward" not in vars(model.model)  # the capture is gone
    with torch.inference_mode():
        model.model(
            input_ids=torch.tensor([[5, 6]]), cache=cache, position_ids=torch.tensor([[128, 129]])
        )
    assert cache.get_seq_length() == k + 2
    assert not press.plans  # record=False


def test_reconstruct_instruction_from_the_models_tokenizer(gqa, tmp_path, monkeypatch):
    """By default the instruction is REPEAT_PROMPT in the model's own tokenizer; without one a
    ValueError names reconstruct_prompt_ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagekv.runtime.reconstruct import REPEAT_PROMPT

    words = ["[UNK]", "Repeat", "the", "previous", "context", "exactly."]
    tok = Tokenizer(models.WordLevel({w: 10 + i for i, w in enumerate(words)}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    model, ids = gqa["qwen2"], _ids(100, seed=2)
    instr = [11, 12, 13, 14, 15]
    monkeypatch.setattr(model.config, "name_or_path", str(tmp_path))
    press = PageEntroKVPress(budget=0.5, page_size=8, window=16, scorer="reconstruct", record=True)
    assert press.instruction_ids(model) == instr
    cache = _prefill(model, ids, press)
    cfg = EvictionConfig(budget=0.5, page_size=8, window=16, scorer="reconstruct")
    ref, full = _reference_plan(model, ids, instr, cfg)
    _assert_kept(press, cache, ref, full)
    assert REPEAT_PROMPT.split() == words[1:]
    monkeypatch.setattr(model.config, "name_or_path", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="reconstruct_prompt_ids"):
        with PageEntroKVPress(budget=0.5, scorer="reconstruct")(model):
            pass
    monkeypatch.setattr(model.config, "name_or_path", "")
    with pytest.raises(ValueError, match="reconstruct_prompt_ids"):
        with PageEntroKVPress(budget=0.5, scorer="reconstruct")(model):
            pass


def test_reconstruct_budget_strict_and_not(gqa, caplog):
    """Below the protected pages: `strict` raises, else those pages and one warning."""
    model, ids = gqa["llama"], _ids(100, seed=4)
    kw = dict(page_size=16, window=32, scorer="reconstruct", reconstruct_prompt_ids=[7])
    from transformers import DynamicCache

    cache = DynamicCache()
    with pytest.raises(BudgetError, match="0.52"):
        with torch.inference_mode(), PageEntroKVPress(budget=0.3, strict=True, **kw)(model):
            model.model(input_ids=torch.tensor([ids]), cache=cache)
    assert cache.get_seq_length() == 100  # cut back to the context, nothing compacted
    caplog.set_level(logging.WARNING, logger="pagekv")
    press = PageEntroKVPress(budget=0.3, record=True, **kw)
    cache = _prefill(model, ids, press)
    assert cache.get_seq_length() == 52
    for i in range(3):
        pages = press.plans[i].page_keep[0]  # [G, 7]: pages 0, 4, 5, 6 only
        assert pages[:, [0, 4, 5, 6]].all() and int(pages.sum()) == 4 * pages.shape[0]
    warned = [r for r in caplog.records if "protected pages" in r.getMessage()]
    assert len(warned) == 1 and "0.52" in warned[0].getMessage()


def test_reconstruct_refusals(gqa):
    from transformers import DynamicCache

    model = gqa["llama"]
    kw = dict(budget=0.5, page_size=4, window=8, scorer="reconstruct", reconstruct_prompt_ids=[])
    with pytest.raises(ValueError, match="batch size 1"):
        with torch.inference_mode(), PageEntroKVPress(**kw)(model):
            model.model(input_ids=torch.tensor([_ids(40, 1), _ids(40, 2)]), cache=DynamicCache())
    assert "forward" not in vars(model.model)
    with pytest.raises(ValueError, match="one forward"):
        with torch.inference_mode(), PageEntroKVPress(**kw)(model):
            cache = DynamicCache()
            model.model(input_ids=torch.tensor([_ids(40, 1)]), cache=cache)
            model.model(input_ids=torch.tensor([[5]]), cache=cache)
    cache = _prefill(model, _ids(20, 3))
    with pytest.raises(ValueError, match="empty cache"):
        with torch.inference_mode(), PageEntroKVPress(**kw)(model):
            model.model(input_ids=torch.tensor([_ids(40, 1)]), cache=cache)
    # an error inside the block: no compression, the forward is restored
    cache = DynamicCache()
    with pytest.raises(RuntimeError, match="boom"):
        with torch.inference_mode(), PageEntroKVPress(**kw)(model):
            model.model(input_ids=torch.tensor([_ids(40, 1)]), cache=cache)
            raise RuntimeError("boom")
    assert cache.get_seq_length() == 40 and "forward" not in vars(model.model)
    # per-layer pressing (compress(), ComposedPress) cannot run the reconstruct scorer
    attn, hidden, keys, values, pe = _layer_inputs(model, _ids(40, seed=11))
    with pytest.raises(ValueError, match="one layer at a time"):
        PageEntroKVPress(**kw).compress(
            attn, hidden, keys, values, None, {"position_embeddings": pe}
        )


def test_reconstruct_without_compression_runs_no_pass(gqa):
    model, ids = gqa["llama"], _ids(64, seed=1)
    for press in (
        PageEntroKVPress(scorer="reconstruct"),  # no budget: kvpress's default
        PageEntroKVPress(compression_ratio=0.0, scorer="reconstruct"),
        PageEntroKVPress(budget=0.5, policy="full", scorer="reconstruct"),
    ):
        with press(model):
            assert "forward" not in vars(model.model)  # no capture, no tokenizer needed
        assert _prefill(model, ids, press).get_seq_length() == 64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scorer": "query"}, "scorer must be one of"),
        ({"reconstruct_chunk": 0}, "reconstruct_chunk"),
        ({"reconstruct_chunk": True}, "reconstruct_chunk"),
        ({"reconstruct_prompt_ids": "Repeat"}, "reconstruct_prompt_ids"),
        ({"reconstruct_prompt_ids": [1, -2]}, "reconstruct_prompt_ids"),
        ({"reconstruct_prompt_ids": [1.5]}, "reconstruct_prompt_ids"),
    ],
)
def test_bad_reconstruct_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PageEntroKVPress(budget=0.5, **kwargs)


def test_worker_knows_the_pagekv_presses():
    from experiments.peer import kvpress_worker as kw

    assert set(kp.PAGEKV_PRESSES) == set(kw.PAGEKV_PRESS_CLASSES)
    press = kw.make_press("pagekv_mean", 0.6, {"page_size": 8})
    assert isinstance(press, MeanPoolPagePress) and press.record
    assert press.compression_ratio == 0.6 and press.page_size == 8
    press = kw.make_press("pagekv_entropy", 0.6, {"budget": 0.25})
    assert press.budget == 0.25 and press.compression_ratio is None
    req = kp.make_request("a", "pagekv_entropy", input_ids=list(range(100)), budget=0.2)
    assert req["expected_kept"] == 20 and req["press"] == "pagekv_entropy"


#: (prompt spec fields, [(policy, budget, page_size)]) checked for parity.
PARITY_PROMPTS = (
    {"context": 500, "depth": 0.25, "seed": 0},
    {"context": 500, "depth": 0.5, "seed": 1},
    {"context": 800, "depth": 0.75, "seed": 2},
    {"context": 600, "depth": 0.1, "seed": 3},
)
PARITY_CONFIGS = (
    ("entropy", 0.2, 16),
    ("entropy", 0.5, 16),
    ("mean", 0.2, 16),
    ("entropy", 0.2, 1),
)
PRESS_OF = {"entropy": "pagekv_entropy", "mean": "pagekv_mean"}
MAX_NEW = 16


def parity_report(max_new_tokens: int = MAX_NEW) -> list[dict]:
    """Runner vs press on the bundled model, question after: per (prompt, config) the (layer, KV
    head)s whose pages agree, and both answers."""
    from pagekv.engine.study import PromptSpec, Study

    # The kvpress worker decodes in float32: so does the runner here (its default on the
    # CPU, float16 linear weights, can pick another greedy token on a near tie).
    study = Study.load("bundled", backend="torch", decode_dtype="float32")
    ours, reqs = [], []
    for pi, fields in enumerate(PARITY_PROMPTS):
        prep = study.prepare(PromptSpec(task="needle", mode="after", **fields))
        ctx, q = prep.prompt["context_ids"], prep.prompt["question_ids"]
        for pol, b, P in PARITY_CONFIGS:
            cfg = EvictionConfig(policy=pol, budget=b, page_size=P)
            res = study.runner.evaluate(prep.prefill, cfg, max_new_tokens=max_new_tokens)
            rid = f"p{pi}-{pol}-b{b}-P{P}"
            ours.append((rid, res, prep.task.answer))
            reqs.append(
                kp.make_request(
                    rid,
                    PRESS_OF[pol],
                    context_ids=ctx,
                    question_ids=q,
                    budget=b,
                    max_new_tokens=max_new_tokens,
                    press_kwargs={"page_size": P, "backend": "torch"},
                )
            )
    got = {r["id"]: r for r in kp.run_kvpress(kp.bundled_model_dir(), reqs, progress=None)}
    rows = []
    for rid, res, expected in ours:
        r = got[rid]
        assert r["error"] is None, (rid, r["error"], r.get("traceback"))
        mine = res.plan.page_keep  # [L, G, n_pages]
        theirs = r["pagekv"]["kept_pages"]  # [L][G] page indices
        L, G, _ = mine.shape
        equal = sum(
            mine[i, g].nonzero().flatten().tolist() == theirs[i][g]
            for i in range(L)
            for g in range(G)
        )
        rows.append(
            {
                "id": rid,
                "layer_groups": L * G,
                "pages_equal": int(equal),
                "k_equal": r["pagekv"]["budget_tokens"] == [int(res.plan.budget_tokens)] * L,
                "stored_equal": r["kept_tokens"] == [int(x) for x in res.plan.union_tokens[:, 0]],
                "answer_equal": r["tokens"] == res.tokens,
                "runner_answer": res.answer,
                "press_answer": r["answer"],
                "expected": expected,
                "kvpress_base": r["pagekv"]["kvpress_base"],
            }
        )
    return rows


@pytest.mark.slow
@pytest.mark.kvpress
def test_parity_with_the_runner_on_the_bundled_model():
    rows = parity_report()
    for r in rows:
        print(
            f"\n{r['id']:>22} pages {r['pages_equal']}/{r['layer_groups']} "
            f"answer_equal={r['answer_equal']} {r['press_answer']!r} "
            f"(runner {r['runner_answer']!r})"
        )
    assert all(r["kvpress_base"] for r in rows)  # the press ran as a kvpress BasePress
    assert all(r["k_equal"] and r["stored_equal"] for r in rows)
    assert all(r["pages_equal"] == r["layer_groups"] for r in rows)
    assert all(r["answer_equal"] for r in rows)
    assert len(rows) == len(PARITY_PROMPTS) * len(PARITY_CONFIGS)


def _readme_block() -> str:
    text = (ROOT / "docs" / "kvpress.md").read_text()
    section = text.split("## Five-line example", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len([ln for ln in block.splitlines() if ln.strip()]) == 5
    return block


SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _fake_hub(tmp_path: Path, repo_id: str, model_dir: Path) -> Path:
    """A Hugging Face cache where `repo_id` resolves offline to the bundled model."""
    hub = tmp_path / "hub"
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    rev = "0" * 40
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for f in model_dir.iterdir():
        if f.is_file():
            (snap / f.name).symlink_to(f)
    return hub


def _kvpress_python() -> Path:
    return kp.venv_python(kp.ensure_kvpress_env(progress=None))


def _in_kvpress(tmp_path, code: str, path: Path = ROOT, repo_id: str = SMOLLM, cwd=None):
    """Run `code` in kvpress's venv with `path` importable and `repo_id` resolving offline to
    the bundled model; its stdout (a failure fails the test)."""
    hub = _fake_hub(tmp_path, repo_id, kp.bundled_model_dir())
    script = tmp_path / "script.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(path), HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    env["TRANSFORMERS_OFFLINE"] = "1"
    out = subprocess.run(
        [str(_kvpress_python()), str(script)], capture_output=True, text=True, env=env,
        timeout=900, cwd=cwd,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.kvpress
def test_five_line_example_runs_as_written(tmp_path):
    block = _readme_block()
    repo_id = re.search(r'model="([^"]+)"', block).group(1)
    setup = (
        "context = 'The grass is green. The sky is blue. ' * 20 + "
        "'The secret passcode is 7351. ' + 'The sun is yellow. Here we go. ' * 20\n"
        "question = 'What is the secret passcode?'\n"
    )
    check = (
        "import json, kvpress, pagekv\n"
        "print(json.dumps({'base': isinstance(press, kvpress.BasePress)}))\n"
        "print(json.dumps({'pagekv': pagekv.__file__}))\n"
    )
    # pagekv as a researcher installs it: its wheel, into a folder on the path (the
    # kvpress environment brings the dependencies), run from outside the checkout.
    site = tmp_path / "site"
    subprocess.run(
        [str(_kvpress_python()), "-m", "pip", "install", "-q", "--no-deps", "--target",
         str(site), str(build_wheel(tmp_path))],
        check=True, timeout=300,
    )  # fmt: skip
    out = _in_kvpress(tmp_path, setup + block + check, path=site, repo_id=repo_id, cwd=tmp_path)
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-1])["pagekv"].startswith(str(site))  # the installed copy
    assert json.loads(lines[-2]) == {"base": True}
    answer = "\n".join(lines[:-2]).strip()
    print("\nexample answer:", repr(answer))
    assert answer  # the pipeline answered through the press


@pytest.mark.slow
@pytest.mark.kvpress
def test_a_short_prompt_at_ratio_0_8_never_aborts_the_pipeline(tmp_path):
    """A budget below the protected pages keeps them, warns, and answers."""
    out = _in_kvpress(
        tmp_path,
        "import json, logging\n"
        "from transformers import pipeline\n"
        "from pagekv.integrations import PageEntroKVPress\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "pipe = pipeline('kv-press-text-generation', "
        "model='HuggingFaceTB/SmolLM2-135M-Instruct')\n"
        "out = {}\n"
        "for ratio in (0.2, 0.8):\n"
        "    press = PageEntroKVPress(compression_ratio=ratio, page_size=16)\n"
        "    out[str(ratio)] = pipe('The sky is blue. The code is 7351.', "
        "question='What is the code?', press=press, max_new_tokens=8)['answer']\n"
        "print(json.dumps(out))\n",
    )
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(answers) == {"0.2", "0.8"} and all(isinstance(a, str) for a in answers.values())
    assert out.stderr.count("keeps only the protected pages") >= 1, out.stderr[-2000:]


RECONSTRUCT_PIPELINE = """
import json, torch
from transformers import DynamicCache, pipeline
from pagekv import EvictionConfig, plan
from pagekv.integrations import PageEntroKVPress
from pagekv.runtime.reconstruct import (
    REPEAT_PROMPT, as_profiles, reconstruction_masses, reconstruction_scores,
)

pipe = pipeline('kv-press-text-generation', model='HuggingFaceTB/SmolLM2-135M-Instruct')
context = ('The grass is green. The sky is blue. ' * 10 + 'The secret passcode is 7351. '
           + 'The sun is yellow. Here we go. ' * 10)
question = 'What is the secret passcode?'
press = PageEntroKVPress(budget=0.5, page_size=16, scorer='reconstruct', record=True)
cache = DynamicCache()
answer = pipe(context, question=question, press=press, cache=cache, max_new_tokens=12)['answer']

# pagekv on its own: the pipeline's context ids, an uncompressed prefill, the
# reconstruction pass with the instruction tokenised by the model's tokenizer, plan.
ids = pipe.preprocess(context, [question], '', 10**9)['context_ids']
model = pipe.model
with torch.no_grad():
    full = model.model(input_ids=ids, past_key_values=DynamicCache()).past_key_values
copy = DynamicCache()
for i, la in enumerate(full.layers):
    copy.update(la.keys.clone(), la.values.clone(), i)
instr = pipe.tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False)
scores = reconstruction_scores(model, copy, ids[0].tolist(), instr)
prof = as_profiles(scores['max'])
cfg = EvictionConfig(budget=0.5, page_size=16, scorer='reconstruct')
ref = plan(prof, full.layers[0].keys.shape[1], cfg, masses=reconstruction_masses(scores, prof, 4))
idx = ref.kept_indices()
same = []
for i, la in enumerate(cache.layers):
    g = idx[i][None, :, :, None].expand(1, -1, -1, la.keys.shape[-1])
    same.append(bool(torch.equal(press.plans[i].page_keep[0], ref.page_keep[i]))
                and bool(torch.equal(la.keys, full.layers[i].keys.gather(2, g)))
                and bool(torch.equal(la.values, full.layers[i].values.gather(2, g))))
window = PageEntroKVPress(budget=0.5, page_size=16, record=True)
pipe(context, question=question, press=window, max_new_tokens=1)
print(json.dumps({
    'answer': answer, 'n': int(ids.shape[1]),
    'kept': [int(la.keys.shape[2]) for la in cache.layers],
    'k_ref': int(idx.shape[-1]), 'same': same, 'layers': len(cache.layers),
    'window_differs': sum(not torch.equal(window.plans[i].page_keep, press.plans[i].page_keep)
                          for i in range(len(cache.layers))),
    'instr': press.instruction_ids(model) == instr and len(instr) > 0,
}))
"""


@pytest.mark.slow
@pytest.mark.kvpress
def test_reconstruct_scorer_through_kvpress_pipeline(tmp_path):
    """In kvpress's pipeline the reconstruct scorer keeps, per layer, exactly the pages pagekv picks
    on its own; the window scorer keeps others."""
    out = _in_kvpress(tmp_path, RECONSTRUCT_PIPELINE)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print("\nreconstruct answer:", repr(got["answer"]), "kept", got["kept"][0], "of", got["n"])
    assert got["instr"]
    assert got["same"] == [True] * got["layers"]
    assert got["kept"] == [got["k_ref"]] * got["layers"] and got["k_ref"] <= got["n"] // 2
    assert got["window_differs"] > 0
    assert isinstance(got["answer"], str) and got["answer"]
