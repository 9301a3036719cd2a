"""The live runner on tiny random GQA decoders: `full` equals `generate`; the compacted cache holds
exactly the planned tokens' K/V; decoding on it equals the model over the full cache with evicted
keys masked (1e-5, every step, both modes); window queries reproduce eager attention;
configurations never leak and the prefill is never mutated."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AttentionInterface,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pagekv import BudgetError, EvictionConfig, plan
from pagekv.runtime.runner import Runner, padded_kept_indices

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 192
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(family: str, attn: str = "sdpa", layers: int = 3, seed: int = 0):
    """A random GQA decoder: 8 query heads over 2 KV heads (r = 4), head dim 8."""
    cfg_cls, model_cls = FAMILIES[family]
    cfg = cfg_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        initializer_range=0.15,  # peakier attention than the default 0.02
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def stored_layers(runner, pre, ev):
    """Per layer `(keys, values)` `[1, G, t, d]`: what `ev`'s decode cache holds (groups
    of one length), read back from the paged pool."""
    cache = runner.decode_cache([ev], pre, 0)
    out = []
    for layer in range(len(cache.k_pool)):
        groups = [cache.read(layer, 0, g) for g in range(len(cache.host_lengths(layer)[0]))]
        out.append(tuple(torch.stack(kv)[None] for kv in zip(*groups, strict=True)))
    return out


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def qwen2():
    return tiny_model("qwen2")


def generate_ref(model, ids: list[int], max_new: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new
        )
    return out[0, len(ids) :].tolist()


_REF_KEEP: dict = {}  # layer -> bool [G, n], read by the reference attention below


def _masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """Eager attention, float32, where group g of this layer cannot see prompt token t
    unless `_REF_KEEP[layer][g, t]`; new tokens (after the prompt) are causal."""
    keep = _REF_KEEP[module.layer_idx]  # [G, n]
    B, H, q, d = query.shape
    G, S = key.shape[1], key.shape[2]
    r = H // G
    n = keep.shape[1]
    k = key.float().repeat_interleave(r, 1)  # [B, H, S, d]
    v = value.float().repeat_interleave(r, 1)
    logits = query.float() @ k.transpose(-1, -2) * scaling  # [B, H, q, S]
    allowed = torch.ones(H, q, S, dtype=torch.bool)
    allowed[:, :, :n] = keep.repeat_interleave(r, 0)[:, None, :]
    causal = torch.arange(S)[None, :] <= (S - q + torch.arange(q))[:, None]  # [q, S]
    allowed &= causal[None]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    out = (probs @ v).to(query.dtype)  # [B, H, q, d]
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register("pagekv_masked_ref", _masked_attention)


def masked_reference_logits(model, pre, stored_keep, feed: list[list[int]]) -> torch.Tensor:
    """Last-position logits after each chunk of `feed`, appended at positions `n, ...` to
    a copy of the FULL prefill cache, attention restricted to `stored_keep` [L, G, n]."""
    from transformers import DynamicCache

    ref = copy.deepcopy(model)
    ref.set_attn_implementation("pagekv_masked_ref")
    _REF_KEEP.clear()
    _REF_KEEP.update({i: stored_keep[i] for i in range(stored_keep.shape[0])})
    cache = DynamicCache(
        ddp_cache_data=[(lay.keys.clone(), lay.values.clone()) for lay in pre.cache.layers]
    )
    pos, out = pre.n, []
    with torch.inference_mode():
        for chunk in feed:
            o = ref(
                input_ids=torch.tensor([chunk]),
                position_ids=torch.arange(pos, pos + len(chunk))[None],
                cache=cache,
                use_cache=True,
            )
            out.append(o.logits[0, -1].float())
            pos += len(chunk)
    return torch.stack(out)


def stored_keep_of(runner, pre, cfg) -> torch.Tensor:
    """Bool [L, G, n] read back from the compacted cache's indices."""
    ev = runner.evict(pre, cfg)
    keep = torch.zeros(pre.n_layers, pre.n_groups, pre.n, dtype=torch.bool)
    for i, idx in enumerate(ev.kept_indices):
        keep[i].scatter_(1, idx, True)
    return keep


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_policy_matches_generate(family):
    model = tiny_model(family)
    ids = prompt(57)
    runner = Runner(model, None)
    pre = runner.prefill(ids, window_max=16)
    res = runner.evaluate(pre, EvictionConfig(policy="full", window=16), max_new_tokens=12)
    assert res.tokens == generate_ref(model, ids, 12)
    assert res.stored_tokens == [[57, 57]] * 3
    assert res.cache_bytes_after == res.cache_bytes_before
    assert res.first_token_from_full_prefill and res.mode == "inside"
    assert res.answer == " ".join(map(str, res.tokens))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_captured_queries_reproduce_eager_attention(family):
    model = tiny_model(family, attn="eager")
    ids = prompt(45, seed=3)
    w = 12
    pre = Runner(model).prefill(ids, window_max=w)
    assert pre.q_win.shape == (3, 8, w, 8)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    for layer, att in enumerate(out.attentions):  # [1, H, n, n]
        ref = att[0, :, -w:, :].float().mean(1)  # [H, n]
        got = pre.profiles(w)[layer]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, msg=f"layer {layer}")
    # shorter windows come from the same capture (the last rows of it)
    ref5 = out.attentions[1][0, :, -5:, :].float().mean(1)
    torch.testing.assert_close(pre.profiles(5)[1], ref5, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "policy,page_size", [("entropy", 4), ("mean", 5), ("max", 1), ("head_independent", 4)]
)
def test_the_decode_cache_holds_exactly_the_kept_tokens(llama, policy, page_size):
    runner = Runner(llama)
    pre = runner.prefill(prompt(83), window_max=16)
    cfg = EvictionConfig(policy=policy, budget=0.4, page_size=page_size, window=8, n_sink=2)
    ev = runner.evict(pre, cfg)
    p = ev.plan
    stored = stored_layers(runner, pre, ev)
    for layer, (full, (keys, values)) in enumerate(zip(pre.cache.layers, stored, strict=True)):
        idx = ev.kept_indices[layer]  # [G, k_l]
        assert keys.shape == (1, 2, idx.shape[1], 8)
        for g in range(2):
            assert keys.shape[2] == ev.stored_tokens[layer][g]
            assert torch.equal(idx[g], idx[g].sort().values)  # positional order kept
            assert torch.equal(keys[0, g], full.keys[0, g, idx[g]])
            assert torch.equal(values[0, g], full.values[0, g, idx[g]])
            union = p.keep[layer, g].nonzero().flatten()
            assert ev.union_tokens[layer][g] == union.numel() == int(p.union_tokens[layer, g])
            assert bool(torch.isin(union, idx[g]).all())  # the union is always stored
    if policy != "head_independent":
        k = int(p.union_tokens[0, 0])
        assert k <= p.budget_tokens
        assert ev.stored_tokens == ev.union_tokens == [[k, k]] * 3


