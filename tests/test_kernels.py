"""Triton kernels against their torch twins (kernels/ and pagekv.runtime.backend), interpreted
without CUDA (tests/conftest.py), compiled with it. Floats within a small multiple of the input
precision's loss; kept pages, protected pages, block tables and compacted tensors exact."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagekv import EvictionConfig, plan
from pagekv.maths.entropy import (
    SINK_EPS,
    HeadMasses,
    collision_mass,
    entropy_head_weights,
    isolated_collision_mass,
    mass_sums,
    sink_mass,
)
from pagekv.maths.paging import page_reduce, page_sizes, protected_pages, select_pages
from pagekv.maths.policies import max_pool, uniform_weights, weighted_pool
from pagekv.maths.profiles import attention_profiles
from pagekv.runtime import backend as be
from pagekv.runtime.backend import compact_layer

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


@pytest.fixture(scope="module")
def kern():
    """The kernel modules, interpreted on CPU-only machines (see tests/conftest.py)."""
    cuda = torch.cuda.is_available()
    pytest.importorskip("triton")
    mods = SimpleNamespace(
        score=importlib.import_module("pagekv.kernels.score"),
        pool=importlib.import_module("pagekv.kernels.pool_pages"),
        compact=importlib.import_module("pagekv.kernels.compact"),
    )
    from pagekv.kernels._common import is_interpreted

    if not cuda:  # conftest chose the interpreter before `kernels` was first imported
        assert is_interpreted(mods.score._profile_kernel), "kernels defined without the interpreter"
    return mods


@pytest.fixture
def device(device, kern):
    """conftest's `device`, once the kernels are imported (and checked interpreted)."""
    return device


