"""Time `plan` per policy on the pilot model's shape (28 layers, 12 heads, 2 groups).

Usage: python benchmarks/bench_plan.py [--n 32768] [--page-size 16] [--repeats 3]

Prints the best-of-repeats wall time per policy and its ratio to `mean` (the
baseline: the pooling most libraries use), all measured in this process.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pagekv import POLICIES, EvictionConfig, plan  # noqa: E402


def make_profiles(L, H, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(L, H, n, generator=g) ** 8
    return p / p.sum(-1, keepdim=True)


def best_time(fn, repeats):
    fn()  # warm-up (allocator, lazy init)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    prof = make_profiles(args.layers, args.heads, args.n)
    print(
        f"plan on [{args.layers}, {args.heads}, {args.n}] float32, G={args.groups}, "
        f"P={args.page_size}, budget={args.budget}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    results = {}
    for policy in POLICIES:
        cfg = EvictionConfig(policy=policy, budget=args.budget, page_size=args.page_size)
        results[policy] = best_time(lambda cfg=cfg: plan(prof, args.groups, cfg), args.repeats)
    print(f"{'policy':<18}{'seconds':>10}{'vs mean':>10}")
    for policy, t in results.items():
        print(f"{policy:<18}{t:>10.3f}{t / results['mean']:>9.2f}x")
    return results


if __name__ == "__main__":
    main()
