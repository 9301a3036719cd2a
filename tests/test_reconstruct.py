"""The reconstruction scorer (`pagekv.runtime.reconstruct`): the model's own attention while it
repeats the context, max over its queries, whatever the chunking, leaving the prefill's cache as
it was; its Triton path gives the torch path's scores."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface

from pagekv.maths.entropy import isolate_sinks, weights_from_mass
from pagekv.runtime import reconstruct
from pagekv.runtime.prefill import attention_modules
from pagekv.runtime.reconstruct import (
    FOCUS_SINKS,
    as_profiles,
    reconstruction_masses,
    reconstruction_scores,
)
from pagekv.runtime.runner import Runner, _new_cache

from .test_runner import prompt, tiny_model


@pytest.fixture(scope="module")
def eager():
    return tiny_model("llama", attn="eager")


def _copy(cache):
    return _new_cache([(la.keys.clone(), la.values.clone()) for la in cache.layers])


def reconstruction_profiles(model, cache, ctx, instr, aggregation="max", **kw):
    """The pass's profiles `[L, H, n]`: its scores by `aggregation`, each row normalised."""
    return as_profiles(reconstruction_scores(model, cache, ctx, instr, **kw)[aggregation])


def _reference(model, ctx: list[int], instr: list[int], aggregation="max") -> torch.Tensor:
    """The same scores from ONE eager forward of context + instruction + context with
    every attention matrix returned: `[L, H, n]`."""
    ids = ctx + instr + ctx
    n, m = len(ctx), len(instr)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    rows = slice(n + m, n + m + n)
    agg = {"max": lambda a: a.amax(1), "mean": lambda a: a.mean(1)}[aggregation]
    best = torch.stack([agg(a[0, :, rows, :n]) for a in out.attentions]).float()
    return best / best.sum(-1, keepdim=True)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_profiles_are_the_models_attention_whatever_the_chunk(eager, chunk):
    runner = Runner(eager)
    ctx, instr = prompt(40, seed=3), prompt(5, seed=4)
    pre = runner.prefill(ctx, window_max=8)
    before = [la.keys.clone() for la in pre.cache.layers]
    got = reconstruction_profiles(eager, _copy(pre.cache), ctx, instr, chunk=chunk)
    want = _reference(eager, ctx, instr)
    assert got.shape == (3, 8, 40)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.allclose(got.sum(-1), torch.ones(3, 8))
    assert all(torch.equal(a, la.keys) for a, la in zip(before, pre.cache.layers, strict=True))


def test_the_mean_aggregation_too(eager):
    runner = Runner(eager)
    ctx, instr = prompt(40, seed=3), prompt(5, seed=4)
    pre = runner.prefill(ctx, window_max=8)
    got = reconstruction_profiles(eager, _copy(pre.cache), ctx, instr, chunk=9, aggregation="mean")
    torch.testing.assert_close(got, _reference(eager, ctx, instr, "mean"), atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got, _reference(eager, ctx, instr, "max"), atol=1e-3)


def test_the_check_can_fail_on_other_rows(eager):
    """A reference over the WRONG rows (the first reading of the context, not the
    reconstruction) differs: the comparison above is not vacuous."""
    runner = Runner(eager)
    ctx, instr = prompt(40, seed=3), prompt(5, seed=4)
    pre = runner.prefill(ctx, window_max=8)
    got = reconstruction_profiles(eager, _copy(pre.cache), ctx, instr, chunk=16)
    ids = ctx + instr + ctx
    with torch.inference_mode():
        out = eager(input_ids=torch.tensor([ids]), output_attentions=True)
    wrong = torch.stack([a[0, :, :40, :40].amax(1) for a in out.attentions]).float()
    wrong = wrong / wrong.sum(-1, keepdim=True)
    assert not torch.allclose(got, wrong, atol=1e-3)


