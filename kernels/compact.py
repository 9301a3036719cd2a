"""The compaction kernel: gather the kept K/V tokens of every layer into a dense cache.

`compact_every_layer` (twin: `pagekv.runtime.compaction.compact_layer`, per layer): a
model's cache is one tensor per layer, `[B, G, n, d]`, and sorted kept indices `[G, k_l]`
per layer give `[B, G, k_l, d]`; the layers may keep different counts `k_l` (a padded
plan). One launch gathers them all: the launcher writes a table of the layers'
addresses and counts (int64 `[7, L]`: keys, values, indices, key out, value out,
`k_l`, the indices' row stride), copied to the device without a host wait, and each
program loads its layer's pointers from it (the pointer-array pattern of Triton's
grouped GEMM). One program copies `BLOCK_T` kept rows of K and of V for one (layer,
batch, group). No stacked copy of the cache is made.

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
    """`compact_every_layer`'s launch: `BLOCK_T` kept rows of `D_PAD` elements per
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
def _gather_layers_kernel(tab_ptr, L, B, G, d, s_b, s_g, s_n,
                          ELEM: tl.constexpr, BLOCK_T: tl.constexpr,
                          D_PAD: tl.constexpr):  # fmt: skip
    # tab_ptr: int64 [7, L], rows: key, value, index, key out, value out addresses, k_l,
    # and the index rows' stride (a layer's [G, k_l] indices may be a view of a wider one).
    i_lbg = tl.program_id(0)
    i_tb = tl.program_id(1)
    i_l = i_lbg // (B * G)
    i_b = (i_lbg // G) % B
    i_g = i_lbg % G
    # The launcher checks every address is 16-byte aligned: the hints let a row's loads
    # and stores be vectorised.
    k_out = tl.load(tab_ptr + 5 * L + i_l)  # this layer's kept count
    p_k = tl.multiple_of(tl.load(tab_ptr + i_l).to(tl.pointer_type(ELEM)), 16)
    p_v = tl.multiple_of(tl.load(tab_ptr + L + i_l).to(tl.pointer_type(ELEM)), 16)
    p_i = tl.multiple_of(tl.load(tab_ptr + 2 * L + i_l).to(tl.pointer_type(tl.int64)), 16)
    p_ko = tl.multiple_of(tl.load(tab_ptr + 3 * L + i_l).to(tl.pointer_type(ELEM)), 16)
    p_vo = tl.multiple_of(tl.load(tab_ptr + 4 * L + i_l).to(tl.pointer_type(ELEM)), 16)
    o_t = i_tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] slots of the layer's output
    o_d = tl.arange(0, D_PAD)
    m_t = o_t < k_out  # the grid covers the largest k_l; shorter layers mask the rest
    m_td = m_t[:, None] & (o_d < d)[None, :]
    s_i = tl.load(tab_ptr + 6 * L + i_l)
    b_idx = tl.load(p_i + i_g * s_i + o_t, mask=m_t, other=0)  # [BT] of [G, k_l]
    src = (
        i_b.to(tl.int64) * s_b
        + i_g.to(tl.int64) * s_g
        + b_idx[:, None].to(tl.int64) * s_n
        + o_d[None, :]
    )  # [BT, D]
    # The output is a contiguous [B, G, k_l, d]: reads and writes 2 (K, V) * BT * d * e bytes.
    dst = ((i_b * G + i_g).to(tl.int64) * k_out + o_t[:, None]) * d + o_d[None, :]
    tl.store(p_ko + dst, tl.load(p_k + src, mask=m_td), mask=m_td)
    tl.store(p_vo + dst, tl.load(p_v + src, mask=m_td), mask=m_td)


def compact_every_layer(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    kept_idx: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gather the kept tokens of every layer in one launch, each layer its own tensor.

    Args:
        keys, values: per layer `[B, G, n, d]`, one shape, dtype and device for all.
        kept_idx: per layer sorted indices `[G, k_l]` in `[0, n)`; `k_l` may differ, and
            a layer's may be a view of a wider tensor (its last dimension contiguous).

    Returns:
        Per layer `(keys [B, G, k_l, d], values [B, G, k_l, d])`, contiguous, equal to
        `pagekv.runtime.compaction.compact_layer` of that layer. The one host wait is
        the bounds check of all the indices at once (one flag read back), whatever the
        number of layers.
    """
    L = len(keys)
    if L == 0 or len(values) != L or len(kept_idx) != L:
        raise ValueError(
            f"need one keys, values and kept_idx tensor per layer; got {L}, {len(values)} "
            f"and {len(kept_idx)}"
        )
    first = keys[0]
    if first.dim() != 4:
        raise ValueError(f"keys must be [B, G, n, d] per layer; got {tuple(first.shape)}")
    B, G, n, d = first.shape
    device = first.device
    for i, (k, v, idx) in enumerate(zip(keys, values, kept_idx, strict=True)):
        if k.shape != first.shape or v.shape != first.shape:
            raise ValueError(
                f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be "
                f"{tuple(first.shape)}, layer 0's shape"
            )
        if k.dtype != first.dtype or v.dtype != first.dtype:
            raise ValueError(f"layer {i}: dtypes {k.dtype}, {v.dtype}; layer 0 has {first.dtype}")
        check_same_device(keys=k, values=v, first=first)
        if idx.dim() != 2 or idx.shape[0] != G:
            raise ValueError(f"layer {i}: kept_idx must be [G={G}, k']; got {tuple(idx.shape)}")
    # One set of input strides for every layer: the cache's own (prefill layers are
    # contiguous), else contiguous copies.
    strides = first.stride()
    if strides[-1] != 1 or any(t.stride() != strides for t in (*keys, *values)):
        keys = [k.contiguous() for k in keys]
        values = [v.contiguous() for v in values]
        strides = keys[0].stride()
    if first.element_size() not in _ELEM:
        raise ValueError(f"unsupported element size {first.element_size()} for {first.dtype}")
    idx = [i.to(device=device, dtype=torch.int64) for i in kept_idx]
    idx = [i if i.stride(-1) == 1 else i.contiguous() for i in idx]
    counts = [int(i.shape[1]) for i in idx]  # shapes: host ints, no wait
    if sum(counts):  # one check of all layers' indices at once, one read
        lo, hi = torch.aminmax(torch.cat(idx, dim=1))
        if bool((lo < 0) | (hi >= n)):
            raise ValueError(f"kept_idx must lie in [0, n={n})")
    out = [(first.new_empty(B, G, k_l, d), first.new_empty(B, G, k_l, d)) for k_l in counts]
    k_max = max(counts)
    if k_max == 0:
        return out
    keys, values, idx = aligned(keys), aligned(values), aligned(idx)
    ptr = [[t.data_ptr() for t in col] for col in (keys, values, idx)]
    ptr += [[o[0].data_ptr() for o in out], [o[1].data_ptr() for o in out], counts]
    ptr.append([i.stride(0) for i in idx])
    table = to_device(torch.tensor(ptr, dtype=torch.int64), device)  # [7, L]
    interpreted = is_interpreted(_gather_layers_kernel)
    launch = gather_layers_launch(target_of(device, interpreted), first.element_size(), d)
    BLOCK_T = dict(launch.constexprs)["BLOCK_T"]
    _gather_layers_kernel[(L * B * G, triton.cdiv(k_max, BLOCK_T))](
        table, L, B, G, d, strides[0], strides[1], strides[2], **launch.kwargs(interpreted),
    )  # fmt: skip
    return out
