"""Benchmark the eviction kernels against their torch twins.

On a GPU (one command)::

    python benchmarks/bench_kernels.py --out runs/perf_kernels.json

times, for the pilot model's shapes (Qwen2.5-1.5B: 28 layers, 12 query heads, 2 KV
groups, head dim 128, window 32, bfloat16) and prompts of 4k to 128k tokens:

- each kernel (score, pool+pages, the runner's compaction of every layer) with
  `triton.testing.do_bench` (CUDA events, median), its twin in eager torch and under
  `torch.compile`;
- the whole eviction step (score + pool + select + compact, all layers) per backend;
- achieved GB/s against the byte model below, and its ratio to the GPU's memory
  bandwidth (`--peak-tbps`; by default the GPU's published figure, `GPU_PEAKS`: 4.8
  for an H200, 3.35 for an H100 SXM);
- the scoring kernel's roofline (`roofline`, near its ridge point at these shapes): its
  bytes, flops and exp2 count, the time each takes at the GPU's peak (`--peak-tflops`,
  `--peak-tflops-fp32`, `--peak-texp`), the bound that applies and the fraction achieved;
- a parity check per size (profile error, kept pages equal, compacted cache equal);
- long query sets (`--long-windows`, 1024 and 2048 queries by default, at sizes up to
  `--long-max-n`): the scoring kernel (`score_w{W}/...`) and its max output as the
  reconstruction scorer uses it (`max_w{W}/...`, `pagekv.runtime.backend.attention_scores`),
  each against its torch twin, with their parity; these are compute-bound, so their
  entries also carry TFLOP/s (`4 L H W n d` multiply-adds counted as flops: two passes
  of logits, the causal triangle counted full).

Byte model: the bytes a kernel must move between HBM and the chip (e = 2 bytes
for bf16, k' = kept tokens per (layer, group), n_pages = ceil(n / P)):

- score: pass 1 reads K (`L G n d e`), pass 2 reads K again and writes the
  float32 profiles (`L H n 4`); the window queries (`2 L H w d e`) are counted, the
  per-tile partials (`L H n/BLOCK_N 16`) and split stats are not (< 1%).
- pool+pages: reads the profiles (`L H n 4`), writes the pooled scores (`L G n 4`) and
  the page scores (`L G n_pages 4`).
- compact: reads and writes the kept rows of K and V (`2 * 2 L G k' d e`) and reads
  the indices (`L G k' 8`).
- eviction step: the sum of score, pool+pages and compact.

The twins are timed with the same byte model, so their GB/s is an effective rate
(they move more bytes: the `[w, n]` logits per head, for one).

Without CUDA the script says so and runs a tiny CPU smoke version (the torch
twins, and the Triton interpreter on tiny shapes) so that it can be tested; those
numbers say nothing about GPU performance.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere


def byte_model(L, H, G, n, d, w, e, P, k_kept):
    parts = {
        "score": 2 * L * G * n * d * e + L * H * n * 4 + 2 * L * H * w * d * e,
        "pool_pages": L * H * n * 4 + L * G * n * 4 + L * G * math.ceil(n / P) * 4,
        "compact": 2 * 2 * L * G * k_kept * d * e + L * G * k_kept * 8,
    }
    return {**parts, "eviction_step": sum(parts.values())}


#: An H200 SXM's peaks, the roofline's defaults (`--peak-*`): HBM3e bandwidth;
#: dense bf16/fp16 tensor-core and fp32 (non-tensor) throughput; exp2 on the special
#: function units (132 SMs x 16 per clock x 1.98 GHz). NVIDIA's published figures, not
#: measured here.
PEAKS = {"tbps": 4.8, "tflops_half": 989.0, "tflops_fp32": 67.0, "texp": 4.18}

#: NVIDIA's published peaks of the GPUs this may run on, by a piece of the name
#: `torch.cuda.get_device_name` gives ("NVIDIA H100 80GB HBM3"; the leading space keeps
#: a GH200 from matching " H200"); the first that matches wins, so the more specific
#: come first. Dense (no sparsity) bf16 tensor and fp32 TFLOP/s; exp2 as
#: SMs x 16 per clock x boost clock. Not measured here.
GPU_PEAKS = (
    # 132 SMs at 1.785 GHz
    (" H200 NVL", {"tbps": 4.8, "tflops_half": 835.0, "tflops_fp32": 60.0, "texp": 3.77}),
    (" H200", PEAKS),
    # 114 SMs at 1.755 GHz
    (" H100 PCIe", {"tbps": 2.0, "tflops_half": 756.0, "tflops_fp32": 51.0, "texp": 3.20}),
    # 132 SMs at 1.785 GHz
    (" H100 NVL", {"tbps": 3.9, "tflops_half": 835.0, "tflops_fp32": 60.0, "texp": 3.77}),
    # The SXM card ("NVIDIA H100 80GB HBM3"): the H200's chip, with 80 GB of HBM3
    (" H100", {"tbps": 3.35, "tflops_half": 989.0, "tflops_fp32": 67.0, "texp": 4.18}),
    # 108 SMs at 1.41 GHz; 40 GB cards have slower HBM2
    (" A100-SXM4-80GB", {"tbps": 2.039, "tflops_half": 312.0, "tflops_fp32": 19.5, "texp": 2.44}),
    (" A100 80GB PCIe", {"tbps": 1.935, "tflops_half": 312.0, "tflops_fp32": 19.5, "texp": 2.44}),
    (" A100", {"tbps": 1.555, "tflops_half": 312.0, "tflops_fp32": 19.5, "texp": 2.44}),
)


def peaks_of(device_name: str) -> tuple[dict, str] | None:
    """The published peaks for a GPU by its name, and the entry that matched; None for
    a GPU not in `GPU_PEAKS` (its roofline then needs the `--peak-*` flags)."""
    for piece, peaks in GPU_PEAKS:
        if piece in device_name:
            return dict(peaks), piece.strip()
    return None


def choose_peaks(device_name: str | None, flags: dict) -> tuple[dict | None, str]:
    """The peaks to judge against and where they came from: each `--peak-*` flag given,
    else the GPU's published figure (`peaks_of`); without CUDA (`device_name` None) the
    H200's, which only the smoke run's roofline shapes use. None when some peak is
    known from neither, with the reason."""
    given = {k: v for k, v in flags.items() if v is not None}
    if device_name is None:
        return {**PEAKS, **given}, "no GPU: an H200's figures, for the smoke run's shapes"
    found = peaks_of(device_name)
    base, source = (found[0], f"published figures for {found[1]}") if found else ({}, "")
    peaks = {**base, **given}
    if set(peaks) != set(PEAKS):
        missing = sorted(set(PEAKS) - set(peaks))
        return None, f"{device_name}: no published peaks on file; --peak-* flags missing {missing}"
    if given:
        source = (source + "; " if source else "") + "flags " + ", ".join(sorted(given))
    return peaks, source


def roofline(L, H, G, n, d, w, e, dot_fp32: bool, ms: float | None = None, peaks=None) -> dict:
    """The scoring kernel's roofline: what it must move and compute, the time each
    takes at the GPU's peak, the bound that applies (the slowest) and, given `ms`, the
    fraction of that bound achieved.

    - bytes: the score byte model (`byte_model`);
    - flops: `4 L H w n d`, the logits of both passes (causal triangle counted full;
      padding rows not counted: the useful work);
    - exps: `2 L H w n`, one exp2 per logit per pass.

    At the pilot's shapes (w = 32, r = 6, d = 128, bf16) that is `4 r w d / (4 d e)`
    = 192 flops per byte of K: near the ridge (989 TFLOP/s / 4.8 TB/s = 206), with the
    exp2 throughput within the same factor: no single bound dominates.
    """
    peaks = {**PEAKS, **(peaks or {})}
    nbytes = 2 * L * G * n * d * e + L * H * n * 4 + 2 * L * H * w * d * e
    flops = 4 * L * H * w * n * d
    exps = 2 * L * H * w * n
    tflops = peaks["tflops_fp32"] if dot_fp32 else peaks["tflops_half"]
    times = {
        "memory": nbytes / (peaks["tbps"] * 1e12) * 1e3,
        "compute": flops / (tflops * 1e12) * 1e3,
        "exp2": exps / (peaks["texp"] * 1e12) * 1e3,
    }
    bound = max(times, key=times.get)
    out = {
        "bytes": nbytes,
        "flops": flops,
        "exps": exps,
        "flops_per_byte": flops / nbytes,
        "ridge_flops_per_byte": tflops / peaks["tbps"],
        "bound_ms": times,
        "bound": bound,
        "peaks": peaks,
    }
    if ms:
        out["frac_of_bound"] = times[bound] / ms
    return out


def long_window_model(L, H, G, n, d, W, e):
    """Bytes and flops of the scoring kernel on `W` queries: the score byte model plus the
    max output (`L H n 4`), and `4 L H W n d` flops (two passes, each `2 W n d` per head)."""
    score = 2 * L * G * n * d * e + L * H * n * 4 + 2 * L * H * W * d * e
    return {"score": score, "max": score + L * H * n * 4, "flops": 4 * L * H * W * n * d}


def make_inputs(L, H, G, n, d, w, dtype, device, seed=0, rng_device="cpu"):
    """Random inputs, drawn on `rng_device` (the CPU by default: the same numbers on every
    machine; drawing on the GPU saves ~10 s per input at 128k tokens)."""
    gen = torch.Generator(device=rng_device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=rng_device).to(device, dtype)

    return randn(L, H, w, d), randn(L, 1, G, n, d), randn(L, 1, G, n, d)  # q, K, V [L, 1, G, n, d]


def make_step(cfg, G, backend):
    """The eviction step for all layers on one backend, as the runner runs it (`plan`:
    weights from the masses, pooling, protected pages, selection)."""
    from pagekv.maths.plan import plan
    from pagekv.runtime import backend as be

    def step(q, keys, values):
        prof, masses, _ = be.score_window(q, keys[:, 0], cfg.n_sink, backend=backend)
        p = plan(prof, G, cfg, masses=masses, pool_pages=be.pooler(backend))
        idx = p.kept_indices()  # [L, G, k']
        layers, _ = be.compact_layers(keys.unbind(0), values.unbind(0), idx.unbind(0), backend)
        return prof, p.page_keep, idx, layers

    return step


def _twin_score(q, keys, n_sink):
    from pagekv.maths.entropy import collision_mass, isolated_collision_mass, sink_mass
    from pagekv.maths.profiles import attention_profiles

    prof = attention_profiles(q, keys)
    return (
        prof,
        sink_mass(prof, n_sink),
        isolated_collision_mass(prof, n_sink),
        collision_mass(prof),
    )


def _twin_pool(prof, weights, G, P, n_sink, window):
    from pagekv.maths.paging import page_reduce, protected_pages
    from pagekv.maths.policies import weighted_pool

    pooled = weighted_pool(prof, weights, G)
    n = prof.shape[-1]
    return pooled, page_reduce(pooled, P, "max"), protected_pages(n, P, n_sink, window, prof.device)


def _kernel_compact(keys, values, idx):
    """The runner's compaction kernel (`compact_every_layer`) on stacked `[L, ...]`
    inputs: one launch, every layer's output its own tensor, stacked here."""
    from pagekv.kernels.compact import compact_every_layer

    pairs = compact_every_layer(keys.unbind(0), values.unbind(0), idx.unbind(0))
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _twin_compact(keys, values, idx):
    from pagekv.runtime.backend import compact_layer

    pairs = [compact_layer(keys[i], values[i], idx[i]) for i in range(keys.shape[0])]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def timer(cuda: bool, warmup: int, rep: int):
    if cuda:
        from triton.testing import do_bench

        return functools.partial(do_bench, warmup=warmup, rep=rep, return_mode="median")

    def bench_cpu(fn):
        fn()  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return bench_cpu