def runner_decoding(model, decode: str) -> Runner:
    """A runner on `model` decoding in "float32" or "float16" (the CPU default)."""
    return Runner(model, decode_dtype=decode)


#: Decode paths and the logits' tolerance against the masked float32 reference. Half
#: weights round every linear's input and weights (10 mantissa bits): under 1e-2 of a
#: logit here (logits up to about 4), where a wrong position or mask moves them by ~1.
DECODES = {"float32": 1e-5, "float16": 2e-2}


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["inside", "after"])
@pytest.mark.parametrize("policy", ["entropy", "streaming", "head_independent"])
def test_decode_on_compacted_cache_equals_masked_reference(family, mode, policy, decode):
    model = tiny_model(family)
    runner = runner_decoding(model, decode)
    ids = prompt(70, seed=5)
    if mode == "after":
        pre = runner.prefill(ids[:60], window_max=8, question_ids=ids[60:])
    else:
        pre = runner.prefill(ids, window_max=8)
    cfg = EvictionConfig(policy=policy, budget=0.35, page_size=4, window=8, n_sink=2)
    res = runner.evaluate(pre, cfg, max_new_tokens=5, return_logits=True, stop_at_eos=False)
    assert len(res.tokens) == 5 and res.logits.shape == (5, VOCAB)
    keep = stored_keep_of(runner, pre, cfg)
    assert keep.sum(-1).tolist() == res.stored_tokens
    if mode == "after":
        feed = [pre.question_ids] + [[t] for t in res.tokens[:-1]]
        ref = masked_reference_logits(model, pre, keep, feed)
        got = res.logits
    else:  # the first token comes from the prefill itself
        torch.testing.assert_close(res.logits[0], pre.first_logits)
        ref = masked_reference_logits(model, pre, keep, [[t] for t in res.tokens[:-1]])
        got = res.logits[1:]
    torch.testing.assert_close(got, ref, atol=DECODES[decode], rtol=0)
    if decode != "float16":  # half weights may flip a near-tie of the argmax
        assert res.tokens[-len(ref) :] == ref.argmax(-1).tolist()
    assert res.first_token_from_full_prefill == (mode == "inside")
    assert res.prompt_tokens == 70 and res.context_tokens == pre.n


