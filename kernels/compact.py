"""The gather kernel: the kept K/V tokens of every layer, copied to where they live next.

`gather_every_layer` (twin: `pagekv.runtime.backend.gather_layer`, per layer): a
model's cache is one tensor per layer, `[B, G, n, d]`, and per layer, per destination
row `r` and group `g`, `counts[r][g]` sorted kept indices in `[0, n)` name the tokens
to copy, to consecutive rows of a flat `[rows, d]` destination starting at
`starts[r][g]`. The paged decode cache (`pagekv.runtime.paged_cache.PagedCache`) is
such a destination: each (row, group)'s blocks are consecutive rows of its pool, so
eviction writes the kept pages straight into the pool, the one copy of K and V a run
makes. `compact_every_layer` is the dense case (`[B, G, k_l, d]` per layer, what
kvpress's pipeline keeps).

One launch gathers every layer: the launcher writes a table of the layers' addresses
and strides (int64 `[8, L]`: keys, values, indices, key out, value out, the (start,
count) pairs, the indices' row and group strides), copied to the device without a
host wait, and each program loads its layer's pointers from it (the pointer-array
pattern of Triton's grouped GEMM). One program copies `BLOCK_T` kept rows of K and of
V for one (layer, row, group). Destination rows may share one source batch row (two
evictions of one prefill decoded as a pair): the source's batch stride is then 0.

The kernel moves bits: it reads the tensors as same-width integers, so the copy is
exact for float32, float16 and bfloat16 alike. Memory traffic: read and write the kept
rows once, `2 (K and V) * 2 (read + write) * rows * d * e` bytes, plus the indices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._common import Launch, aligned, check_same_device, is_interpreted, next_pow2, to_device
from .targets import Target, target_of

#: The integer type the gather moves for each element size (`_gather_layers_kernel`'s
#: `ELEM`): the kernel copies bits.
_ELEM = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def gather_layers_launch(target: Target, elem_size: int, d: int) -> Launch:
    """`gather_every_layer`'s launch: `BLOCK_T` kept rows of `D_PAD` elements per
    program, moved as integers of `elem_size` bytes (no shared memory: a copy through
    registers), the layers' addresses read from a table."""
    return Launch(
        module=__name__,
        kernel="_gather_layers_kernel",
        types=(("tab_ptr", "*i64"),),
        constexprs=(
            ("ELEM", _ELEM[elem_size]),
            ("BLOCK_T", 256 if target.interpreted else 64),
            ("D_PAD", next_pow2(d)),
        ),  # fmt: skip
        aligned=("tab_ptr",),
    )


@triton.jit
def _gather_layers_kernel(tab_ptr, L, R, G, d, s_b, s_g, s_n,
                          ELEM: tl.constexpr, BLOCK_T: tl.constexpr,
                          D_PAD: tl.constexpr):  # fmt: skip
    # tab_ptr: int64 [8, L], rows: key, value, index, key out, value out addresses, the
    # address of the layer's int64 [R * G, 2] (start, count) pairs, and the index
    # tensor's row and group strides (a layer's indices may be a view of a wider one,
    # or one [G, k] shared by every row: row stride 0).
    i_lrg = tl.program_id(0)
    i_tb = tl.program_id(1)
    i_l = i_lrg // (R * G)
    i_r = (i_lrg // G) % R
    i_g = i_lrg % G
    # The launcher checks every address is 16-byte aligned: the hints let a row's loads
    # and stores be vectorised.
    p_k = tl.multiple_of(tl.load(tab_ptr + i_l).to(tl.pointer_type(ELEM)), 16)
    p_v = tl.multiple_of(tl.load(tab_ptr + L + i_l).to(tl.pointer_type(ELEM)), 16)
    p_i = tl.multiple_of(tl.load(tab_ptr + 2 * L + i_l).to(tl.pointer_type(tl.int64)), 16)
    p_ko = tl.multiple_of(tl.load(tab_ptr + 3 * L + i_l).to(tl.pointer_type(ELEM)), 16)
    p_vo = tl.multiple_of(tl.load(tab_ptr + 4 * L + i_l).to(tl.pointer_type(ELEM)), 16)
    p_m = tl.load(tab_ptr + 5 * L + i_l).to(tl.pointer_type(tl.int64))
    start = tl.load(p_m + 2 * (i_r * G + i_g))  # the first destination row
    count = tl.load(p_m + 2 * (i_r * G + i_g) + 1)  # this (row, group)'s kept tokens
    o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] kept slots
    o_d = tl.arange(0, D_PAD)
    m_t = o_t < count  # the grid covers the largest count; shorter ones mask the rest
    m_td = m_t[:, None] & (o_d < d)[None, :]
    s_ir = tl.load(tab_ptr + 6 * L + i_l)
    s_ig = tl.load(tab_ptr + 7 * L + i_l)
    b_idx = tl.load(p_i + i_r * s_ir + i_g * s_ig + o_t, mask=m_t, other=0)  # [BT]
    src = (
        i_r.to(tl.int64) * s_b
        + i_g.to(tl.int64) * s_g
        + b_idx[:, None].to(tl.int64) * s_n
        + o_d[None, :]
    )  # [BT, D]
    # The destination is flat [rows, d]: reads and writes 2 (K, V) * BT * d * e bytes.
    dst = (start + o_t[:, None]) * d + o_d[None, :]
    tl.store(p_ko + dst, tl.load(p_k + src, mask=m_td), mask=m_td)
    tl.store(p_vo + dst, tl.load(p_v + src, mask=m_td), mask=m_td)