def assert_close(name, got, ref, lowp=None, floor=1e-6, factor=2.0):
    """`|got - ref| <= factor * |lowp - ref| + floor` (max over elements)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert bool(torch.isfinite(got).all()), f"{name}: non-finite values"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    base = (lowp.double().cpu() - ref).abs().max().item() if lowp is not None else 0.0
    tol = factor * base + floor
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} (low-precision torch {base:.3g})"


def assert_equal(name, got, ref):
    got, ref = got.cpu(), ref.cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: not identical; first differing indices {bad}")


def profiles_lowp(q, k, scale=None):
    """`attention_profiles` done in the input dtype (the error budget of that dtype)."""
    L, H, w, d = q.shape
    G, n = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(H // G, dim=1)  # [L, H, n, d]
    scale = d**-0.5 if scale is None else scale
    logits = (q @ kk.transpose(-1, -2)) * scale  # [L, H, w, n] in q.dtype
    future = (
        torch.arange(n, device=q.device)[None, :] > torch.arange(n - w, n, device=q.device)[:, None]
    )
    logits = logits.masked_fill(future, float("-inf"))
    return torch.softmax(logits, -1).mean(2)  # [L, H, n]


SCORE_SHAPES = [
    # (L, H, G, w, n, d, n_sink, tiles_per_split)
    (1, 2, 2, 4, 63, 16, 4, None),  # r = 1, awkward n
    (2, 3, 1, 8, 130, 48, 4, 1),  # r = 3, three tiles, one tile per split, d not 2^k
    (1, 6, 1, 32, 200, 64, 4, None),  # r = 6, the default window
    (1, 3, 1, 5, 5, 16, 4, None),  # n < config window: w clipped to n
    (1, 2, 1, 3, 3, 16, 4, None),  # n <= n_sink: plain collision mass
    (1, 6, 2, 1, 40, 16, 0, None),  # w = 1, no sinks
]


def kernel_score(kern, q, k, n_sink, **kw):
    """The kernel's profiles, and its per-head sums turned into masses by the core's
    one conversion (`HeadMasses.from_sums`): `(profiles, sink, iso, collision)`."""
    prof, sums = kern.score.score_layers(q, k, n_sink, **kw)
    assert tuple(sums.shape) == (*prof.shape[:2], 4), "sums shape"
    m = HeadMasses.from_sums(sums, k.shape[-2], n_sink)
    return prof, m.sink, m.isolated, m.collision


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    SCORE_SHAPES,
    ids=[("L{}-H{}-G{}-w{}-n{}-d{}-s{}-t{}".format(*s)) for s in SCORE_SHAPES],
)
def test_score_matches_twin(kern, device, shape, dtype):
    L, H, G, w, n, d, n_sink, tps = shape
    gen = torch.Generator().manual_seed(n * 31 + H)
    q = (torch.randn(L, H, w, d, generator=gen) * 2).to(device, dtype)
    k = torch.randn(L, G, n, d, generator=gen).to(device, dtype)
    prof, sink, iso, coll = kernel_score(kern, q, k, n_sink, block_n=64, tiles_per_split=tps)
    ref = attention_profiles(q, k)  # upcasts: the fp32 reference of these inputs
    low = profiles_lowp(q, k).float()
    assert_close("profiles", prof, ref, low, floor=1e-6)
    assert_close("profile row sums", prof.sum(-1), torch.ones(L, H), floor=1e-5)
    assert_close("sink_mass", sink, sink_mass(ref, n_sink), sink_mass(low, n_sink), floor=1e-6)
    assert_close(
        "iso_collision",
        iso,
        isolated_collision_mass(ref, n_sink),
        isolated_collision_mass(low, n_sink),
        floor=2e-6,
    )
    assert_close("collision", coll, collision_mass(ref), collision_mass(low), floor=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_score_degenerate_sink_head(kern, device, dtype):
    """A head with all its attention on the sinks takes the SINK_EPS guard: 1/(n - n_sink)."""
    L, H, G, w, n, d, n_sink = 1, 3, 1, 4, 50, 16, 4
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(L, H, w, d, generator=gen) * 0.1
    k = torch.randn(L, G, n, d, generator=gen) * 0.1
    q[0, 0, :, 0] = 30.0  # head 0 ...
    k[0, 0, 1, 0] = 10.0  # ... puts a logit of 300 on sink token 1: non-sink mass ~ e^-300
    q, k = q.to(device, dtype), k.to(device, dtype)
    prof, sink, iso, coll = kernel_score(kern, q, k, n_sink, scale=1.0, block_n=64)
    ref = attention_profiles(q, k, scale=1.0)
    assert float(ref[0, 0, n_sink:].sum()) < SINK_EPS
    assert_close("sink_mass", sink, sink_mass(ref, n_sink), floor=1e-5)
    assert iso[0, 0].item() == pytest.approx(1.0 / (n - n_sink), rel=1e-6), "iso_collision[0, 0]"
    assert_close("iso_collision", iso, isolated_collision_mass(ref, n_sink), floor=1e-5)
    assert_close("collision", coll, collision_mass(ref), floor=1e-5)


def test_score_rejects_bad_input(kern):
    q = torch.zeros(1, 3, 4, 16)
    with pytest.raises(ValueError, match="multiple of KV groups"):
        kern.score.score_layers(q, torch.zeros(1, 2, 8, 16), 4)
    with pytest.raises(ValueError, match="window"):
        kern.score.score_layers(q, torch.zeros(1, 1, 3, 16), 4)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        kern.score.score_layers(q.long(), torch.zeros(1, 1, 8, 16), 4)


def test_score_mixed_dtypes(kern, device):
    """fp32 queries over a bf16 cache: the fp32 maths of the twin."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 8, 32, generator=gen).to(device)
    k = torch.randn(1, 2, 70, 32, generator=gen).to(device, torch.bfloat16)
    prof, *_ = kern.score.score_layers(q, k, 4, block_n=64)
    assert_close("profiles", prof, attention_profiles(q, k), floor=1e-6)