def test_positions_continue_at_n_not_at_compacted_length(llama):
    """Negative control: decoding the compacted cache at position k' instead of n
    visibly changes the logits, so the reference comparison above has teeth."""
    runner = Runner(llama)
    pre = runner.prefill(prompt(80), window_max=8)
    ev = runner.evict(pre, EvictionConfig(policy="entropy", budget=0.3, page_size=4, window=8))
    k = ev.stored_tokens[0][0]
    tok = int(pre.first_logits.argmax())
    step = runner_decoding(llama, "float32")._lean_decoder().step
    with torch.inference_mode():
        ids = torch.tensor([[tok]])
        good = step(ids, pre.n, runner.decode_cache([ev], pre, 1))[0]
        bad = step(ids, k, runner.decode_cache([ev], pre, 1))[0]
    keep = stored_keep_of(runner, pre, ev.plan.config)
    ref = masked_reference_logits(llama, pre, keep, [[tok]])[0]
    torch.testing.assert_close(good.float(), ref, atol=1e-5, rtol=0)
    assert (bad.float() - ref).abs().max() > 1e-3


def test_question_after_full_equals_whole_prompt(llama, qwen2):
    for model in (llama, qwen2):
        runner = Runner(model)
        ctx, question = prompt(50, seed=7), prompt(9, seed=8)
        full = EvictionConfig(policy="full", window=8)
        after = runner.evaluate(
            runner.prefill(ctx, window_max=8, question_ids=question), full, max_new_tokens=10
        )
        inside = runner.evaluate(runner.prefill(ctx + question, window_max=8), full, 10)
        assert after.mode == "after" and not after.first_token_from_full_prefill
        assert after.tokens == inside.tokens == generate_ref(model, ctx + question, 10)
        assert after.prompt_tokens == 59 and after.context_tokens == 50


def test_no_leak_between_configurations(llama):
    runner = Runner(llama)
    pre = runner.prefill(prompt(90, seed=11), window_max=16)
    snapshot = [(lay.keys.clone(), lay.values.clone()) for lay in pre.cache.layers]
    first_logits = pre.first_logits.clone()
    a = EvictionConfig(policy="entropy", budget=0.3, page_size=4, window=8)
    b = EvictionConfig(policy="streaming", budget=0.3, page_size=4, window=8)
    ra1, rb, ra2 = (runner.evaluate(pre, c, max_new_tokens=8, stop_at_eos=False) for c in (a, b, a))
    assert ra1.tokens == ra2.tokens
    assert ra1.stored_tokens == ra2.stored_tokens
    # The count each (layer, group) stores, from the geometry alone: n = 90, pages of 4
    # (the last holds 2), k = floor(0.3 * 90) = 27. Protected: page 0 (sinks 0..3) and
    # the window 82..89 (pages 20, 21, 22: 4 + 4 + 2 tokens) = 14; 13 left admit three
    # more whole pages: 14 + 12 = 26.
    assert ra1.budget_tokens == rb.budget_tokens == 27
    assert ra1.stored_tokens == rb.stored_tokens == [[26, 26]] * 3
    # Streaming's three are the most recent free pages, 17, 18 and 19, everywhere.
    streaming_pages = [0, 17, 18, 19, 20, 21, 22]
    assert all(row.nonzero().flatten().tolist() == streaming_pages
               for row in rb.plan.page_keep.flatten(0, 1))  # fmt: skip
    for (k, v), lay in zip(snapshot, pre.cache.layers, strict=True):
        assert lay.keys.shape[2] == pre.n
        assert torch.equal(k, lay.keys) and torch.equal(v, lay.values)
    assert torch.equal(first_logits, pre.first_logits)
    # and the full policy after all that still equals generate
    full = runner.evaluate(pre, EvictionConfig(policy="full", window=8), max_new_tokens=8)
    assert full.tokens == generate_ref(llama, pre.ids, 8)


