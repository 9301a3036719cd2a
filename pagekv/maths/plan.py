"""`plan`: from attention profiles to the pages each (layer, group) keeps.

The whole selection is batched over layers, heads and pages; nothing loops over
tokens. See docs/design.md ("The data path") and docs/method.md for the definitions. What a
policy does is written in `pagekv/maths/policies.py`; this module applies the
one selection rule (`pagekv.maths.paging.select_pages`) to whatever page scores the
policy gives, so it has no branch per policy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagekv.maths.config import EvictionConfig
from pagekv.maths.entropy import HeadMasses
from pagekv.maths.metrics import GroupOverlap, group_overlap, needle_retention
from pagekv.maths.paging import (
    _select,
    _select_global,
    check_budget,
    expand_pages,
    kept_token_indices,
    page_sizes,
    protected_pages,
    to_device,
)
from pagekv.maths.policies import ScoreInputs, get_policy, pooled_page_scores
from pagekv.maths.profiles import smooth_scores

#: Rows of a profile must sum to 1 within this (float32 accumulation over 128k terms).
ROW_SUM_TOL = 1e-3


@dataclass
class Plan:
    """What `plan` decided, with the data the metrics and plots need.

    Shapes: `L` layers, `H` query heads, `G` groups (`r = H / G`), `n` prompt
    tokens, `n_pages = ceil(n / P)`.
    """

    config: EvictionConfig
    n: int
    n_groups: int
    budget_tokens: int  # k = floor(beta * n) (n for `full`)
    window: int  # effective window, min(config.window, n)
    page_sizes: torch.Tensor  # int64 [n_pages]
    protected: torch.Tensor  # bool [n_pages]
    keep: torch.Tensor  # bool [L, G, n]
    page_keep: torch.Tensor  # bool [L, G, n_pages]
    union_tokens: torch.Tensor  # int64 [L, G]
    head_weights: torch.Tensor  # float32 [L, H] weights used (1/r where none are)
    page_scores: torch.Tensor  # float32 [L, G, n_pages]
    uor: torch.Tensor  # float64 [L, G] (1.0 for pooled policies)
    head_keep: torch.Tensor | None  # bool [L, H, n] (head_independent only)
    head_page_keep: torch.Tensor | None  # bool [L, H, n_pages] (head_independent only)
    overlap: GroupOverlap | None  # disagreement and bounds (head_independent only)
    sink_mass: torch.Tensor  # float32 [L, H]
    sink_heads: torch.Tensor  # bool [L, H]
    weights_isolated: torch.Tensor  # float32 [L, H] Page-EntroKV's weights
    weights_nosink: torch.Tensor  # float32 [L, H] the same without sink isolation
    backends: dict = field(default_factory=dict)  # step -> "torch" / "triton", "device"
    #: What planning on a prefill cost, in seconds (`Runner.plan`): `score_s`
    #: (profiles and masses, memoised per prefill) and `plan_s` (this selection).
    timings: dict = field(default_factory=dict)
    #: `union_tokens` read to the host once (`union_counts`); None until then.
    _counts: list | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def n_pages(self) -> int:
        return int(self.page_sizes.numel())

    def union_counts(self) -> list[list[int]]:
        """`union_tokens` as host ints `[L][G]` (a fresh list): read from the device the
        first time, then memoised, so `dense`, `kept_indices` and the runner share one
        host wait."""
        if self._counts is None:
            self._counts = self.union_tokens.tolist()
        return [list(row) for row in self._counts]

    @property
    def allocated(self) -> bool:
        """True when a global allocation left its (layer, group)s different counts: a
        gathered cache then stores each group's own count, unpadded."""
        return self.config.allocation != "uniform" and not self.dense

    def stored_counts(self) -> list[list[int]]:
        """What a gathered decode cache stores per (layer, KV head) for this plan
        (`Runner.evict`): each group's own count when `allocated`; otherwise every group
        of a layer at the layer's largest count, as the runner pads a layer's groups to
        one width."""
        union = self.union_counts()
        if self.allocated:
            return union
        return [[max(row)] * len(row) for row in union]

    @property
    def dense(self) -> bool:
        """True when every (layer, group) keeps the same number of tokens."""
        return len({c for row in self.union_counts() for c in row}) == 1

    def kept_indices(self) -> torch.Tensor:
        """Sorted kept token indices `[L, G, k']` (int64), for a dense plan.

        Computed on the plan's device from `keep` and the host count `k'`
        (`kept_token_indices`): no host wait beyond `union_counts`'s one read.

        Raises ValueError for a head-independent plan whose unions differ in size
        (its groups cannot share one dense tensor: that is the overspend UOR measures).
        """
        if not self.dense:
            raise ValueError(
                "kept sets differ in size across (layer, group); no dense index tensor"
            )
        return kept_token_indices(self.keep, self.union_counts()[0][0])

    def needle_retention(self, needle_positions) -> torch.Tensor:
        """Fraction of the needle tokens kept per (layer, group), float64 `[L, G]`."""
        return needle_retention(self.keep, needle_positions)


