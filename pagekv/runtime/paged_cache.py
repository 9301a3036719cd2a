"""The decode cache: each (layer, row, group)'s kept tokens in blocks of a pool.

After eviction a (layer, group) holds its own kept pages, and groups may hold different
amounts (a global plan allocates pages per group). `PagedCache` keeps them in a pool
of blocks found through block tables (the layout of a paged KV cache such as vLLM's),
with room to grow, and is what the decode step
(`pagekv.runtime.decode.LeanDecoder.step`) writes to and attends over.

Per layer `l`:

- `k_pool[l]`, `v_pool[l]`: `[num_blocks, P, d]`, `P` the page size;
- `tables[l]`: int32 `[B, G, max_blocks]`, the blocks of (row `b`, group `g`) in token
  order, `-1` past them; token `j` of (b, g) sits in block `tables[l][b, g, j // P]`,
  slot `j % P`;
- `lengths[l]`: int32 `[B, G]` on the device (what the paged-decode kernel reads), and
  the same counts on the host (`host_lengths`). Every (layer, row, group) grows by the
  same tokens at once (`grow(t)`, then `write` per layer).

Room. (b, g) gets `ceil((t + extra) / P)` blocks for its `t` kept tokens and `extra`
more (the question and the answer; docs/design.md, "What runs where", the decode cache).

Blocks are handed out in (row, group) order and each (row, group) gets consecutive
ones. The torch path of `attend` reads them through that order (a (row, group)'s
tokens are one slice of the pool, and a layer whose (row, group)s all hold the same
number of blocks is one `[B, G, C, d]` view); the kernel path reads the block tables.

Attention: `attend` (the paged-decode kernel for one new token on the Triton backend,
torch's SDPA over the slices otherwise).
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from pagekv.maths.profiles import future_mask
from pagekv.runtime.backend import gather_layers

__all__ = ["PagedCache", "blocks_needed", "bucket", "group_attention", "write_slots"]


def bucket(n: int) -> int:
    """The capacity bucket of `n` blocks: `n` itself up to 8, else the smallest
    `m * 2^e >= n` with `m` in 4..8 (under a quarter more than `n`), so that decodes of
    near sizes share one."""
    n = max(int(n), 1)
    e = max(n.bit_length() - 3, 0)
    return -(-n >> e) << e


def blocks_needed(counts, extra: int, page_size: int) -> int:
    """The blocks a row of `counts[l][g]` kept tokens and `extra` more takes in pages of
    `page_size`: `sum over (l, g) of ceil((counts[l][g] + extra) / P)`, at least one
    each."""
    P = int(page_size)
    return sum(max(1, -(-(int(t) + extra) // P)) for row in counts for t in row)


class PagedCache:
    """Per layer, per batch row, per group: tokens in blocks of a pool (module docstring).

    Args:
        layers: per layer `(keys, values)`, each a `[B, G, t, d]` tensor (every group
            of every row holding `t` tokens), a list of such tensors stacked along the
            rows (two caches decoded as a pair), or a list over rows of a list over
            groups of `[t_bg, d]` tensors (groups of different lengths).
        extra: the tokens every (row, group) must be able to append.
        page_size: `P`, the tokens per block (the plan's page size).
        kernel: attend one new token through `pagekv.kernels.paged_decode` (the Triton backend).
    """

    def __init__(self, layers, extra: int, page_size: int, kernel: bool = False):
        groups = [(_groups(keys), _groups(values)) for keys, values in layers]
        counts = [[[int(k.shape[0]) for k in row] for row in ks] for ks, _ in groups]
        self._build(counts, groups[0][0][0][0], extra, page_size, kernel)
        for layer, (ks, vs) in enumerate(groups):
            d = ks[0][0].shape[-1]
            flat_k, flat_v = self.k_pool[layer].view(-1, d), self.v_pool[layer].view(-1, d)
            for b, (krow, vrow) in enumerate(zip(ks, vs, strict=True)):
                for g, (k, v) in enumerate(zip(krow, vrow, strict=True)):
                    t, s = counts[layer][b][g], self._firsts[layer][b][g] * self.page_size
                    flat_k[s : s + t].copy_(k)
                    flat_v[s : s + t].copy_(v)

    @classmethod
    def gathered(
        cls, keys, values, kept, counts, extra: int, page_size: int, kernel=False, backend="torch"
    ) -> PagedCache:
        """A cache of a prefill's kept tokens, gathered straight into the pool (eviction:
        the one copy of K and V a run makes); `gathered_on` names the backend that
        gathered them (`pagekv.runtime.backend.gather_layers`).

        Args:
            keys, values: per layer `[1, G, n, d]`, the prefill's cache (left as it is).
            kept: per layer sorted token indices `[B, G, k]` (row b, group g keeps its
                first `counts[l][b][g]`), `[G, k]` for every row alike, or None: every
                token.
            counts: per layer `[B][G]` host ints, the tokens each (row, group) keeps.
            extra, page_size, kernel: as `PagedCache`.
        """
        new = object.__new__(cls)
        new._build(counts, keys[0], extra, page_size, kernel)
        P = new.page_size
        starts = [[[f * P for f in row] for row in firsts] for firsts in new._firsts]
        new.gathered_on = gather_layers(
            keys, values, kept, new.k_pool, new.v_pool, starts, counts, backend
        )
        return new

    def _build(self, counts, like: torch.Tensor, extra: int, page_size: int, kernel: bool):
        """The empty cache whose (layer l, row b, group g) holds `counts[l][b][g]` tokens
        and room for `extra` more: its zeroed pools (in `like`'s dtype, device and head
        dim), block tables, lengths and views. Whatever the number of layers, one
        allocation per pool and one copy of the tables and lengths to the device."""
        if int(page_size) < 1 or int(extra) < 0:
            raise ValueError(f"page_size must be >= 1 and extra >= 0; got {page_size}, {extra}")
        self.page_size = P = int(page_size)
        self.extra = int(extra)
        self.kernel = bool(kernel)
        #: The backend that gathered the tokens in (`gathered`); "none": copied in.
        self.gathered_on = "none"
        #: Write and attend through the block tables and the device lengths only (what a
        #: CUDA graph replays: no shape or address that changes from step to step).
        self.static = False
        #: Tokens appended to every (layer, row, group) since the build (`grow`).
        self.added = 0
        L, B, G = len(counts), len(counts[0]), len(counts[0][0])
        self._base = counts
        self._blocks = [
            [[blocks_needed([[t]], extra, P) for t in row] for row in c] for c in counts
        ]
        self._firsts, tables, sizes = [], [], []
        for blocks in self._blocks:
            *starts, total = accumulate((c for row in blocks for c in row), initial=0)
            firsts = [starts[b * G : (b + 1) * G] for b in range(B)]  # each (row, group)'s
            width = max(max(row) for row in blocks)
            tables.append(
                [
                    [[*range(f, f + c), *[-1] * (width - c)] for f, c in zip(fr, br, strict=True)]
                    for fr, br in zip(firsts, blocks, strict=True)
                ]
            )  # [B][G][width]
            self._firsts.append(firsts)
            sizes.append(total)
        d = int(like.shape[-1])
        self.k_pool, self.v_pool = _pools(sizes, P, d, like), _pools(sizes, P, d, like)
        # Every (row, group) grows by the same tokens, so a layer whose (row, group)s
        # start alike stays alike: one `[B, G, C, d]` view of each pool, made once.
        self._views = []
        for layer, blocks in enumerate(self._blocks):
            flat = [x for row in blocks for x in row] + [x for row in counts[layer] for x in row]
            alike = len(set(flat[: B * G])) == 1 and len(set(flat[B * G :])) == 1
            k, v = self.k_pool[layer], self.v_pool[layer]
            self._views.append((k.view(B, G, -1, d), v.view(B, G, -1, d)) if alike else None)
        self._room = min(
            c * P - t
            for blocks, base in zip(self._blocks, counts, strict=True)
            for brow, trow in zip(blocks, base, strict=True)
            for c, t in zip(brow, trow, strict=True)
        )
        # The lengths and every table in one int32 buffer, copied to the device at once.
        host = torch.tensor(
            [t for c in counts for row in c for t in row]
            + [x for table in tables for brow in table for grow in brow for x in grow],
            dtype=torch.int32,
        )
        if like.device.type == "cuda":
            dev = host.pin_memory().to(like.device, non_blocking=True)
        else:
            dev = host.to(like.device)
        #: int32 `[L, B, G]` on the device: what the kernel reads; `lengths[l]` a view.
        self._lengths = dev[: L * B * G].view(L, B, G)
        self.lengths = list(self._lengths.unbind(0))
        widths = [len(table[0][0]) * B * G for table in tables]
        self.tables = [
            t.view(B, G, -1) for t in dev[L * B * G :].split(widths)
        ]  # per layer int32 [B, G, width]

    # ---------------------------------------------------------------- sizes

    @property
    def nbytes(self) -> int:
        """The bytes of every pool (keys and values), the decode-time cache."""
        return int(sum(k.nbytes + v.nbytes for k, v in zip(self.k_pool, self.v_pool, strict=True)))

    def row_nbytes(self, row: int) -> int:
        """The bytes of batch row `row`'s blocks (keys and values, every layer)."""
        return sum(
            2 * pool[0].nbytes * sum(blocks[row])  # every pool holds >= 1 block
            for pool, blocks in zip(self.k_pool, self._blocks, strict=True)
        )

    def room(self) -> int:
        """How many more tokens every (layer, row, group) can take."""
        return self._room - self.added

    def host_lengths(self, layer: int) -> list[list[int]]:
        """The tokens each (row, group) of `layer` holds, `[B][G]` host ints."""
        return [[t + self.added for t in row] for row in self._base[layer]]

    def read(self, layer: int, row: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of (layer, row, group) in order: `([t, d], [t, d])` views."""
        s = self._firsts[layer][row][group] * self.page_size
        t = self._base[layer][row][group] + self.added
        k, v = self.k_pool[layer], self.v_pool[layer]
        return k.view(-1, k.shape[-1])[s : s + t], v.view(-1, v.shape[-1])[s : s + t]

    # ---------------------------------------------------------------- buckets

    def bucket_key(self) -> tuple:
        """What a CUDA graph of a step over this cache was recorded on, up to the
        capacity buckets: the page size, the kernel, the dtype and device, and per layer
        the pool's blocks and the tables' width rounded up to their `bucket`, the rows,
        the groups and the head dim."""
        k0 = self.k_pool[0]
        layers = tuple(
            (bucket(k.shape[0]), *t.shape[:2], bucket(t.shape[2]), k.shape[-1])
            for k, t in zip(self.k_pool, self.tables, strict=True)
        )
        return (self.page_size, self.kernel, k0.dtype, str(k0.device), layers)

    def bucketed(self) -> PagedCache:
        """A `static` cache whose pools and tables have their `bucket_key`'s sizes,
        holding this cache's tokens (`adopt`): what a graph of that bucket records."""
        new = object.__new__(PagedCache)
        new.page_size, new.kernel, new.static = self.page_size, self.kernel, True
        new.extra = self.extra
        new.k_pool = [k.new_zeros(bucket(k.shape[0]), *k.shape[1:]) for k in self.k_pool]
        new.v_pool = [v.new_zeros(bucket(v.shape[0]), *v.shape[1:]) for v in self.v_pool]
        new.tables = [t.new_full((*t.shape[:2], bucket(t.shape[2])), -1) for t in self.tables]
        new._lengths = self._lengths.clone()
        new.lengths = list(new._lengths.unbind(0))
        new._views = [None] * len(self.k_pool)  # the pools' blocks are not all used
        new.adopt(self)
        return new

    def adopt(self, other: PagedCache) -> None:
        """Hold `other`'s tokens, in place: its blocks copied to the front of each pool
        and its tables and lengths written over ours (same `bucket_key`; the tensors a
        graph recorded keep their addresses)."""
        if other.bucket_key() != self.bucket_key():
            raise ValueError("adopt needs a cache of the same capacity bucket")
        for mine, theirs in ((self.k_pool, other.k_pool), (self.v_pool, other.v_pool)):
            for a, b in zip(mine, theirs, strict=True):
                a[: b.shape[0]].copy_(b)
        for a, b in zip(self.tables, other.tables, strict=True):
            a[..., : b.shape[2]].copy_(b)
            a[..., b.shape[2] :] = -1
        self._lengths.copy_(other._lengths)
        self._base, self._firsts, self._blocks = other._base, other._firsts, other._blocks
        self._room, self.added = other._room, other.added

    # ---------------------------------------------------------------- decode

    def grow(self, t: int, device: bool = True) -> None:
        """Make room for `t` new tokens in every (layer, row, group): their lengths grow
        by `t` (on the host and, in one op, on the device; `device=False`: the host's
        count alone, beside a CUDA graph whose replay adds on the device); `write` fills
        the slots."""
        if self.room() < t:
            raise ValueError(f"PagedCache is full: {t} new tokens, room for {self.room()}")
        self.added += t
        if device:
            self._lengths.add_(t)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the `t` tokens of the last `grow(t)` into `layer`: `[B, G, t, d]` (in the
        pool's dtype or one it promotes from)."""
        B, G, t, d = k.shape
        views = None if self.static else self._views[layer]
        if views is not None:  # one strided copy into the layer's view
            n0 = self._base[layer][0][0] + self.added - t
            views[0].narrow(2, n0, t).copy_(k)
            views[1].narrow(2, n0, t).copy_(v)
            return
        write_slots(self.k_pool[layer], self.v_pool[layer], self.tables[layer],
                    self.lengths[layer], k, v)  # fmt: skip

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the `t` newest tokens' queries `[B, H, t, d]` (written already)
        over `layer`; `[B, H, t, d]` in the pool's dtype (`q` is cast to it)."""
        if q.dtype != self.k_pool[layer].dtype:
            q = q.to(self.k_pool[layer].dtype)
        if (self.kernel or self.static) and q.shape[2] == 1:  # the kernel reads the tables
            from pagekv.kernels.paged_decode import paged_decode

            return paged_decode(
                q[:, :, 0], self.k_pool[layer], self.v_pool[layer], self.tables[layer],
                self.lengths[layer], scale,
            )[:, :, None]  # fmt: skip
        return self._attend_torch(layer, q, scale)

    def _attend_torch(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Torch's SDPA over the (row, group) slices (module docstring)."""
        B, H = q.shape[:2]
        G = len(self._base[layer][0])
        r = H // G
        views = self._views[layer]
        if views is not None:
            n = self._base[layer][0][0] + self.added
            return group_attention(q, views[0][:, :, :n], views[1][:, :, :n], scale)
        out = torch.empty_like(q)
        for b in range(B):
            for g in range(G):
                keys, values = self.read(layer, b, g)  # [n_bg, d]
                qg = q[None, b, g * r : (g + 1) * r]  # [1, r, t, d]
                a = group_attention(qg, keys[None, None], values[None, None], scale)
                out[b, g * r : (g + 1) * r] = a[0]
        return out


def write_slots(k_pool, v_pool, table, lengths, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write `k`, `v` `[B, G, t, d]`, the `t` newest tokens of each (row, group) (the
    last `t` of `lengths` `[B, G]`), into the pools `[num_blocks, P, d]` at the slots
    the block table `[B, G, width]` gives them (`PagedCache.write`, and the shared
    pool's `pagekv.runtime.block_pool.PoolBatch.write`)."""
    t, d = k.shape[2], k.shape[3]
    P = k_pool.shape[1]
    pos = lengths.long()[..., None] - t + torch.arange(t, device=k.device)
    blk = table.long().gather(2, pos // P)  # [B, G, t] each new token's block
    rows = (blk * P + pos % P).reshape(-1)
    dtype = k_pool.dtype  # a half-precision product is promoted here
    k_pool.view(-1, d).index_copy_(0, rows, k.reshape(-1, d).to(dtype))
    v_pool.view(-1, d).index_copy_(0, rows, v.reshape(-1, d).to(dtype))


def group_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """SDPA of queries `[B, H, t, d]` over their groups' `[B, G, n, d]`, the `t` new
    tokens the last of the `n` (causal among themselves): `[B, H, t, d]`. Also the
    reconstruction pass's output on the Triton backend (`pagekv.runtime.reconstruct`)."""
    B, H, t, d = q.shape
    G, n = keys.shape[1], keys.shape[2]
    if t == 1:
        # A group's r query heads are r query rows over the group's keys: each group's
        # keys and values are read once, not once per query head.
        a = F.scaled_dot_product_attention(q.reshape(B, G, H // G, d), keys, values, scale=scale)
        return a.reshape(B, H, 1, d)
    mask = torch.zeros(t, n, dtype=q.dtype, device=q.device)  # additive, [t, n]
    mask.masked_fill_(future_mask(n, t, q.device), torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )


def _pools(sizes: list[int], P: int, d: int, like: torch.Tensor) -> list[torch.Tensor]:
    """Per layer a zeroed `[sizes[l], P, d]` pool, all of them views of one allocation,
    each starting 16-byte aligned (what the gather kernel's writes assume)."""
    step = max(1, 16 // like.element_size())  # elements in 16 bytes
    lengths = [-(-(n * P * d) // step) * step for n in sizes]  # each rounded up to it
    flat = like.new_zeros(sum(lengths))
    return [
        part[: n * P * d].view(n, P, d) for part, n in zip(flat.split(lengths), sizes, strict=True)
    ]


def _groups(x) -> list[list[torch.Tensor]]:
    """`layers`' per-layer entry (see `PagedCache`) as a list over rows of a list over
    groups of `[t, d]` tensors (views)."""
    blocks = [x] if isinstance(x, torch.Tensor) else list(x)
    if all(isinstance(b, torch.Tensor) and b.dim() == 4 for b in blocks):  # [B, G, t, d]
        return [list(row.unbind(0)) for block in blocks for row in block.unbind(0)]
    rows = [list(row) for row in blocks if not isinstance(row, torch.Tensor)]
    if len(rows) != len(blocks) or not all(
        isinstance(k, torch.Tensor) and k.dim() == 2 for row in rows for k in row
    ):
        raise ValueError(
            "a layer's keys and values must be [B, G, t, d] tensors or a list over rows "
            "of a list over groups of [t, d] tensors"
        )
    return rows
