"""Where do mean and entropy pooling give different right/wrong verdicts? (issue 30)

Usage: python experiments/pooling_search.py [--model qwen-coder-0.5b] [--prompts N]
       [--modes inside after] [--out assets/results/pooling_search.jsonl]
       [--summary assets/results/pooling_search.json] [--minutes M]

For every prompt (single needles at 1000 and 2000 tokens and five depths, multi-needle
prompts with distractors, and the curated QA and code tasks; the seeds are new, never
used to choose a setting) and both question modes, one prefill; then for every setting
of `SETTINGS` (budget 2-20 %, pages of 1-32, tau 0.25-4, the window scorer with its
window of 32 in both modes, and with the question after, the reconstruct scorer with
its window of 8 and the budget shared globally) it plans `mean` and `entropy` under
the same settings (only the policy differs). Where the two plans keep exactly the same
tokens in every (layer, group), one decode serves both (the compacted caches are
identical, and greedy decoding is deterministic); otherwise each is decoded.
`max_weight` is entropy's largest head weight in each layer (over its groups), averaged
over the layers (mean's is 1/r = 0.14). A row per (prompt, mode, setting) goes to the
JSONL file as soon as it is measured, so a stopped run resumes where it stopped.

The summary counts, per setting and over all of them: prompt-settings where both are
right, both wrong, only mean right, only entropy right, and where the full cache itself
is wrong (kept in the counts, marked). It prints a markdown table of every setting with
a verdict that differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagekv import BudgetError, EvictionConfig  # noqa: E402
from pagekv.engine.study import PromptSpec, Study  # noqa: E402
from pagekv.paths import POOLING_SEARCH_PATH, POOLING_SEARCH_ROWS_PATH  # noqa: E402
from pagekv.tasks.curated import task_names  # noqa: E402

#: Seeds no earlier run of the project used (the replay's are 0-16).
SEED_BASE = 300


@dataclass(frozen=True)
class Setting:
    """One setting both policies are planned (and decoded) under."""

    scorer: str
    budget: float
    page_size: int = 16
    tau: float = 1.0

    @property
    def label(self) -> str:
        return f"{self.scorer} b{self.budget:g} P{self.page_size} tau{self.tau:g}"

    def config(self, policy: str) -> EvictionConfig:
        extra = {"scorer": "window", "allocation": "uniform", "window": 32}
        if self.scorer == "reconstruct":  # the replay's question-agnostic setting
            extra = {"scorer": "reconstruct", "allocation": "global", "window": 8}
        return EvictionConfig(
            policy=policy, budget=self.budget, page_size=self.page_size, tau=self.tau, **extra
        )


def _settings(scorer: str) -> tuple[Setting, ...]:
    out = [Setting(scorer, b) for b in (0.02, 0.03, 0.05, 0.1, 0.2)]  # pages of 16, tau 1
    for b in (0.05, 0.1):
        out += [Setting(scorer, b, page_size=page) for page in (1, 4, 32)]
        out += [Setting(scorer, b, tau=tau) for tau in (0.25, 4.0)]
    return tuple(out)


#: The settings of each question mode: the window scorer in both; the reconstruct
#: scorer (question-agnostic, made for the question asked after) only after, where it
#: is meant to be used (its pass costs about 40 s per 2000-token prompt here).
SETTINGS = {
    "after": _settings("window") + _settings("reconstruct"),
    "inside": _settings("window"),
}


def prompt_specs(mode: str) -> list[PromptSpec]:
    """The prompts of the search (31: 15 single needles, 5 multi-needle, 11 curated)."""
    singles = [
        (context, depth)
        for context in (1000, 2000)
        for depth in (0.1, 0.3, 0.5, 0.7, 0.9)
        for _ in range(2 if context == 1000 else 1)
    ]
    specs = [
        PromptSpec(task="needle", context=c, depth=d, seed=SEED_BASE + i, mode=mode)
        for i, (c, d) in enumerate(singles)
    ] + [
        PromptSpec(task="needle", context=1500, needles=k, seed=SEED_BASE + 50 + s, mode=mode)
        for k, s in ((2, 1), (3, 2), (4, 3), (2, 4), (3, 5))
    ]
    curated = [
        PromptSpec(task=k, curated=n, mode=mode) for k in ("qa", "code") for n in task_names(k)
    ]
    # Interleaved (a needle, a curated task, ...) so that a run stopped early has both.
    out = []
    while specs or curated:
        out += [x.pop(0) for x in (specs, curated) if x]
    return out


def prompt_id(spec: PromptSpec) -> str:
    if spec.task == "needle":
        return f"needle n{spec.context} d{spec.depth} x{spec.needles} s{spec.seed}"
    return f"{spec.task} {spec.curated}"


def measure(study: Study, prep, setting: Setting) -> dict:
    """One row: both policies' verdicts under `setting` on the prepared prompt."""
    row = {"setting": setting.label, **asdict(setting)}
    try:
        plans = {p: study.plan(prep, setting.config(p)) for p in ("mean", "entropy")}
    except BudgetError as e:
        row.update(infeasible=True, min_budget=round(float(e.min_budget), 4))
        return row
    keep_m, keep_e = plans["mean"].keep, plans["entropy"].keep
    same = bool((keep_m == keep_e).all())
    row.update(
        infeasible=False,
        same_kept=same,
        kept_overlap=round(float((keep_m & keep_e).sum() / max(int(keep_e.sum()), 1)), 4),
        max_weight=round(float(plans["entropy"].head_weights.max(-1).values.mean()), 4),
    )
    records = {"mean": study.run(prep, setting.config("mean"))}
    records["entropy"] = records["mean"] if same else study.run(prep, setting.config("entropy"))
    for policy, rec in records.items():
        row[policy] = {
            "correct": bool(rec.correct),
            "answer": rec.answer,
            "needle_kept_all": rec.needle_kept_all,
        }
    return row


