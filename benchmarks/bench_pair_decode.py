"""A and B decoded together, against two separate decodes, on the bundled model.

Usage: python benchmarks/bench_pair_decode.py [--context 2000] [--repeats 3]

On the app's first preset (a 2000-token needle prompt with 3 needles, question asked
after compression, mean vs entropy at pages of 16) and a few budgets, times in one
process, each the median of `--repeats`:

- `separate`: `Runner.evaluate` for A, then for B (the baseline);
- `pair`: `Runner.evaluate_pair` as the app runs it (one batch of 2 in the decode step);

and prints the pair as a ratio to `separate`, with whether the answers are the same
tokens in both. With `--threads`, also `pair, other thread`: the same call made
from a second thread (as a web server's handler would), which libgomp's throttled
OpenMP workers slow down (see `pagekv.engine.worker`). With `--mmap-threshold-mib N`,
glibc's allocator is first set as `pagekv.app.allocator.tame` sets it, with an N MiB
threshold (the app's is `allocator.MMAP_THRESHOLD`).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagekv import EvictionConfig  # noqa: E402
from pagekv.engine.study import PromptSpec, Study  # noqa: E402


def median_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default="0.1,0.2,0.3")
    ap.add_argument("--threads", action="store_true", help="also time it from another thread")
    ap.add_argument("--mmap-threshold-mib", type=float, default=None, help="tame() first")
    args = ap.parse_args(argv)
    if args.mmap_threshold_mib is not None:
        from pagekv.app import allocator

        allocator.tame(mmap_threshold=int(args.mmap_threshold_mib * 2**20))
        print(f"allocator: mmap threshold {args.mmap_threshold_mib:g} MiB, arenas capped")
    study = Study.load("bundled", backend="torch")
    spec = PromptSpec(task="needle", context=args.context, seed=12, needles=3)
    prep = study.prepare(spec.replace(mode="after"))
    runner, pre = study.runner, prep.prefill
    print(f"{study.loaded.name}: {prep.n} context tokens, question after; median of "
          f"{args.repeats}")  # fmt: skip
    print(f"{'budget':>6s} {'tokens':>6s} {'separate s':>10s} {'pair':>12s}  same answers")
    for budget in (float(b) for b in args.budgets.split(",")):
        a = EvictionConfig(policy="mean", budget=budget, page_size=16, tau=0.25)
        b = a.replace(policy="entropy")
        t_sep, sep = median_time(lambda a=a, b=b: [runner.evaluate(pre, c) for c in (a, b)],
                                 args.repeats)  # fmt: skip
        evaluate_pair = functools.partial(runner.evaluate_pair, pre, a, b)
        t_pair, pair = median_time(evaluate_pair, args.repeats)
        same = all(x.tokens == z.tokens for x, z in zip(sep, pair, strict=True))
        n_tok = max(len(r.tokens) for r in sep)
        line = (
            f"{budget:6.2f} {n_tok:6d} {t_sep:10.2f} {t_pair:5.2f} ({t_pair / t_sep:4.2f}x)  {same}"
        )
        if args.threads:
            with ThreadPoolExecutor(max_workers=1) as other:
                t = other.submit(median_time, evaluate_pair, args.repeats).result()[0]
            line += f"  pair, other thread {t:5.2f} ({t / t_sep:4.2f}x)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
