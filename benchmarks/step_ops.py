"""The eviction step's device work against the model's depth: the operations it
dispatches, counted with `TorchDispatchMode`, less views and allocations (what
tests/test_host_waits.py holds equal at 2 and 6 layers).

    python benchmarks/step_ops.py [--layers 2 28] [--all] [--per-layer-cache] [--new-cache]

On a tiny random Llama (8 query heads over 2 KV heads, 150 tokens, pages of 8) on the
Triton path under the interpreter (set here, before the kernels are defined; the
interpreter itself adds a few operations per launch, the same at every depth), one
`Runner.evict` on a fresh prefill (its scoring included) per policy and allocation.
At a depth like the pilot model's 28 layers, where the step is bound by the host's
launches, each per-layer operation would be a launch at every layer.

`--all` counts every dispatch instead, views and allocations included (an output tensor
and an index view per layer remain); `--per-layer-cache` counts with the compacted
layers wrapped as before (the baseline below) instead of by `_new_cache`.
`--new-cache` times `_new_cache`, which wraps the compacted layers in a transformers
cache, over 28 layers of 6,554 bfloat16 tokens (the pilot's 20 % of 32k), against the
same cache built with transformers' `lazy_initialization` on every layer (two
placeholder tensors a layer), in one process: best of 7 x 200 calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagekv import EvictionConfig  # noqa: E402
from pagekv.runtime import runner as runner_mod  # noqa: E402
from pagekv.runtime.runner import Runner, _new_cache  # noqa: E402
from tests.test_host_waits import DeviceOps  # noqa: E402
from tests.test_runner import prompt, tiny_model  # noqa: E402

CASES = (("entropy", "uniform"), ("head_independent", "uniform"), ("entropy", "global"),
         ("entropy", "layer"))  # fmt: skip


def step_ops(layers: int, policy: str, allocation: str, every: bool = False) -> int:
    """The operations one `Runner.evict` dispatches (`every`: views and allocations too)."""
    cfg = EvictionConfig(policy=policy, budget=0.4, page_size=8, window=16, allocation=allocation)
    runner = Runner(tiny_model("llama", layers=layers, seed=layers), None, backend="triton")
    ids = prompt(150, seed=3)
    runner.evict(runner.prefill(ids, window_max=16), cfg)  # warm: one-off work left out
    pre = runner.prefill(ids, window_max=16)
    with DeviceOps(every) as ops:
        runner.evict(pre, cfg)
    return ops.total


def step_ops_per_layer_cache(*args) -> int:
    """`step_ops` with the runner wrapping the compacted layers by `cache_per_layer`."""
    with mock.patch.object(
        runner_mod, "_new_cache", lambda layers=None: cache_per_layer(layers or ())
    ):
        return step_ops(*args)


def cache_per_layer(layers):
    """The baseline of `--new-cache`: transformers' `lazy_initialization` on every layer,
    as `_new_cache` did before."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    for k, v in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


def time_new_cache() -> dict:
    """Microseconds per call over 28 layers of `[1, 2, 6554, 128]` bfloat16 keys and
    values: `_new_cache` and the per-layer baseline, best of 7 x 200."""
    shape = (1, 2, 6554, 128)
    layers = [tuple(torch.empty(shape, dtype=torch.bfloat16) for _ in "kv") for _ in range(28)]
    return {
        name: 1e6 * min(timeit.repeat(lambda f=f: f(layers), number=200, repeat=7)) / 200
        for name, f in (("per-layer baseline", cache_per_layer), ("_new_cache", _new_cache))
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 28])
    ap.add_argument("--all", action="store_true", help="count views and allocations too")
    ap.add_argument("--per-layer-cache", action="store_true",
                    help="count with the per-layer baseline wrapping the layers")  # fmt: skip
    ap.add_argument("--new-cache", action="store_true", help="time _new_cache (see above)")
    args = ap.parse_args(argv)
    print("policy-allocation: " + ", ".join(f"L={n}" for n in args.layers))
    for policy, allocation in CASES:
        count = step_ops_per_layer_cache if args.per_layer_cache else step_ops
        counts = [count(n, policy, allocation, args.all) for n in args.layers]
        print(f"{policy}-{allocation}: " + ", ".join(map(str, counts)))
    if args.new_cache:
        us = time_new_cache()
        print(", ".join(f"{name} {t:.1f} us" for name, t in us.items())
              + f": {us['per-layer baseline'] / us['_new_cache']:.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