def gather_every_layer(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    kept_idx: Sequence[torch.Tensor],
    out_keys: Sequence[torch.Tensor],
    out_values: Sequence[torch.Tensor],
    starts: Sequence,
    counts: Sequence,
) -> None:
    """Copy the kept tokens of every layer to their destination rows, in one launch.

    Args:
        keys, values: per layer `[B, G, n, d]`, one shape, dtype and device for all.
            `B` is the destinations' rows `R`, or 1 (every row reads batch row 0).
        kept_idx: per layer sorted indices in `[0, n)`: `[R, G, k]`, or `[G, k]` for
            every row alike; `k` may differ by layer, and a layer's may be a view of a
            wider tensor (its last dimension contiguous) or an expanded one.
        out_keys, out_values: per layer a contiguous destination in the keys' dtype,
            read as `[rows, d]`.
        starts, counts: per layer `[R][G]` host ints: (row r, group g)'s first
            `counts` indices go to destination rows `starts .. starts + counts - 1`.

    The one host wait is the bounds check of all the indices at once (one flag read
    back), whatever the number of layers.
    """
    L = len(keys)
    if L == 0 or not len(values) == len(kept_idx) == len(out_keys) == len(out_values) == L:
        raise ValueError(
            f"need one keys, values, kept_idx and output tensor per layer; got {L}, "
            f"{len(values)}, {len(kept_idx)}, {len(out_keys)} and {len(out_values)}"
        )
    first = keys[0]
    if first.dim() != 4:
        raise ValueError(f"keys must be [B, G, n, d] per layer; got {tuple(first.shape)}")
    B, G, n, d = first.shape
    R = len(counts[0])
    if B not in (1, R):
        raise ValueError(f"keys hold {B} batch rows for {R} destination rows")
    device = first.device
    meta = []  # per layer the (start, count) pairs of its R * G (row, group)s
    for i, (k, v, idx) in enumerate(zip(keys, values, kept_idx, strict=True)):
        if k.shape != first.shape or v.shape != first.shape:
            raise ValueError(
                f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be "
                f"{tuple(first.shape)}, layer 0's shape"
            )
        if k.dtype != first.dtype or v.dtype != first.dtype:
            raise ValueError(f"layer {i}: dtypes {k.dtype}, {v.dtype}; layer 0 has {first.dtype}")
        check_same_device(keys=k, values=v, first=first)
        if idx.dim() not in (2, 3) or idx.shape[-2] != G or (idx.dim() == 3 and idx.shape[0] != R):
            raise ValueError(
                f"layer {i}: kept_idx must be [G={G}, k] or [R={R}, G, k]; got {tuple(idx.shape)}"
            )
        width = int(idx.shape[-1])
        if any(c > width for row in counts[i] for c in row):
            raise ValueError(f"layer {i}: counts past the {width} indices")
        pairs = _pairs(starts[i], counts[i], R, G)
        meta.append(pairs)
        for out in (out_keys[i], out_values[i]):
            if not out.is_contiguous() or out.dtype != first.dtype or out.shape[-1] != d:
                raise ValueError(
                    f"layer {i}: outputs must be contiguous [rows, d={d}], {first.dtype}"
                )
            if out.data_ptr() % 16:  # the kernel's vectorisation hint (written in place)
                raise ValueError(f"layer {i}: outputs must start 16-byte aligned")
            if max(s + c for s, c in pairs) > out.numel() // d:
                raise ValueError(
                    f"layer {i}: destination rows past the output's {out.numel() // d}"
                )
    # One set of input strides for every layer: the cache's own (prefill layers are
    # contiguous), else contiguous copies.
    strides = first.stride()
    if strides[-1] != 1 or any(t.stride() != strides for t in (*keys, *values)):
        keys = [k.contiguous() for k in keys]
        values = [v.contiguous() for v in values]
        strides = keys[0].stride()
    s_b = strides[0] if B > 1 else 0
    if first.element_size() not in _ELEM:
        raise ValueError(f"unsupported element size {first.element_size()} for {first.dtype}")
    idx = [i.to(device=device, dtype=torch.int64) for i in kept_idx]
    idx = [i if i.stride(-1) == 1 else i.contiguous() for i in idx]
    k_max = max(c for layer in counts for row in layer for c in row)
    if k_max == 0:
        return
    # One check of all layers' indices at once, one read: indices of one shape but their
    # width joined as they are (no copy per layer), mixed shapes flattened first.
    flat = idx if len({i.shape[:-1] for i in idx}) == 1 else [i.reshape(-1) for i in idx]
    lo, hi = torch.aminmax(torch.cat(flat, dim=-1))
    if bool((lo < 0) | (hi >= n)):
        raise ValueError(f"kept_idx must lie in [0, n={n})")
    keys, values, idx = aligned(keys), aligned(values), aligned(idx)
    meta = torch.tensor(meta, dtype=torch.int64)  # [L, R * G, 2]
    meta = to_device(meta, device)  # alive until the launch is queued, as the table
    ptr = [[t.data_ptr() for t in col] for col in (keys, values, idx, out_keys, out_values)]
    ptr.append([meta[i].data_ptr() for i in range(L)])
    ptr.append([i.stride(0) if i.dim() == 3 else 0 for i in idx])
    ptr.append([i.stride(-2) for i in idx])
    table = to_device(torch.tensor(ptr, dtype=torch.int64), device)  # [8, L]
    interpreted = is_interpreted(_gather_layers_kernel)
    launch = gather_layers_launch(target_of(device, interpreted), first.element_size(), d)
    BLOCK_T = dict(launch.constexprs)["BLOCK_T"]
    _gather_layers_kernel[(L * R * G, triton.cdiv(k_max, BLOCK_T))](
        table, L, R, G, d, s_b, strides[1], strides[2], **launch.kwargs(interpreted),
    )  # fmt: skip


