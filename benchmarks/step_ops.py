"""The eviction step's device work against the model's depth: the operations it
dispatches, counted with `TorchDispatchMode`, less views and allocations (what
tests/test_host_waits.py holds equal at 2 and 6 layers).

    python benchmarks/step_ops.py [--layers 2 28]

On a tiny random Llama (8 query heads over 2 KV heads, 150 tokens, pages of 8) on the
Triton path under the interpreter (set here, before the kernels are defined; the
interpreter itself adds a few operations per launch, the same at every depth), one
`Runner.evict` on a fresh prefill (its scoring included) per policy and allocation.
At a depth like the pilot model's 28 layers, where the step is bound by the host's
launches, each per-layer operation would be a launch at every layer.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv import EvictionConfig  # noqa: E402
from pagekv.runtime.runner import Runner  # noqa: E402
from tests.test_host_waits import DeviceOps  # noqa: E402
from tests.test_runner import prompt, tiny_model  # noqa: E402

CASES = (("entropy", "uniform"), ("head_independent", "uniform"), ("entropy", "global"),
         ("entropy", "layer"))  # fmt: skip


def step_ops(layers: int, policy: str, allocation: str) -> Counter:
    cfg = EvictionConfig(policy=policy, budget=0.4, page_size=8, window=16, allocation=allocation)
    runner = Runner(tiny_model("llama", layers=layers, seed=layers), None, backend="triton")
    ids = prompt(150, seed=3)
    runner.evict(runner.prefill(ids, window_max=16), cfg)  # warm: one-off work left out
    pre = runner.prefill(ids, window_max=16)
    with DeviceOps() as ops:
        runner.evict(pre, cfg)
    return ops.counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 28])
    args = ap.parse_args(argv)
    print("policy-allocation: " + ", ".join(f"L={n}" for n in args.layers))
    for policy, allocation in CASES:
        counts = [sum(step_ops(n, policy, allocation).values()) for n in args.layers]
        print(f"{policy}-{allocation}: " + ", ".join(map(str, counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
