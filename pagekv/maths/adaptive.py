"""Adaptive page size: per prompt, the largest page that keeps what tokens would.

Pages of 16 are what a paged cache frees, but a page is kept for its best tokens and
brings the rest along: where a prompt's high-scoring tokens are scattered, pages of 16
leave some of them out at the same budget. The rule here measures that on the scores
alone, before any question is seen:

- the **token plan** is the same configuration at page size 1; its page scores are the
  pooled token scores `s[l, g, t]` that every page size reduces;
- a plan at page size `P` **captures** `sum s * keep_P` over the tokens the token plan
  does not protect, as a share of what the token plan itself keeps there
  (`captured_share`);
- `choose_page_size` takes the largest candidate `P` whose share is at least the
  threshold, or the smallest candidate when none is.

The share is at most 1 (`tests/test_adaptive_page.py` checks it): the token plan keeps
the best free tokens by `s` up to the same budget (in each (layer, group), or layer, or
in all, by the allocation), and a plan at any page size keeps the token plan's protected
tokens (the first `n_sink` and the last `window` are inside its protected pages) and no
more tokens in all than that budget. docs/research.md ("At equal memory") has what the rule
measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekv.maths.plan import Plan


@dataclass(frozen=True)
class AdaptiveChoice:
    """What `choose_page_size` decided: the page size, its plan, and the share every
    candidate it tried captured (largest first; it stops at the first that passes)."""

    page_size: int
    plan: Plan
    shares: dict[int, float]


def captured_share(token_plan: Plan, paged: Plan) -> float:
    """The share of the token plan's kept free score that `paged`'s kept tokens hold.

    `token_plan` is a plan at page size 1 (its page scores are token scores); `paged` is
    one of the same prompt and configuration at another page size. Tokens the token plan
    protects (the sinks and the window, kept by both) count on neither side. 1.0 when the
    token plan keeps no free score.
    """
    if token_plan.config.page_size != 1:
        raise ValueError(f"the token plan must have page size 1; got {token_plan.config.page_size}")
    if paged.keep.shape != token_plan.keep.shape:
        raise ValueError(
            f"plans of different shapes: {tuple(paged.keep.shape)} against "
            f"{tuple(token_plan.keep.shape)} (not the same prompt)"
        )
    s = token_plan.page_scores.double() * (~token_plan.protected).double()  # [L, G, n]
    best = float((s * token_plan.keep.double()).sum())
    if best <= 0.0:
        return 1.0
    return float((s * paged.keep.double()).sum()) / best


def choose_page_size(
    plan_at: Callable[[int], Plan],
    candidates: Sequence[int] = (16, 8, 4),
    threshold: float = 0.9,
) -> AdaptiveChoice:
    """The largest of `candidates` whose plan captures at least `threshold` of what
    the token plan keeps (`captured_share`); the smallest candidate when none does.

    Args:
        plan_at: page size -> the plan of one prompt and configuration at that page
            size (called with 1 first, for the token plan, then with the candidates
            from the largest down).
        candidates: page sizes >= 1 to choose from.
        threshold: in [0, 1]; 0 always takes the largest candidate, 1 takes the largest
            that loses none of the token plan's score.

    Raises:
        ValueError: no candidates, a page size below 1, or a threshold outside [0, 1].
        BudgetError: from `plan_at`, when a page size's protected pages exceed the budget.
    """
    sizes = sorted({int(p) for p in candidates}, reverse=True)
    if not sizes or sizes[-1] < 1:
        raise ValueError(f"candidates must be page sizes >= 1; got {list(candidates)!r}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1]; got {threshold!r}")
    token_plan = plan_at(1)
    shares: dict[int, float] = {}
    for size in sizes:  # the last, smallest, is taken when none passes
        paged = token_plan if size == 1 else plan_at(size)
        shares[size] = captured_share(token_plan, paged)
        if shares[size] >= threshold:
            break
    return AdaptiveChoice(page_size=size, plan=paged, shares=shares)
