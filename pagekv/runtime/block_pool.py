"""A fixed pool of KV blocks that many sequences share: rows admitted when their blocks
are free, decoded together, and released when they finish (`pagekv.runtime.serve`).

One pool holds every layer: keys and values are each one `[num_blocks, P, d]` tensor,
and a block is `P` tokens of one (layer, row, KV head). Each row keeps, per layer, its
own block table `[G, width]` (its blocks in token order, `-1` past them) and its own
lengths `[G]`: layers and KV heads of one row may hold different numbers of tokens
(a global plan allocates pages per group), and rows differ in length and position.
This is `pagekv.runtime.paged_cache.PagedCache`'s layout with the blocks taken from a
free list instead of laid out in a row's order, so a row's blocks need not be
consecutive and a released row's blocks serve the next one.

Admission reserves everything a row will write: `ceil((kept + extra) / P)` blocks per
(layer, KV head), `extra` its question and answer tokens. A row admitted never waits
for a block, and nothing is recomputed (transformers' continuous batching instead
allocates as it goes and recomputes a request it starves).

`PoolBatch` is a step's view of some live rows: what `LeanDecoder.step` writes to and
attends over (`grow`, `write`, `attend`, as `PagedCache`). Its tables and lengths are
`[L, B, G, ...]` tensors on the device, so the paged-decode kernel reads a batch of
rows of different lengths through them; the torch path gathers each (row, group)'s
blocks and masks the slots past its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagekv.runtime.paged_cache import blocks_needed, write_slots

__all__ = ["BlockPool", "PoolBatch", "blocks_needed"]


@dataclass
class _Row:
    """One admitted sequence: per layer its blocks `[G][c]` and kept tokens `[G]`."""

    blocks: list[list[list[int]]]
    base: list[list[int]]
    added: int = 0  # tokens appended to every (layer, group) since admission

    @property
    def n_blocks(self) -> int:
        return sum(len(b) for layer in self.blocks for b in layer)


class BlockPool:
    """`num_blocks` blocks of `page_size` tokens, shared by every layer and every row.

    Args:
        num_blocks: the pool's blocks (each `P` tokens of one (layer, KV head)).
        n_layers, n_groups: the model's layers and KV heads.
        head_dim, page_size: `d` and `P`.
        like: a tensor of the cache's dtype and device.
        kernel: attend one new token through `pagekv.kernels.paged_decode`.
    """

    def __init__(self, num_blocks, n_layers, n_groups, head_dim, page_size, like, kernel=False):
        if int(num_blocks) < 1 or int(page_size) < 1:
            raise ValueError(
                f"a pool needs at least one block and a page size >= 1; got {num_blocks}, "
                f"{page_size}"
            )
        self.num_blocks, self.page_size = int(num_blocks), int(page_size)
        self.n_layers, self.n_groups, self.head_dim = int(n_layers), int(n_groups), int(head_dim)
        self.kernel = bool(kernel)
        shape = (self.num_blocks, self.page_size, self.head_dim)
        self.k = like.new_zeros(shape)
        self.v = like.new_zeros(shape)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self.rows: dict[int, _Row] = {}
        self._next_id = 0

    @classmethod
    def of_bytes(cls, nbytes, n_layers, n_groups, head_dim, page_size, like, kernel=False):
        """The pool of `nbytes` bytes (keys and values): `nbytes // block_bytes` blocks."""
        block = 2 * int(page_size) * int(head_dim) * like.element_size()
        return cls(int(nbytes) // block, n_layers, n_groups, head_dim, page_size, like, kernel)

    @property
    def block_bytes(self) -> int:
        """The bytes of one block, its keys and its values."""
        return 2 * self.page_size * self.head_dim * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def admit(self, keys, values, kept, counts, extra: int) -> int | None:
        """Copy a prefill's kept tokens into free blocks, with room for `extra` more per
        (layer, group): the new row's id, or None (nothing changed) when too few blocks
        are free.

        Args:
            keys, values: per layer `[1, G, n, d]`, the prefill's cache (left as it is).
            kept: per layer sorted token indices `[G, k]` (group g keeps its first
                `counts[l][g]`), or None: every token.
            counts: per layer `[G]` host ints.
            extra: the question's and the answer's tokens.
        """
        if blocks_needed(counts, extra, self.page_size) > len(self._free):
            return None
        P, d = self.page_size, self.head_dim
        flat_k, flat_v = self.k.view(-1, d), self.v.view(-1, d)
        blocks = []
        for layer, row_counts in enumerate(counts):
            layer_blocks = []
            for g, t in enumerate(row_counts):
                mine = [self._free.pop() for _ in range(blocks_needed([[t]], extra, P))]
                layer_blocks.append(mine)
                if t == 0:
                    continue
                src = (
                    torch.arange(t, device=self.k.device)
                    if kept is None or kept[layer] is None
                    else kept[layer][g, :t].to(self.k.device)
                )
                dst = self._slots(mine, t)
                flat_k.index_copy_(0, dst, keys[layer][0, g].index_select(0, src).to(self.k.dtype))
                flat_v.index_copy_(
                    0, dst, values[layer][0, g].index_select(0, src).to(self.v.dtype)
                )
            blocks.append(layer_blocks)
        row = self._next_id
        self._next_id += 1
        self.rows[row] = _Row(blocks, [list(map(int, c)) for c in counts])
        return row

    def release(self, row: int) -> None:
        """Return `row`'s blocks to the free list."""
        r = self.rows.pop(row)
        for layer in r.blocks:
            for b in layer:
                self._free.extend(reversed(b))

    def lengths(self, row: int) -> list[list[int]]:
        """The tokens each (layer, group) of `row` holds, `[L][G]` host ints."""
        r = self.rows[row]
        return [[t + r.added for t in c] for c in r.base]

    def read(self, row: int, layer: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of (row, layer, group) in order: `([t, d], [t, d])` copies."""
        r = self.rows[row]
        idx = self._slots(r.blocks[layer][group], r.base[layer][group] + r.added)
        d = self.head_dim
        return self.k.view(-1, d)[idx], self.v.view(-1, d)[idx]

    def _slots(self, blocks: list[int], t: int) -> torch.Tensor:
        """The pool rows (of the `[num_blocks * P, d]` view) of the first `t` tokens held
        in `blocks`, in order."""
        P = self.page_size
        j = torch.arange(t, device=self.k.device)
        return torch.tensor(blocks, device=self.k.device)[j // P] * P + j % P

    def batch(self, rows: list[int]) -> PoolBatch:
        """The step view of `rows` (live ids, in the batch's order)."""
        return PoolBatch(self, list(rows))


class PoolBatch:
    """`rows` of a `BlockPool` as one decode batch: `grow`, `write` and `attend` as
    `PagedCache` has them (module docstring). Build a new one when the rows change."""

    static = False

    def __init__(self, pool: BlockPool, rows: list[int]):
        if not rows:
            raise ValueError("a batch needs at least one row")
        self.pool, self.rows = pool, rows
        self.kernel = pool.kernel
        L, G, B = pool.n_layers, pool.n_groups, len(rows)
        rs = [pool.rows[r] for r in rows]
        self.width = max(len(b) for r in rs for layer in r.blocks for b in layer)
        tables = torch.full((L, B, G, self.width), -1, dtype=torch.int32)
        for b, r in enumerate(rs):
            for layer, groups in enumerate(r.blocks):
                for g, blocks in enumerate(groups):
                    tables[layer, b, g, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lengths = torch.tensor(
            [[[t + r.added for t in r.base[layer]] for r in rs] for layer in range(L)],
            dtype=torch.int32,
        )  # [L, B, G]
        dev = pool.k.device
        self.tables, self._lengths = tables.to(dev), lengths.to(dev)
        self.lengths = list(self._lengths.unbind(0))
        self._room = min(
            len(blocks) * pool.page_size - (t + r.added)
            for r in rs
            for layer, groups in enumerate(r.blocks)
            for blocks, t in zip(groups, r.base[layer], strict=True)
        )
        self._index = [None] * L  # per layer, the pool rows of every slot `[B, G, W * P]`

    def room(self) -> int:
        """How many more tokens every (layer, row, group) of the batch can take."""
        return self._room

    def grow(self, t: int, device: bool = True) -> None:
        """Make room for `t` new tokens in every (layer, row, group) of the batch."""
        if self._room < t:
            raise ValueError(f"a pool row is full: {t} new tokens, room for {self._room}")
        self._room -= t
        for r in self.rows:
            self.pool.rows[r].added += t
        self._lengths.add_(t)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the `t` tokens of the last `grow(t)` into `layer`: `[B, G, t, d]`."""
        write_slots(self.pool.k, self.pool.v, self.tables[layer], self.lengths[layer], k, v)

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the `t` newest tokens' queries `[B, H, t, d]` (written already)
        over each row's tokens of `layer`, causal among the new ones: `[B, H, t, d]` in
        the pool's dtype."""
        pool = self.pool
        if q.dtype != pool.k.dtype:
            q = q.to(pool.k.dtype)
        if self.kernel and q.shape[2] == 1:
            from pagekv.kernels.paged_decode import paged_decode

            out = paged_decode(
                q[:, :, 0], pool.k, pool.v, self.tables[layer], self.lengths[layer], scale
            )
            return out[:, :, None]
        B, H, t, d = q.shape
        G = pool.n_groups
        r = H // G
        idx = self._index[layer]
        if idx is None:  # every reserved slot of each (row, group), past its length too
            P = pool.page_size
            blk = self.tables[layer].long().clamp(min=0)  # [B, G, W]
            idx = (blk[..., None] * P + torch.arange(P, device=blk.device)).flatten(2)
            self._index[layer] = idx
        n = idx.shape[-1]
        keys = pool.k.view(-1, d).index_select(0, idx.reshape(-1)).view(B, G, n, d)
        values = pool.v.view(-1, d).index_select(0, idx.reshape(-1)).view(B, G, n, d)
        # query i of the t new ones sees slots j < length - t + 1 + i
        ends = self.lengths[layer].long()[:, :, None] - t + 1 + torch.arange(t, device=q.device)
        mask = torch.arange(n, device=q.device) < ends[..., None]  # [B, G, t, n]
        mask = mask[:, :, None].expand(B, G, r, t, n).reshape(B, G, r * t, n)
        qg = q.reshape(B, G, r * t, d)  # a group's r heads, each its t queries
        a = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return a.reshape(B, H, t, d)
