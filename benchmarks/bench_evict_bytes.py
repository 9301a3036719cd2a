"""The bytes one run allocates from its plan to its first decode step, on the bundled model.

Usage: python benchmarks/bench_evict_bytes.py [--sizes 2000] [--model bundled] [--json PATH]

Per prompt size (a needle prompt of that many context tokens) and eviction (entropy at
20 % in pages of 16, head-independent, and entropy with the global allocation), the
bytes of every new tensor the runner makes while it evicts (`Runner.evict`) and gathers
the kept tokens into the decode cache (`Runner.decode_cache`, with room for 24 answer
tokens), counted by a `TorchDispatchMode` (views and writes into a given tensor are not
new), beside the decode pool's bytes and the kept keys' and values' bytes. The run's
one copy of K and V is the pool; what is allocated beyond it is indices and tables.
`tests/test_paged_cache.py` checks the same bound on a small model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv import EvictionConfig  # noqa: E402
from pagekv.runtime.models import load_model  # noqa: E402
from pagekv.runtime.runner import Runner  # noqa: E402
from pagekv.tasks.needle import make_needle_task  # noqa: E402

CONFIGS = {
    "entropy": EvictionConfig(policy="entropy", budget=0.2, page_size=16),
    "head_independent": EvictionConfig(policy="head_independent", budget=0.2, page_size=16),
    "entropy, global": EvictionConfig(
        policy="entropy", budget=0.2, page_size=16, allocation="global"
    ),
}


class Allocations(TorchDispatchMode):
    """The bytes of every new storage an op makes while the mode is on."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.nbytes += t.untyped_storage().nbytes()
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2000])
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    loaded = load_model(args.model)
    runner = Runner(loaded.model, loaded.tokenizer)
    mib = 2**20
    hdr = (
        f"{'tokens':>7}  {'eviction':<18}{'kept MiB':>9}{'pool MiB':>9}"
        f"{'allocated MiB':>14}{'/ pool':>8}"
    )
    print(f"model {loaded.name}, {loaded.dtype}, backend {runner.backend}", hdr, sep="\n")
    print("-" * len(hdr))
    rows = []
    for size in args.sizes:
        task = make_needle_task(loaded.tokenizer, context_tokens=size, depth=0.5, seed=0)
        pre = runner.prefill(task.build_prompt_ids(loaded.tokenizer)["input_ids"])
        for name, cfg in CONFIGS.items():
            planned = runner.plan(pre, cfg)
            with torch.inference_mode(), Allocations() as made:
                ev = runner.evict(pre, cfg, planned)
                cache = runner.decode_cache([ev], pre, 24)
            row = {"tokens": pre.n, "eviction": name, "kept_bytes": ev.kept_bytes,
                   "pool_bytes": cache.nbytes, "allocated_bytes": made.nbytes}  # fmt: skip
            rows.append(row)
            print(
                f"{pre.n:>7}  {name:<18}{ev.kept_bytes / mib:>9.2f}{cache.nbytes / mib:>9.2f}"
                f"{made.nbytes / mib:>14.2f}{made.nbytes / cache.nbytes:>8.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": loaded.name, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
