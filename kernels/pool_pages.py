"""Pooling + page kernel: group scores, page scores and the protected-page mask.

Torch twin: `pagekv.maths.policies.weighted_pool` / `max_pool`, then
`pagekv.maths.paging.page_reduce` and `protected_pages`. Selection stays in torch
(`pagekv.maths.paging.select_pages`: a stable sort, ties to the lower page index).

One program owns a block of `BLOCK_J` pages of one (layer, group): a tile
`[BLOCK_J, P_PAD]` of token scores per head. It pools the `r` heads of the group
into `s_g(t)` and reduces each page row to `S_g(j)` (max or sum).

Bit-exactness. Selection compares page scores, so equal inputs must give equal
scores on both paths, ties included. The weighted pool is summed in head index
order in float32, `((0 + w_0 s_0) + w_1 s_1) + ...`, each product rounded before
the add: the launcher turns off fp contraction (`enable_fp_fusion=False`) so the
compiler cannot fuse `w * s + acc` into an FMA. `max` pooling and the max page
reduction are exact in any order. The sum page reduction adds a page's tokens in
index order from 0, one float32 add at a time, as the twin does (`page_reduce`), so
both reductions give the twin's bits and the two backends keep the same pages on
exact and near ties.

Memory traffic: reads the profiles once (`L H n 4` bytes) and the weights; writes
the page scores (`L G n_pages 4`) and, when asked, the pooled scores (`L G n 4`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import MAX, SUM, Launch, check_same_device, is_interpreted, next_pow2
from .targets import Target, target_of

POOLINGS = ("weighted", "max")
REDUCTIONS = ("max", "sum")


@triton.jit
def _pool_pages_kernel(s_ptr, w_ptr, pooled_ptr, page_ptr, prot_ptr, n, H, G, r, P, n_pages,
                       n_sink, window, max_pool, sum_pages, write_pooled,
                       BLOCK_J: tl.constexpr, P_PAD: tl.constexpr):  # fmt: skip
    # max_pool, sum_pages and write_pooled are runtime flags (uniform branches): one
    # compiled kernel per page size serves every pooling and reduction.
    i_lg = tl.program_id(0)
    i_j = tl.program_id(1)
    i_l = i_lg // G
    i_g = i_lg % G
    o_j = i_j * BLOCK_J + tl.arange(0, BLOCK_J)  # [BJ] pages
    o_p = tl.arange(0, P_PAD)  # [PP] slot in page
    o_t = o_j[:, None] * P + o_p[None, :]  # [BJ, PP] tokens
    m_t = (o_p[None, :] < P) & (o_t < n)
    b_acc = tl.full([BLOCK_J, P_PAD], 0.0, tl.float32)
    if max_pool:
        b_acc = tl.full([BLOCK_J, P_PAD], float("-inf"), tl.float32)
    for i_r in range(0, r):  # heads of the group in index order
        i_h = i_g * r + i_r
        p_s = s_ptr + (i_l * H + i_h).to(tl.int64) * n + o_t
        b_s = tl.load(p_s, mask=m_t, other=0.0).to(tl.float32)  # reads BJ * P * 4 bytes
        if max_pool:
            b_acc = tl.maximum(b_acc, b_s)
        else:
            b_w = tl.load(w_ptr + i_l * H + i_h).to(tl.float32)
            b_acc = b_acc + b_w * b_s
    if write_pooled:
        tl.store(pooled_ptr + i_lg.to(tl.int64) * n + o_t, b_acc, mask=m_t)
    if sum_pages:
        # A page's tokens in index order, one add at a time (the twin's order): column
        # i_p of the tile, picked out by a sum of one value and zeros, which is exact.
        # P passes over the tile; the sum is the ablation, not the default.
        b_tok = tl.where(m_t, b_acc, 0.0)  # [BJ, PP], 0 past n
        b_page = tl.full([BLOCK_J], 0.0, tl.float32)
        for i_p in range(0, P):
            b_page = b_page + tl.reduce(tl.where(o_p[None, :] == i_p, b_tok, 0.0), 1, SUM)
    else:
        b_page = tl.reduce(tl.where(m_t, b_acc, float("-inf")), 1, MAX)  # [BJ]
    m_j = o_j < n_pages
    tl.store(page_ptr + i_lg.to(tl.int64) * n_pages + o_j, b_page, mask=m_j)
    # Protected: the page holds a sink (first token < n_sink) or a window token
    # (last token >= n - window). Only the first (layer, group) writes it.
    first = o_j * P
    last = tl.minimum(first + P, n) - 1
    b_prot = (first < n_sink) | (last >= n - window)
    tl.store(prot_ptr + o_j, b_prot.to(tl.int8), mask=m_j & ((o_j * 0 + i_lg) == 0))


def pool_launch(target: Target, page_size: int) -> Launch:
    """The pooling kernel's launch for pages of `page_size` on `target`: a tile of
    `BLOCK_J` pages of `P_PAD = next_pow2(P)` slots, about 2048 tokens (on
    a GPU, 16384 in the interpreter), whatever the prompt length (a short prompt masks
    the rest of its one tile), so a GPU compiles one kernel per page size. No shared
    memory but the reductions' scratch; fp contraction off (see the module docstring)."""
    P_PAD = next_pow2(page_size)
    tokens = 1 << 14 if target.interpreted else 2048
    BLOCK_J = max(1, next_pow2(tokens) // P_PAD)
    ptrs = ("s_ptr", "w_ptr", "pooled_ptr", "page_ptr")
    return Launch(
        module=__name__,
        kernel="_pool_pages_kernel",
        types=(*((p, "*fp32") for p in ptrs), ("prot_ptr", "*i8")),
        constexprs=(("BLOCK_J", BLOCK_J), ("P_PAD", P_PAD)),
        options=(("enable_fp_fusion", False),),
        aligned=(*ptrs, "prot_ptr"),
    )


def pool_pages(
    scores: torch.Tensor,
    weights: torch.Tensor | None,
    n_groups: int,
    page_size: int,
    n_sink: int,
    window: int,
    pooling: str = "weighted",
    reduction: str = "max",
    return_pooled: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Pooled scores, page scores and protected pages in one launch.

    Args:
        scores: `[L, H, n]` token scores per head (profiles, maybe smoothed).
        weights: `[L, H]` head weights for `pooling="weighted"` (ignored for "max").
        n_groups: `G`, with `H % G == 0`; heads `g*r .. g*r + r - 1` form group `g`.
        page_size: `P >= 1`; the last page may be partial.
        n_sink, window: the protected tokens (`t < n_sink`, `t >= n - window`).
        pooling: "weighted" (`sum_h w_h s_h`) or "max" (`max_h s_h`).
        reduction: page score, "max" or "sum" over the page's tokens.
        return_pooled: also write the pooled `[L, G, n]` scores.

    Returns:
        `(pooled [L, G, n] float32 or None, page_scores [L, G, n_pages] float32,
        protected [n_pages] bool)`.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}; got {pooling!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if scores.dim() != 3:
        raise ValueError(f"scores must be [L, H, n]; got {tuple(scores.shape)}")
    L, H, n = scores.shape
    if n_groups < 1 or H % n_groups:
        raise ValueError(f"H={H} heads cannot be split into n_groups={n_groups} groups")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1; got {page_size}")
    if pooling == "weighted":
        if weights is None or tuple(weights.shape) != (L, H):
            shape = None if weights is None else tuple(weights.shape)
            raise ValueError(f"weighted pooling needs weights [L={L}, H={H}]; got {shape}")
        device = check_same_device(scores=scores, weights=weights)
        weights = weights.float().contiguous()
    else:
        device = scores.device
        weights = torch.empty(1, dtype=torch.float32, device=device)  # unused
    scores = scores.float().contiguous()
    G = n_groups
    r = H // G
    P = page_size
    n_pages = triton.cdiv(n, P)
    interpreted = is_interpreted(_pool_pages_kernel)
    launch = pool_launch(target_of(device, interpreted), P)
    BLOCK_J = dict(launch.constexprs)["BLOCK_J"]
    page_scores = torch.empty(L, G, n_pages, dtype=torch.float32, device=device)
    prot = torch.empty(n_pages, dtype=torch.int8, device=device)
    pooled = torch.empty(L, G, n, dtype=torch.float32, device=device) if return_pooled else None
    _pool_pages_kernel[(L * G, triton.cdiv(n_pages, BLOCK_J))](
        scores, weights, pooled if return_pooled else page_scores, page_scores, prot,
        n, H, G, r, P, n_pages, n_sink, window,
        int(pooling == "max"), int(reduction == "sum"), int(bool(return_pooled)),
        **launch.kwargs(interpreted),
    )  # fmt: skip
    return pooled, page_scores, prot.bool()
