"""Sweep the scoring kernel's launch options on a GPU: which blocks and compile options
make `pagekv.kernels.score.score_layers` fastest at the pilot model's shapes.

On a CUDA machine::

    python benchmarks/tune_score.py --out docs/tune_score.json

times `score_layers` (both passes and the host-side merges, `triton.testing.do_bench`,
median) at the pilot's shapes (28 layers, 12 query heads, 2 KV heads, head dim 128,
window 32, bfloat16) for prompts of 32k and 128k tokens, over:

- the key tile `BLOCK_N` (32, 64, 128), the warps (4, 8) and the pipeline stages of
  (pass 1, pass 2) ((1, 1), (2, 2), (3, 3)), with the launcher's rows (one query block
  of 8 heads x 32 queries);
- 16-query blocks (two query blocks, pass 2's loop over them) at 64-key tiles;
- fewer heads per program (1, 2 or 4 of the group's 6, the whole window in each) at
  64-key tiles, 4 or 8 warps and 2 or 3 stages, and at 128-key tiles with 8 warps
  (`--family heads` sweeps the launcher and these alone; `blocks` the others);
- for each, the key tiles per pass-2 program (`tiles_per_prog`: 1, 4, 16), a runtime
  argument (no new compile).

Every option is checked against the launcher's own choice on the same inputs (the
largest profile difference; a launch that does not compile or fit is recorded with its
error, not timed). The launcher's choice is timed first, and each option's time is
printed as a ratio to it. The table is sorted by the time at the largest size; the last
line names the fastest option. A `--deadline` (s) stops the sweep early, keeping what
was timed.

Without CUDA it says so and exits 0: the interpreter's times say nothing of a GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

#: The pilot's shapes: (L, H, G, d, w).
PILOT = (28, 12, 2, 128, 32)


#: The option families (`--family`).
FAMILIES = ("all", "blocks", "heads")


def options(family: str = "all") -> list[dict]:
    """The swept options, the launcher's own first (an empty dict).

    - `blocks` (swept on an H200 on 2026-12-04, docs/tune_score.json): the key tile,
      warps and stages at the launcher's rows (8 heads x 32 queries: for r = 6, a
      quarter of them padding), and 16-query blocks.
    - `heads`: fewer heads per program (`heads`: 1, 2 or 4, the whole window of 32
      queries in each), so that the head blocks divide r = 6 (1 and 2: no padding
      rows) and a program holds 32-128 rows instead of 256. Compiled for sm_90 here
      (docs/performance.md, "Kernels"), such launches need
      fewer registers and fit 2-5 programs on an SM where the launcher's pass 2 fits
      one; untimed until a GPU sweeps them.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}; got {family!r}")
    out: list[dict] = [{}]
    if family in ("all", "blocks"):
        grid = itertools.product((32, 64, 128), (4, 8), ((1, 1), (2, 2), (3, 3)))
        out += [{"BLOCK_N": b, "num_warps": w, "stages": s} for b, w, s in grid]
        out += [{"BLOCK_N": 64, "num_warps": w, "stages": (2, 2), "block_w": 16} for w in (4, 8)]
    if family in ("all", "heads"):
        grid = itertools.product((2, 1, 4), (4, 8), ((2, 2), (3, 3)))
        out += [{"BLOCK_N": 64, "num_warps": w, "stages": s, "heads": h} for h, w, s in grid]
        out += [{"BLOCK_N": 128, "num_warps": 8, "stages": (2, 2), "heads": h} for h in (2, 1)]
    return out


def label(opt: dict) -> str:
    if not opt:
        return "launcher"
    s = f"N{opt['BLOCK_N']} w{opt['num_warps']} s{opt['stages'][0]}{opt['stages'][1]}"
    s += f" qb{opt['block_w']}" if "block_w" in opt else ""
    return s + (f" h{opt['heads']}" if "heads" in opt else "")