def test_bad_inputs(eager):
    runner = Runner(eager)
    ctx = prompt(12, seed=1)
    pre = runner.prefill(ctx, window_max=4)
    with pytest.raises(ValueError, match="chunk"):
        reconstruction_profiles(eager, _copy(pre.cache), ctx, [], chunk=0)
    with pytest.raises(ValueError, match="holds 12 tokens"):
        reconstruction_profiles(eager, _copy(pre.cache), ctx[:5], [])


def test_the_runner_plans_and_decodes_with_it_once_per_prompt(eager):
    from pagekv import EvictionConfig

    runner = Runner(eager)
    ctx = prompt(64, seed=5)
    pre = runner.prefill(ctx, window_max=8, question_ids=prompt(4, seed=6))
    held = [(la.keys, la.values, la.keys.clone(), la.values.clone()) for la in pre.cache.layers]
    win = EvictionConfig(policy="entropy", budget=0.3, page_size=4, n_sink=2, window=8)
    rec = win.replace(scorer="reconstruct")
    p_rec = runner.plan(pre, rec)
    # The pass left the prefill's cache as it was: the same tensors, the same values.
    for la, (k, v, k0, v0) in zip(pre.cache.layers, held, strict=True):
        assert la.keys is k and la.values is v and la.keys.shape[2] == 64
        assert torch.equal(k, k0) and torch.equal(v, v0)
    first = pre._scores[("reconstruct", 2)][0]
    # The same profiles as the module computes on its own (no instruction: no tokenizer).
    want = reconstruction_profiles(eager, _copy(pre.cache), ctx, [])
    torch.testing.assert_close(first, want)
    seconds = pre.timings["reconstruct_s"]
    for policy in ("mean", "max", "entropy_nosink"):  # every scoring policy can use it
        runner.plan(pre, rec.replace(policy=policy))
    runner.plan(pre, rec.replace(n_sink=0))
    assert pre._scores[("reconstruct", 0)][0] is first  # one pass per prompt
    assert pre.timings["reconstruct_s"] == seconds
    p_win = runner.plan(pre, win)
    assert not torch.equal(p_rec.page_keep, p_win.page_keep)  # another scorer, other pages
    assert bool(p_rec.page_keep[..., p_rec.protected].all())  # window pages still protected
    res = runner.evaluate(pre, rec, max_new_tokens=3)
    assert len(res.tokens) == 3 and res.config["scorer"] == "reconstruct"