def scores_reference(q, k, dtype, scale=None):
    """Mean and max over the `w` causal queries of the softmax, computed in `dtype`
    (float64: the reference; the input dtype: what that precision loses)."""
    L, H, w, d = q.shape
    G, n = k.shape[1], k.shape[2]
    qq, kk = q.to(dtype), k.to(dtype).repeat_interleave(H // G, dim=1)  # [L, H, n, d]
    scale = d**-0.5 if scale is None else scale
    logits = (qq @ kk.transpose(-1, -2)) * scale  # [L, H, w, n]
    future = (
        torch.arange(n, device=q.device)[None, :] > torch.arange(n - w, n, device=q.device)[:, None]
    )
    probs = torch.softmax(logits.masked_fill(future, float("-inf")), -1)
    return probs.mean(2), probs.amax(2)  # [L, H, n] each


# (w, block_w): the default row blocks (several query blocks on a GPU once w > 256), and
# forced ones: an exact multiple of the block, a last block of one query, 3 blocks.
LONG_CASES = [(1, None), (17, None), (256, None), (257, None), (600, None), (256, 64),
              (257, 128), (600, 256)]  # fmt: skip


@pytest.mark.parametrize("dtype", [DTYPES[0], DTYPES[2]])
@pytest.mark.parametrize("w, block_w", LONG_CASES, ids=[f"w{w}-bw{b}" for w, b in LONG_CASES])
def test_score_long_query_sets(kern, device, w, block_w, dtype):
    """Any number of queries, in one or several query blocks: the mean profile, its masses
    and the max output match the float64 reference within the input dtype's budget."""
    L, H, G, d, n_sink = 1, 2, 1, 16, 4  # r = 2: the heads of a group share the programs
    n = w + 23
    gen = torch.Generator().manual_seed(w)
    q = (torch.randn(L, H, w, d, generator=gen) * 2).to(device, dtype)
    k = torch.randn(L, G, n, d, generator=gen).to(device, dtype)
    W_BLK, n_qb, R_BLK, _ = kern.score.row_blocks(w, H // G, 256, block_w)
    assert R_BLK * W_BLK <= 256 and (n_qb > 1) == (w > W_BLK)
    prof, sums, top = kern.score.score_layers(q, k, n_sink, block_w=block_w, return_max=True)
    ref, ref_top = scores_reference(q, k, torch.float64)
    low, low_top = (x.float() for x in scores_reference(q, k, dtype))
    assert_close("profiles", prof, ref, low, floor=1e-6)
    assert_close("profile row sums", prof.sum(-1), torch.ones(L, H), floor=1e-5)
    assert_close("max over queries", top, ref_top, low_top, floor=2e-6)
    m = HeadMasses.from_sums(sums, n, n_sink)
    assert_close("sink_mass", m.sink, sink_mass(ref, n_sink), sink_mass(low, n_sink))
    assert_close("iso_collision", m.isolated, isolated_collision_mass(ref, n_sink),
                 isolated_collision_mass(low, n_sink), floor=2e-6)  # fmt: skip
    assert_close("collision", m.collision, collision_mass(ref), collision_mass(low))
    # Every query counts: the max is at least the mean, and the last query's keys
    # (the whole prompt) all get some attention.
    assert bool((top >= prof - 1e-7).all()) and bool((top > 0).all())
    if w == 257 and block_w is None:  # return_max changes nothing else
        prof2, sums2 = kern.score.score_layers(q, k, n_sink, block_w=block_w)
        assert_equal("profiles without return_max", prof2, prof)
        assert_equal("sums without return_max", sums2, sums)


@pytest.mark.parametrize("w, block_w", [(8, None), (40, 16)], ids=["one-qb", "three-qb"])
def test_score_any_run_of_key_tiles_per_program(kern, device, w, block_w):
    """Any `tiles_per_prog` (not dividing the 10 tiles, or past them) gives the bits of one tile per
    program, matching the reference."""
    L, H, G, d, n, n_sink = 2, 4, 2, 16, 300, 4
    gen = torch.Generator().manual_seed(w)
    q = (torch.randn(L, H, w, d, generator=gen) * 2).to(device)
    k = torch.randn(L, G, n, d, generator=gen).to(device)
    kw = dict(block_n=32, block_w=block_w, return_max=True)
    one = kern.score.score_layers(q, k, n_sink, tiles_per_prog=1, **kw)
    ref, ref_top = scores_reference(q, k, torch.float64)
    assert_close("profiles", one[0], ref, floor=1e-6)
    assert_close("max over queries", one[2], ref_top, floor=2e-6)
    for run in (3, 4, 10, 64):
        got = kern.score.score_layers(q, k, n_sink, tiles_per_prog=run, **kw)
        for name, a, b in zip(("profiles", "sums", "max"), got, one, strict=True):
            assert_equal(f"{name}, {run} tiles per program", a, b)


def test_row_blocks_bound_the_rows(kern):
    """A program holds at most max_rows query rows, blocks cover every query and head, and a
    launcher picks at most two row shapes per head count."""
    for max_rows in (32, 256, 1024):
        for r in (1, 2, 3, 4, 6, 8, 16):
            shapes = set()
            for w in (1, 15, 16, 17, 32, 255, 256, 257, 600, 1024, 2048, 4097, 100_000):
                W_BLK, n_qb, R_BLK, n_rb = kern.score.row_blocks(w, r, max_rows)
                assert 16 <= W_BLK <= max_rows and R_BLK * W_BLK <= max_rows, (w, r, max_rows)
                assert (n_qb - 1) * W_BLK < w <= n_qb * W_BLK, (w, r, max_rows)
                assert (n_rb - 1) * R_BLK < r <= n_rb * R_BLK, (w, r, max_rows)
                assert R_BLK == min(1 << (r - 1).bit_length(), max_rows // 16)
                assert W_BLK == (16 if w <= 16 else max_rows // R_BLK), (w, r, max_rows)
                shapes.add((R_BLK, W_BLK))
            assert len(shapes) <= 2, (r, max_rows, shapes)
            # The interpreter's tight rows: no padding beyond the next power of two.
            for w in (1, 17, 32, 600, 4097):
                W_BLK, n_qb, R_BLK, _ = kern.score.row_blocks(w, r, max_rows, tight=True)
                assert W_BLK == max(min(1 << (w - 1).bit_length(), max_rows // R_BLK), 16)
                assert R_BLK * W_BLK <= max_rows and (n_qb - 1) * W_BLK < w <= n_qb * W_BLK
    with pytest.raises(ValueError, match="block_w"):
        kern.score.row_blocks(40, 2, 256, block_w=24)
    # A forced block size keeps the bound: heads per block shrink to fit it.
    assert kern.score.row_blocks(600, 2, 256, block_w=256) == (256, 3, 1, 2)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    w=st.integers(1, 70),
    extra=st.integers(0, 40),
    r=st.sampled_from([1, 2, 3]),
    G=st.integers(1, 2),
    block_w=st.sampled_from([16, 32, None]),
    seed=st.integers(0, 2**16),
)
def test_score_query_blocks_property(kern, device, w, extra, r, G, block_w, seed):
    """Random shapes and query-block sizes: the same mean and max as the reference."""
    n, d, H = w + extra, 16, G * r
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, H, w, d, generator=gen) * 2).to(device)
    k = torch.randn(1, G, n, d, generator=gen).to(device)
    prof, sums, top = kern.score.score_layers(q, k, 2, block_w=block_w, return_max=True)
    ref, ref_top = scores_reference(q, k, torch.float64)
    assert_close("profiles", prof, ref, floor=1e-6)
    assert_close("max over queries", top, ref_top, floor=2e-6)
    assert_close("mass sums", sums, mass_sums(ref, 2), floor=2e-6)


@pytest.mark.parametrize("kdtype", [DTYPES[0], DTYPES[2]])
def test_attention_scores_backends(kern, device, kdtype):
    """`backend.attention_scores`: Triton and the torch twin agree on a 300-query set (a
    reconstruction chunk), for float32 queries over a float32 or bfloat16 cache."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(4, 300, 16, generator=gen).to(device)  # [H, w, d], one layer
    k = torch.randn(2, 330, 16, generator=gen).to(device, kdtype)
    mean_t, top_t, used_t = be.attention_scores(q, k, 0.3, backend="torch")
    mean_k, top_k, used_k = be.attention_scores(q, k, 0.3, backend="triton")
    assert (used_t, used_k) == ("torch", "triton")
    ref, ref_top = scores_reference(q[None], k[None], torch.float64, scale=0.3)
    for name, got in (("mean (torch)", mean_t), ("mean (triton)", mean_k)):
        assert_close(name, got, ref, floor=1e-6)
    for name, got in (("max (torch)", top_t), ("max (triton)", top_k)):
        assert_close(name, got, ref_top, floor=2e-6)
    assert_close("mean twin vs attention_profiles", mean_t, attention_profiles(q[None], k[None],
                 scale=0.3), floor=1e-6)  # fmt: skip


def pool_reference(scores, weights, G):
    """`s_g(t) = sum_{h in g} w_h s_h(t)` in float64 (rounding negligible next to fp32's):
    scores `[L, H, n]`, weights `[L, H]` -> `[L, G, n]` float64."""
    L, H, n = scores.shape
    s = scores.double().view(L, G, H // G, n)
    w = weights.double().view(L, G, H // G, 1)
    return (w * s).sum(2)


def pool_tolerance(scores, weights, G, ref):
    """What fp32 may lose on `ref`: the error of torch's own fp32 sum (any order), doubled,
    plus a floor of `r` roundings of the largest pooled value."""
    L, H, n = scores.shape
    r = H // G
    fp32 = (weights.float().view(L, G, r, 1) * scores.float().view(L, G, r, n)).sum(2)
    floor = 2 * r * 2.0**-24 * float(ref.abs().max())
    return fp32, floor


POOL_SHAPES = [
    # (L, H, G, n, P, n_sink, window)
    (2, 2, 2, 37, 4, 4, 8),  # r = 1, partial last page
    (1, 3, 1, 50, 1, 4, 8),  # P = 1 (token level)
    (2, 6, 1, 64, 64, 4, 32),  # a single page
    (1, 6, 2, 70, 16, 4, 32),  # r = 3, partial last page
    (1, 12, 2, 33, 8, 0, 33),  # r = 6, window = n (everything protected)
]


@pytest.mark.parametrize("reduction", ["max", "sum"])
@pytest.mark.parametrize("pooling", ["weighted", "max"])
@pytest.mark.parametrize(
    "shape", POOL_SHAPES, ids=["L{}-H{}-G{}-n{}-P{}-s{}-w{}".format(*s) for s in POOL_SHAPES]
)
def test_pool_pages_matches_twin(kern, device, shape, pooling, reduction):
    L, H, G, n, P, n_sink, window = shape
    gen = torch.Generator().manual_seed(n + H)
    prof = torch.softmax(torch.randn(L, H, n, generator=gen) * 3, -1).to(device)
    weights = entropy_head_weights(prof, G, n_sink) if pooling == "weighted" else None
    pooled, pages, prot = kern.pool.pool_pages(
        prof, weights, G, P, n_sink, window, pooling, reduction
    )
    twin = weighted_pool(prof, weights, G) if pooling == "weighted" else max_pool(prof, G)
    twin_pages = page_reduce(twin, P, reduction)
    assert_equal("protected", prot, protected_pages(n, P, n_sink, window, device))
    if pooling == "weighted":
        # Kernel and twin both add the heads in index order, one fp32 add at a time:
        # bit-identical, so a near-tie between pages cannot flip between backends.
        assert_equal("pooled (kernel vs weighted_pool)", pooled, twin)
        ref = pool_reference(prof, weights, G)
        fp32, floor = pool_tolerance(prof, weights, G, ref)
        assert_close("pooled vs float64 reference", pooled, ref, fp32, floor=floor)
        assert_close("weighted_pool vs float64 reference", twin, ref, fp32, floor=floor)
        ref_pages = page_reduce(ref, P, reduction)
        fp32_pages = page_reduce(fp32, P, reduction)
        page_floor = floor * (P if reduction == "sum" else 1)
        assert_close("page_scores vs float64 reference", pages, ref_pages, fp32_pages,
                     floor=page_floor)  # fmt: skip
    else:  # a max is exact in any precision
        ref = prof.double().view(L, G, H // G, n).amax(2)
        assert_equal("pooled (max) vs reference", pooled.double(), ref)
        assert_equal("pooled (max, kernel vs max_pool)", pooled, twin)
    if reduction == "max":
        assert_equal("page_scores (kernel vs twin)", pages, twin_pages)
    else:  # a page sum's order may differ between kernel and twin
        assert_close("page_scores vs twin", pages, twin_pages, floor=1e-6 * P)
    sizes = page_sizes(n, P, device)
    k_min = int(sizes[prot].sum())
    for k in sorted({k_min, (k_min + n) // 2, n}):
        assert_equal(
            f"kept pages (k={k})",
            select_pages(pages, prot, sizes, k),
            select_pages(twin_pages, prot, sizes, k),
        )


@pytest.mark.parametrize("r", [2, 4])
def test_pool_pages_exact_ties(kern, device, r):
    """Many exact ties (multiples of 1/8, weights 1/r): kept sets follow the tie rule."""
    L, G, n, P = 2, 2, 96, 4
    H = G * r
    gen = torch.Generator().manual_seed(r)
    scores = (torch.randint(0, 3, (L, H, n), generator=gen) / 8.0).to(device)
    weights = uniform_weights(L, H, G, device)
    _, pages, prot = kern.pool.pool_pages(scores, weights, G, P, 4, 8, "weighted", "max")
    twin = page_reduce(weighted_pool(scores, weights, G), P, "max")
    assert_equal("page_scores", pages, twin)
    sizes = page_sizes(n, P, device)
    for k in (16, 40, 64):
        assert_equal(f"kept pages (k={k})", select_pages(pages, prot, sizes, k),
                     select_pages(twin, prot, sizes, k))  # fmt: skip


COMPACT_SHAPES = [
    # (L, B, G, n, d, P, budget)
    (2, 1, 2, 37, 16, 4, 0.6),  # partial last page
    (1, 2, 3, 50, 24, 1, 0.5),  # P = 1, batch 2, d not 2^k
    (2, 1, 1, 16, 32, 16, 1.0),  # a single page
    (1, 1, 2, 70, 64, 16, 0.7),
]
COMPACT_IDS = ["L{}-B{}-G{}-n{}-d{}-P{}-b{}".format(*s) for s in COMPACT_SHAPES]


def _plan_for(L, G, n, P, budget, device, seed):
    gen = torch.Generator().manual_seed(seed)
    prof = torch.softmax(torch.randn(L, 2 * G, n, generator=gen) * 3, -1)
    cfg = EvictionConfig(policy="entropy", budget=budget, page_size=P, n_sink=2, window=4)
    return plan(prof.to(device), G, cfg)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", COMPACT_SHAPES, ids=COMPACT_IDS)
def test_compact_matches_twin(kern, device, shape, dtype):
    L, B, G, n, d, P, budget = shape
    p = _plan_for(L, G, n, P, budget, device, seed=n)
    idx = p.kept_indices()  # [L, G, k']
    gen = torch.Generator().manual_seed(d)
    keys = torch.randn(L, B, G, n, d, generator=gen).to(device, dtype)
    values = torch.randn(L, B, G, n, d, generator=gen).to(device, dtype)
    every = kern.compact.compact_every_layer(keys.unbind(0), values.unbind(0), idx.unbind(0))
    for i, (k_all, v_all) in enumerate(every):  # all layers, one launch
        k_ref, v_ref = compact_layer(keys[i], values[i], idx[i])
        (k_one, v_one), *_ = kern.compact.compact_every_layer([keys[i]], [values[i]], [idx[i]])
        assert_equal(f"keys layer {i}", k_one, k_ref)
        assert_equal(f"values layer {i}", v_one, v_ref)
        assert_equal(f"keys layer {i} (all layers)", k_all, k_ref)
        assert_equal(f"values layer {i} (all layers)", v_all, v_ref)


def test_backend_dispatch_parity(kern, device, caplog):
    L, H, G, w, n, d = 2, 6, 2, 8, 45, 16
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(L, H, w, d, generator=gen).to(device)
    k = torch.randn(L, G, n, d, generator=gen).to(device)
    with caplog.at_level("DEBUG", logger="pagekv"):
        out_t = be.score_window(q, k, 4, backend="torch")
        out_k = be.score_window(q, k, 4, backend="triton")
    assert (out_t[-1], out_k[-1]) == ("torch", "triton")
    assert "score_window ran on the triton backend" in caplog.text

    def parts(out):
        prof, m, _ = out
        return prof, m.sink, m.isolated, m.collision

    for name, a, b in zip(
        ("profiles", "sink", "iso", "collision"), parts(out_k), parts(out_t), strict=True
    ):
        assert_close(name, a, b, floor=2e-6)
    weights = entropy_head_weights(out_t[0], G, 4)
    _, pages_t, prot_t, _ = be.page_scores(out_t[0], weights, G, 4, 4, w, backend="torch")
    _, pages_k, prot_k, _ = be.page_scores(out_t[0], weights, G, 4, 4, w, backend="triton")
    assert_equal("protected", prot_k, prot_t)
    sizes = page_sizes(n, 4, device)
    assert_equal("kept pages", select_pages(pages_k, prot_k, sizes, 24),
                 select_pages(pages_t, prot_t, sizes, 24))  # fmt: skip
    idx = torch.arange(0, n, 2, device=device).expand(G, -1)
    kv = torch.randn(1, G, n, d, generator=gen).to(device)
    [(k_t, v_t)], _ = be.compact_layers([kv], [-kv], [idx], backend="torch")
    [(k_k, v_k)], used = be.compact_layers([kv], [-kv], [idx], backend="triton")
    assert used == "triton"
    assert_equal("compact keys", k_k, k_t)
    assert_equal("compact values", v_k, v_t)


def test_resolve_backend(kern):
    cpu = torch.zeros(1)
    assert be.resolve_backend("torch", cpu) == "torch"
    assert be.resolve_backend("auto", cpu) == "torch"
    assert be.resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        be.resolve_backend("cuda", cpu)
    if not torch.cuda.is_available():
        assert be.resolve_backend("triton", cpu) == "triton"  # the interpreter
    else:
        assert be.resolve_backend("auto", torch.zeros(1, device="cuda")) == "triton"


def test_pagekv_imports_without_triton_and_refuses_uninterpreted_cpu():
    """`import pagekv.runtime.backend` pulls in neither Triton nor the kernels; asking for
    Triton on CPU without TRITON_INTERPRET=1 raises a clear BackendError."""
    code = (
        "import sys\n"
        "import torch\n"
        "import pagekv, pagekv.runtime.backend as be, pagekv.runtime.paged_cache\n"
        "assert 'triton' not in sys.modules and 'pagekv.kernels' not in sys.modules\n"
        "assert be.resolve_backend('auto', torch.zeros(1)) == 'torch'\n"
        "try:\n"
        "    be.resolve_backend('triton', torch.zeros(1))\n"
        "except be.BackendError as e:\n"
        "    assert 'TRITON_INTERPRET=1' in str(e) or 'unavailable' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
