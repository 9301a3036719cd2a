"""Eviction configuration: one frozen, validated dataclass (docs/design.md, "The data path")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from pagekv.maths.policies import POLICIES, POOLED_POLICIES, get_policy

__all__ = ["POLICIES", "POOLED_POLICIES", "EvictionConfig"]

SMOOTHING_KINDS = ("max", "avg")
PAGE_REDUCTIONS = ("max", "sum")
#: How the budget is spread: `k` tokens in every (layer, group), or the `L G k` tokens
#: shared across them by page scores on the model's attention scale
#: (`pagekv.maths.paging.select_pages_global`).
ALLOCATIONS = ("uniform", "global", "layer")
#: Whose attention scores the prompt: the last `window` prompt tokens' queries, or the
#: queries of a pass that repeats the context (`pagekv.runtime.reconstruct`).
SCORERS = ("window", "reconstruct")


@dataclass(frozen=True)
class EvictionConfig:
    """What to keep of a prefilled prompt's KV cache.

    Example:
        >>> EvictionConfig(policy="entropy", budget=0.2, page_size=16).budget_tokens(1000)
        200

    Fields:
        policy: one of `POLICIES` (the registry in `pagekv.maths.policies`).
        budget: fraction `beta` of the prompt kept per (layer, group), in (0, 1];
            `k = floor(beta * n)` tokens. Ignored by `full`.
        page_size: tokens per page `P` (1 = token-level eviction).
        n_sink: the first `n_sink` tokens are attention sinks (protected, and removed
            from the profile before the entropy is taken).
        window: the last `window` prompt tokens are the observation window (their
            queries score the prompt; their pages are protected). Clipped to `n`.
        tau: temperature of the head-weight softmax, > 0.
        smoothing: odd width of the 1-D pooling of token scores along t (1 = off).
        smoothing_kind: "max" or "avg" pooling for that smoothing.
        page_reduction: "max" (default) or "sum" of token scores within a page.
        sink_threshold: a head whose sink mass is >= this is a sink head, in (0, 1].
        allocation: "uniform" (default): every (layer, group) keeps at most `k` tokens;
            "global": the `L G k` tokens are shared across the (layer, group)s by their
            pooled page scores, compared on the model's own attention scale (the
            reconstruction scorer's raw attention: `plan`'s `scales`), pooled policies
            only; every (layer, group) still keeps its protected pages. "layer": the
            same within each layer: its `G k` tokens shared across its groups (every
            layer keeps the same total, as kvpress's KVzip with `layerwise=True`).
        scorer: "window" (default): the last `window` prompt tokens' queries score the
            prompt; "reconstruct": the model's attention while it repeats the context
            (question-agnostic; `pagekv.runtime.reconstruct`). The window's pages are
            protected either way.
    """

    policy: str = "entropy"
    budget: float = 0.2
    page_size: int = 16
    n_sink: int = 4
    window: int = 32
    tau: float = 1.0
    smoothing: int = 1
    smoothing_kind: str = "max"
    page_reduction: str = "max"
    sink_threshold: float = 0.5
    allocation: str = "uniform"
    scorer: str = "window"

    def __post_init__(self) -> None:
        get_policy(self.policy)  # ValueError naming the choices
        _check_real("budget", self.budget, "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        _check_int("page_size", self.page_size, "an integer >= 1", lambda v: v >= 1)
        _check_int("n_sink", self.n_sink, "an integer >= 0", lambda v: v >= 0)
        _check_int("window", self.window, "an integer >= 1", lambda v: v >= 1)
        _check_real("tau", self.tau, "a finite number > 0", lambda v: 0.0 < v < math.inf)
        _check_int(
            "smoothing", self.smoothing, "an odd integer >= 1", lambda v: v >= 1 and v % 2 == 1
        )
        _check_choice("smoothing_kind", self.smoothing_kind, SMOOTHING_KINDS)
        _check_choice("page_reduction", self.page_reduction, PAGE_REDUCTIONS)
        _check_real("sink_threshold", self.sink_threshold, "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        _check_choice("allocation", self.allocation, ALLOCATIONS)
        _check_choice("scorer", self.scorer, SCORERS)
        if self.allocation != "uniform" and get_policy(self.policy).per_head:
            raise ValueError(
                f"allocation {self.allocation!r} shares one budget by pooled page scores; policy "
                f"{self.policy!r} selects per head (use allocation 'uniform')"
            )

    @property
    def pooled(self) -> bool:
        """True when every (layer, group) keeps one dense page set of the same size."""
        return get_policy(self.policy).pooled and self.allocation == "uniform"

    def budget_tokens(self, n: int) -> int:
        """`k = floor(beta * n)`, the token budget per (layer, group) for a prompt of `n`.

        A tiny epsilon absorbs binary rounding (0.29 * 100 is 28.999999999999996 in
        floating point, and a user who asks for 29% of 100 tokens means 29).
        """
        if get_policy(self.policy).keeps_all:
            return n
        return int(math.floor(self.budget * n + 1e-9))

    def replace(self, **changes) -> EvictionConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


def _check_int(name: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise ValueError(f"{name} must be {allowed}; got {value!r}")


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_real(name: str, value, allowed: str, ok) -> None:
    real = not isinstance(value, bool) and isinstance(value, (int, float))
    if not real or math.isnan(value) or not ok(float(value)):
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
