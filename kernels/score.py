"""Scoring kernel: attention profiles, sink mass and collision masses in two passes.

Torch twin: `pagekv.maths.profiles.attention_profiles` followed by
`pagekv.maths.entropy.mass_sums` (this module imports nothing from `pagekv`; the
conversion of the sums into head weights, with its guard, lives in the core:
`pagekv.maths.entropy.HeadMasses.from_sums`).

For every layer `l`, group `g` and query head `h` of the group (GQA: head `h`
reads KV group `h // r`), with window query `i` at position `n - w + i` seeing the
keys `t <= n - w + i` (causal):

    a_h(t) = (1 / w) sum_i softmax_t(q_{h,i} . k_g(t) * scale)

Pass 1 (`_stats_kernel`, grid `[L * G * head blocks, splits]`) streams key tiles
`[BLOCK_N, d]` and keeps, per (head, query) row, the running max `m` and the
running sum `l = sum exp(s - m)` (online softmax: when the max grows by `D`, the old
sum is rescaled by `exp(-D)`, so no `exp` ever sees a positive argument). Each split
of the key axis writes its `(m, l)`; the host merges the splits into the row's
log-sum-exp `lse = m + log(l)` (a `[L * G, splits, rows]` tensor, tiny next to K).

Pass 2 (`_profile_kernel`, grid `[L * G * head blocks, key tiles]`) recomputes the
logits of one key tile, turns them into probabilities `exp(s - lse)` (each <= 1,
exact normalisation, no division), averages over the window's queries and writes
the profile tile `[heads, BLOCK_N]`. In the same program it writes four partial
sums of the tile per head: sink mass, non-sink mass, non-sink squares and all
squares; the host adds the tiles (a `[L, H, tiles, 4]` buffer) into `[L, H, 4]`.
No program holds more than one key tile.

Memory traffic (bytes a perfect implementation must move, element size `e`):
pass 1 reads K once (`L G n d e`), pass 2 reads K again and writes the profiles
(`L H n 4`); the queries (`L H w d e`) and the partial buffers are negligible.

All logits are kept in base 2 (`qk_scale = scale * log2(e)`, `exp2`), the usual
trick that saves a multiply per element; the result is the same softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    MAX,
    SUM,
    check_same_device,
    check_window_shapes,
    is_interpreted,
    next_pow2,
)

LOG2E = 1.4426950408889634
#: Finite stand-in for -inf as the initial running max, so that a row whose keys in a
#: tile are all masked (-inf logits) rescales by exp2(-1e30 + 1e30) = 1, not NaN.
NEG_BIG = -1.0e30


@triton.jit
def _load_q(q_ptr, i_l, i_g, i_rb, r, w, d, stride_ql, stride_qh, stride_qw,
            R_BLK: tl.constexpr, W_PAD: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    # Rows of the query block: row m is head i_rb * R_BLK + m // W_PAD of the group,
    # window query m % W_PAD. Padding rows (head >= r or query >= w) load zeros.
    o_m = tl.arange(0, R_BLK * W_PAD)  # [M]
    i_r = i_rb * R_BLK + o_m // W_PAD
    i_w = o_m % W_PAD
    m_m = (i_r < r) & (i_w < w)
    o_d = tl.arange(0, D_PAD)
    p_q = (
        q_ptr
        + i_l.to(tl.int64) * stride_ql
        + (i_g * r + i_r)[:, None] * stride_qh
        + i_w[:, None] * stride_qw
        + o_d[None, :]
    )
    b_q = tl.load(p_q, mask=m_m[:, None] & (o_d < d)[None, :], other=0.0)  # [M, D]
    return b_q, i_w, m_m


@triton.jit
def _logits(b_q, k_ptr, i_l, i_g, i_t, n, w, d, i_w, qk_scale, stride_kl, stride_kg, stride_kn,
            BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    # Logits of one key tile in base 2, causal and length masked: [M, BLOCK_N].
    o_n = i_t * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D_PAD)
    p_k = (
        k_ptr
        + i_l.to(tl.int64) * stride_kl
        + i_g.to(tl.int64) * stride_kg
        + o_n[:, None].to(tl.int64) * stride_kn
        + o_d[None, :]
    )
    # Reads BLOCK_N * d * e bytes of K.
    b_k = tl.load(p_k, mask=(o_n < n)[:, None] & (o_d < d)[None, :], other=0.0)  # [N, D]
    if DOT_FP32:
        # fp32 inputs (exact fp32 products, no tf32) and the interpreter (numpy has
        # no bfloat16 matmul) take this branch.
        b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
    else:
        # fp16/bf16 products are exact in fp32, and the dot accumulates in fp32.
        b_s = tl.dot(b_q, tl.trans(b_k))
    b_s = b_s * qk_scale  # [M, N]
    pos_q = n - w + i_w  # [M] position of each window query
    visible = (o_n[None, :] <= pos_q[:, None]) & (o_n < n)[None, :]
    return tl.where(visible, b_s, float("-inf")), o_n


@triton.jit
def _stats_kernel(q_ptr, k_ptr, m_ptr, l_ptr, n, w, d, r, G, n_rb, n_tiles, tiles_per_split,
                  qk_scale, stride_ql, stride_qh, stride_qw, stride_kl, stride_kg, stride_kn,
                  R_BLK: tl.constexpr, W_PAD: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    i_lgr = tl.program_id(0)
    i_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    i_l = i_lgr // (G * n_rb)
    i_g = (i_lgr // n_rb) % G
    i_rb = i_lgr % n_rb
    b_q, i_w, m_m = _load_q(q_ptr, i_l, i_g, i_rb, r, w, d, stride_ql, stride_qh, stride_qw,
                            R_BLK, W_PAD, D_PAD)  # fmt: skip
    b_m = tl.full([R_BLK * W_PAD], NEG_BIG, tl.float32)  # running max (base-2 logits)
    b_l = tl.full([R_BLK * W_PAD], 0.0, tl.float32)  # running sum of exp2(s - b_m)
    t_lo = i_s * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, n_tiles)
    for i_t in range(t_lo, t_hi):
        b_s, o_n = _logits(b_q, k_ptr, i_l, i_g, i_t, n, w, d, i_w, qk_scale,
                           stride_kl, stride_kg, stride_kn, BLOCK_N, D_PAD, DOT_FP32)  # fmt: skip
        b_mn = tl.maximum(b_m, tl.reduce(b_s, 1, MAX))
        # Online update: rescale the old sum to the new max, then add this tile.
        b_l = b_l * tl.exp2(b_m - b_mn) + tl.reduce(tl.exp2(b_s - b_mn[:, None]), 1, SUM)
        b_m = b_mn
    o_m = tl.arange(0, R_BLK * W_PAD)
    p_out = (i_lgr * n_splits + i_s) * (R_BLK * W_PAD) + o_m
    tl.store(m_ptr + p_out, b_m)
    tl.store(l_ptr + p_out, b_l)


@triton.jit
def _profile_kernel(q_ptr, k_ptr, lse_ptr, prof_ptr, part_ptr, n, w, d, r, G, H, n_rb, n_tiles,
                    n_sink, qk_scale, stride_ql, stride_qh, stride_qw, stride_kl, stride_kg,
                    stride_kn, R_BLK: tl.constexpr, W_PAD: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    i_lgr = tl.program_id(0)
    i_t = tl.program_id(1)
    i_l = i_lgr // (G * n_rb)
    i_g = (i_lgr // n_rb) % G
    i_rb = i_lgr % n_rb
    b_q, i_w, m_m = _load_q(q_ptr, i_l, i_g, i_rb, r, w, d, stride_ql, stride_qh, stride_qw,
                            R_BLK, W_PAD, D_PAD)  # fmt: skip
    b_s, o_n = _logits(b_q, k_ptr, i_l, i_g, i_t, n, w, d, i_w, qk_scale,
                       stride_kl, stride_kg, stride_kn, BLOCK_N, D_PAD, DOT_FP32)  # fmt: skip
    o_m = tl.arange(0, R_BLK * W_PAD)
    b_lse = tl.load(lse_ptr + i_lgr * (R_BLK * W_PAD) + o_m)  # [M]
    # exp2(s - lse) <= 1: the normalised probability, 0 where masked (exp2(-inf)).
    b_p = tl.exp2(b_s - b_lse[:, None])
    b_p = tl.where(m_m[:, None], b_p, 0.0)  # [M, N]
    b_a = tl.reduce(tl.reshape(b_p, (R_BLK, W_PAD, BLOCK_N)), 1, SUM) / w  # [R_BLK, N]
    o_r = i_rb * R_BLK + tl.arange(0, R_BLK)
    o_h = i_g * r + o_r  # [R_BLK] query heads
    m_r = o_r < r
    m_n = o_n < n
    p_prof = prof_ptr + (i_l * H + o_h)[:, None].to(tl.int64) * n + o_n[None, :]
    tl.store(p_prof, b_a, mask=m_r[:, None] & m_n[None, :])  # writes R_BLK * BLOCK_N * 4 bytes
    # Partial sums of this tile, per head: [sink, rest, rest^2, all^2].
    is_sink = (o_n < n_sink)[None, :]
    is_rest = ((o_n >= n_sink) & m_n)[None, :]
    b_sink = tl.reduce(tl.where(is_sink, b_a, 0.0), 1, SUM)
    b_rest = tl.reduce(tl.where(is_rest, b_a, 0.0), 1, SUM)
    b_sq_rest = tl.reduce(tl.where(is_rest, b_a * b_a, 0.0), 1, SUM)
    b_sq_all = tl.reduce(b_a * b_a, 1, SUM)  # b_a is 0 past n
    p_part = part_ptr + ((i_l * H + o_h).to(tl.int64) * n_tiles + i_t) * 4
    tl.store(p_part + 0, b_sink, mask=m_r)
    tl.store(p_part + 1, b_rest, mask=m_r)
    tl.store(p_part + 2, b_sq_rest, mask=m_r)
    tl.store(p_part + 3, b_sq_all, mask=m_r)


def default_blocks(device: torch.device, interpreted: bool) -> tuple[int, int]:
    """(BLOCK_N, max rows per program): small tiles on a GPU, large in the interpreter
    (it pays per program, not per element)."""
    if interpreted:
        return 256, 1024
    return 64, 256


def score_layers(
    q_win: torch.Tensor,
    keys: torch.Tensor,
    n_sink: int,
    scale: float | None = None,
    block_n: int | None = None,
    tiles_per_split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Profiles and per-head mass sums of every layer in two launches.

    Args:
        q_win: `[L, H, w, d]` (or `[H, w, d]` for one layer) window queries after RoPE.
        keys: `[L, G, n, d]` (or `[G, n, d]`) cached keys; float32, float16 or
            bfloat16 (fp16/bf16 with matching queries use the native dot, fp32
            accumulation); `H % G == 0`, `1 <= w <= n`.
        n_sink: number of sink tokens (`>= 0`).
        scale: softmax scale, default `1 / sqrt(d)`.
        block_n: key tile (a power of two >= 16); default by device.
        tiles_per_split: key tiles per pass-1 program; default fills the GPU.

    Returns:
        `(profiles [L, H, n], sums [L, H, 4])`, float32; the columns of `sums` are the
        sink mass, non-sink mass, non-sink squares and all squares of each head's
        profile (`pagekv.maths.entropy.MASS_SUMS`; 3-D inputs give `L = 1`).
    """
    if q_win.dim() == 3 and keys.dim() == 3:
        q_win, keys = q_win[None], keys[None]
    L, H, w, d, G, n = check_window_shapes(q_win, keys)
    if q_win.dtype not in FLOAT_DTYPES or keys.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"q_win and keys must be float32, float16 or bfloat16; got {q_win.dtype}, {keys.dtype}"
        )
    if n_sink < 0:
        raise ValueError(f"n_sink must be >= 0; got {n_sink}")
    device = check_same_device(q_win=q_win, keys=keys)
    # The kernels address the head dimension with unit stride.
    q_win = q_win if q_win.stride(-1) == 1 else q_win.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()

    interpreted = is_interpreted(_profile_kernel)
    dflt_n, max_rows = default_blocks(device, interpreted)
    BLOCK_N = block_n or dflt_n
    if BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block_n must be a power of two >= 16; got {BLOCK_N}")
    r = H // G
    W_PAD = max(next_pow2(w), 16)  # tl.dot needs >= 16 rows
    R_BLK = max(1, min(next_pow2(r), max_rows // W_PAD))
    n_rb = triton.cdiv(r, R_BLK)
    M = R_BLK * W_PAD
    D_PAD = max(next_pow2(d), 16)
    n_tiles = triton.cdiv(n, BLOCK_N)
    if tiles_per_split is None:
        if interpreted:
            tiles_per_split = n_tiles  # one program per row block: fewest Python steps
        else:
            # Aim at ~8 programs per SM-ish worth of work; at least 4 tiles each.
            target = 1024
            tiles_per_split = max(4, triton.cdiv(n_tiles * L * G * n_rb, target))
    tiles_per_split = max(1, min(int(tiles_per_split), n_tiles))
    n_splits = triton.cdiv(n_tiles, tiles_per_split)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qk_scale = scale * LOG2E
    # Mixed dtypes (say fp32 queries, bf16 cache) take the fp32 dot too, like the twin.
    dot_fp32 = (
        interpreted or torch.float32 in (q_win.dtype, keys.dtype) or q_win.dtype != keys.dtype
    )
    rows = L * G * n_rb

    part_m = torch.empty(rows, n_splits, M, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    common = dict(R_BLK=R_BLK, W_PAD=W_PAD, D_PAD=D_PAD, BLOCK_N=BLOCK_N, DOT_FP32=dot_fp32)
    if not interpreted:
        common["num_warps"] = 8 if M >= 128 else 4
    _stats_kernel[(rows, n_splits)](
        q_win, keys, part_m, part_l, n, w, d, r, G, n_rb, n_tiles, tiles_per_split, qk_scale,
        q_win.stride(0), q_win.stride(1), q_win.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        **common,
    )  # fmt: skip
    # Merge the splits: lse = M + log2(sum_s l_s 2^(m_s - M)); empty splits have l_s = 0.
    m_max = part_m.amax(1, keepdim=True)  # [rows, 1, M]
    total = (part_l * torch.exp2(part_m - m_max)).sum(1)  # [rows, M]
    lse = (m_max.squeeze(1) + torch.log2(total)).contiguous()  # [rows, M]
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # padding rows only

    profiles = torch.empty(L, H, n, dtype=torch.float32, device=device)
    part = torch.empty(L, H, n_tiles, 4, dtype=torch.float32, device=device)
    _profile_kernel[(rows, n_tiles)](
        q_win, keys, lse, profiles, part, n, w, d, r, G, H, n_rb, n_tiles, n_sink, qk_scale,
        q_win.stride(0), q_win.stride(1), q_win.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        **common,
    )  # fmt: skip
    return profiles, part.sum(2)  # [L, H, 4]
