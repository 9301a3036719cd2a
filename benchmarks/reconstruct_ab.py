"""A/B of the reconstruction scorer on the replay's T4 needle prompts, question asked
AFTER compression (the strict test): recall of the window scorer against the
reconstruction scorer's aggregations (max, mean over the reconstruction queries), with
the uniform and the global allocation, at the budgets given. Entropy pooling, pages of
16, n_sink 4, window 32 (the replay's T4 settings).

    python benchmarks/reconstruct_ab.py [--contexts 500 1000 2000] [--budgets 0.2 0.5]
                                         [--page-size 16] [--json out.json]

Each prompt is prefilled once and reconstructed once (both aggregations come from the
same pass); every setting then plans and decodes on that prefill. Prints one row per
setting: prompts right, stored tokens (mean per prompt, from the compacted caches), and
the mean seconds of the prefill and of the reconstruction pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv import EvictionConfig, plan  # noqa: E402
from pagekv.measurement.replay.grid import FULL  # noqa: E402
from pagekv.runtime.reconstruct import as_profiles  # noqa: E402
from pagekv.runtime.runner import Planned  # noqa: E402
from pagekv.serving.study import PromptSpec, Study  # noqa: E402
from pagekv.tasks import default_max_new_tokens, score  # noqa: E402


def t4_specs(contexts) -> list[PromptSpec]:
    """The replay's T4 after-mode prompts (its seeds), for the given context lengths."""
    out = []
    for ci, ctx in enumerate(FULL.t4_contexts):
        if ctx not in contexts:
            continue
        for di, depth in enumerate(FULL.t4_depths):
            seed = 100 * ci + 10 * di
            out.append(PromptSpec(context_tokens=ctx, depth=depth, seed=seed, mode="after"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[500, 1000, 2000])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.5])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    study = Study.load("bundled")
    runner = study.runner
    base = EvictionConfig(policy="entropy", page_size=args.page_size, n_sink=4, window=32)
    rows: dict[str, dict] = {}
    times = {"prefill_s": [], "reconstruct_s": []}
    specs = t4_specs(set(args.contexts))
    for spec in specs:
        prep = study.prepare(spec)
        pre = prep.prefill
        times["prefill_s"].append(pre.timings["prefill_s"])
        scores = runner.reconstruction(pre)  # both aggregations from one pass
        times["reconstruct_s"].append(pre.timings["reconstruct_s"])
        for budget in args.budgets:
            settings = [("window", None, "uniform")]
            settings += [("reconstruct", agg, alloc) for agg in ("max", "mean")
                         for alloc in ("uniform", "global")]  # fmt: skip
            for scorer, agg, alloc in settings:
                cfg = base.replace(budget=budget, allocation=alloc)
                name = f"{scorer}{'/' + agg if agg else ''}, {alloc}, {100 * budget:g}%"
                try:
                    if scorer == "window":
                        planned = runner.plan_for(pre, cfg)
                    else:
                        prof = as_profiles(scores[agg])
                        p = plan(prof, pre.n_groups, cfg, backend=runner.backend)
                        planned = Planned(plan=p, scored_on="torch", score_s=0.0, plan_s=0.0)
                    res = runner.evaluate(
                        pre, cfg, max_new_tokens=default_max_new_tokens(prep.task), planned=planned
                    )
                except ValueError as e:  # an infeasible budget for a short prompt
                    print(f"{spec.context_tokens}/{spec.depth}: {name}: {e}", file=sys.stderr)
                    continue
                right = bool(score(res.answer, prep.task)["correct"])
                row = rows.setdefault(name, {"right": 0, "prompts": 0, "stored": 0})
                row["right"] += right
                row["prompts"] += 1
                row["stored"] += sum(map(sum, res.stored_tokens))
        print(f"done {spec.context_tokens} tokens, depth {spec.depth}", file=sys.stderr)
    print(f"{'setting':<34} {'right':>9} {'stored tokens (mean)':>22}")
    for name, r in rows.items():
        print(f"{name:<34} {r['right']:>4}/{r['prompts']:<4} {r['stored'] / r['prompts']:>22.0f}")
    mean = {k: sum(v) / len(v) for k, v in times.items() if v}
    print(
        f"prefill {mean['prefill_s']:.2f} s, reconstruction {mean['reconstruct_s']:.2f} s "
        f"(mean per prompt, {len(specs)} prompts)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "mean_s": mean}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
