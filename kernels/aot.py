"""Compile every launch the launchers choose, ahead of time, for GPU targets, with no GPU.

    python -m pagekv.kernels.aot [--arch 80 90] [--jobs 2] [--json FILE]

The Triton interpreter (how the kernels run on a CPU) checks the maths, never the
compile: a module global read inside `@triton.jit`, a block that overflows a GPU's
shared memory or a dtype a GPU dot refuses all pass there and fail only on the GPU.
Triton compiles for a GPU target on any machine:
`triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))`
runs the whole pipeline (Triton IR, LLVM, PTX, ptxas to a cubin) and reports the shared
memory a program asks for (`metadata.shared`).

What is compiled: for each target (`pagekv.kernels.targets.CHECKED`: sm_80 and sm_90), every
distinct `Launch` that the launchers (`score_launch`, `pool_launch`,
`gather_layers_launch`, `paged_decode_launch`) choose over `GRID`, a
grid of real shapes: the pilot model (Qwen2.5-1.5B: head dim 128, r = 6), the bundled
(SmolLM2-135M: 64, r = 3) and the second model (Qwen2.5-Coder-0.5B: 64, r = 7), and
around them head dims 64 and 128, 1 to 8 heads per group, windows 1 to 2048 (the
reconstruction scorer's chunks included), fp32, fp16, bf16 and fp32 queries over bf16
keys, pages of 1 to 64 tokens.
Every launch is compiled as Triton's JIT specialises it when its sizes are multiples of
16 (the pilot's are), the case that pipelines its loops and so asks for the most shared
memory. A launch fails when it does not compile or when its shared memory exceeds the
target's (`Target.shared_bytes`). The exit status is 1 when any launch fails.

`tests/test_kernel_compile.py` runs this in the default test suite. The kernels must be
defined compiled, so `TRITON_INTERPRET` must be unset when `kernels` is first imported
(the command refuses otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ._common import Launch, is_interpreted
from .compact import gather_layers_launch
from .paged_decode import paged_decode_launch
from .pool_pages import pool_launch
from .score import score_launch
from .targets import CHECKED, Target, cuda_target


@dataclass(frozen=True)
class Grid:
    """The shapes the launchers are asked about."""

    models: tuple = (("pilot Qwen2.5-1.5B", 128, 6), ("bundled SmolLM2-135M", 64, 3),
                     ("second Qwen2.5-Coder-0.5B", 64, 7))  # fmt: skip
    head_dims: tuple = (64, 128)
    group_sizes: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    #: The app's windows (1 to 128), the default (32), the reconstruction chunk (256)
    #: and its last partial chunks, and long query sets up to 2048.
    windows: tuple = (1, 8, 15, 16, 17, 32, 64, 100, 128, 255, 256, 257, 1024, 2048)
    #: (query dtype, key dtype): the four the kernels read.
    dtypes: tuple = (
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    )
    page_sizes: tuple = (1, 2, 4, 8, 16, 32, 64)

    def shapes(self):
        """(head dim, heads per group) pairs: the models' and the grid's."""
        pairs = {(d, r) for _, d, r in self.models}
        pairs |= {(d, r) for d in self.head_dims for r in self.group_sizes}
        return sorted(pairs)


GRID = Grid()


def launches(target: Target, grid: Grid = GRID) -> list[Launch]:
    """Every distinct launch the launchers choose on `target` over `grid`, in order."""
    out: dict[Launch, None] = {}
    for d, r in grid.shapes():
        for q_dtype, k_dtype in grid.dtypes:
            for w in grid.windows:
                cfg = score_launch(target, q_dtype, k_dtype, d, r, w)
                for with_max in (False, True):  # the reconstruction scorer's maxima
                    out.update(dict.fromkeys(cfg.launches(q_dtype, k_dtype, with_max)))
    for P in grid.page_sizes:
        out[pool_launch(target, P)] = None
    sizes = sorted({torch.tensor([], dtype=k).element_size() for _, k in grid.dtypes})
    for e in sizes:
        for d in grid.head_dims:
            out[gather_layers_launch(target, e, d)] = None
    for d, r in grid.shapes():
        for dtype in sorted({k for _, k in grid.dtypes}, key=str):
            out[paged_decode_launch(target, dtype, d, r).launch(dtype)] = None
    return list(out)


class Interpreted(ValueError):
    """The kernel was defined under `TRITON_INTERPRET=1`: there is nothing to compile."""


def compile_for(launch: Launch, target: Target):
    """`launch` compiled for `target`: Triton's compiled kernel (its `metadata`, and its
    `asm` by stage: `ttgir`, `ptx`, `cubin`, ...). Raises the compiler's own error, and
    `Interpreted` for kernels defined under the interpreter."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    if is_interpreted(fn):
        raise Interpreted("kernels defined under TRITON_INTERPRET=1")
    consts = dict(launch.constexprs)
    types = dict(launch.types)
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    # Triton's JIT marks a size argument divisible by 16 when its value is: then a row's
    # loads go vector-wide and the loops pipeline, each stage a buffer more of shared
    # memory. So every i32 size is marked (the launch's worst case: the pilot's sizes,
    # head dim 128 and prompts of whole 16-token pages, are all multiples of 16), and
    # the pointers the launcher aligns.
    sizes = [a for a in fn.arg_names if a not in consts and types.get(a, "i32") == "i32"]
    marked = [*launch.aligned, *(a for a in sizes if a not in launch.aligned)]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in marked}
    return triton.compile(
        ASTSource(fn, sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", target.arch, 32),
        options=launch.compile_options(),
    )


def resource_usage(compiled) -> dict:
    """What one program of a compiled kernel holds, read from its cubin by the
    `cuobjdump` that ships with Triton (`-res-usage`): `registers` per thread, `stack`
    bytes per thread (nonzero: registers spilled to local memory) and `shared` bytes."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[-300:]!r}")
    return {"registers": int(found[1]), "stack": int(found[2]),
            "shared": int(compiled.metadata.shared)}  # fmt: skip


def programs_per_sm(usage: dict, num_warps: int, target: Target) -> int:
    """How many such programs an SM of `target` holds at once: the fewest its registers
    (65,536 a SM, a thread's count rounded up to 8), its shared memory (the target's
    per-program limit plus the 1 KB a program reserves is the SM's whole) and its warps
    (64 a SM) allow. Programs that share an SM hide each other's waits."""
    regs = -(-max(usage["registers"], 1) // 8) * 8
    by_regs = 65536 // (regs * 32 * num_warps)
    by_shared = (target.shared_bytes + 1024) // (usage["shared"] + 1024)
    return min(by_regs, by_shared, 64 // num_warps, 32)


def compile_launch(launch: Launch, target: Target) -> dict:
    """Compile `launch` for `target`; its shared memory against the target's limit.

    Returns a JSON-ready dict: `label`, `target`, `ok`, `shared`, `limit`, `seconds` and,
    when it failed, `error` (the compiler's message, or that it does not fit)."""
    out = {"label": launch.label, "target": target.name, "limit": target.shared_bytes}
    t0 = time.perf_counter()
    try:
        compiled = compile_for(launch, target)
    except Interpreted as e:
        return {**out, "ok": False, "error": str(e)}
    except Exception as e:  # the compiler's own error, whatever its class
        message = " ".join(str(e).split())[-600:]
        return {**out, "ok": False, "seconds": time.perf_counter() - t0,
                "error": f"does not compile: {type(e).__name__}: {message}"}  # fmt: skip
    shared = int(compiled.metadata.shared)
    out.update(shared=shared, seconds=round(time.perf_counter() - t0, 2))
    if shared > target.shared_bytes:
        return {**out, "ok": False,
                "error": f"needs {shared} bytes of shared memory; {target.name} allows "
                f"{target.shared_bytes}"}  # fmt: skip
    return {**out, "ok": True}


def check(targets, jobs: int = 1) -> list[dict]:
    """Compile every launch of `GRID` for every target, `jobs` at a time."""
    work = list(zip(*[(launch, t) for t in targets for launch in launches(t)], strict=True))
    ctx = multiprocessing.get_context("fork")  # the workers inherit the compiled kernels
    results = []
    with ProcessPoolExecutor(jobs, mp_context=ctx) if jobs > 1 else nullcontext() as pool:
        for res in (
            pool.map(compile_launch, *work, chunksize=4) if pool else map(compile_launch, *work)
        ):
            results.append(res)
            print(_line(res))
    return results


def _line(res: dict) -> str:
    shared = f"{res['shared']:>7} of {res['limit']} B" if "shared" in res else " " * 20
    status = "ok" if res["ok"] else "FAILED: " + res["error"]
    return f"{res['target']:>6} {shared} {res.get('seconds', 0):5.1f}s {res['label']}  {status}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[t.arch for t in CHECKED],
                    help="CUDA architectures (80 for sm_80); default: %(default)s")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="write every result to this file")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("pagekv.kernels.aot: TRITON_INTERPRET=1 defines the kernels interpreted; unset it")
        return 2
    targets = [cuda_target(a) for a in args.arch]
    t0 = time.perf_counter()
    results = check(targets, args.jobs)
    failed = [r for r in results if not r["ok"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": [t.name for t in targets], "results": results}, f, indent=1)
    worst = {
        t.name: max((r.get("shared", 0) for r in results if r["target"] == t.name), default=0)
        for t in targets
    }
    print(
        f"pagekv.kernels.aot: {len(results)} launches, {len(failed)} failed, in "
        f"{time.perf_counter() - t0:.0f} s; most shared memory: "
        + ", ".join(f"{name} {b} B" for name, b in worst.items())
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
