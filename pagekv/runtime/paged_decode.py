"""Paged decode attention in torch: the twin of `pagekv.kernels.paged_decode.paged_decode`.

One new token's queries `[B, H, d]` against each (row, group)'s pages of a pool
(`pagekv.runtime.paged_cache`'s layout, one layer of it; see the kernel's module
docstring): the pages are gathered into a dense `[len, d]` per (row, group), in
block-table order and cut at the length, and attended with the softmax in float32.
"""

from __future__ import annotations

import torch


def paged_decode_torch(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """`[B, H, d]` attention outputs in `q`'s dtype (arguments as the kernel's)."""
    B, H, d = q.shape
    G = block_table.shape[1]
    r = H // G
    scale = d**-0.5 if scale is None else float(scale)
    out = torch.empty_like(q)
    for b in range(B):
        for g in range(G):
            n = int(lengths[b, g])
            k = read_pages(k_pool, block_table[b, g], n).float()  # [n, d]
            v = read_pages(v_pool, block_table[b, g], n).float()
            qg = q[b, g * r : (g + 1) * r].float()  # [r, d]
            w = torch.softmax(qg @ k.T * scale, dim=-1)  # [r, n]
            out[b, g * r : (g + 1) * r] = (w @ v).to(q.dtype)
    return out


def read_pages(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one block list `table` of `pool` `[num_blocks, P, d]`,
    in list order: `[length, d]`. Only a list's last block may be partly filled, so its
    `ceil(length / P)` first blocks hold them."""
    P, d = pool.shape[1], pool.shape[2]
    blocks = table[: -(-int(length) // P)].long()
    return pool[blocks].reshape(-1, d)[: int(length)]
