"""The eviction policies: how each pools the heads of a GQA group and scores pages.

Selection (protected pages, budget, ties) is written once, in
`pagekv.maths.paging.select_pages`, and `pagekv.maths.plan` applies it to whatever page
scores a policy returns; so a policy only says how to score pages:

- a pooled policy returns one page score per (layer, group): `[L, G, n_pages]`,
  higher = keep, and every (layer, group) keeps the same number of tokens;
- a per-head policy (`per_head=True`) returns `[L, H, n_pages]`: every head selects
  alone and the group keeps the union of its heads' pages.

The pooled score of token `t` in group `g` (docs/design.md, "The data path"):

- `entropy` (Page-EntroKV), `entropy_nosink`, `mean`: `s_g(t) = sum_{h in g} w_h s_h(t)`
  (`weighted_pool`), with `w_h = softmax_{h in g}(-H2(a~_h) / tau)`, `a~_h` the profile
  with the sinks removed and renormalised (`entropy`), the same on the raw profile
  (`entropy_nosink`), or `1/r` (`mean`);
- `max`: `max_{h in g} s_h(t)` (`max_pool`).

The inputs come as a `ScoreInputs`, which also gives the pooling operations (through
the plan's `pool_pages`: torch ops by default, the Triton kernel where the runtime gives
it, `pagekv.runtime.backend.pooler`), so a policy never branches on the backend.

This module is the one place the list of policies is written (`POLICIES` and the
derived tuples); the configuration, the CLI, the app, the figures and the replay read
it. A new policy is one `Policy(...)` in `_POLICIES` (and its test).

    >>> POLICIES[:3]
    ('entropy', 'entropy_nosink', 'mean')
    >>> get_policy("head_independent").per_head
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from pagekv.maths.entropy import HeadMasses, weights_from_mass
from pagekv.maths.paging import page_reduce

if TYPE_CHECKING:  # config imports this module for the list of policies
    from pagekv.maths.config import EvictionConfig

# ----------------------------------------------------------------------------- pooling


def weighted_pool(scores: torch.Tensor, weights: torch.Tensor, n_groups: int) -> torch.Tensor:
    """`sum_{h in g} w_h s_h(t)`: scores `[L, H, n]`, weights `[L, H]` -> `[L, G, n]`."""
    L, H, n = scores.shape
    r = H // n_groups
    s = scores.float().view(L, n_groups, r, n)
    w = weights.float().view(L, n_groups, r, 1)
    # Heads summed in index order, one fp32 add at a time: torch's reduction order
    # over a dim is unspecified (r >= 5 differs by an ulp on CPU), and the Triton
    # kernel (kernels/pool_pages.py) adds in this order, so the two are bit-identical
    # and a near-tie between pages cannot flip between backends.
    acc = w[:, :, 0] * s[:, :, 0]
    for i in range(1, r):
        acc = acc + w[:, :, i] * s[:, :, i]
    return acc


def max_pool(scores: torch.Tensor, n_groups: int) -> torch.Tensor:
    """`max_{h in g} s_h(t)`: `[L, H, n]` -> `[L, G, n]`."""
    L, H, n = scores.shape
    return scores.float().view(L, n_groups, H // n_groups, n).amax(dim=2)


def pooled_page_scores(
    scores, weights, n_groups: int, page_size: int, n_sink: int, window: int, reduction: str
) -> tuple[torch.Tensor, str]:
    """`plan`'s pooling step in torch: `(page scores [L, G, n_pages], "torch")`, pooled
    by `weights` (`max_pool` for None) and reduced over each page. `n_sink` and
    `window` are unused here; the Triton kernel's step takes them
    (`pagekv.runtime.backend.pooler`), and gives bit-identical page scores."""
    pooled = (
        max_pool(scores, n_groups) if weights is None else weighted_pool(scores, weights, n_groups)
    )
    return page_reduce(pooled, page_size, reduction), "torch"


def uniform_weights(L: int, H: int, n_groups: int, device=None) -> torch.Tensor:
    """Mean pooling's weights: `1/r` for every head, `[L, H]`."""
    return torch.full((L, H), n_groups / H, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------- policies


@dataclass
class ScoreInputs:
    """Everything a policy may read, for one prompt and one configuration.

    Shapes: `L` layers, `H` heads, `G` groups, `n` tokens, `n_pages = ceil(n / P)`.
    A policy computes its own head weights from what is here (the heads' masses, the
    scores): the three weightings the policies share are computed on first use, so a
    new weighting is written beside its policy, never in `plan`.
    """

    scores: torch.Tensor  # float32 [L, H, n] token scores (profiles, maybe smoothed)
    n_groups: int  # G
    config: EvictionConfig
    masses: HeadMasses  # every head's sink, collision and isolated collision mass
    pool: Callable  # (weights [L, H] | None, n_groups) -> page scores [L, G', n_pages]

    @cached_property
    def weights_isolated(self) -> torch.Tensor:
        """float32 `[L, H]`: Page-EntroKV's weights (entropy after sink isolation)."""
        return weights_from_mass(self.masses.isolated, self.n_groups, self.config.tau)

    @cached_property
    def weights_nosink(self) -> torch.Tensor:
        """float32 `[L, H]`: the same without sink isolation."""
        return weights_from_mass(self.masses.collision, self.n_groups, self.config.tau)

    @cached_property
    def weights_uniform(self) -> torch.Tensor:
        """float32 `[L, H]`: 1/r (mean pooling)."""
        L, H, _ = self.scores.shape
        return uniform_weights(L, H, self.n_groups, self.scores.device)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.scores.shape)

    def weighted_pages(self, weights: torch.Tensor) -> torch.Tensor:
        """`reduce_{t in page} sum_{h in g} w_h s_h(t)`: `[L, G, n_pages]`."""
        return self.pool(weights, self.n_groups)

    def max_pages(self) -> torch.Tensor:
        """`reduce_{t in page} max_{h in g} s_h(t)`: `[L, G, n_pages]`."""
        return self.pool(None, self.n_groups)

    def head_pages(self) -> torch.Tensor:
        """Every head's own page scores, `[L, H, n_pages]` (pooling groups of one head)."""
        L, H, _ = self.shape
        ones = torch.ones(L, H, dtype=torch.float32, device=self.scores.device)
        return self.pool(ones, H)

    def recency_pages(self) -> torch.Tensor:
        """Page `j` scores `j`, `[L, G, n_pages]`: later pages rank higher (the protected
        sink pages come first anyway); the attention profiles are not read."""
        L, _, n = self.shape
        n_pages = -(-n // self.config.page_size)
        rank = torch.arange(n_pages, device=self.scores.device, dtype=torch.float32)
        return rank.expand(L, self.n_groups, n_pages).clone()


@dataclass(frozen=True)
class Policy:
    """One eviction policy.

    Attributes:
        name: the key users type (`EvictionConfig.policy`, `--policy`, the app).
        summary: one line for help texts and the app.
        page_scores: `ScoreInputs -> [L, G, n_pages]` (or `[L, H, n_pages]` when
            `per_head`), higher = keep.
        weights: `ScoreInputs -> [L, H]`, the head weights the policy pools with
            (reported by `Plan.head_weights`); None means `1/r`.
        per_head: every head selects alone; the group keeps the union (not dense).
        keeps_all: no eviction (the budget is `n`).
        uses_attention: the page scores come from the attention profiles (False
            for a rule like recency).
    """

    name: str
    summary: str
    page_scores: Callable[[ScoreInputs], torch.Tensor]
    weights: Callable[[ScoreInputs], torch.Tensor] | None = None
    per_head: bool = False
    keeps_all: bool = False
    uses_attention: bool = True

    @property
    def pooled(self) -> bool:
        """True when every (layer, group) keeps one dense page set of the same size."""
        return not self.per_head

    def head_weights(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.weights_uniform if self.weights is None else self.weights(inputs)


#: Every policy, in display order.
_POLICIES = (
    # Page-EntroKV: pool each group by sink-isolated collision entropy.
    Policy(
        name="entropy",
        summary="Page-EntroKV: heads weighted by sink-isolated collision entropy",
        weights=lambda x: x.weights_isolated,
        page_scores=lambda x: x.weighted_pages(x.weights_isolated),
    ),
    # The ablation: sink heads look focused here (their mass sits on a few tokens), the
    # masquerade that `entropy` removes.
    Policy(
        name="entropy_nosink",
        summary="entropy weights taken on the raw profiles (sinks included): the ablation",
        weights=lambda x: x.weights_nosink,
        page_scores=lambda x: x.weighted_pages(x.weights_nosink),
    ),
    # What most libraries do: every head of a group weighs 1/r.
    Policy(
        name="mean",
        summary="mean pooling: every head of a group weighs 1/r",
        weights=lambda x: x.weights_uniform,
        page_scores=lambda x: x.weighted_pages(x.weights_uniform),
    ),
    Policy(
        name="max",
        summary="max pooling: a token scores what its most interested head gives it",
        page_scores=lambda x: x.max_pages(),
    ),
    # The baseline whose overspend the union overhead ratio (UOR) measures: the group
    # stores the union of its heads' picks, up to `r` times the budget.
    Policy(
        name="head_independent",
        summary="every head picks its own pages; the group stores the union",
        page_scores=lambda x: x.head_pages(),
        per_head=True,
    ),
    # StreamingLLM: the sinks plus the most recent pages that fit.
    Policy(
        name="streaming",
        summary="StreamingLLM: sinks plus the most recent pages",
        page_scores=lambda x: x.recency_pages(),
        uses_attention=False,
    ),
    # The reference: the budget is the whole prompt, so selection keeps every page; the
    # page scores are mean pooling's, for display only.
    Policy(
        name="full",
        summary="no eviction: the full cache",
        page_scores=lambda x: x.weighted_pages(x.weights_uniform),
        keeps_all=True,
    ),
)

REGISTRY: dict[str, Policy] = {p.name: p for p in _POLICIES}
if len(REGISTRY) != len(_POLICIES):
    raise ValueError("two policies share a name")

#: Every policy, in display order.
POLICIES: tuple[str, ...] = tuple(REGISTRY)
#: Policies whose kept set is the same dense size in every (layer, group).
POOLED_POLICIES: tuple[str, ...] = tuple(n for n, p in REGISTRY.items() if p.pooled)
#: Pooled policies that evict (every pooled one but `full`).
EVICTING_POOLED: tuple[str, ...] = tuple(
    n for n, p in REGISTRY.items() if p.pooled and not p.keeps_all
)
#: Pooled policies that score pages from the attention profiles (the pooling rules).
POOLING_POLICIES: tuple[str, ...] = tuple(n for n in EVICTING_POOLED if REGISTRY[n].uses_attention)


def get_policy(name: str) -> Policy:
    """The policy called `name`; ValueError listing the choices otherwise."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}") from None


__all__ = [
    "EVICTING_POOLED",
    "POLICIES",
    "POOLED_POLICIES",
    "POOLING_POLICIES",
    "REGISTRY",
    "Policy",
    "ScoreInputs",
    "get_policy",
    "max_pool",
    "pooled_page_scores",
    "uniform_weights",
    "weighted_pool",
]
