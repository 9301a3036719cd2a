"""Needle results of every policy at several budgets on one fixed prompt.

Usage: python experiments/needle_budgets.py [--context 2000] [--depth 0.5] [--seed 0]
       [--budgets 0.05 0.1 0.2 0.5] [--page-size 16] [--modes inside after] [--json PATH]

One prefill per question mode; every (budget, policy) re-runs only planning,
compaction and greedy decoding. Prints a markdown table: the answer, whether it
is right, and the needle's mean retention over (layer, group).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagekv import POLICIES, BudgetError, EvictionConfig  # noqa: E402
from pagekv.engine.study import PromptSpec, Study  # noqa: E402
from pagekv.runtime.result import mean_retention  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["inside", "after"])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    study = Study.load(args.model, allow_fallback=False)
    rows = []
    spec = PromptSpec(task="needle", context=args.context, depth=args.depth, seed=args.seed)
    for mode in args.modes:
        prep = study.prepare(spec.replace(mode=mode))
        print(
            f"\n### question {mode}: {prep.n} prefilled tokens, expected "
            f"{prep.task.answer!r} ({prep.task.question})\n"
        )
        print("| budget | policy | kept/group | needle kept | right | answer |")
        print("|---|---|---|---|---|---|")
        for budget in args.budgets:
            for policy in POLICIES:
                if policy == "full" and budget != args.budgets[0]:
                    continue
                cfg = EvictionConfig(policy=policy, budget=budget, page_size=args.page_size)
                try:
                    res = study.run(prep, cfg, max_new_tokens=args.max_new_tokens)
                except BudgetError as e:
                    print(f"| {budget} | {policy} | - | - | - | infeasible: {e.min_budget:.3f} |")
                    continue
                ret, rec = mean_retention(res), res.to_dict()
                row = {
                    "mode": mode,
                    "budget": budget if policy != "full" else 1.0,
                    "policy": policy,
                    "kept": rec["kept_tokens"][0],
                    "needle_retention": ret,
                    "needle_kept_all": rec["needle_kept_all"],
                    "correct": rec["correct"],
                    "answer": rec["answer"],
                }
                rows.append(row)
                ans = rec["answer"].replace("|", "/").replace("\n", " ")
                print(
                    f"| {row['budget']} | {policy} | {row['kept']} | {ret:.2f} | "
                    f"{'yes' if rec['correct'] else 'no'} | {ans} |"
                )
    print(f"\n{time.perf_counter() - t0:.0f}s in all (model {study.loaded.name}, page size "
          f"{args.page_size}, n_sink 4, window 32, tau 1)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
