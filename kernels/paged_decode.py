"""Paged decode attention: one new token's queries against a cache kept as pages.

Torch twin: the torch path of `pagekv.runtime.paged_cache.PagedCache.attend` (SDPA over
each (row, group)'s tokens), which the torch backend's decode runs.

The cache of one layer is a pool of blocks, `k_pool` and `v_pool` `[num_blocks, P, d]`,
and per batch row `b` and KV group `g` a list of blocks, `block_table[b, g, :]` (int32,
`-1` past its pages), and a length, `lengths[b, g]` (int32): token `j < lengths[b, g]`
of that (row, group) sits in block `block_table[b, g, j // P]`, slot `j % P`. Only the
last block of a list may be partly filled (a prompt's last page, or the tokens decoded
since), so the length says which tokens are real; nothing is inferred from zeros.
This is `pagekv.runtime.paged_cache.PagedCache`'s layout, one layer of it.

For every batch row `b` and query head `h` (GQA: head `h` reads group `h // r`):

    out[b, h] = sum_j softmax_j(q[b, h] . k_g(j) * scale) v_g(j),   j < lengths[b, g]

Programs. One program per (row, group, split) reads the group's tokens once for all
`r` heads of the group (GQA: the rows of the dot are the group's heads, padded to 16
for `tl.dot`). It streams token tiles of `BLOCK_T` tokens (a tile spans several pages
when `P < BLOCK_T`; each token's address comes from the block table, so any page size
works), with the online softmax (running max `m`, sum `l` and weighted values `acc`).
A long cache is cut into `splits` ranges of tiles, each program writing its
`(m, l, acc)`; the launcher merges the splits (`merge_splits`, a log-sum-exp). A split
past a group's length writes `l = 0`, which the merge ignores.

All logits are in base 2 (`qk_scale = scale * log2(e)`), as in `kernels/score.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    MAX,
    NEG_BIG,
    SUM,
    TRITON_TYPES,
    Launch,
    check_same_device,
    is_interpreted,
    next_pow2,
)
from .targets import Target, target_of


@triton.jit(do_not_specialize=["tiles_per_split"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, G, r,
                         d, P, max_pages, tiles_per_split, qk_scale, stride_qb, stride_qh,
                         R_PAD: tl.constexpr, BLOCK_T: tl.constexpr, D_PAD: tl.constexpr,
                         DOT_FP32: tl.constexpr):  # fmt: skip
    i_bg = tl.program_id(0)  # (batch row, group)
    i_s = tl.program_id(1)  # split
    n_splits = tl.num_programs(1)
    i_b = i_bg // G
    i_g = i_bg % G
    o_r = tl.arange(0, R_PAD)
    o_d = tl.arange(0, D_PAD)
    m_r = o_r < r
    m_d = o_d < d
    p_q = q_ptr + i_b.to(tl.int64) * stride_qb + (i_g * r + o_r)[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)  # [R, D]
    length = tl.load(len_ptr + i_bg)
    p_table = table_ptr + i_bg.to(tl.int64) * max_pages
    b_m = tl.full([R_PAD], NEG_BIG, tl.float32)
    b_l = tl.zeros([R_PAD], tl.float32)
    b_acc = tl.zeros([R_PAD, D_PAD], tl.float32)
    t_lo = i_s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, tl.cdiv(length, BLOCK_T))
    for i_t in range(t_lo, t_hi):
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # token index within the group
        m_t = o_t < length
        blk = tl.load(p_table + o_t // P, mask=m_t, other=0)  # its block
        row = blk.to(tl.int64) * P + o_t % P  # its row in the pool
        m_kv = m_t[:, None] & m_d[None, :]
        b_k = tl.load(k_ptr + row[:, None] * d + o_d[None, :], mask=m_kv, other=0.0)  # [T, D]
        b_v = tl.load(v_ptr + row[:, None] * d + o_d[None, :], mask=m_kv, other=0.0)
        if DOT_FP32:
            b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = tl.where(m_t[None, :], b_s * qk_scale, float("-inf"))  # [R, T]
        b_mn = tl.maximum(b_m, tl.reduce(b_s, 1, MAX))
        b_p = tl.exp2(b_s - b_mn[:, None])
        alpha = tl.exp2(b_m - b_mn)
        b_l = b_l * alpha + tl.reduce(b_p, 1, SUM)
        if DOT_FP32:
            pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(b_p.to(b_v.dtype), b_v)
        b_acc = b_acc * alpha[:, None] + pv
        b_m = b_mn
    p_out = (i_bg * n_splits + i_s).to(tl.int64) * R_PAD + o_r
    tl.store(m_ptr + p_out, b_m)
    tl.store(l_ptr + p_out, b_l)
    tl.store(acc_ptr + p_out[:, None] * D_PAD + o_d[None, :], b_acc)


@dataclass(frozen=True)
class DecodeLaunch:
    """The blocks and options of one paged-decode launch (`paged_decode_launch`)."""

    R_PAD: int  # the group's heads, padded (tl.dot needs 16 rows)
    BLOCK_T: int  # tokens per tile
    D_PAD: int
    DOT_FP32: bool
    num_warps: int

    def launch(self, dtype: torch.dtype) -> Launch:
        t = TRITON_TYPES[dtype]
        ptrs = (*((p, f"*{t}") for p in ("q_ptr", "k_ptr", "v_ptr")),
                *((p, "*i32") for p in ("table_ptr", "len_ptr")),
                *((p, "*fp32") for p in ("m_ptr", "l_ptr", "acc_ptr")))  # fmt: skip
        consts = ("R_PAD", "BLOCK_T", "D_PAD", "DOT_FP32")
        return Launch(
            module=__name__,
            kernel="_paged_decode_kernel",
            types=(*ptrs, ("qk_scale", "fp32")),
            constexprs=tuple((c, getattr(self, c)) for c in consts),
            num_warps=self.num_warps,
            aligned=tuple(p for p, _ in ptrs),
        )


def paged_decode_launch(target: Target, dtype: torch.dtype, d: int, r: int) -> DecodeLaunch:
    """The blocks on `target`: 64-token tiles on a GPU (the fp32 dot for fp32 caches,
    the native one with fp32 accumulation for fp16/bf16), 128-token tiles interpreted
    (the interpreter pays per loop step, and runs the fp32 dot: numpy has no bf16)."""
    R_PAD = max(16, next_pow2(r))
    D_PAD = max(16, next_pow2(d))
    if target.interpreted:
        return DecodeLaunch(R_PAD, 128, D_PAD, True, 4)
    return DecodeLaunch(R_PAD, 64, D_PAD, dtype == torch.float32, 4)


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """`(m, l, acc)` of the splits `[rows, S, R]`, `[rows, S, R]`, `[rows, S, R, D]` ->
    the attention output `[rows, R, D]`: each split rescaled to the largest max (base 2)."""
    top = m.amax(1, keepdim=True)
    w = torch.exp2(m - top)  # [rows, S, R]; an empty split has l = 0 and acc = 0
    den = (l * w).sum(1)  # [rows, R]
    num = (acc * w[..., None]).sum(1)  # [rows, R, D]
    return num / den.clamp_min(torch.finfo(torch.float32).tiny)[..., None]


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per batch row over its paged cache.

    Args:
        q: `[B, H, d]` queries (after RoPE), `H = G r`.
        k_pool, v_pool: `[num_blocks, P, d]`, the cache's dtype (float32, float16 or
            bfloat16, the same as `q`).
        block_table: int32 `[B, G, max_pages]`, `-1` past a list's pages.
        lengths: int32 `[B, G]`, the tokens of each (row, group), each `>= 1`.
        scale: softmax scale; default `1 / sqrt(d)`.
        splits: ranges of token tiles per (row, group), merged after; default: enough
            programs to fill a GPU (1 interpreted).

    Returns:
        `[B, H, d]` in `q`'s dtype.
    """
    if q.dim() != 3 or k_pool.dim() != 3 or k_pool.shape != v_pool.shape:
        raise ValueError(
            f"q must be [B, H, d] and the pools [num_blocks, P, d]; got {tuple(q.shape)}, "
            f"{tuple(k_pool.shape)} and {tuple(v_pool.shape)}"
        )
    B, H, d = q.shape
    P = int(k_pool.shape[1])
    if k_pool.shape[2] != d or not (q.dtype == k_pool.dtype == v_pool.dtype):
        raise ValueError("q and the pools must share the head dim and the dtype")
    if (
        block_table.dim() != 3
        or block_table.shape[0] != B
        or tuple(lengths.shape) != tuple(block_table.shape[:2])
    ):
        raise ValueError(
            f"block_table must be [B={B}, G, max_pages] and lengths [B, G]; got "
            f"{tuple(block_table.shape)} and {tuple(lengths.shape)}"
        )
    G, max_pages = int(block_table.shape[1]), int(block_table.shape[2])
    if H % G:
        raise ValueError(f"query heads H={H} must be a multiple of KV groups G={G}")
    device = check_same_device(q=q, k_pool=k_pool, v_pool=v_pool)
    r = H // G
    q = q.contiguous()
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    table = block_table.to(device=device, dtype=torch.int32).contiguous()
    lens = lengths.to(device=device, dtype=torch.int32).contiguous()
    interpreted = is_interpreted(_paged_decode_kernel)
    cfg = paged_decode_launch(target_of(device, interpreted), q.dtype, d, r)
    tiles = triton.cdiv(max_pages * P, cfg.BLOCK_T)
    if splits is None:
        splits = 1 if interpreted else max(1, min(tiles, 512 // max(1, B * G)))
    splits = max(1, min(int(splits), tiles))
    per_split = triton.cdiv(tiles, splits)
    rows = B * G
    m = torch.empty(rows, splits, cfg.R_PAD, dtype=torch.float32, device=device)
    l = torch.empty_like(m)  # noqa: E741
    acc = torch.empty(rows, splits, cfg.R_PAD, cfg.D_PAD, dtype=torch.float32, device=device)
    qk_scale = (d**-0.5 if scale is None else float(scale)) * LOG2E
    _paged_decode_kernel[(rows, splits)](
        q, k_pool, v_pool, table, lens, m, l, acc, G, r, d, P, max_pages, per_split, qk_scale,
        q.stride(0), q.stride(1), **cfg.launch(q.dtype).kwargs(interpreted),
    )  # fmt: skip
    return merge_splits(m, l, acc)[:, :r, :d].reshape(B, H, d).to(q.dtype)
