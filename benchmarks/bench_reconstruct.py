"""The reconstruction scorer's pass against the prefill it follows, on the bundled model.

Usage: python benchmarks/bench_reconstruct.py [--sizes 1000 2000] [--model bundled]
       [--repeats 3] [--json PATH] [--profile]

Per prompt size (a needle prompt of that many context tokens): the prefill's seconds
(the baseline, `Runner.prefill`), the reconstruction pass's seconds
(`Runner.reconstruction`: the instruction, then the context again in chunks, scored as
it goes) and their ratio, each the fastest of `--repeats` alternated runs in this
process, so both see the same machine. The CPU's model, flags, cores and load average
are printed and written with the rows (a timing means little without them).
`--profile` then prints torch.profiler's costliest operations of one more pass on the
last size (where the pass's seconds go).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.runtime.machine import cpu_facts  # noqa: E402
from pagekv.runtime.models import load_model  # noqa: E402
from pagekv.runtime.runner import Runner  # noqa: E402
from pagekv.tasks.needle import make_needle_task  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs; the fastest kept")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--profile", action="store_true", help="the ops of one more pass")
    args = ap.parse_args(argv)

    loaded = load_model(args.model)
    runner = Runner(loaded.model, loaded.tokenizer)
    cpu = cpu_facts()
    print(
        f"model {loaded.name} on {loaded.device}, {loaded.dtype}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; backend {runner.backend}\n"
        f"cpu {cpu['model']} ({', '.join(cpu['flags']) or 'no listed flags'}), "
        f"{cpu['cores']} cores, load {cpu['loadavg_1_5_15']}"
    )
    hdr = f"{'tokens':>7}{'prefill s':>11}{'reconstruct s':>15}{'ratio':>8}"
    print(hdr, "-" * len(hdr), sep="\n")
    rows = []
    for size in args.sizes:
        task = make_needle_task(loaded.tokenizer, context_tokens=size, depth=0.5, seed=0)
        ids = task.build_prompt_ids(loaded.tokenizer)["input_ids"]
        prefill_s, recon_s = [], []
        runner.reconstruction(runner.prefill(ids))  # warm: first-call allocations
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            pre = runner.prefill(ids)
            prefill_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            runner.reconstruction(pre)
            recon_s.append(time.perf_counter() - t0)
        row = {
            "prompt_tokens": len(ids),
            "prefill_s": min(prefill_s),
            "reconstruct_s": min(recon_s),
            "ratio": min(recon_s) / min(prefill_s),
        }
        rows.append(row)
        print(
            f"{row['prompt_tokens']:>7}{row['prefill_s']:>11.2f}{row['reconstruct_s']:>15.2f}"
            f"{row['ratio']:>8.2f}",
            flush=True,
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        pre = runner.prefill(ids)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.reconstruction(pre)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.json:
        out = {"model": loaded.name, "dtype": str(loaded.dtype), "cpu": cpu, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
