"""What a policy is: a name and a rule that turns head scores into page scores.

A policy file (one per policy in this package) defines `POLICY`, an instance of
`Policy`. Selection (protected pages, budget, ties) is written once, in
`pagekv.maths.paging.select_pages`, and `pagekv.maths.plan` applies it to whatever page scores
the policy returns; so a policy only says how to score pages:

- a pooled policy returns one page score per (layer, group): `[L, G, n_pages]`,
  higher = keep, and every (layer, group) keeps the same number of tokens;
- a per-head policy (`per_head=True`) returns `[L, H, n_pages]`: every head selects
  alone and the group keeps the union of its heads' pages.

The inputs come as a `ScoreInputs`, which also gives the pooling operations (through
the plan's `pool_pages`: torch ops by default, the Triton kernel where the runtime gives
it, `pagekv.runtime.backend.pooler`), so a policy never branches on the backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from pagekv.maths.entropy import HeadMasses, weights_from_mass
from pagekv.maths.pooling import uniform_weights

if TYPE_CHECKING:  # config imports this package for the list of policies
    from pagekv.maths.config import EvictionConfig


@dataclass
class ScoreInputs:
    """Everything a policy may read, for one prompt and one configuration.

    Shapes: `L` layers, `H` heads, `G` groups, `n` tokens, `n_pages = ceil(n / P)`.
    A policy computes its own head weights from what is here (the heads' masses, the
    scores): the three weightings the policies share are computed on first use, so a
    new weighting is written in its policy's file, never in `plan`.
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


@dataclass(frozen=True)
class Policy:
    """One eviction policy.

    Attributes:
        name: the key users type (`EvictionConfig.policy`, `--policy`, the app).
        order: where it is listed (lower first).
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
    order: int
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