def launch_for(opt: dict, q, keys, target=None):
    """The `ScoreLaunch` of option `opt` on these inputs (None: the launcher's), for
    `target` (default: the CUDA device of `q`)."""
    from pagekv.kernels.score import score_launch
    from pagekv.kernels.targets import target_of

    if not opt:
        return None
    L, H, w, d = q.shape
    r = H // keys.shape[1]
    base = score_launch(
        target or target_of(q.device, False), q.dtype, keys.dtype, d, r, w,
        block_n=opt["BLOCK_N"], block_w=opt.get("block_w"),
    )  # fmt: skip
    base = dataclasses.replace(base, num_warps=opt["num_warps"], stages=tuple(opt["stages"]))
    if "heads" not in opt:
        return base
    # `heads` heads of the group per program, the whole window in each (query blocks of
    # the next power of two >= w, at least 16 rows: what `tl.dot` needs).
    heads = min(int(opt["heads"]), r)
    W_BLK = max(16, 1 << max(w - 1, 0).bit_length())
    return dataclasses.replace(base, R_BLK=heads, n_rb=-(-r // heads), W_BLK=W_BLK, n_qb=1)


def resources(family: str, arch: int, limit: int | None = None) -> list[dict]:
    """Each option's two kernels compiled for `cuda_target(arch)` at the pilot's shapes,
    with no GPU (`pagekv.kernels.aot`): registers and stack (spills) per thread, shared
    memory, and programs an SM holds (`programs_per_sm`). What a sweep's timings may be
    read against; the first `limit` options only, if given."""
    from pagekv.kernels.aot import compile_for, programs_per_sm, resource_usage
    from pagekv.kernels.score import score_launch
    from pagekv.kernels.targets import cuda_target

    target = cuda_target(arch)
    L, H, G, d, w = PILOT
    q = torch.empty(L, H, w, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(L, G, 16, d, dtype=torch.bfloat16, device="meta")
    rows = []
    for opt in options(family)[:limit]:
        launch = launch_for(opt, q, k, target) or score_launch(target, q.dtype, k.dtype, d,
                                                                H // G, w)  # fmt: skip
        row = {"option": label(opt), **opt, "rows": launch.rows, "R_BLK": launch.R_BLK}
        for name, kernel in zip(("stats", "profile"), launch.launches(q.dtype, k.dtype),
                                strict=True):  # fmt: skip
            try:
                usage = resource_usage(compile_for(kernel, target))
                usage["programs_per_sm"] = programs_per_sm(usage, launch.num_warps, target)
            except Exception as exc:  # a launch that does not compile
                usage = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            row[name] = usage
        rows.append(row)
        kernels = " | ".join(f"{name}: {_usage_text(row[name])}" for name in ("stats", "profile"))
        print(f"{target.name} {row['option']:<22} rows {launch.rows:>3} | {kernels}", flush=True)
    return rows


def _usage_text(usage: dict) -> str:
    if "error" in usage:
        return usage["error"]
    return (f"{usage['registers']} regs, stack {usage['stack']} B, {usage['shared']} B shared, "
            f"{usage['programs_per_sm']} per SM")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=None, help="the JSON file (default: none)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--tiles", type=int, nargs="+", default=[1, 4, 16],
                    help="key tiles per pass-2 program")  # fmt: skip
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds")
    ap.add_argument("--family", choices=FAMILIES, default="all",
                    help="which options to sweep (`options`): blocks, heads or all")  # fmt: skip
    ap.add_argument("--resources", type=int, nargs="?", const=90, default=None, metavar="ARCH",
                    help="no GPU needed: compile each option for sm_ARCH (default 90) and "
                    "print its registers, spills, shared memory and programs per SM")  # fmt: skip
    ap.add_argument("--limit", type=int, default=None, help="the first LIMIT options only")
    args = ap.parse_args()
    if args.resources is not None:
        if os.environ.get("TRITON_INTERPRET") == "1":
            print("tune_score --resources: TRITON_INTERPRET=1 defines the kernels "
                  "interpreted; unset it")  # fmt: skip
            return 2
        rows = resources(args.family, args.resources, args.limit)
        if args.out:
            args.out.write_text(json.dumps({"arch": args.resources, "rows": rows}, indent=1) + "\n")
        return 1 if any("error" in r[k] for r in rows for k in ("stats", "profile")) else 0
    if not torch.cuda.is_available():
        print("tune_score: no CUDA device; nothing to tune (interpreted times mean nothing)")
        return 0
    import triton

    from pagekv.kernels.score import score_layers

    t_start = time.time()
    L, H, G, d, w = PILOT
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    base_ms: dict[int, float] = {}
    inputs = {}
    for n in args.sizes:
        q = torch.randn(L, H, w, d, generator=gen, device=dev).to(torch.bfloat16)
        k = torch.randn(L, G, n, d, generator=gen, device=dev).to(torch.bfloat16)
        inputs[n] = (q, k, score_layers(q, k, 4)[0])
    for opt in options(args.family)[: args.limit]:
        if time.time() - t_start > args.deadline:
            print(f"tune_score: deadline ({args.deadline:.0f} s) reached; stopping")
            break
        for tiles in [None] if not opt else args.tiles:
            row = {"option": label(opt), **opt, "tiles_per_prog": tiles, "ms": {}, "err": {}}
            for n, (q, k, ref) in inputs.items():
                try:
                    run = functools.partial(
                        score_layers, q, k, 4, launch=launch_for(opt, q, k), tiles_per_prog=tiles
                    )
                    row["err"][n] = float((run()[0] - ref).abs().max())
                    row["ms"][n] = triton.testing.do_bench(
                        run, warmup=10, rep=40, return_mode="median"
                    )
                except Exception as exc:  # a launch that does not compile or fit
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    break
            if not opt:
                base_ms = dict(row["ms"])
            rows.append(row)
            ratios = " ".join(
                f"{n}: {ms:7.3f} ms ({base_ms[n] / ms:4.2f}x)" for n, ms in row["ms"].items()
            )
            print(f"[{time.time() - t_start:6.1f}s] {row['option']:<22} tiles {tiles!s:>4} "
                  f"{ratios} {row.get('error', '')}", flush=True)  # fmt: skip
    big = max(args.sizes)
    timed = sorted((r for r in rows if big in r["ms"]), key=lambda r: r["ms"][big])
    print(f"\nsorted by the time at n = {big} (ratio: the launcher's time over it)")
    for r in timed:
        print(f"  {r['option']:<22} tiles {r['tiles_per_prog']!s:>4} {r['ms'][big]:7.3f} ms "
              f"{base_ms[big] / r['ms'][big]:4.2f}x  max |diff| {r['err'][big]:.1e}")  # fmt: skip
    if timed:
        best = timed[0]
        print(f"fastest at n = {big}: {best['option']} tiles {best['tiles_per_prog']} "
              f"({best['ms'][big]:.3f} ms; launcher {base_ms[big]:.3f} ms)")  # fmt: skip
    if args.out:
        meta = {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "shapes": dict(zip(("L", "H", "G", "d", "w"), PILOT, strict=True)),
            "dtype": "bfloat16",
            "timer": "triton.testing.do_bench (median, ms) of score_layers",
            "date": time.strftime("%Y-%m-%d"),
        }
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