def test_the_pass_writes_each_chunk_into_its_cache_in_place(eager):
    """The pass copies the prefill's cache once and never concatenates a layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n = 64
    pre = Runner(eager).prefill(prompt(n, seed=5), window_max=8)

    class LayerCats(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and out.dim() == 4 and out.shape[2] >= n:
                LayerCats.seen += 1  # a [1, G, >= n, d] concatenation: a whole layer
            return out

    with LayerCats():
        reconstruction_scores(eager, pre.cache, pre.ids, prompt(3, seed=9), chunk=8)
    assert LayerCats.seen == 0
    la = pre.cache.layers[0]
    with LayerCats():  # the control: a DynamicCache grown by one chunk concatenates
        _copy(pre.cache).update(la.keys[:, :, :8], la.values[:, :, :8], 0)
    assert LayerCats.seen == 2  # its keys and its values


@pytest.mark.parametrize("chunk, n", [(7, 40), (300, 310)])
def test_the_triton_path_gives_the_torch_scores(eager, chunk, n):
    """backend="triton" equals torch, both aggregations, short and 300-query chunks."""
    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()
    model = copy.deepcopy(eager).to("cuda") if cuda else eager
    runner = Runner(model)
    ctx, instr = prompt(n, seed=3), prompt(5, seed=4)
    pre = runner.prefill(ctx, window_max=8)
    want = reconstruction_scores(model, _copy(pre.cache), ctx, instr, chunk=chunk)
    got = reconstruction_scores(model, _copy(pre.cache), ctx, instr, chunk=chunk, backend="triton")
    assert set(got) == {"max", "mean", "focus_mass", "focus_sink"}
    for agg in ("max", "mean"):
        assert got[agg].shape == (3, 8, n) and got[agg].dtype == torch.float32
        torch.testing.assert_close(got[agg], want[agg], atol=2e-6, rtol=1e-5, msg=agg)
    for part in ("focus_mass", "focus_sink"):  # torch ops on both backends, same rows
        torch.testing.assert_close(got[part], want[part], atol=2e-6, rtol=1e-5, msg=part)
    # The two aggregations differ, so each comparison checks its own output.
    assert not torch.allclose(got["max"], got["mean"], atol=1e-3)


@pytest.mark.parametrize("order", ["sdpa, as kvpress wraps it", "eager"])
def test_either_order_of_the_sixth_argument_gives_the_same_scores(eager, order, monkeypatch):
    """Dropout sixth (kvpress's wrapper) or scaling sixth (eager): the same scores, with a doubled
    scaling so a lost one would show."""
    runner = Runner(eager)
    ctx, instr = prompt(30, seed=5), prompt(4, seed=6)
    pre = runner.prefill(ctx, window_max=8)
    inner = reconstruct._scored_attention
    scale = 2.0 / eager.config.head_dim**0.5

    def plain(module, query, key, value, attention_mask=None, **kw):
        return inner(module, query, key, value, attention_mask, scaling=scale)

    def wrapped(module, query, key, value, attention_mask=None, **kw):
        if order == "eager":
            return inner(module, query, key, value, attention_mask, scale, 0.0)
        return inner(module, query, key, value, attention_mask, 0.0, scaling=scale)

    got = {}
    for name, fn in (("plain", plain), (order, wrapped)):
        monkeypatch.setitem(AttentionInterface._global_mapping, reconstruct.SCORED_ATTENTION, fn)
        got[name] = reconstruction_scores(eager, _copy(pre.cache), ctx, instr, chunk=8)
    for agg in ("max", "mean", "focus_mass"):
        torch.testing.assert_close(got[order][agg], got["plain"][agg], msg=agg)
    monkeypatch.undo()
    own = reconstruction_scores(eager, _copy(pre.cache), ctx, instr, chunk=8)
    assert not torch.allclose(own["max"], got["plain"]["max"])  # the doubled scale counts


def test_the_backend_is_checked_before_the_pass(eager):
    runner = Runner(eager)
    ctx = prompt(12, seed=1)
    pre = runner.prefill(ctx, window_max=4)
    with pytest.raises(ValueError, match="backend must be one of"):
        reconstruction_profiles(eager, _copy(pre.cache), ctx, [], backend="cuda")


def _reference_focus(model, ctx: list[int], instr: list[int], n_sink: int):
    """Per head, the mean over reconstruction queries of the isolated collision mass and sink share,
    row by row: `([L, H], [L, H])`."""
    ids = ctx + instr + ctx
    n, m = len(ctx), len(instr)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    masses, sinks = [], []
    for a in out.attentions:
        rows = a[0, :, n + m :, :n].double()  # [H, n queries, n context keys]
        rows = rows / rows.sum(-1, keepdim=True)
        iso = isolate_sinks(rows, n_sink).double()  # one "profile" per query row
        masses.append((iso * iso).sum(-1).mean(-1))
        sinks.append(rows[..., :n_sink].sum(-1).mean(-1))
    return torch.stack(masses).float(), torch.stack(sinks).float()


@pytest.mark.parametrize("n_sink", [0, 2, 5])
def test_the_head_masses_are_the_reconstruction_queries_focus(eager, n_sink):
    """`reconstruction_masses` is the queries' mean focus, not the max profile's."""
    runner = Runner(eager)
    ctx, instr = prompt(40, seed=3), prompt(5, seed=4)
    pre = runner.prefill(ctx, window_max=8)
    scores = reconstruction_scores(eager, _copy(pre.cache), ctx, instr, chunk=16)
    assert scores["focus_mass"].shape == (3, 8, FOCUS_SINKS + 1)
    prof = scores["max"] / scores["max"].sum(-1, keepdim=True)
    got = reconstruction_masses(scores, prof, n_sink)
    want_mass, want_sink = _reference_focus(eager, ctx, instr, n_sink)
    torch.testing.assert_close(got.isolated, want_mass, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got.sink, want_sink, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got.collision, _reference_focus(eager, ctx, instr, 0)[0])
    assert got.n_sink == n_sink
    # The profile's own collision mass is another quantity (the check can fail).
    profile_mass = (isolate_sinks(prof, n_sink) ** 2).sum(-1)
    assert not torch.allclose(got.isolated, profile_mass, rtol=0.1)
    with pytest.raises(ValueError, match=f"n_sink 0..{FOCUS_SINKS}"):
        reconstruction_masses(scores, prof, FOCUS_SINKS + 1)


def test_the_runner_weights_heads_by_the_queries_focus(eager):
    """The runner's reconstruct plan weights each group's heads by the focus masses
    (softmax of -H2 within a group), memoised per n_sink on the one pass."""
    from pagekv import EvictionConfig

    runner = Runner(eager)
    ctx = prompt(48, seed=7)
    pre = runner.prefill(ctx, window_max=8)
    cfg = EvictionConfig(policy="entropy", budget=0.4, page_size=4, n_sink=3, window=8,
                         scorer="reconstruct")  # fmt: skip
    p = runner.plan(pre, cfg)
    scores = pre.reconstruction
    want = weights_from_mass(scores["focus_mass"][..., 3], pre.n_groups, cfg.tau)
    torch.testing.assert_close(p.head_weights, want)
    prof = pre._scores[("reconstruct", 3)][0]
    other = weights_from_mass((isolate_sinks(prof, 3) ** 2).sum(-1), pre.n_groups, cfg.tau)
    assert not torch.allclose(p.head_weights, other, atol=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_family_under_sdpa_gives_the_eager_reference(family, monkeypatch):
    """An SDPA model of each family gives its eager reference, then SDPA again."""
    from pagekv.runtime.reconstruct import SCORED_ATTENTION

    model = tiny_model(family)  # SDPA
    runner = Runner(model)
    ctx, instr = prompt(40, seed=3), prompt(5, seed=4)
    pre = runner.prefill(ctx, window_max=8)
    seen = []
    real = reconstruct._scored_attention

    def spy(module, *args, **kwargs):
        seen.append(module.config._attn_implementation)
        return real(module, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, SCORED_ATTENTION, spy)
    got = reconstruction_profiles(model, _copy(pre.cache), ctx, instr, chunk=16)
    assert seen == [SCORED_ATTENTION] * 3 * 3  # 3 layers x 3 chunks, the instruction not
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_pagekv_pass") for m in attention_modules(model))
    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    torch.testing.assert_close(got, _reference(model, ctx, instr), atol=2e-5, rtol=1e-4)


def test_a_failed_pass_leaves_the_model_as_it_was(eager):
    """An error inside a chunk's forward leaves the model's attention and modules as they were."""
    runner = Runner(eager)
    ctx = prompt(24, seed=8)
    pre = runner.prefill(ctx, window_max=4)
    ids = torch.tensor([ctx])
    with torch.inference_mode():
        before = eager(input_ids=ids).logits
    bad = ctx[:-1] + [10**6]
    with pytest.raises(IndexError):
        reconstruction_scores(eager, _copy(pre.cache), bad, prompt(3, seed=9), chunk=8)
    assert eager.config._attn_implementation == "eager"
    assert not any(hasattr(m, "_pagekv_pass") for m in attention_modules(eager))
    with torch.inference_mode():
        assert torch.equal(eager(input_ids=ids).logits, before)