def measure(results: dict, bench, peak_tbps: float | None, name: str, fn, nbytes: int,
            flops: int | None = None) -> None:  # fmt: skip
    """Time `fn` into `results[name]`; a failure is recorded, not raised."""
    try:
        ms = bench(fn)
    except Exception as e:  # one bad case must not lose the whole (one-shot) GPU run
        results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(f"  {name:<28} FAILED: {results[name]['error']}", flush=True)
        return
    gbps = nbytes / (ms * 1e-3) / 1e9
    entry = {"ms": ms, "bytes": nbytes, "GB/s": gbps}
    if peak_tbps:
        entry["frac_of_peak"] = gbps / (peak_tbps * 1e3)
    if flops:
        entry["flops"] = flops
        entry["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
    results[name] = entry
    frac = f"  {100 * entry['frac_of_peak']:5.1f}% of peak" if peak_tbps else ""
    print(f"  {name:<28} {ms:10.3f} ms  {gbps:9.1f} GB/s{frac}", flush=True)


def run_size(args, n, device, cuda, bench, compiled=None) -> dict:
    from pagekv import EvictionConfig
    from pagekv.kernels.compact import compact_every_layer as k_compact
    from pagekv.kernels.pool_pages import pool_pages
    from pagekv.kernels.score import score_layers as k_score
    from pagekv.maths.entropy import HeadMasses, weights_from_mass
    from pagekv.maths.paging import expand_pages, page_sizes, select_pages

    L, H, G, d, w = args.layers, args.heads, args.groups, args.head_dim, args.window
    dtype = getattr(torch, args.dtype)
    e = torch.empty(0, dtype=dtype).element_size()
    cfg = EvictionConfig(policy="entropy", budget=args.budget, page_size=args.page_size,
                         n_sink=args.n_sink, window=w)  # fmt: skip
    P = cfg.page_size
    window = min(w, n)
    rng = device if args.rng_device else "cpu"
    q, keys, values = make_inputs(L, H, G, n, d, w, dtype, device, rng_device=rng)
    k4 = keys[:, 0]
    print(f"n = {n}", flush=True)
    res: dict = {"n": n}

    # Reference plan from the kernels (used to size the compaction inputs).
    prof, sums = k_score(q, k4, cfg.n_sink)
    masses = HeadMasses.from_sums(sums, n, cfg.n_sink)
    weights = weights_from_mass(masses.isolated, G, cfg.tau)
    _, pages, prot = pool_pages(prof, weights, G, P, cfg.n_sink, window)
    sizes = page_sizes(n, P, device)
    budget_tokens = cfg.budget_tokens(n)
    keep = expand_pages(select_pages(pages, prot, sizes, budget_tokens), n, P)
    k_kept = int(keep[0, 0].sum())
    idx = torch.arange(n, device=device).expand(L, G, n)[keep].view(L, G, k_kept)
    res["kept_tokens"] = k_kept
    nbytes = byte_model(L, H, G, n, d, w, e, P, k_kept)
    res["bytes"] = nbytes

    # Parity at this size (one call each).
    try:
        t_prof, *_ = _twin_score(q, k4, cfg.n_sink)
        _, t_pages, t_prot = _twin_pool(t_prof, weights, G, P, cfg.n_sink, window)
        _, k_pages, _ = pool_pages(t_prof, weights, G, P, cfg.n_sink, window)
        kk, vv = _kernel_compact(keys, values, idx)
        tk, tv = _twin_compact(keys, values, idx)
        kept = [select_pages(p, t_prot, sizes, budget_tokens) for p in (k_pages, t_pages)]
        res["parity"] = {
            "profiles_max_abs_err": float((prof - t_prof).abs().max()),
            "protected_equal": bool(torch.equal(prot, t_prot)),
            "kept_pages_equal": bool(torch.equal(*kept)),
            "compact_equal": bool(torch.equal(kk, tk) and torch.equal(vv, tv)),
        }
        del t_prof, kk, vv, tk, tv
    except Exception as ex:
        res["parity"] = {"error": f"{type(ex).__name__}: {ex}"[:500]}
    print(f"  parity: {res['parity']}", flush=True)

    peaks = args.peaks  # `choose_peaks`: None for a GPU whose peaks are not known
    peak = peaks["tbps"] if cuda and peaks else None
    m = res.setdefault("times", {})
    time_it = functools.partial(measure, m, bench, peak)  # (name, fn, nbytes, flops=None)
    time_it("score/triton", lambda: k_score(q, k4, cfg.n_sink), nbytes["score"])
    score = m["score/triton"]
    rf = {}
    if peaks:
        rf = score["roofline"] = roofline(L, H, G, n, d, window, e, dtype == torch.float32,
                                          score.get("ms"), peaks)  # fmt: skip
    if cuda and "frac_of_bound" in rf:
        print(f"  score roofline: {rf['flops_per_byte']:.0f} flop/B (ridge "
              f"{rf['ridge_flops_per_byte']:.0f}), {rf['bound']}-bound at "
              f"{rf['bound_ms'][rf['bound']]:.3f} ms: {100 * rf['frac_of_bound']:.1f}% of it",
              flush=True)  # fmt: skip
    time_it("score/torch", lambda: _twin_score(q, k4, cfg.n_sink), nbytes["score"])
    pool_args = (prof, weights, G, P, cfg.n_sink, window)
    time_it("pool_pages/triton", lambda: pool_pages(*pool_args), nbytes["pool_pages"])
    time_it("pool_pages/torch", lambda: _twin_pool(*pool_args), nbytes["pool_pages"])
    c_args = (keys.unbind(0), values.unbind(0), idx.unbind(0))
    time_it("compact/triton", lambda: k_compact(*c_args), nbytes["compact"])
    time_it("compact/torch", lambda: _twin_compact(keys, values, idx), nbytes["compact"])
    for backend in ("triton", "torch"):
        step = functools.partial(make_step(cfg, G, backend), q, keys, values)
        time_it(f"eviction_step/{backend}", step, nbytes["eviction_step"])
    if compiled:
        c_score, c_pool, c_compact = compiled
        time_it("score/torch.compile", lambda: c_score(q, k4, cfg.n_sink), nbytes["score"])
        time_it("pool_pages/torch.compile", lambda: c_pool(*pool_args), nbytes["pool_pages"])
        time_it("compact/torch.compile", lambda: c_compact(keys, values, idx), nbytes["compact"])
    long_windows(args, res, n, k4, device, time_it, e)
    return res


def long_windows(args, res, n, k4, device, time_it, e) -> None:
    """Long query sets over the same keys: the score kernel and the max output against
    their twins (timed by `time_it(name, fn, nbytes, flops)` into `res["times"]`), and
    their parity (`res["long_parity"]`)."""
    from pagekv.kernels.score import score_layers as k_score
    from pagekv.runtime import backend as be

    L, H, G, d = args.layers, args.heads, args.groups, args.head_dim
    rng = device if args.rng_device else "cpu"
    parity = res.setdefault("long_parity", {})
    for W in args.long_windows:
        if W > n or n > args.long_max_n:
            parity[f"w{W}"] = {"skipped": "W > n" if W > n else "n > --long-max-n"}
            continue
        gen = torch.Generator(device=rng).manual_seed(W)
        q = torch.randn(L, H, W, d, generator=gen, device=rng).to(device, k4.dtype)
        model = long_window_model(L, H, G, n, d, W, e)
        try:
            prof, _, top = k_score(q, k4, args.n_sink, return_max=True)
            t_prof, *_ = _twin_score(q, k4, args.n_sink)
            t_mean, t_top, _ = be.attention_scores(q, k4, backend="torch")
            parity[f"w{W}"] = {
                "profiles_max_abs_err": float((prof - t_prof).abs().max()),
                "max_max_abs_err": float((top - t_top).abs().max()),
                "mean_twins_max_abs_err": float((t_mean - t_prof).abs().max()),
            }
            del prof, top, t_prof, t_mean, t_top
        except Exception as ex:  # e.g. the twin out of memory
            parity[f"w{W}"] = {"error": f"{type(ex).__name__}: {ex}"[:500]}
        print(f"  parity w={W}: {parity[f'w{W}']}", flush=True)
        fl = model["flops"]
        for backend, fn in (("triton", k_score), ("torch", _twin_score)):
            score = functools.partial(fn, q, k4, args.n_sink)
            time_it(f"score_w{W}/{backend}", score, model["score"], fl)
        for backend in ("triton", "torch"):
            top = functools.partial(be.attention_scores, q, k4, backend=backend)
            time_it(f"max_w{W}/{backend}", top, model["max"], fl)
        del q
        if device.type == "cuda":
            torch.cuda.empty_cache()


#: The arguments that `meta["shapes"]` records.
SHAPE_ARGS = (
    "layers heads groups head_dim window dtype page_size budget n_sink long_windows long_max_n"
).split()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    sizes = [4096, 8192, 16384, 32768, 65536, 131072]
    ap.add_argument("--sizes", type=int, nargs="+", default=sizes, help="prompt lengths n")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--long-windows", type=int, nargs="*", default=[1024, 2048],
                    help="long query sets timed per size (none: skip them)")  # fmt: skip
    ap.add_argument("--long-max-n", type=int, default=16384,
                    help="time the long query sets only up to this prompt length")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--peak-tbps", type=float, default=None,
                    help="GPU memory bandwidth in TB/s for the ratio (default: the "
                    "GPU's published figure, GPU_PEAKS; H200: 4.8)")  # fmt: skip
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16/fp16 tensor TFLOP/s (H200: 989)")  # fmt: skip
    ap.add_argument("--peak-tflops-fp32", type=float, default=None,
                    help="fp32 (non-tensor) TFLOP/s (H200: 67)")  # fmt: skip
    ap.add_argument("--peak-texp", type=float, default=None,
                    help="exp2 on the special function units, 1e12/s (H200: 4.18)")  # fmt: skip
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile twins (they compile once per size)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time (ms)")
    ap.add_argument("--rng-device", action="store_true",
                    help="draw the random inputs on the benchmark device, not the CPU")  # fmt: skip
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="skip (and record) a size that would end after S seconds, "
                    "estimated from the previous size's time scaled by n, plus 25%%")  # fmt: skip
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda:
        # Must precede the first import of `kernels`: Triton reads it at definition.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(
            "No CUDA device: running a tiny CPU smoke version (torch twins and the Triton "
            "interpreter on tiny shapes). These timings say nothing about GPU performance; "
            "run this script on a GPU for the real benchmark.",
            flush=True,
        )
        args.layers, args.head_dim = 2, 32
        args.sizes = [n for n in args.sizes if n <= 512] or [256, 512]
        args.compile = False
    device = torch.device("cuda" if cuda else "cpu")
    flags = {"tbps": args.peak_tbps, "tflops_half": args.peak_tflops,
             "tflops_fp32": args.peak_tflops_fp32, "texp": args.peak_texp}  # fmt: skip
    args.peaks, peaks_from = choose_peaks(torch.cuda.get_device_name(0) if cuda else None, flags)
    if cuda:
        print(f"peaks: {args.peaks} ({peaks_from})", flush=True)
    meta = {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()})",
        "smoke": not cuda,
        "torch": torch.__version__,
        "shapes": {k: getattr(args, k) for k in SHAPE_ARGS},
        "peak_tbps": args.peaks["tbps"] if cuda and args.peaks else None,
        "peaks": args.peaks,
        "peaks_from": peaks_from,
        "timer": "triton.testing.do_bench (median, ms)" if cuda else "time.perf_counter (median)",
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        print("triton does not import: nothing to benchmark", file=sys.stderr)
        return 1
    print(json.dumps(meta), flush=True)
    bench = timer(cuda, args.warmup, args.rep)
    compiled = None
    if args.compile and cuda:
        # Compiled once with dynamic shapes, so the sizes share one compilation where
        # they can; the first call of each size still pays any recompilation, outside
        # the timed region (do_bench calls the function before it starts timing).
        compiled = tuple(
            torch.compile(f, dynamic=True) for f in (_twin_score, _twin_pool, _twin_compact)
        )
    results = []
    t_start, last = time.perf_counter(), None  # last: (n, seconds) of the previous size
    for n in args.sizes:
        if args.time_budget is not None:
            left = args.time_budget - (time.perf_counter() - t_start)
            need = 1.25 * last[1] * n / last[0] if last else 0.0
            if left <= 0 or need > left:
                reason = f"time budget: {left:.0f} s left, about {need:.0f} s needed"
                print(f"n = {n}: skipped ({reason})", flush=True)
                results.append({"n": n, "skipped": reason})
                continue
        t_size = time.perf_counter()
        try:
            results.append(run_size(args, n, device, cuda, bench, compiled))
        except Exception as e:  # e.g. out of memory at the largest size
            print(f"n = {n}: FAILED {type(e).__name__}: {e}", flush=True)
            results.append({"n": n, "error": f"{type(e).__name__}: {e}"[:500]})
        last = (n, time.perf_counter() - t_size)
        results[-1]["wall_s"] = last[1]
        if cuda:
            torch.cuda.empty_cache()  # the inputs of the last size are gone with run_size
        if args.out:  # write as we go: a timeout keeps what was measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
