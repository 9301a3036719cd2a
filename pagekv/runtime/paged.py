"""Paged KV layout: eviction at the hardware tuple (layer, group, page) (torch twin).

A paged cache (vLLM's `PagedAttention`) stores tokens in fixed-size blocks of a
pool and finds them through a block table. Page-EntroKV keeps whole pages per
(layer, group), so after eviction each (layer, group) has its own list of blocks:

- `k_pool`, `v_pool`: `[num_blocks, P, d]`, one block per kept page, blocks of all
  (layer, group) pairs side by side; `num_blocks = kept_pages.sum()`.
- `block_table`: int32 `[L, G, max_pages]`, the pool blocks of (layer, group) in
  prompt order, `-1` past its `kept_pages[l, g]` entries.
- `src_pages`: int32 `[L, G, max_pages]`, the prompt page each slot holds (`-1` pad).
- `kept_pages`: int32 `[L, G]`; `stored_tokens`: int64 `[L, G]`, the valid tokens
  (a partial last page counts only its real tokens; lengths are tracked, never
  inferred from zeros).

Blocks are handed out in (layer, group) row-major order, then in prompt order.

Worked example (`L = 1, G = 2, P = 4, n = 22`, so 6 pages and the last, page 5,
holds tokens 20 and 21 only). Group 0 keeps pages `[1, 3, 5]` and group 1 keeps
`[0, 2, 5]`::

    block_table[0, 0] = [0, 1, 2]    src_pages[0, 0] = [1, 3, 5]
    block_table[0, 1] = [3, 4, 5]    src_pages[0, 1] = [0, 2, 5]

so for (layer 0, group 1) block 3 holds tokens `[0..3]`, block 4 tokens `[8..11]`
and block 5 tokens `[20, 21]` in its slots 0 and 1 (slots 2 and 3 stay zero);
`stored_tokens[0, 1] = 4 + 4 + 2 = 10`. Reading blocks `[3, 4, 5]` back and cutting at
10 tokens gives exactly `compact_layer`'s dense rows for the same kept tokens.

The Triton twin is `kernels.compact.write_paged`; `pagekv.runtime.backend.paged_layout`
chooses between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.maths.paging import page_sizes


@dataclass
class PagedKV:
    """A compacted cache in the paged layout (see the module docstring)."""

    k_pool: torch.Tensor  # [num_blocks, P, d]
    v_pool: torch.Tensor  # [num_blocks, P, d]
    block_table: torch.Tensor  # int32 [L, G, max_pages], -1 padding
    src_pages: torch.Tensor  # int32 [L, G, max_pages], -1 padding
    kept_pages: torch.Tensor  # int32 [L, G]
    stored_tokens: torch.Tensor  # int64 [L, G]
    page_size: int
    n: int  # prompt length the pages were cut from

    @property
    def num_blocks(self) -> int:
        return int(self.k_pool.shape[0])

    def read(self, layer: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept tokens of (layer, group) in prompt order: `([T, d], [T, d])`."""
        table = self.block_table[layer, group]
        t = int(self.stored_tokens[layer, group])
        return read_pages(self.k_pool, table, t), read_pages(self.v_pool, table, t)

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`([L, G, k', d], [L, G, k', d])` when every (layer, group) keeps `k'` tokens."""
        if not bool((self.stored_tokens == self.stored_tokens.flatten()[0]).all()):
            raise ValueError("kept token counts differ across (layer, group); not dense")
        L, G = self.stored_tokens.shape
        ks, vs = zip(*(self.read(i, g) for i in range(L) for g in range(G)), strict=True)
        d = self.k_pool.shape[-1]
        return torch.stack(ks).view(L, G, -1, d), torch.stack(vs).view(L, G, -1, d)


def read_pages(pool: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one block list `table` of `pool` `[num_blocks, P, d]`,
    in list order: `[length, d]`. Only a list's last block may be partly filled, so its
    `ceil(length / P)` first blocks hold them."""
    P, d = pool.shape[1], pool.shape[2]
    blocks = table[: -(-int(length) // P)].long()
    return pool[blocks].reshape(-1, d)[: int(length)]


def block_table(page_keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block ids for a kept-page mask.

    Args:
        page_keep: bool `[L, G, n_pages]`.

    Returns:
        `(block_table, src_pages, kept_pages)`: int32 `[L, G, max_pages]` pool blocks
        and prompt pages per slot (`-1` padding), int32 `[L, G]` counts. See the
        module docstring for a worked example.
    """
    if page_keep.dim() != 3 or page_keep.dtype != torch.bool:
        raise ValueError(f"page_keep must be bool [L, G, n_pages]; got {page_keep.dtype} "
                         f"{tuple(page_keep.shape)}")  # fmt: skip
    L, G, n_pages = page_keep.shape
    dev = page_keep.device
    kept = page_keep.sum(-1)  # [L, G] int64
    max_pages = int(kept.max()) if kept.numel() else 0
    # Kept pages first, in ascending page order: a stable sort of "not kept".
    order = torch.sort((~page_keep).to(torch.int8), dim=-1, stable=True).indices
    slots = torch.arange(max_pages, device=dev)  # [max_pages]
    valid = slots[None, None, :] < kept[..., None]  # [L, G, max_pages]
    src = torch.where(valid, order[..., :max_pages], -1)
    first = (torch.cumsum(kept.flatten(), 0) - kept.flatten()).view(L, G)  # exclusive prefix
    blocks = torch.where(valid, first[..., None] + slots, -1)
    return blocks.to(torch.int32), src.to(torch.int32), kept.to(torch.int32)


def _layers(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`[L, G, n, d]`, or a sequence of per-layer `[G, n, d]` / `[1, G, n, d]` -> list."""
    layers = list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)
    out = []
    for i, t in enumerate(layers):
        if t.dim() == 4 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 3:
            raise ValueError(f"layer {i}: expected [G, n, d] (or batch 1); got {tuple(t.shape)}")
        out.append(t)
    return out


def empty_paged(page_keep: torch.Tensor, n: int, page_size: int, d: int, dtype, device) -> PagedKV:
    """A `PagedKV` with its tables filled and zeroed pools, ready for a copy."""
    blocks, src, kept = block_table(page_keep.to(device))
    sizes = page_sizes(n, page_size, device)
    if sizes.numel() != page_keep.shape[-1]:
        raise ValueError(
            f"page_keep has {page_keep.shape[-1]} pages; n={n} with P={page_size} has "
            f"{sizes.numel()}"
        )
    stored_tokens = (page_keep.to(device=device, dtype=torch.int64) * sizes).sum(-1)
    num_blocks = int(kept.sum())
    pool = torch.zeros(num_blocks, page_size, d, dtype=dtype, device=device)
    return PagedKV(pool, pool.clone(), blocks, src, kept, stored_tokens, page_size, n)


def to_paged(
    keys: torch.Tensor | Sequence[torch.Tensor],
    values: torch.Tensor | Sequence[torch.Tensor],
    page_keep: torch.Tensor,
    page_size: int,
) -> PagedKV:
    """Copy the kept pages of every (layer, group) into a fresh page pool (torch twin).

    Args:
        keys, values: `[L, G, n, d]`, or one `[G, n, d]` / `[1, G, n, d]` per layer
            (a batch of one sequence: block tables are per sequence).
        page_keep: bool `[L, G, n_pages]`, e.g. `Plan.page_keep`.
        page_size: `P`.

    Returns:
        A `PagedKV`; tokens of a partial last page fill the first slots of its block,
        the rest of the block stays zero.
    """
    ks, vs = _layers(keys), _layers(values)
    if len(ks) != len(vs) or any(k.shape != v.shape for k, v in zip(ks, vs, strict=True)):
        raise ValueError("keys and values must have the same layers and shapes")
    if len(ks) != page_keep.shape[0]:
        raise ValueError(f"{len(ks)} layers of keys but page_keep has {page_keep.shape[0]}")
    G, n, d = ks[0].shape
    out = empty_paged(page_keep, n, page_size, d, ks[0].dtype, ks[0].device)
    P = page_size
    dev = ks[0].device
    slot = torch.arange(P, device=dev)  # [P] position inside a block
    group = torch.arange(G, device=dev)[:, None, None]  # [G, 1, 1]
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        src = out.src_pages[i].long()[..., None]  # [G, max_pages, 1]
        tok = src * P + slot  # [G, max_pages, P] prompt token of each pool slot
        ok = (src >= 0) & (tok < n)  # kept slot, and not past a partial last page
        blk = out.block_table[i].long()[..., None].expand_as(tok)
        g_of = group.expand_as(tok)
        s_of = slot.expand_as(tok)
        out.k_pool[blk[ok], s_of[ok]] = k[g_of[ok], tok[ok]]
        out.v_pool[blk[ok], s_of[ok]] = v[g_of[ok], tok[ok]]
    return out