def test_a_run_decodes_the_plan_it_is_given(llama):
    """`evaluate(planned=...)` decodes `Runner.plan`'s plan, and refuses a foreign one."""
    runner = Runner(llama)
    pre = runner.prefill(prompt(90, seed=12), window_max=16)
    cfg = EvictionConfig(policy="entropy", budget=0.3, page_size=4, window=8)
    p = runner.plan(pre, cfg)
    assert p.backends["score"] == "torch" and set(p.timings) == {"score_s", "plan_s"}
    given = runner.evaluate(pre, cfg, max_new_tokens=6, stop_at_eos=False, planned=p)
    own = runner.evaluate(pre, cfg, max_new_tokens=6, stop_at_eos=False)
    assert given.plan is p and own.plan is not p
    assert given.tokens == own.tokens and torch.equal(given.plan.keep, own.plan.keep)
    assert given.timings["score_s"] == p.timings["score_s"]
    assert given.backends["score"] == "torch"
    other = runner.prefill(prompt(80, seed=12), window_max=16)
    bare = plan(pre.profiles(8), pre.n_groups, cfg)
    for wrong, on, config in ((p, pre, cfg.replace(budget=0.4)), (p, other, cfg), (bare, pre, cfg)):
        with pytest.raises(ValueError, match="Runner.plan"):
            runner.evaluate(on, config, max_new_tokens=2, planned=wrong)


def test_a_per_head_run_reports_the_needle_in_its_unions(llama):
    """`needle_retention_union`: per-head runs' share in the unions; None when pooled."""
    runner = Runner(llama)
    pre = runner.prefill(prompt(96, seed=14), window_max=8)
    needle = list(range(40, 46))
    cfg = EvictionConfig(policy="head_independent", budget=0.3, page_size=4, window=8)
    per_head = runner.evaluate(pre, cfg, max_new_tokens=1, needle_positions=needle)
    assert per_head.needle_retention_union == per_head.plan.needle_retention(needle).tolist()
    pooled = runner.evaluate(pre, cfg.replace(policy="entropy"), 1, needle_positions=needle)
    assert pooled.needle_retention_union is None and pooled.needle_retention is not None


