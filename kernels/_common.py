"""Helpers the kernel launchers share: interpreter detection, block sizes and `Launch`,
the record of one launch configuration.

Importing this module imports Triton; `pagekv` only imports `kernels` lazily,
inside `pagekv.runtime.backend`'s dispatch, so `pagekv` itself never needs Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A launch's small host table on `device`: pinned and queued on CUDA (no host wait)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def aligned(tensors) -> list[torch.Tensor]:
    """`tensors`, each cloned unless 16-byte aligned (the kernels' vectorisation hint)."""
    return [t if t.data_ptr() % 16 == 0 else t.clone() for t in tensors]


def check_window_shapes(q_shape: tuple, k_shape: tuple) -> tuple[int, ...]:
    """Validate the shapes `q_win [L, H, w, d]` and `keys [L, G, n, d]`; `(L, H, w, d, G, n)`.

    The launcher's own check (the kernels import nothing from `pagekv`); the torch
    twin checks the same in `pagekv.maths.profiles.check_window_shapes`.
    """
    q_shape, k_shape = tuple(q_shape), tuple(k_shape)
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(
            f"q_win must be [L, H, w, d] and keys [L, G, n, d]; got {q_shape} and {k_shape}"
        )
    L, H, w, d = q_shape
    Lk, G, n, dk = k_shape
    if Lk != L or dk != d:
        raise ValueError(f"q_win {q_shape} and keys {k_shape} disagree")
    if G == 0 or H % G != 0:
        raise ValueError(f"query heads H={H} must be a multiple of KV groups G={G}")
    if not 1 <= w <= n:
        raise ValueError(f"window w={w} must be in [1, n={n}]")
    return L, H, w, d, G, n


#: Triton's name of each torch dtype the kernels read (a launch's argument types).
TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass(frozen=True)
class Launch:
    """One launch configuration of one kernel: what its launcher passes besides the
    tensors and sizes, and what `kernels/aot.py` compiles for a GPU target to check
    that it compiles and fits.

    - `kernel`: the `@triton.jit` function's name in `module`.
    - `types`: the Triton type of every argument that is not a 32-bit integer
      (pointers `*bf16`, float scalars `fp32`); the other arguments are `i32` sizes.
    - `constexprs`: the compile-time arguments, as the launcher passes them.
    - `num_warps`, `num_stages`, `options`: the compile options (the interpreter takes
      none); `options` holds any others, such as `("enable_fp_fusion", False)`.
    - `aligned`: arguments the launcher guarantees are multiples of 16 (pointers to
      16-byte aligned memory, strides of such rows), as Triton's JIT marks them.
    """

    module: str
    kernel: str
    types: tuple = ()
    constexprs: tuple = ()
    num_warps: int = 4
    num_stages: int = 2
    options: tuple = ()
    aligned: tuple = ()

    def compile_options(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, **dict(self.options))

    def kwargs(self, interpreted: bool) -> dict:
        """The launch's keyword arguments: its constexprs, and its options when compiled."""
        out = dict(self.constexprs)
        if not interpreted:
            out.update(self.compile_options())
        return out

    @property
    def label(self) -> str:
        consts = ", ".join(f"{k}={getattr(v, 'name', None) or v}" for k, v in self.constexprs)
        types = ", ".join(f"{k}:{v}" for k, v in self.types if v.startswith("*"))
        return f"{self.kernel}[{consts}; {types}; warps {self.num_warps}, stages {self.num_stages}]"


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

#: log2(e): the kernels keep logits in base 2 (`qk_scale = scale * LOG2E`, `exp2`).
LOG2E = 1.4426950408889634
#: Finite stand-in for -inf as the initial running max of an online softmax, so that a
#: row whose keys in a tile are all masked (-inf logits) rescales by
#: exp2(-1e30 + 1e30) = 1, not NaN. A `tl.constexpr`: a compiled kernel may read no
#: other module global (the interpreter accepts any, which is why
#: tests/test_kernel_compile.py compiles for GPU targets).
NEG_BIG = tl.constexpr(-1.0e30)
