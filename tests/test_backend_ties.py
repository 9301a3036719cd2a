"""Both backends keep the same pages on exact and near ties (docs/design.md).

Weights, smoothing and selection are shared torch code; the pooling runs on the torch twin or the
Triton kernel, both adding in index order, so the page scores must be the same bits. Planted
ties: exact (integer counts, copied pages), near (one token moved one ulp), and permuted (a
page's tokens shuffled, which float32 sums by the order of the adds)."""

from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagekv import POLICIES, EvictionConfig, min_feasible_budget, plan
from pagekv.maths.policies import get_policy
from pagekv.runtime.backend import pooler
from tests.strategies import geometry, random_profiles

SETTINGS = settings(max_examples=120, deadline=None)
TIES = ("exact", "near", "permuted")


def planted(seed: int, L: int, H: int, n: int, P: int, kind: str) -> torch.Tensor:
    """Profiles `[L, H, n]` (rows sum to 1) with ties of `kind` planted between pages."""
    g = torch.Generator().manual_seed(seed)
    if kind == "exact":
        counts = torch.randint(1, 5, (L, H, n), generator=g).float()  # no empty row
        prof = counts / counts.sum(-1, keepdim=True)
    else:
        prof = random_profiles(seed, L, H, n)
    full = n // P  # whole pages (the last may be partial)
    if full < 2:
        return prof
    # Most whole pages become copies of one page, so the ties meet at the budget's edge.
    a = int(torch.randint(0, full, (1,), generator=g))
    src = prof[..., a * P : (a + 1) * P].clone()  # [L, H, P], every head alike
    copies = [b for b in range(full) if b != a and float(torch.rand(1, generator=g)) < 0.75]
    for b in copies:
        order = torch.randperm(P, generator=g) if kind == "permuted" else torch.arange(P)
        prof[..., b * P : (b + 1) * P] = src[..., order]
    prof = prof / prof.sum(-1, keepdim=True)  # equal values stay equal
    if kind == "near":  # in each copy, one token per head one ulp away, up or down
        for b in copies:
            t = b * P + torch.randint(0, P, (L, H, 1), generator=g)
            up = torch.rand(L, H, 1, generator=g) < 0.5
            old = prof.gather(-1, t)
            moved = torch.nextafter(old, torch.where(up, old + 1, torch.zeros_like(old)))
            prof.scatter_(-1, t, moved)
    return prof


@SETTINGS
@given(
    geo=geometry(max_n=700),
    u=st.floats(0, 1),
    kind=st.sampled_from(TIES),
    policy=st.sampled_from(POLICIES),
    reduction=st.sampled_from(["max", "sum"]),
    smoothing=st.sampled_from([1, 3]),
    global_=st.booleans(),
    scaled=st.booleans(),
)
def test_both_backends_keep_the_same_pages_on_ties(
    geo, u, kind, policy, reduction, smoothing, global_, scaled
):
    seed, L, G, r, n, P, n_sink, window = geo
    H = G * r
    prof = planted(seed, L, H, n, P, kind)
    lo = min_feasible_budget(n, P, n_sink, min(window, n))
    allocation = "global" if global_ and not get_policy(policy).per_head else "uniform"
    cfg = EvictionConfig(
        policy=policy,
        budget=min(1.0, lo + u * (1.0 - lo)),
        page_size=P,
        n_sink=n_sink,
        window=window,
        page_reduction=reduction,
        smoothing=smoothing,
        allocation=allocation,
    )
    scales = None
    if scaled and allocation == "global":  # the reconstruction scorer's raw scale
        scales = 0.5 + torch.rand(L, H, generator=torch.Generator().manual_seed(seed))
    twin = plan(prof, G, cfg, scales=scales, pool_pages=pooler("torch"))
    kern = plan(prof, G, cfg, scales=scales, pool_pages=pooler("triton"))
    assert kern.backends["pool"] in ("triton", "none"), kern.backends
    assert torch.equal(kern.page_scores, twin.page_scores), "page scores differ in their bits"
    assert torch.equal(kern.page_keep, twin.page_keep), "kept pages differ"
    if twin.head_page_keep is not None:
        assert torch.equal(kern.head_page_keep, twin.head_page_keep), "per-head pages differ"
    scores = twin.page_scores[..., ~twin.protected]
    if scores.numel() and scores.flatten().unique().numel() < scores.numel():
        event("free pages tied exactly")


def test_permuted_pages_tell_summation_orders_apart():
    """A permuted page sums to other float32 bits in another summation order."""
    from pagekv.maths.paging import page_reduce

    differ = 0
    for seed in range(20):
        prof = planted(seed, 1, 1, 64 * 8, 64, "permuted")[0, 0]
        pages = prof.view(8, 64)
        differ += int((page_reduce(prof, 64, "sum") != pages.sum(-1)).any())
    assert differ > 0, "no permuted page summed differently: the near ties plant nothing"
