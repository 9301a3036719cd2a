"""Pooling the heads of each GQA group into one token score per (layer, group).

`s_g(t)` for the pooled policies (docs/design.md, "The data path"):
  - entropy / entropy_nosink / mean: `sum_h w_h s_h(t)` with the given weights;
  - max: `max_h s_h(t)`.
"""

from __future__ import annotations

import torch

from pagekv.maths.paging import page_reduce


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
