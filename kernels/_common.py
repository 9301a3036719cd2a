"""Helpers the kernel launchers share: interpreter detection and block sizes.

Importing this module imports Triton; `pagekv` only imports `kernels` lazily,
inside `pagekv.runtime.backend`'s dispatch, so `pagekv` itself never needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Dtypes the kernels read. Accumulation is always float32.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreted(kernel) -> bool:
    """True when `kernel` (a `@triton.jit` object) runs in the Triton interpreter.

    Triton decides this once, when the decorator runs: with `TRITON_INTERPRET=1`
    in the environment at that moment it builds an `InterpretedFunction`, else a
    compiled `JITFunction`. Setting the variable later changes nothing for kernels
    already defined, so the launchers ask the kernel object, not the environment.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def next_pow2(x: int) -> int:
    """Smallest power of two `>= max(x, 1)` (`tl.arange` needs power-of-two lengths)."""
    return 1 << max(int(x) - 1, 0).bit_length()


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"tensors must share one device; got {devices}")
    return next(iter(devices.values()))


def check_window_shapes(q_win: torch.Tensor, keys: torch.Tensor) -> tuple[int, ...]:
    """Validate `q_win [L, H, w, d]` against `keys [L, G, n, d]`; `(L, H, w, d, G, n)`.

    The launcher's own check (the kernels import nothing from `pagekv`); the torch
    twin checks the same in `pagekv.maths.profiles.check_window_shapes`.
    """
    if q_win.dim() != 4 or keys.dim() != 4:
        raise ValueError(
            f"q_win must be [L, H, w, d] and keys [L, G, n, d]; got {tuple(q_win.shape)} "
            f"and {tuple(keys.shape)}"
        )
    L, H, w, d = q_win.shape
    Lk, G, n, dk = keys.shape
    if Lk != L or dk != d:
        raise ValueError(f"q_win {tuple(q_win.shape)} and keys {tuple(keys.shape)} disagree")
    if G == 0 or H % G != 0:
        raise ValueError(f"query heads H={H} must be a multiple of KV groups G={G}")
    if not 1 <= w <= n:
        raise ValueError(f"window w={w} must be in [1, n={n}]")
    return L, H, w, d, G, n


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same width.

    A gather copies bits, so the compaction kernels move integers: the copy is
    exact for every float format, and the interpreter (numpy, no bfloat16) can run it.
    """
    size = t.element_size()
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if size not in as_int:
        raise ValueError(f"unsupported element size {size} for dtype {t.dtype}")
    return t.view(as_int[size])


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


# Reductions: the kernels call `tl.reduce(x, axis, SUM)` / `tl.reduce(x, axis, MAX)`
# rather than `tl.sum` / `tl.max`. Those two are themselves `@triton.jit` functions of
# `triton.language.standard`, built when Triton is first imported: if that happened
# before TRITON_INTERPRET=1 was set (another library imported Triton first), they are
# compiled-mode objects the interpreter refuses to call. `tl.reduce` with the very
# combine functions they use compiles to the same code on a GPU, and the interpreter
# recognises those combine functions by identity and reduces with numpy. So the kernels
# only need TRITON_INTERPRET=1 before they themselves are defined. (If a Triton version
# renames the combine functions, the local ones work too, through the interpreter's
# slow generic path.)
SUM = getattr(tl.standard, "_sum_combine", _add)
MAX = getattr(tl.standard, "_elementwise_max", _max)