def plan(
    profiles: torch.Tensor,
    n_groups: int,
    config: EvictionConfig,
    *,
    masses: HeadMasses | None = None,
    scales: torch.Tensor | None = None,
    pool_pages: Callable | None = None,
) -> Plan:
    """Select the pages each (layer, group) keeps under `config`.

    Every step runs on the profiles' device (no copy to the host): the weights,
    protected pages and selection are torch operations, and the pooling step is
    `pool_pages`'s (torch by default; the Triton kernel's through the runtime's
    `pagekv.runtime.backend.pooler`). `Plan.backends` names what ran each step.

    Args:
        profiles: `[L, H, n]` float attention profiles (rows sum to 1), from
            `attention_profiles` or the scoring kernel.
        n_groups: `G`, the number of KV heads; `H % G == 0`.
        config: the policy, budget and page geometry.
        masses: the per-head masses of these profiles (from the scoring kernel, so
            they are not recomputed); taken from the profiles when None. Their
            `n_sink` must be the configuration's.
        scales: `[L, H]` positive, each head's attention mass before it was normalised
            into its profile (the reconstruction scorer's raw scores sum to it; None:
            the profiles are the attention itself, as the window scorer's). Under
            `allocation="global"` (and `"layer"`) the pages are pooled from `profiles *
            scales`, the model's own attention, so that every (layer, group) competes
            on one scale (`select_pages_global`); the head weights and the uniform
            allocation use the profiles.
        pool_pages: the pooling step, `(scores [L, H, n], weights [L, H] or None for
            max pooling, n_groups, page_size, n_sink, window, reduction) -> (page
            scores [L, G, n_pages], the backend that ran)`; None:
            `pagekv.maths.policies.pooled_page_scores` (torch). `pooler("auto")` from
            `pagekv.runtime.backend` runs the Triton kernel on CUDA.

    Returns:
        A `Plan`. For every pooled policy under the uniform allocation each (layer,
        group) keeps exactly the same number of tokens, `<= floor(budget * n)`, equal
        to the summed sizes of its kept pages; under `allocation="global"` the counts
        vary and their total is `<= L G floor(budget * n)`; under `"layer"` they vary
        within a layer and each layer's total is `<= G floor(budget * n)`.

    Raises:
        ValueError: malformed profiles or masses. BudgetError (a ValueError): the
            protected pages alone exceed the budget; its message names the smallest
            feasible one.
    """
    _check_profiles(profiles, n_groups)
    cfg = config
    policy = get_policy(cfg.policy)
    L, H, n = profiles.shape
    G = n_groups
    P = cfg.page_size
    dev = profiles.device
    p32 = profiles.float()
    window = min(cfg.window, n)
    k = cfg.budget_tokens(n)
    # Page geometry is host arithmetic on n and P: the scalars selection needs never
    # wait on the device.
    sizes = page_sizes(n, P)
    prot = protected_pages(n, P, cfg.n_sink, window)
    check_budget(sizes, prot, k)  # before any work on the device
    sizes_d, prot_d = to_device(sizes, dev), to_device(prot, dev)  # queued, no host wait
    if masses is None:
        masses = HeadMasses.from_profiles(p32, cfg.n_sink)
    elif masses.n_sink != cfg.n_sink or tuple(masses.sink.shape) != (L, H):
        raise ValueError(
            f"masses were taken with n_sink={masses.n_sink} for shape "
            f"{tuple(masses.sink.shape)}; this plan needs n_sink={cfg.n_sink}, [{L}, {H}]"
        )
    if scales is not None and cfg.allocation != "uniform":
        p32 = p32 * _checked_scales(scales, L, H).to(p32)[..., None]  # the raw attention
    scores = smooth_scores(p32, cfg.smoothing, cfg.smoothing_kind)  # [L, H, n]
    pooled_on: list[str] = []

    pool_step = pooled_page_scores if pool_pages is None else pool_pages

    def pool(weights, groups):
        pages, used = pool_step(scores, weights, groups, P, cfg.n_sink, window, cfg.page_reduction)
        pooled_on.append(used)
        return pages

    inputs = ScoreInputs(scores=scores, n_groups=G, config=cfg, masses=masses, pool=pool)
    weights = policy.head_weights(inputs)  # the policy's own weighting
    scored = policy.page_scores(inputs)
    head_keep = head_page_keep = overlap = None
    if policy.per_head:
        head_page_keep = _select(scored, prot, sizes, prot_d, k)  # [L, H, n_pages]
        head_keep = expand_pages(head_page_keep, n, P)
        overlap = group_overlap(head_keep, G)
        page_scores = scored.view(L, G, H // G, -1).amax(2)
        page_keep = head_page_keep.view(L, G, H // G, -1).any(2)
        uor = overlap.uor
    else:
        page_scores = scored
        # `select_pages` and `select_pages_global`, given the geometry on both sides.
        if cfg.allocation != "uniform":  # "global", or "layer": shared within a layer
            per_layer = cfg.allocation == "layer"
            page_keep = _select_global(page_scores, prot_d, sizes_d, k, per_layer)
        else:
            page_keep = _select(page_scores, prot, sizes, prot_d, k)
        uor = torch.ones(L, G, dtype=torch.float64, device=dev)
    keep = expand_pages(page_keep, n, P)
    union_tokens = (page_keep.to(torch.int64) * sizes_d).sum(-1)
    return Plan(
        config=cfg,
        n=n,
        n_groups=G,
        budget_tokens=k,
        window=window,
        page_sizes=sizes_d,
        protected=prot_d,
        keep=keep,
        page_keep=page_keep,
        union_tokens=union_tokens,
        head_weights=weights,
        page_scores=page_scores,
        uor=uor,
        head_keep=head_keep,
        head_page_keep=head_page_keep,
        overlap=overlap,
        sink_mass=masses.sink,
        sink_heads=masses.sink >= cfg.sink_threshold,
        weights_isolated=inputs.weights_isolated,  # what the views show, for any policy
        weights_nosink=inputs.weights_nosink,
        backends={
            "weights": "torch",
            "pool": pooled_on[0] if pooled_on else "none",
            "select": "torch",
            "device": str(dev),
        },
    )


def _checked_scales(scales, L: int, H: int) -> torch.Tensor:
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != (L, H):
        shape = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales)
        raise ValueError(f"scales must be a [{L}, {H}] tensor; got {shape}")
    s = scales.float()
    if not bool((torch.isfinite(s) & (s > 0)).all()):  # one host wait
        raise ValueError("scales must be finite and positive")
    return s


def _check_profiles(profiles: torch.Tensor, n_groups: int) -> None:
    if not isinstance(profiles, torch.Tensor) or profiles.dim() != 3:
        shape = tuple(profiles.shape) if isinstance(profiles, torch.Tensor) else type(profiles)
        raise ValueError(f"profiles must be a [L, H, n] tensor; got {shape}")
    if not profiles.is_floating_point():
        raise ValueError(f"profiles must be floating point; got {profiles.dtype}")
    L, H, n = profiles.shape
    if L == 0 or H == 0 or n == 0:
        raise ValueError(f"profiles must be non-empty; got shape {tuple(profiles.shape)}")
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be a positive integer; got {n_groups!r}")
    if H % n_groups:
        raise ValueError(f"H={H} query heads are not a multiple of n_groups={n_groups}")
    p = profiles.float()
    sums = p.sum(-1)
    # The checks reduce on the device and come back in one read (one host wait).
    values_ok = (torch.isfinite(p) & (p >= 0)).all()
    rows_ok = ((sums - 1).abs() <= ROW_SUM_TOL).all()
    values_ok, rows_ok = torch.stack([values_ok, rows_ok]).tolist()
    if not values_ok:
        raise ValueError("profiles must be finite and non-negative")
    if not rows_ok:
        worst = float((sums - 1).abs().max())
        raise ValueError(f"profile rows must sum to 1 (worst row is off by {worst:.3g})")
