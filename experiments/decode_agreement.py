"""Which prompts decode the same tokens with the default decode as with float32.

Usage: python experiments/decode_agreement.py [--dtype auto] [--json PATH]

On the bundled model, every curated task (`assets/tasks`) in both question modes, and
the needle prompts of 1k, 2k and 4k tokens, each decoded with the full cache and with
entropy pooling at 20 % (pages of 16) and at 50 %, by two runners on the same prefill:
the decode step with float32 linear weights (`--dtype float32`, the prefill's numerics:
the baseline; before issue 40 it was the model's own transformers forward, which
docs/decode_agreement.json records) and the runner's default (`--dtype auto`: float16
linear weights on the CPU). Prints
per case whether the tokens are identical and whether each answer is right, then the
counts; the app's lessons are checked with `python -m pagekv lessons --check`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagekv import EvictionConfig  # noqa: E402
from pagekv.engine.study import PromptSpec, Study  # noqa: E402
from pagekv.runtime.decode import DECODE_DTYPES  # noqa: E402
from pagekv.runtime.models import load_model  # noqa: E402
from pagekv.tasks import load_tasks  # noqa: E402

CONFIGS = {
    "full": EvictionConfig(policy="full"),
    "entropy 20%": EvictionConfig(policy="entropy", budget=0.2, page_size=16),
    "entropy 50%": EvictionConfig(policy="entropy", budget=0.5, page_size=16),
}


def specs() -> list[PromptSpec]:
    return [
        PromptSpec(task=t.kind, curated=t.name, mode=mode)
        for t in load_tasks()
        for mode in t.meta["modes"]
    ] + [
        PromptSpec(task="needle", context=n, depth=0.5, seed=0, mode=mode)
        for n in (1000, 2000, 4000)
        for mode in ("inside", "after")
    ]


def case_rows(spec: PromptSpec, studies, preps, other: str, shown: str) -> list[dict]:
    """One prompt's cases: each of `CONFIGS` run by the baseline and the other study of
    `studies` on their own prepared prompt of `preps`, printed as they come. A row says
    whether the two decode the same answer tokens and whether each answer is right
    (`correct_float32` and `correct_<other>`; `shown` is the other's name in the print).
    A budget below the protected pages is not a case."""
    rows = []
    n = preps[0].n
    for label, cfg in CONFIGS.items():
        try:
            pairs = zip(studies, preps, strict=True)
            a, b = (study.run(prep, cfg).to_dict() for study, prep in pairs)
        except ValueError as e:  # a budget below the protected pages: not a case
            print(f"skip {spec.task} {spec.curated or spec.context} {label}: {e}")
            continue
        row = {
            "task": spec.task,
            "name": spec.curated or f"{n} tokens",
            "mode": spec.mode,
            "config": label,
            "same_tokens": a["tokens"] == b["tokens"],
            "correct_float32": bool(a["correct"]),
            f"correct_{other}": bool(b["correct"]),
            "answer_float32": a["answer"],
            f"answer_{other}": b["answer"],
        }
        rows.append(row)
        mark = "same" if row["same_tokens"] else "DIFF"
        print(
            f"{mark:5} {row['task']:7} {row['name'][:28]:28} {row['mode']:7} {label:12} "
            f"right: f32 {row['correct_float32']!s:5} {shown} {row[f'correct_{other}']!s:5}"
            + ("" if row["same_tokens"] else f"  {a['answer']!r} | {b['answer']!r}")
        )
    return rows


def counts(rows: list[dict], other: str) -> str:
    """How many cases decode the same tokens, and in how many the verdict differs."""
    same = sum(r["same_tokens"] for r in rows)
    flips = sum(r["correct_float32"] != r[f"correct_{other}"] for r in rows)
    return (
        f"{same} of {len(rows)} cases decode the same tokens; the verdict (right/wrong) "
        f"differs in {flips}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", choices=DECODE_DTYPES)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    loaded = load_model("bundled")
    base = Study(loaded, decode_dtype="float32")
    study = Study(loaded, decode_dtype=args.dtype)
    print(f"baseline: {base.runner.decode_path}; default: {study.runner.decode_path}")
    rows = []
    t0 = time.perf_counter()
    for spec in specs():
        prep = study.prepare(spec)
        rows += case_rows(spec, (base, study), (prep, prep), "default", "default")
    print(f"\n{counts(rows, 'default')}; {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            meta = {"baseline": base.runner.decode_path, "default": study.runner.decode_path}
            json.dump({**meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
