"""The lean decode step (`pagekv.runtime.decode`) against transformers' forward: float32 weights
match to float32 tolerance, token by token and several at once; half weights to their rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from pagekv import EvictionConfig
from pagekv.runtime.decode import (
    DECODE_DTYPES,
    LeanDecoder,
    resolve_decode,
    unsupported_reason,
)
from pagekv.runtime.paged_cache import PagedCache
from pagekv.runtime.runner import Runner
from tests.test_runner import prompt, tiny_model


def _reference(model, ids, feeds):
    """transformers' own logits `[steps, V]`: prefill `ids`, then each feed in turn."""
    cache = DynamicCache()
    out = []
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        pos = len(ids)
        for feed in feeds:
            x = torch.tensor([feed])
            p = torch.arange(pos, pos + len(feed))[None]
            o = model(input_ids=x, position_ids=p, cache=cache, use_cache=True)
            out.append(o.logits[0, -1])
            pos += len(feed)
    return torch.stack(out), cache


def _lean(model, ids, feeds, weights):
    ref_cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=ref_cache, use_cache=True)
    layers = [(lay.keys, lay.values) for lay in ref_cache.layers]
    cache = PagedCache(layers, extra=sum(len(f) for f in feeds), page_size=8)
    dec = LeanDecoder(model, weights)
    out, pos = [], len(ids)
    for feed in feeds:
        out.append(dec.step(torch.tensor([feed]), pos, cache)[0])
        pos += len(feed)
    return torch.stack(out), cache


FEEDS = [[5, 9, 11, 3], [7], [8], [12, 4], [6]]  # several tokens at once, and one


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_float32_weights_give_the_models_own_logits(family):
    model = tiny_model(family, seed=4)
    ids = prompt(40, seed=8)
    ref, ref_cache = _reference(model, ids, FEEDS)
    got, cache = _lean(model, ids, FEEDS, torch.float32)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    for i, lay in enumerate(ref_cache.layers):  # the cache holds the same keys and values
        G = lay.keys.shape[1]
        assert cache.host_lengths(i) == [[40 + sum(len(f) for f in FEEDS)] * G]
        assert cache.lengths[i].tolist() == cache.host_lengths(i)
        for g in range(G):
            k, v = cache.read(i, 0, g)
            torch.testing.assert_close(k, lay.keys[0, g], atol=1e-5, rtol=0)
            torch.testing.assert_close(v, lay.values[0, g], atol=1e-5, rtol=0)


@pytest.mark.parametrize("weights", [torch.float16, torch.bfloat16])
def test_half_weights_stay_within_their_rounding(weights):
    model = tiny_model("llama", seed=4)
    ids = prompt(40, seed=8)
    ref, _ = _reference(model, ids, FEEDS)
    got, _ = _lean(model, ids, FEEDS, weights)
    err = float((got - ref).abs().max())
    # bfloat16 keeps 7 mantissa bits, float16 10: 8x coarser, and so is the bound.
    bound = 2e-2 if weights == torch.float16 else 1.6e-1
    assert 0 < err < bound, err
    assert got.dtype == torch.float32


def test_the_cache_reports_when_it_is_full():
    model = tiny_model("llama")
    pre_cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt(20)]), cache=pre_cache, use_cache=True)
    layers = [(lay.keys, lay.values) for lay in pre_cache.layers]
    cache = PagedCache(layers, extra=2, page_size=11)  # 22 tokens: two whole pages
    dec = LeanDecoder(model, torch.float16)
    dec.step(torch.tensor([[5, 6]]), 20, cache)
    assert cache.room() == 0 and [cache.host_lengths(i) for i in range(3)] == [[[22, 22]]] * 3
    with pytest.raises(ValueError, match="PagedCache is full: 1 new tokens, room for 0"):
        dec.step(torch.tensor([[7]]), 22, cache)


def test_which_decode_runs():
    llama = tiny_model("llama")
    assert resolve_decode("auto", llama) == (torch.float16, "lean step, float16 linear weights")
    assert resolve_decode("bfloat16", llama)[0] == torch.bfloat16
    assert resolve_decode(torch.float16, llama)[0] == torch.float16
    assert resolve_decode("float32", llama) == (torch.float32, "lean step, float32 linear weights")
    # Qwen3 normalises q and k per head; the step does too.
    assert unsupported_reason(tiny_model("qwen3")) is None
    with pytest.raises(ValueError, match="unknown decode dtype 'int4'"):
        resolve_decode("int4", llama)
    assert set(DECODE_DTYPES) == {"auto", "float32", "float16", "bfloat16"}
    # "auto" is float16 only for a float32 model on the CPU; else the model's own dtype.
    half = tiny_model("llama").to(torch.bfloat16)
    assert resolve_decode("auto", half)[0] == torch.bfloat16
    assert resolve_decode("auto", tiny_model("llama").to("meta")) == (
        torch.float32,
        "lean step, float32 linear weights",
    )
    odd = tiny_model("llama")
    odd.config.model_type = "gemma"
    with pytest.raises(ValueError, match="decode step cannot run this model: model type 'gemma'"):
        resolve_decode("auto", odd)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_bfloat16_model_decodes_in_the_lean_step(backend):
    """A bfloat16 model in the lean step (paged cache, kernel or torch attention): the forward's
    tokens, logits within bfloat16 rounding."""
    model = tiny_model("llama").to(torch.bfloat16)
    runner = Runner(model, backend=backend)  # "auto": the model's own dtype
    ctx, question = prompt(90, seed=3), [4, 5, 6]
    pre = runner.prefill(ctx, window_max=8, question_ids=question)
    cfg = EvictionConfig(policy="full", page_size=8, window=8, n_sink=2)
    res = runner.evaluate(pre, cfg, 5, stop_at_eos=False, return_logits=True)
    ref, _ = _reference(model, ctx, [question] + [[t] for t in res.tokens[:-1]])
    assert res.backends["decode"] == "lean step, bfloat16 linear weights"
    assert res.tokens == ref.float().argmax(-1).tolist()
    assert float((res.logits - ref.float()).abs().max()) < 0.2


def test_a_part_the_step_does_not_know_is_refused():
    model = tiny_model("llama")
    model.model.layers[1].self_attn.q_norm = torch.nn.Identity()
    assert unsupported_reason(model) == "layer 1: the per-head q/k norms are not a pair of RMSNorms"
    model = tiny_model("llama")
    model.model.layers[2].mlp.up_proj = torch.nn.Identity()
    assert unsupported_reason(model) == "layer 2: the MLP is not a gated gate/up/down MLP"
    with pytest.raises(ValueError, match="LeanDecoder: layer 2"):
        LeanDecoder(model)


def test_the_runner_names_its_decode_and_leaves_the_prefill_alone():
    model = tiny_model("llama")
    ids = prompt(64, seed=3)
    cfg = EvictionConfig(policy="full", page_size=4, window=8, n_sink=2)
    answers = {}
    for decode in ("float32", "auto"):
        runner = Runner(model, decode_dtype=decode)
        pre = runner.prefill(ids, window_max=8)
        before = [lay.keys.clone() for lay in pre.cache.layers]
        res = runner.evaluate(pre, cfg, max_new_tokens=6, stop_at_eos=False)
        answers[decode] = res
        after = [lay.keys for lay in pre.cache.layers]
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
        assert res.backends["decode"] == runner.decode_path
    assert answers["float32"].backends["decode"] == "lean step, float32 linear weights"
    assert answers["auto"].backends["decode"] == "lean step, float16 linear weights"
    assert answers["auto"].tokens == answers["float32"].tokens