#: What `summarize` counts per setting and mode (the `only_` ones list the prompts).
COUNTS = (
    "measured infeasible both_right both_wrong only_mean only_entropy same_kept full_wrong"
).split()


def summarize(rows: list[dict]) -> dict:
    """Counts per setting and in all (see the module docstring)."""
    per: dict[str, dict] = {}
    for r in rows:
        setting = {k: r[k] for k in ("setting", "scorer", "budget", "page_size", "tau")}
        c = per.setdefault(r["setting"], setting | {"mode": {}})
        m = c["mode"].setdefault(r["mode"], {k: [] if k.startswith("only_") else 0 for k in COUNTS})
        if r["infeasible"]:
            m["infeasible"] += 1
            continue
        m["measured"] += 1
        m["same_kept"] += int(r["same_kept"])
        m["full_wrong"] += int(not r["full_correct"])
        a, b = r["mean"]["correct"], r["entropy"]["correct"]
        if a == b:
            m["both_right" if a else "both_wrong"] += 1
        else:
            m["only_mean" if a else "only_entropy"].append(r["prompt"])
    total = {"measured": 0, "infeasible": 0, "only_mean": 0, "only_entropy": 0, "same_kept": 0}
    for c in per.values():
        for m in c["mode"].values():
            for k in total:  # the `only_` counts are lists of prompts
                total[k] += len(m[k]) if k.startswith("only_") else m[k]
    return {"settings": list(per.values()), "total": total}


def _markdown(summary: dict) -> str:
    """Every setting and mode: prompts measured (infeasible ones apart), how many each
    policy answered right, and where only one did."""
    lines = [
        "| setting | question | measured (infeasible) | mean right | entropy right | "
        "only mean right | only entropy right |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in summary["settings"]:
        for mode, m in c["mode"].items():
            om, oe = len(m["only_mean"]), len(m["only_entropy"])
            mark = "**" if om or oe else ""
            lines.append(
                f"| {c['setting']} | {mode} | {m['measured']} ({m['infeasible']}) | "
                f"{m['both_right'] + om} | {m['both_right'] + oe} | {mark}{om}{mark} | "
                f"{mark}{oe}{mark} |"
            )
    t = summary["total"]
    lines.append(
        f"\nIn all: {t['measured']} prompt-settings measured ({t['infeasible']} infeasible), "
        f"the same kept set on {t['same_kept']}; only mean right on {t['only_mean']}, "
        f"only entropy right on {t['only_entropy']}."
    )
    return "\n".join(lines)


def _search(study: Study, args, done: set, rows: list, t0: float) -> None:
    """Measure every (prompt, mode, setting) not in `done`, appending to `args.out`."""
    for spec in prompt_specs("inside")[: args.prompts]:
        for mode in args.modes:
            spec = spec.replace(mode=mode)
            pid = prompt_id(spec)
            todo = [s for s in SETTINGS[mode] if (pid, mode, s.label) not in done]
            if not todo:
                continue
            if args.minutes is not None and time.perf_counter() - t0 > 60 * args.minutes:
                print(f"stopped after {args.minutes} minutes; run again to resume")
                return
            t1 = time.perf_counter()
            prep = study.prepare(spec)
            full = study.run_full(prep)
            with open(args.out, "a") as f:
                for s in todo:
                    row = {"prompt": pid, "mode": mode, "n": prep.n, **measure(study, prep, s)}
                    row["full_correct"] = bool(full["correct"])
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
            for memo in (study.prefills, study.results, study.plans):
                memo.clear()
            print(
                f"{mode} {pid}: {prep.n} tokens, full {'right' if full['correct'] else 'wrong'}, "
                f"{len(todo)} settings in {time.perf_counter() - t1:.0f} s "
                f"({(time.perf_counter() - t0) / 60:.1f} min in all)",
                flush=True,
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen-coder-0.5b")
    ap.add_argument("--modes", nargs="+", default=["after", "inside"])
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--out", default=str(POOLING_SEARCH_ROWS_PATH))
    ap.add_argument("--summary", default=str(POOLING_SEARCH_PATH))
    ap.add_argument("--minutes", type=float, default=None, help="stop starting prompts after")
    ap.add_argument(
        "--summarize-only", action="store_true", help="rewrite the summary from --out, no model"
    )
    args = ap.parse_args(argv)

    rows = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = [json.loads(line) for line in f]
    done = {(r["prompt"], r["mode"], r["setting"]) for r in rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    t0 = time.perf_counter()
    if not args.summarize_only:
        study = Study.load(args.model, allow_fallback=False)
        print(f"{study.loaded.name}: {study.loaded.origin}, r = {study.loaded.group_size}")
        _search(study, args, done, rows, t0)
    summary = summarize(rows)
    summary["model"] = args.model
    summary["command"] = f"python experiments/pooling_search.py --model {args.model}"
    with open(args.summary, "w") as f:
        json.dump(summary, f, indent=1)
    print(_markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
