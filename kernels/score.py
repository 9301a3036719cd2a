"""Scoring kernel: attention profiles, sink mass and collision masses in two passes.

Torch twin: `pagekv.maths.profiles.attention_profiles` followed by
`pagekv.maths.entropy.mass_sums` (this module imports nothing from `pagekv`; the
conversion of the sums into head weights, with its guard, lives in the core:
`pagekv.maths.entropy.HeadMasses.from_sums`). With `return_max=True` it also gives the
largest probability any query puts on each key (twin: the torch path of
`pagekv.runtime.backend.attention_scores`, which the reconstruction scorer uses).

For every layer `l`, group `g` and query head `h` of the group (GQA: head `h`
reads KV group `h // r`), with query `i` of the `w` queries at position `n - w + i`
seeing the keys `t <= n - w + i` (causal):

    a_h(t) = (1 / w) sum_i softmax_t(q_{h,i} . k_g(t) * scale)
    top_h(t) = max_i softmax_t(q_{h,i} . k_g(t) * scale)        (return_max only)

Layers. The keys of each layer are their own tensor (a model's cache), read through a
table of the layers' addresses (int64 `[L]`, the pointer-array pattern of
`kernels/compact.py`), and each layer has its own softmax scale (float32 `[L]`): every
layer of a cache is scored in one launch pair, with no stacked copy of the keys. A
stacked `[L, G, n, d]` tensor is addressed the same way.

Rows. A program's rows are `R_BLK` heads of one group times `W_BLK` queries,
`M = R_BLK * W_BLK <= max_rows`, with `R_BLK = min(next_pow2(r), max_rows // 16)` and
`W_BLK = 16` for a window of at most 16 queries (`tl.dot` needs 16 rows), else
`max_rows // R_BLK` (`row_blocks`). A window longer than that is cut into
`n_qb = ceil(w / W_BLK)` query blocks. So a launcher chooses at most two row shapes per
head count, whatever the window: a GPU compiles (and `tests/test_kernel_compile.py`
checks) a handful of configurations, not one per window length. `max_rows`, the key
tile and the compile options come from the target, the dtypes and the head dim
(`score_launch`).

Pass 1 (`_stats_kernel`, grid `[L * G * head blocks * query blocks, splits]`) streams
key tiles `[BLOCK_N, d]` and keeps, per (head, query) row, the running max `m` and the
running sum `l = sum exp(s - m)` (online softmax: when the max grows by `D`, the old
sum is rescaled by `exp(-D)`, so no `exp` ever sees a positive argument). The stats are
per row, so query blocks are independent programs; each stops at the last key tile
its last query sees (the causal skip). Each split of the key axis writes its
`(m, l)`; the host merges the splits into the row's log-sum-exp `lse = m + log(l)`
(a `[L * G * head blocks, query blocks, M]` tensor, tiny next to K).

Pass 2 (`_profile_kernel`, grid `[L * G * head blocks, key tiles / tiles_per_prog]`)
streams a run of `tiles_per_prog` key tiles (a runtime argument, `profile_tiles`). With
one query block (a window of at most `W_BLK` queries, the usual case) it loads the
queries and their log-sum-exps once, and per key tile recomputes the logits `[M, BLOCK_N]`,
turns them into probabilities `exp(s - lse)` (each <= 1, exact normalisation, no
division) and sums them over the block's queries (and, with `return_max`, compiled in
as `WITH_MAX`, takes their max): a loop the compiler pipelines, the next tile's load
under this one's arithmetic. With several query blocks, per key tile it LOOPS over the
query blocks, in index order, from the first block whose last query sees the tile,
adding each block's sum into a `[R_BLK, BLOCK_N]` accumulator. Either way it then holds
the tile of the averaged profile, writes it, and writes the tile's four partial sums
per head: sink mass, non-sink mass, non-sink squares and all squares; the host adds the
tiles (a `[L, H, tiles, 4]` buffer) into `[L, H, 4]`.

Why the merge across query blocks happens inside one program (and not by writing one
partial profile per query block and reducing them afterwards):
- the four mass sums are functions of the AVERAGED profile (squares of the mean, not
  means of squares), so they need the merged tile; merged in the program, they are
  formed exactly as in the one-block case, with no second launch and no torch pass
  over `[L, H, n]`;
- it is deterministic (a fixed loop order, no atomics) and needs no extra memory,
  where per-block partials would cost `n_qb` profile-sized buffers (`n_qb L H n 4`
  bytes, 700 MB at 28 layers, 12 heads, 128k keys and 4 blocks);
- the key tile is read from memory once and reused by every query block.
The price is parallelism: the grid does not grow with `n_qb`. It does not need to:
the key-tile axis already gives `L G n_rb n / (BLOCK_N tiles_per_prog)` programs, and a
long query set means more work per program, not fewer programs than before.

No program holds more than one key tile and `M <= max(max_rows, 16)` query rows.

Memory traffic (bytes a perfect implementation must move, element size `e`):
pass 1 reads K once (`L G n d e`), pass 2 reads K again and writes the profiles
(`L H n 4`, and the maxima with `return_max`); the queries (`L H w d e`) are re-read
by every key tile (from the cache hierarchy) and the partial buffers are negligible.
Work: each pass computes the logits, `2 L H w n d` flops (the causal triangle counted
full), and `L H w n` exp2 each. At the default window (w = 32) and r = 6 that is about
180 flops per byte of K in bf16, near an H200's ridge point (989 TFLOP/s over
4.8 TB/s, about 206), and the exp2 on the special function units take about as long:
`benchmarks/bench_kernels.py` reports the three bounds (`roofline`).

All logits are kept in base 2 (`qk_scale = scale * log2(e)`, `exp2`), the usual
trick that saves a multiply per element; the result is the same softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    LOG2E,
    MAX,
    NEG_BIG,
    SUM,
    TRITON_TYPES,
    Launch,
    aligned,
    check_same_device,
    check_window_shapes,
    is_interpreted,
    next_pow2,
    to_device,
)
from .targets import Target, target_of


@triton.jit
def _load_q(q_ptr, i_l, i_g, i_rb, i_qb, r, w, d, stride_ql, stride_qh, stride_qw,
            R_BLK: tl.constexpr, W_BLK: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    # Rows of the (head block, query block): row m is head i_rb * R_BLK + m // W_BLK of
    # the group, query i_qb * W_BLK + m % W_BLK. Padding rows (head >= r or query >= w)
    # load zeros.
    o_m = tl.arange(0, R_BLK * W_BLK)  # [M]
    i_r = i_rb * R_BLK + o_m // W_BLK
    i_w = i_qb * W_BLK + o_m % W_BLK
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
def _layer_keys(ktab_ptr, i_l, K_ELEM: tl.constexpr):
    # The layer's keys: an address from the table (the launcher checks every address is
    # 16-byte aligned, so the hint lets the loads of a row be vectorised).
    return tl.multiple_of(tl.load(ktab_ptr + i_l).to(tl.pointer_type(K_ELEM)), 16)


@triton.jit
def _load_k(p_kl, i_g, i_t, n, d, stride_kg, stride_kn,
            BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):  # fmt: skip
    # One key tile [BLOCK_N, D] of the layer's keys `p_kl`; reads BLOCK_N * d * e bytes.
    o_n = i_t * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, D_PAD)
    p_k = p_kl + i_g.to(tl.int64) * stride_kg + o_n[:, None].to(tl.int64) * stride_kn + o_d[None, :]
    b_k = tl.load(p_k, mask=(o_n < n)[:, None] & (o_d < d)[None, :], other=0.0)  # [N, D]
    return b_k, o_n


@triton.jit
def _logits(b_q, b_k, o_n, n, w, i_w, qk_scale, DOT_FP32: tl.constexpr):
    # Logits of one key tile in base 2, causal and length masked: [M, BLOCK_N].
    if DOT_FP32:
        # fp32 inputs (exact fp32 products, no tf32) and the interpreter (numpy has
        # no bfloat16 matmul) take this branch.
        b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
    else:
        # fp16/bf16 products are exact in fp32, and the dot accumulates in fp32.
        b_s = tl.dot(b_q, tl.trans(b_k))
    b_s = b_s * qk_scale  # [M, N]
    pos_q = n - w + i_w  # [M] position of each query
    visible = (o_n[None, :] <= pos_q[:, None]) & (o_n < n)[None, :]
    return tl.where(visible, b_s, float("-inf"))


@triton.jit
def _stats_kernel(q_ptr, ktab_ptr, scale_ptr, m_ptr, l_ptr, n, w, d, r, G, n_rb, n_qb, n_tiles,
                  tiles_per_split, stride_ql, stride_qh, stride_qw, stride_kg, stride_kn,
                  R_BLK: tl.constexpr, W_BLK: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                  K_ELEM: tl.constexpr):  # fmt: skip
    i_p = tl.program_id(0)  # (layer, group, head block, query block)
    i_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    i_qb = i_p % n_qb
    i_lgr = i_p // n_qb
    i_l = i_lgr // (G * n_rb)
    i_g = (i_lgr // n_rb) % G
    i_rb = i_lgr % n_rb
    p_kl = _layer_keys(ktab_ptr, i_l, K_ELEM)
    qk_scale = tl.load(scale_ptr + i_l)  # the layer's softmax scale times log2(e)
    b_q, i_w, m_m = _load_q(q_ptr, i_l, i_g, i_rb, i_qb, r, w, d, stride_ql, stride_qh,
                            stride_qw, R_BLK, W_BLK, D_PAD)  # fmt: skip
    b_m = tl.full([R_BLK * W_BLK], NEG_BIG, tl.float32)  # running max (base-2 logits)
    b_l = tl.full([R_BLK * W_BLK], 0.0, tl.float32)  # running sum of exp2(s - b_m)
    # Causal skip: no query of the block sees a key past its last row's position
    # n - w + (i_qb + 1) * W_BLK - 1 (past n - 1 for a padded last block: n_tiles bounds).
    t_end = (n - w + (i_qb + 1) * W_BLK - 1) // BLOCK_N + 1
    t_lo = i_s * tiles_per_split
    t_hi = tl.minimum(tl.minimum(t_lo + tiles_per_split, n_tiles), t_end)
    for i_t in range(t_lo, t_hi):
        b_k, o_n = _load_k(p_kl, i_g, i_t, n, d, stride_kg, stride_kn, BLOCK_N, D_PAD)
        b_s = _logits(b_q, b_k, o_n, n, w, i_w, qk_scale, DOT_FP32)
        b_mn = tl.maximum(b_m, tl.reduce(b_s, 1, MAX))
        # Online update: rescale the old sum to the new max, then add this tile.
        b_l = b_l * tl.exp2(b_m - b_mn) + tl.reduce(tl.exp2(b_s - b_mn[:, None]), 1, SUM)
        b_m = b_mn
    o_m = tl.arange(0, R_BLK * W_BLK)
    p_out = (i_p * n_splits + i_s).to(tl.int64) * (R_BLK * W_BLK) + o_m
    tl.store(m_ptr + p_out, b_m)
    tl.store(l_ptr + p_out, b_l)


@triton.jit
def _profile_probs(b_q, b_k, o_n, b_lse, m_m, n, w, i_w, qk_scale,
                   R_BLK: tl.constexpr, W_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_FP32: tl.constexpr):  # fmt: skip
    # One query block's normalised probabilities on one key tile, [R_BLK, W_BLK, N]:
    # exp2(s - lse) <= 1, 0 where masked (exp2(-inf)) and on padding rows.
    b_s = _logits(b_q, b_k, o_n, n, w, i_w, qk_scale, DOT_FP32)
    b_p = tl.where(m_m[:, None], tl.exp2(b_s - b_lse[:, None]), 0.0)  # [M, N]
    return tl.reshape(b_p, (R_BLK, W_BLK, BLOCK_N))


@triton.jit
def _write_tile(b_sum, b_top, prof_ptr, top_ptr, part_ptr, o_n, i_t, i_l, i_g, i_rb,
                n, w, r, H, n_tiles, n_sink, R_BLK: tl.constexpr,
                WITH_MAX: tl.constexpr):  # fmt: skip
    # The tile of the averaged profile (and of the maxima), and its four partial sums
    # per head: [sink, rest, rest^2, all^2].
    b_a = b_sum / w  # [R_BLK, N]
    o_r = i_rb * R_BLK + tl.arange(0, R_BLK)
    o_h = i_g * r + o_r  # [R_BLK] query heads
    m_r = o_r < r
    m_n = o_n < n
    p_prof = (i_l * H + o_h)[:, None].to(tl.int64) * n + o_n[None, :]
    m_out = m_r[:, None] & m_n[None, :]
    tl.store(prof_ptr + p_prof, b_a, mask=m_out)  # writes R_BLK * BLOCK_N * 4 bytes
    if WITH_MAX:
        tl.store(top_ptr + p_prof, b_top, mask=m_out)
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


@triton.jit(do_not_specialize=["tiles_per_prog"])  # a run length: one compile for any
def _profile_kernel(q_ptr, ktab_ptr, scale_ptr, lse_ptr, prof_ptr, top_ptr, part_ptr, n, w, d,
                    r, G, H, n_rb, n_qb, n_tiles, tiles_per_prog, n_sink, stride_ql,
                    stride_qh, stride_qw, stride_kg, stride_kn, R_BLK: tl.constexpr,
                    W_BLK: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_FP32: tl.constexpr, K_ELEM: tl.constexpr,
                    WITH_MAX: tl.constexpr):  # fmt: skip
    # WITH_MAX (the maxima too, for the reconstruction scorer) is compiled in or out:
    # as a runtime flag its registers stayed live in the profile-only launch, which then
    # spilled at the pilot's launch on sm_90 (255 registers and 56 bytes of stack a
    # thread; 254 and none without it; `benchmarks/tune_score.py --resources`).
    i_lgr = tl.program_id(0)
    i_c = tl.program_id(1)  # this program's run of `tiles_per_prog` key tiles
    i_l = i_lgr // (G * n_rb)
    i_g = (i_lgr // n_rb) % G
    i_rb = i_lgr % n_rb
    p_kl = _layer_keys(ktab_ptr, i_l, K_ELEM)
    qk_scale = tl.load(scale_ptr + i_l)
    o_m = tl.arange(0, R_BLK * W_BLK)
    t_lo = i_c * tiles_per_prog
    t_hi = tl.minimum(t_lo + tiles_per_prog, n_tiles)
    if n_qb == 1:
        # One query block (the usual window): its queries and log-sum-exps are loaded
        # once and the key tiles stream past them (a loop the compiler pipelines).
        b_q, i_w, m_m = _load_q(q_ptr, i_l, i_g, i_rb, 0, r, w, d, stride_ql, stride_qh,
                                stride_qw, R_BLK, W_BLK, D_PAD)  # fmt: skip
        b_lse = tl.load(lse_ptr + i_lgr.to(tl.int64) * (R_BLK * W_BLK) + o_m)
        for i_t in range(t_lo, t_hi):
            b_k, o_n = _load_k(p_kl, i_g, i_t, n, d, stride_kg, stride_kn, BLOCK_N, D_PAD)
            b_p3 = _profile_probs(b_q, b_k, o_n, b_lse, m_m, n, w, i_w, qk_scale, R_BLK, W_BLK,
                                  BLOCK_N, DOT_FP32)  # fmt: skip
            b_sum = tl.reduce(b_p3, 1, SUM)  # [R_BLK, N]
            b_top = b_sum
            if WITH_MAX:
                b_top = tl.reduce(b_p3, 1, MAX)
            _write_tile(b_sum, b_top, prof_ptr, top_ptr, part_ptr, o_n, i_t, i_l, i_g, i_rb, n,
                        w, r, H, n_tiles, n_sink, R_BLK, WITH_MAX)  # fmt: skip
    else:
        for i_t in range(t_lo, t_hi):
            b_k, o_n = _load_k(p_kl, i_g, i_t, n, d, stride_kg, stride_kn, BLOCK_N, D_PAD)
            b_sum = tl.zeros([R_BLK, BLOCK_N], dtype=tl.float32)  # over the queries so far
            b_top = tl.zeros([R_BLK, BLOCK_N], dtype=tl.float32)  # max over them so far
            # Query blocks in index order, from the first one with a query that sees the
            # tile (query i sees key t0 = i_t * BLOCK_N iff i >= t0 - (n - w)); the last
            # block sees every key < n, so the loop runs at least once.
            qb_lo = tl.maximum(i_t * BLOCK_N - (n - w), 0) // W_BLK
            for i_qb in range(qb_lo, n_qb):
                b_q, i_w, m_m = _load_q(q_ptr, i_l, i_g, i_rb, i_qb, r, w, d, stride_ql,
                                        stride_qh, stride_qw, R_BLK, W_BLK, D_PAD)  # fmt: skip
                p_lse = lse_ptr + (i_lgr * n_qb + i_qb).to(tl.int64) * (R_BLK * W_BLK) + o_m
                b_p3 = _profile_probs(b_q, b_k, o_n, tl.load(p_lse), m_m, n, w, i_w, qk_scale,
                                      R_BLK, W_BLK, BLOCK_N, DOT_FP32)  # fmt: skip
                b_sum += tl.reduce(b_p3, 1, SUM)
                if WITH_MAX:
                    b_top = tl.maximum(b_top, tl.reduce(b_p3, 1, MAX))
            _write_tile(b_sum, b_top, prof_ptr, top_ptr, part_ptr, o_n, i_t, i_l, i_g, i_rb, n,
                        w, r, H, n_tiles, n_sink, R_BLK, WITH_MAX)  # fmt: skip


#: The Triton element type of each key dtype (`K_ELEM`).
_K_ELEM = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class ScoreLaunch:
    """The blocks and options of one scoring launch pair (`score_launch`)."""

    W_BLK: int  # query rows per query block
    n_qb: int  # query blocks
    R_BLK: int  # heads per head block
    n_rb: int  # head blocks per group
    BLOCK_N: int  # keys per tile
    D_PAD: int  # the head dim padded to a power of two
    DOT_FP32: bool  # fp32 products (fp32 or mixed inputs, and the interpreter)
    num_warps: int
    stages: tuple  # num_stages of (pass 1, pass 2)

    @property
    def rows(self) -> int:
        return self.R_BLK * self.W_BLK

    def launches(
        self, q_dtype: torch.dtype, k_dtype: torch.dtype, with_max: bool = False
    ) -> tuple[Launch, Launch]:
        """The two kernels' `Launch` records (what the launcher passes, and what
        `kernels/aot.py` compiles); `with_max` compiles pass 2 with the maxima."""
        consts = (("R_BLK", self.R_BLK), ("W_BLK", self.W_BLK), ("D_PAD", self.D_PAD),
                  ("BLOCK_N", self.BLOCK_N), ("DOT_FP32", self.DOT_FP32),
                  ("K_ELEM", _K_ELEM[k_dtype]))  # fmt: skip
        head = (
            ("q_ptr", f"*{TRITON_TYPES[q_dtype]}"),
            ("ktab_ptr", "*i64"),
            ("scale_ptr", "*fp32"),
        )
        strides = ("stride_ql", "stride_qh", "stride_qw", "stride_kg", "stride_kn")

        def launch(kernel: str, ptrs: tuple, stages: int, more: tuple = ()) -> Launch:
            types = (*head, *((p, "*fp32") for p in ptrs))
            aligned = (*(p for p, _ in types), *strides)
            return Launch(__name__, kernel, types, consts + more, self.num_warps, stages,
                          aligned=aligned)  # fmt: skip

        return (
            launch("_stats_kernel", ("m_ptr", "l_ptr"), self.stages[0]),
            launch(
                "_profile_kernel",
                ("lse_ptr", "prof_ptr", "top_ptr", "part_ptr"),
                self.stages[1],
                (("WITH_MAX", bool(with_max)),),
            ),
        )


def row_blocks(
    w: int, r: int, max_rows: int, block_w: int | None = None, tight: bool = False
) -> tuple[int, ...]:
    """How `w` queries of `r` heads per group are cut into program rows (the module
    docstring, "Rows"): `(W_BLK, n_qb, R_BLK, n_rb)`, query rows per block, query blocks,
    heads per block, head blocks. With `tight` (the interpreter, which compiles nothing
    but pays for padding rows) `W_BLK = next_pow2(w)` within `[16, max_rows // R_BLK]`;
    `block_w` (a power of two >= 16) overrides `W_BLK`."""
    R_BLK = max(1, min(next_pow2(r), max_rows // 16))
    if block_w is None and tight:
        W_BLK = max(min(next_pow2(w), max_rows // R_BLK), 16)
    elif block_w is None:
        W_BLK = 16 if w <= 16 else max(max_rows // R_BLK, 16)  # tl.dot needs >= 16 rows
    else:
        W_BLK = int(block_w)
        if W_BLK < 16 or W_BLK & (W_BLK - 1):
            raise ValueError(f"block_w must be a power of two >= 16; got {block_w}")
        R_BLK = max(1, min(R_BLK, max_rows // W_BLK))
    n_qb = -(-w // W_BLK)
    n_rb = -(-r // R_BLK)
    return W_BLK, n_qb, R_BLK, n_rb


def _shared_estimate(rows: int, block_n: int, d_pad: int, elem: int, stages: int = 1) -> int:
    """A bound of a scoring program's shared memory at the dot's element size, fitted to
    the compiled figures (`kernels/aot.py`, every size a multiple of 16 so that the loops
    pipeline): its query rows once per pipeline stage (pass 2's loop over query blocks
    buffers them) and two key tiles. For example sm_90, bf16, head dim 128, 256 rows of
    64-key tiles: 217,088 bytes compiled at 3 stages, 229,376 estimated; 151,552 and
    163,840 at 2. `tests/test_kernel_compile.py` compiles every launch the launcher
    chooses, so an estimate below a compiled figure fails there."""
    return (stages * rows + 2 * block_n) * d_pad * elem


def score_launch(
    target: Target,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
    d: int,
    r: int,
    w: int,
    block_n: int | None = None,
    block_w: int | None = None,
) -> ScoreLaunch:
    """The blocks a scoring launch uses on `target` for these dtypes and shapes.

    - The interpreter: 256-key tiles and up to 1024 rows (it pays per program and per
      loop step, hardly per element), the fp32 dot (numpy has no bfloat16 matmul).
    - fp16/bf16 queries over keys of the same dtype on a GPU: the native dot (fp32
      accumulation), 64-key tiles and the most rows of 256, 128, ... whose shared
      memory (`_shared_estimate`) fits the target, at the most pipeline stages of 3, 2,
      1 that fit with them; 8 warps from 128 rows. On an H200 at the pilot's shapes
      (256 rows, head dim 128: 3 stages) `benchmarks/tune_score.py` timed this fastest
      of 21 options (docs/tune_score.json).
    - fp32, or mixed dtypes (say fp32 queries over a bf16 cache), on a GPU: the fp32 dot
      (exact products, no tf32), 32-key tiles and 32 rows (it unrolls into FMAs).

    Raises ValueError when not even 16 rows fit (a head dim far beyond any model's).
    """
    D_PAD = max(next_pow2(d), 16)
    if target.interpreted:
        BLOCK_N, max_rows, warps, stages, dot_fp32 = block_n or 256, 1024, 4, (1, 1), True
    else:
        dot_fp32 = torch.float32 in (q_dtype, k_dtype) or q_dtype != k_dtype
        elem = 4 if dot_fp32 else 2
        BLOCK_N = block_n or (32 if dot_fp32 else 64)
        fitting = [
            (m, st)
            for m in ((32, 16) if dot_fp32 else (256, 128, 64, 32, 16))
            for st in ((1,) if dot_fp32 else (3, 2, 1))
            if _shared_estimate(m, BLOCK_N, D_PAD, elem, st) <= target.shared_bytes
        ]
        if not fitting:
            raise ValueError(
                f"no scoring block fits {target.name}'s {target.shared_bytes} bytes of shared "
                f"memory at head dim {d} with {BLOCK_N}-key tiles"
            )
        max_rows, st = fitting[0]  # the most rows, then the most stages
        stages = (st, st)
        warps = 8 if max_rows >= 128 else 4
    if BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block_n must be a power of two >= 16; got {BLOCK_N}")
    W_BLK, n_qb, R_BLK, n_rb = row_blocks(w, r, max_rows, block_w, tight=target.interpreted)
    if not target.interpreted and R_BLK * W_BLK < max_rows:
        warps = 8 if R_BLK * W_BLK >= 128 else 4
    return ScoreLaunch(W_BLK, n_qb, R_BLK, n_rb, BLOCK_N, D_PAD, dot_fp32, warps, stages)


#: Pass-2 programs a compiled launch aims at (`profile_tiles`): some waves of an H200's
#: 132 SMs, each program streaming its key tiles past one set of query rows.
PROFILE_PROGRAMS = 2048
#: The most key tiles one pass-2 program streams.
PROFILE_TILES_MAX = 16


def profile_tiles(n_tiles: int, rows: int, interpreted: bool) -> int:
    """Key tiles per pass-2 program: on a GPU, enough that `rows` times the programs per
    row come to about `PROFILE_PROGRAMS`, at most `PROFILE_TILES_MAX` (1 for few tiles);
    interpreted, one (the interpreter pays per loop step as per program)."""
    if interpreted:
        return 1
    return max(1, min(PROFILE_TILES_MAX, -(-n_tiles * rows // PROFILE_PROGRAMS)))


def _layer_list(keys) -> list[torch.Tensor]:
    """`[L, G, n, d]` or a sequence of `[G, n, d]` / `[1, G, n, d]` -> `[G, n, d]` views."""
    if isinstance(keys, torch.Tensor):
        if keys.dim() == 3:
            return [keys]
        if keys.dim() != 4:
            raise ValueError(f"keys must be [L, G, n, d]; got {tuple(keys.shape)}")
        return list(keys.unbind(0))
    out = [k[0] if k.dim() == 4 and k.shape[0] == 1 else k for k in keys]
    if not out or any(k.dim() != 3 for k in out):
        raise ValueError("keys must be [L, G, n, d] or one [G, n, d] tensor per layer")
    return out


def _key_table(layers: list[torch.Tensor], device: torch.device):
    """Per-layer keys with one set of (group, token) strides and 16-byte aligned rows, and
    the int64 table of their addresses on `device` (copied without a host wait)."""
    first = layers[0]
    for i, k in enumerate(layers):
        if k.shape != first.shape or k.dtype != first.dtype:
            raise ValueError(
                f"layer {i}: keys {tuple(k.shape)} {k.dtype}; layer 0 has "
                f"{tuple(first.shape)} {first.dtype}"
            )
        check_same_device(keys=k, first=first)
    strides = first.stride()
    if strides[-1] != 1 or any(k.stride() != strides for k in layers):
        layers = [k.contiguous() for k in layers]
    layers = aligned(layers)  # the kernel's hint (`_layer_keys`)
    return layers, to_device(torch.tensor([k.data_ptr() for k in layers]), device)


def score_layers(
    q_win: torch.Tensor,
    keys: torch.Tensor | Sequence[torch.Tensor],
    n_sink: int,
    scale: float | Sequence[float] | None = None,
    block_n: int | None = None,
    tiles_per_split: int | None = None,
    *,
    block_w: int | None = None,
    return_max: bool = False,
    tiles_per_prog: int | None = None,
    launch: ScoreLaunch | None = None,
) -> tuple[torch.Tensor, ...]:
    """Profiles and per-head mass sums of every layer in two launches.

    Args:
        q_win: `[L, H, w, d]` (or `[H, w, d]` for one layer) queries after RoPE, query
            `i` at position `n - w + i` (the window, or a reconstruction chunk).
        keys: `[L, G, n, d]` (or `[G, n, d]`) cached keys, or one `[G, n, d]` (or
            `[1, G, n, d]`) tensor per layer, as a model's cache holds them (no stacked
            copy is made); float32, float16 or bfloat16 (fp16/bf16 with queries of the
            same dtype use the native dot, fp32 accumulation); `H % G == 0`,
            `1 <= w <= n`.
        n_sink: number of sink tokens (`>= 0`).
        scale: softmax scale, one for all layers or one per layer; default `1 / sqrt(d)`.
        block_n: key tile (a power of two >= 16); default by target (`score_launch`).
        tiles_per_split: key tiles per pass-1 program; default fills the GPU.
        block_w: query rows per query block (a power of two >= 16); default by
            `row_blocks`. Any value gives the same results up to float rounding.
        return_max: also return the largest probability of any query on each key.
        tiles_per_prog: key tiles per pass-2 program; default `profile_tiles`.
        launch: the blocks and compile options, instead of `score_launch`'s (for
            `benchmarks/tune_score.py`; the compile check covers only the launcher's own).

    Returns:
        `(profiles [L, H, n], sums [L, H, 4])`, float32, and `top [L, H, n]` float32
        third when `return_max`; the columns of `sums` are the sink mass, non-sink mass,
        non-sink squares and all squares of each head's profile
        (`pagekv.maths.entropy.MASS_SUMS`; 3-D inputs give `L = 1`).

    Host waits: none (the layer table and the scales are queued to the device).
    """
    if q_win.dim() == 3:
        q_win = q_win[None]
    layers = _layer_list(keys)
    L = len(layers)
    _, H, w, d, G, n = check_window_shapes(q_win.shape, (L, *layers[0].shape))
    k_dtype = layers[0].dtype
    if q_win.dtype not in FLOAT_DTYPES or k_dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"q_win and keys must be float32, float16 or bfloat16; got {q_win.dtype}, {k_dtype}"
        )
    if n_sink < 0:
        raise ValueError(f"n_sink must be >= 0; got {n_sink}")
    device = check_same_device(q_win=q_win, keys=layers[0])
    scales = [scale] * L if scale is None or isinstance(scale, (int, float)) else list(scale)
    if len(scales) != L:
        raise ValueError(f"need one scale per layer ({L}); got {len(scales)}")
    # The kernels address the head dimension with unit stride.
    q_win = q_win if q_win.stride(-1) == 1 else q_win.contiguous()
    layers, ktab = _key_table(layers, device)
    qk_scale = [(d**-0.5 if s is None else float(s)) * LOG2E for s in scales]
    scale_t = to_device(torch.tensor(qk_scale, dtype=torch.float32), device)

    interpreted = is_interpreted(_profile_kernel)
    target = target_of(device, interpreted)
    r = H // G
    cfg = launch or score_launch(target, q_win.dtype, k_dtype, d, r, w, block_n, block_w)
    stats, profile = cfg.launches(q_win.dtype, k_dtype, return_max)
    BLOCK_N, M, n_qb, n_rb = cfg.BLOCK_N, cfg.rows, cfg.n_qb, cfg.n_rb
    n_tiles = triton.cdiv(n, BLOCK_N)
    rows = L * G * n_rb  # pass-2 programs per key tile
    if tiles_per_split is None:
        if interpreted:
            tiles_per_split = n_tiles  # one program per row block: fewest Python steps
        else:
            # Aim at ~8 programs per SM-ish worth of work (1024 programs); at least 4 tiles.
            tiles_per_split = max(4, triton.cdiv(n_tiles * rows * n_qb, 1024))
    tiles_per_split = max(1, min(int(tiles_per_split), n_tiles))
    n_splits = triton.cdiv(n_tiles, tiles_per_split)
    k_strides = layers[0].stride()[:2]  # (group, token) of every layer

    part_m = torch.empty(rows * n_qb, n_splits, M, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    _stats_kernel[(rows * n_qb, n_splits)](
        q_win, ktab, scale_t, part_m, part_l, n, w, d, r, G, n_rb, n_qb, n_tiles,
        tiles_per_split, q_win.stride(0), q_win.stride(1), q_win.stride(2), *k_strides,
        **stats.kwargs(interpreted),
    )  # fmt: skip
    # Merge the splits: lse = M + log2(sum_s l_s 2^(m_s - M)); empty splits (past the
    # causal end or the last tile) have l_s = 0 and m_s = NEG_BIG.
    m_max = part_m.amax(1, keepdim=True)  # [rows * n_qb, 1, M]
    total = (part_l * torch.exp2(part_m - m_max)).sum(1)  # [rows * n_qb, M]
    lse = (m_max.squeeze(1) + torch.log2(total)).contiguous()  # [rows, n_qb, M] flat
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # padding rows only

    profiles = torch.empty(L, H, n, dtype=torch.float32, device=device)
    top = torch.empty_like(profiles) if return_max else profiles  # unused pointer without
    part = torch.empty(L, H, n_tiles, 4, dtype=torch.float32, device=device)
    per_prog = max(
        1, min(int(tiles_per_prog or profile_tiles(n_tiles, rows, interpreted)), n_tiles)
    )
    _profile_kernel[(rows, triton.cdiv(n_tiles, per_prog))](
        q_win, ktab, scale_t, lse, profiles, top, part, n, w, d, r, G, H, n_rb, n_qb, n_tiles,
        per_prog, n_sink, q_win.stride(0), q_win.stride(1), q_win.stride(2), *k_strides,
        **profile.kwargs(interpreted),
    )  # fmt: skip
    if return_max:
        return profiles, part.sum(2), top
    return profiles, part.sum(2)  # [L, H, 4]