def test_head_independent_pads_each_layer_to_its_largest_union(llama):
    runner = Runner(llama)
    pre = runner.prefill(prompt(96, seed=13), window_max=8)
    found_uneven, padding_ranked = False, 0
    for budget in (0.25, 0.3, 0.4):
        cfg = EvictionConfig(
            policy="head_independent", budget=budget, page_size=4, window=8, n_sink=2
        )
        ev = runner.evict(pre, cfg)
        p = ev.plan
        assert ev.union_tokens == p.union_tokens.tolist()
        for layer in range(3):
            assert ev.stored_tokens[layer] == [max(ev.union_tokens[layer])] * 2
            idx = ev.kept_indices[layer]
            for g in range(2):
                stored_pages = torch.zeros(p.n_pages, dtype=torch.bool)
                stored_pages[idx[g] // 4] = True
                union_pages = p.page_keep[layer, g]
                added = stored_pages & ~union_pages
                assert bool((stored_pages | ~union_pages).all())  # union inside stored
                found_uneven |= bool(added.any())
                rest = ~stored_pages
                if added.any() and rest.any():  # padding took the best remaining pages
                    s = p.page_scores[layer, g]
                    assert float(s[added].min()) >= float(s[rest].max())
                    padding_ranked += 1
        res = runner.evaluate(pre, cfg, max_new_tokens=3)
        assert res.union_tokens == ev.union_tokens and res.stored_tokens == ev.stored_tokens
        # UOR = union / k', k' what each head keeps: the count a pooled policy keeps.
        k_head = runner.evict(pre, cfg.replace(policy="mean")).stored_tokens[0][0]
        unions = [u for row in ev.union_tokens for u in row]
        assert res.uor["max"] == pytest.approx(max(unions) / k_head)
        assert res.uor["mean"] == pytest.approx(sum(unions) / len(unions) / k_head)
    assert found_uneven, "no budget gave unequal unions; the padding went untested"
    assert padding_ranked > 0, "padding never left a page out; its ranking went untested"


def test_padded_indices_worked_example():
    """The docstring example: P = 2, group 0 keeps pages {0, 3}, group 1 {0, 1, 3}."""
    from types import SimpleNamespace

    from pagekv.maths.paging import expand_pages, page_sizes

    page_keep = torch.tensor([[[1, 0, 0, 1], [1, 1, 0, 1]]], dtype=torch.bool)  # [1, 2, 4]
    p = SimpleNamespace(
        config=EvictionConfig(page_size=2, n_sink=2, window=2),
        n=8,
        window=2,
        keep=expand_pages(page_keep, 8, 2),
        page_keep=page_keep,
        union_tokens=torch.tensor([[4, 6]]),
        page_sizes=page_sizes(8, 2),
        protected=torch.tensor([True, False, False, True]),  # the sink and window pages
        page_scores=torch.tensor([[[0.0, 0.1, 0.5, 0.0], [0.0, 0.0, 0.9, 0.0]]]),
    )
    (idx,) = padded_kept_indices(p)
    assert idx.tolist() == [[0, 1, 4, 5, 6, 7], [0, 1, 2, 3, 6, 7]]


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ragged_head_independent_cache_decodes_like_reference(attn, decode):
    """Layers of different lengths: decoded token by token (transformers) or each
    layer at its own length (the lean step), still exact."""
    model = tiny_model("llama", attn=attn, layers=4, seed=3)
    runner = runner_decoding(model, decode)
    ids = prompt(100, seed=17)
    pre = runner.prefill(ids[:92], window_max=8, question_ids=ids[92:])
    for budget in (0.2, 0.25, 0.3, 0.35, 0.4):
        cfg = EvictionConfig(
            policy="head_independent", budget=budget, page_size=4, window=8, n_sink=2
        )
        ev = runner.evict(pre, cfg)
        if ev.ragged:
            break
    assert ev.ragged, "no budget gave layers of different lengths"
    res = runner.evaluate(pre, cfg, max_new_tokens=3, return_logits=True, stop_at_eos=False)
    keep = stored_keep_of(runner, pre, cfg)
    feed = [pre.question_ids] + [[t] for t in res.tokens[:-1]]
    ref = masked_reference_logits(model, pre, keep, feed)
    torch.testing.assert_close(res.logits, ref, atol=DECODES[decode], rtol=0)


def test_budget_error_names_the_minimal_budget(llama):
    runner = Runner(llama)
    pre = runner.prefill(prompt(100), window_max=32)
    cfg = EvictionConfig(policy="entropy", budget=0.1, page_size=16, window=32, n_sink=4)
    with pytest.raises(BudgetError, match="smallest feasible budget") as err:
        runner.evaluate(pre, cfg)
    assert isinstance(err.value, ValueError)
    # protected: page 0 (sinks, 16 tokens) and pages 4, 5, 6 (window 68..99: 16+16+4)
    assert err.value.min_budget == pytest.approx(0.52)
    assert "0.520" in str(err.value)
    ok = runner.evaluate(pre, cfg.replace(budget=0.52), max_new_tokens=2)
    assert ok.stored_tokens == [[52, 52]] * 3


def test_result_fields_and_json(llama):
    runner = Runner(llama)
    ids = prompt(64, seed=19)
    pre = runner.prefill(ids, window_max=16)
    assert pre.n == 64 and pre.timings["prefill_s"] > 0
    assert (pre.n_layers, pre.n_heads, pre.n_groups, pre.head_dim) == (3, 8, 2, 8)
    assert pre.scale == pytest.approx(8**-0.5)
    cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=8, window=16)
    res = runner.evaluate(pre, cfg, max_new_tokens=4, needle_positions=[30, 31])
    d = res.to_dict()
    json.dumps(d)
    assert "plan" not in d and "logits" not in d and res.plan is not None
    assert d["policy"] == "entropy" and d["config"]["budget"] == 0.5
    assert d["budget_tokens"] == 32 and d["backend"] == "torch" and d["device"] == "cpu"
    assert set(d["timings"]) >= {"prefill_s", "evict_s", "decode_s"}
    assert d["cache_bytes_before"] == 3 * 2 * (1 * 2 * 64 * 8 * 4)
    assert d["cache_bytes_after"] == d["cache_bytes_before"] * 32 // 64
    kept30 = res.plan.keep[:, :, 30:32].double().mean(-1).tolist()
    assert d["needle_retention"] == kept30
    assert d["needle_kept_all"] == bool(res.plan.keep[:, :, 30:32].all())
    # Pooled UOR measured on the compacted cache (stored tokens over the group's one kept
    # mask), not the plan's constant 1; the reported `uor` is that measurement.
    measured = torch.tensor(d["stored_tokens"], dtype=torch.float64)
    measured = measured / res.plan.keep.sum(-1).double()
    assert measured.tolist() == [[1.0, 1.0]] * 3
    assert d["uor"] == {"mean": float(measured.mean()), "max": float(measured.max())}


