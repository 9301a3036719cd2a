"""The machine a launch is fitted to: a CUDA architecture and its shared memory, or the
interpreter.

A launcher sizes its blocks from the target, the dtype and the head dim (never from the
device type alone): shared memory per block differs by a factor of two between GPUs
(sm_80 allows 166,912 bytes, sm_86 101,376, sm_90 232,448), and a block that does not
fit fails only when it is compiled for that GPU, never in the interpreter. So a launcher
takes a `Target` and `tests/test_kernel_compile.py` compiles every launch configuration
the launchers choose ahead of time for `CHECKED` (sm_80 and sm_90), on a machine with
no GPU, and checks each fits (`kernels/aot.py`).

`target_of(device)` asks the device when a kernel is launched (never at import time):
its capability, and the opt-in shared memory per block torch reports, or this table's
figure for the architecture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

#: Opt-in shared memory per block (bytes) by architecture (capability major * 10 +
#: minor), from NVIDIA's CUDA C programming guide, "Compute capabilities".
SHARED_BYTES = {
    70: 98_304,
    75: 65_536,
    **dict.fromkeys((80, 87), 166_912),
    **dict.fromkeys((86, 89, 120, 121), 101_376),
    **dict.fromkeys((90, 100, 103), 232_448),
}
#: What an architecture missing from the table is assumed to allow (the smallest
#: figure of the Ampere and later rows: a block that fits this fits them all).
SHARED_BYTES_UNKNOWN = 101_376


@dataclass(frozen=True)
class Target:
    """Where a kernel runs: `kind` "cuda" (compiled for `arch`, e.g. 90 for sm_90) or
    "interpreter" (Triton's numpy interpreter on CPU tensors: no shared memory, and
    large blocks, since it pays per program and per loop step, hardly per element)."""

    kind: str
    arch: int = 0
    shared_bytes: int = 0

    @property
    def interpreted(self) -> bool:
        return self.kind == "interpreter"

    @property
    def name(self) -> str:
        return "interpreter" if self.interpreted else f"sm_{self.arch}"


INTERPRETER = Target("interpreter")


def cuda_target(arch: int, shared_bytes: int | None = None) -> Target:
    """The CUDA target of architecture `arch` (80 for sm_80), with the table's shared
    memory unless `shared_bytes` says otherwise."""
    limit = SHARED_BYTES.get(int(arch), SHARED_BYTES_UNKNOWN)
    return Target("cuda", int(arch), int(shared_bytes or limit))


#: The targets tests/test_kernel_compile.py compiles every launch for (A100, H100/H200).
CHECKED = (cuda_target(80), cuda_target(90))


@functools.cache
def _cuda_device_target(index: int) -> Target:
    major, minor = torch.cuda.get_device_capability(index)
    props = torch.cuda.get_device_properties(index)
    return cuda_target(10 * major + minor, getattr(props, "shared_memory_per_block_optin", None))


def target_of(device: torch.device, interpreted: bool) -> Target:
    """The target of a launch on `device`: the interpreter when the kernel was defined
    under `TRITON_INTERPRET=1`, else the CUDA device's architecture and shared memory
    (asked once per device, at the first launch)."""
    if interpreted:
        return INTERPRETER
    if device.type != "cuda":
        raise ValueError(f"compiled Triton kernels run on CUDA tensors; got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_device_target(index)