def _pairs(starts, counts, R: int, G: int) -> list[tuple[int, int]]:
    """One layer's `[R][G]` starts and counts as `R * G` (start, count) pairs."""
    if len(starts) != R or len(counts) != R or any(len(s) != G for s in (*starts, *counts)):
        raise ValueError(f"starts and counts must be [R={R}][G={G}] per layer")
    rows = zip(starts, counts, strict=True)
    return [(int(s), int(c)) for sr, cr in rows for s, c in zip(sr, cr, strict=True)]


def compact_every_layer(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    kept_idx: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gather the kept tokens of every layer in one launch, each layer its own dense
    tensor (`gather_every_layer` into contiguous outputs).

    Args:
        keys, values: per layer `[B, G, n, d]`, one shape, dtype and device for all.
        kept_idx: per layer sorted indices `[G, k_l]` in `[0, n)`; `k_l` may differ, and
            a layer's may be a view of a wider tensor (its last dimension contiguous).

    Returns:
        Per layer `(keys [B, G, k_l, d], values [B, G, k_l, d])`, contiguous, equal to
        `pagekv.runtime.backend.compact_layer` of that layer.
    """
    if not keys or keys[0].dim() != 4:
        raise ValueError("keys must be [B, G, n, d] per layer")
    B, G, _, d = keys[0].shape
    if len(kept_idx) != len(keys):
        raise ValueError(f"need one kept_idx per layer; got {len(kept_idx)} for {len(keys)}")
    for i, idx in enumerate(kept_idx):
        if idx.dim() != 2 or idx.shape[0] != G:
            raise ValueError(f"layer {i}: kept_idx must be [G={G}, k']; got {tuple(idx.shape)}")
    ks = [int(i.shape[1]) for i in kept_idx]  # shapes: host ints, no wait
    out = [(keys[0].new_empty(B, G, k, d), keys[0].new_empty(B, G, k, d)) for k in ks]
    starts = [[[(b * G + g) * k for g in range(G)] for b in range(B)] for k in ks]
    counts = [[[k] * G for _ in range(B)] for k in ks]
    gather_every_layer(
        keys, values, kept_idx, [o[0] for o in out], [o[1] for o in out], starts, counts
    )
    return out