def test_eos_stops_like_generate(llama):
    runner = Runner(llama)
    ids = prompt(40, seed=23)
    pre = runner.prefill(ids, window_max=8)
    free = runner.evaluate(pre, EvictionConfig(policy="full", window=8), 6, stop_at_eos=False)
    eos = free.tokens[2]
    model = copy.deepcopy(llama)
    model.generation_config.eos_token_id = [eos, VOCAB - 1]
    r2 = Runner(model)
    res = r2.evaluate(r2.prefill(ids, window_max=8), EvictionConfig(policy="full", window=8), 6)
    stop_at = free.tokens.index(eos) + 1
    assert res.tokens == free.tokens[:stop_at] and res.stop_reason == "eos"
    assert res.tokens == generate_ref(model, ids, 6)


def test_triton_backend_on_cpu_without_interpreter_is_a_backend_error():
    """A triton runner on the CPU without `TRITON_INTERPRET=1` raises BackendError (in a child
    process: conftest sets the variable here)."""
    code = (
        "import os\n"
        "assert 'TRITON_INTERPRET' not in os.environ\n"
        "from pagekv.runtime.backend import BackendError\n"
        "from pagekv.runtime.runner import Runner\n"
        "from tests.test_runner import tiny_model\n"
        "model = tiny_model('llama', layers=1)\n"
        "assert Runner(model, backend='torch').backend == 'torch'\n"
        "try:\n"
        "    Runner(model, backend='triton')\n"
        "except BackendError as e:\n"
        "    print('BackendError:', e)\n"
        "else:\n"
        "    raise SystemExit('Runner(backend=triton) on CPU raised no BackendError')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    assert "BackendError:" in res.stdout and "TRITON_INTERPRET=1" in res.stdout, res.stdout


def test_bad_inputs_are_clear_errors(llama):
    runner = Runner(llama)
    with pytest.raises(ValueError, match="backend"):
        Runner(llama, backend="cuda")
    assert runner.backend == "torch"  # auto on CPU
    with pytest.raises(ValueError, match="empty"):
        runner.prefill([])
    pre = runner.prefill(prompt(50), window_max=8)
    with pytest.raises(ValueError, match="window_max"):
        runner.evaluate(pre, EvictionConfig(policy="entropy", budget=0.5, window=16))
    with pytest.raises(ValueError, match="max_new_tokens"):
        runner.evaluate(pre, EvictionConfig(policy="full", window=8), max_new_tokens=-1)
    assert runner.evaluate(pre, EvictionConfig(policy="full", window=8), 0).tokens == []
