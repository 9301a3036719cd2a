"""The answer tokens of a checkout: every curated task and needle prompt under every
policy family, written to JSON, so two checkouts (say, before and after a change to the
decode) can be compared token by token.

Usage: python experiments/answers_of_checkout.py --out A.json [--tree PATH] [--dtype auto]
       python experiments/answers_of_checkout.py --compare A.json B.json

`--tree` imports `pagekv` from another checkout (its `Study`, `Runner.evaluate` and
`EvictionConfig`, the API this script uses), e.g. a `git worktree` of an older commit.
On the bundled model:
every curated task (`assets/tasks`) in its question modes, and needle prompts of 1k and
2k tokens in both modes; per prompt one prefill and at most 24 greedy tokens (to the
first EOS) under each configuration of `CONFIGS` (full; entropy, mean and max pooling;
head-independent; recency; entropy with global and per-layer allocation; pages of
16). Each case also records, per decoded step, its two largest logits (`top2`).
`--compare` prints the cases whose tokens differ, with both files' two largest logits
at the first step where they part (two equal logits are an exact tie, which `argmax`
breaks toward the lower token id), and the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONFIGS = {
    "full": dict(policy="full"),
    "entropy 20%": dict(policy="entropy", budget=0.2, page_size=16),
    "mean 20%": dict(policy="mean", budget=0.2, page_size=16),
    "max 20%": dict(policy="max", budget=0.2, page_size=16),
    "head_independent 20%": dict(policy="head_independent", budget=0.2, page_size=16),
    "streaming 20%": dict(policy="streaming", budget=0.2, page_size=16),
    "entropy 20% global": dict(policy="entropy", budget=0.2, page_size=16, allocation="global"),
    "entropy 20% layer": dict(policy="entropy", budget=0.2, page_size=16, allocation="layer"),
}
NEW_TOKENS = 24


def answers(tree: str, dtype: str) -> dict:
    """`{"decode": ..., "tokens": {case: tokens}, "top2": {case: [[logit, logit], ...]}}`:
    every prompt and configuration decoded by `tree`'s code, with each step's two largest
    logits."""
    sys.path.insert(0, tree)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pagekv import EvictionConfig

    try:
        from pagekv.engine.study import PromptSpec, Study
    except ModuleNotFoundError:  # a checkout from before the engine was library code
        try:
            from pagekv.engine.study import PromptSpec, Study
        except ModuleNotFoundError:  # from before the app's parts were pagekv/app
            from pagekv.serving.study import PromptSpec, Study
    from pagekv.runtime.models import load_model
    from pagekv.tasks import load_tasks

    study = Study(load_model("bundled"), decode_dtype=dtype, result_memo_bytes=0)
    specs = [PromptSpec(task=t.kind, curated=t.name, mode=m) for t in load_tasks()
             for m in t.meta["modes"]]  # fmt: skip
    specs += [PromptSpec(task="needle", context=n, depth=0.5, seed=0, mode=m)
              for n in (1000, 2000) for m in ("inside", "after")]  # fmt: skip
    out, top2 = {}, {}
    for spec in specs:
        prep = study.prepare(spec)
        for label, kw in CONFIGS.items():
            case = f"{spec.task} {spec.curated or prep.n} {spec.mode} {label}"
            try:
                # The runner's own evaluate (what Study.run calls), with each step's logits.
                res = study.runner.evaluate(prep.prefill, EvictionConfig(**kw), NEW_TOKENS,
                                            return_logits=True)  # fmt: skip
            except ValueError as e:  # a budget below the protected pages: refused
                out[case] = f"refused: {e}"
                continue
            out[case] = res.tokens
            best = res.logits.topk(2, dim=-1).values.tolist()  # [steps, 2]
            top2[case] = [[round(v, 6) for v in step] for step in best]
    return {"decode": study.runner.decode_path, "tokens": out, "top2": top2}


def write(got: dict, path: str) -> None:
    """`answers`' JSON with one line per case (readable diffs, a small file)."""

    def section(d: dict) -> str:
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in d.items()) + "}"

    body = ",\n".join(
        f" {json.dumps(k)}: {section(v) if isinstance(v, dict) else json.dumps(v)}"
        for k, v in got.items()
    )
    with open(path, "w") as f:
        f.write("{\n" + body + "\n}\n")


def parting(a: list, b: list) -> int | None:
    """The first step where two token lists differ (None if they are equal)."""
    if a == b:
        return None
    pairs = enumerate(zip(a, b, strict=False))  # a shorter list ends where it stops
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    cases = sorted(set(a["tokens"]) | set(b["tokens"]))
    differ = [c for c in cases if a["tokens"].get(c) != b["tokens"].get(c)]
    print(f"{a_path}: {a['decode']}\n{b_path}: {b['decode']}")
    for c in differ:
        ta, tb = a["tokens"].get(c), b["tokens"].get(c)
        print(f"DIFF {c}\n  {ta}\n  {tb}")
        at = parting(ta, tb) if isinstance(ta, list) and isinstance(tb, list) else None
        la, lb = (f.get("top2", {}).get(c) for f in (a, b))
        if at is not None and la and lb and at < min(len(la), len(lb)):
            print(f"  they part at step {at}: two largest logits {la[at]} and {lb[at]}")
    print(f"{len(cases) - len(differ)} of {len(cases)} cases decode the same tokens")
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the answers here")
    ap.add_argument("--tree", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out or --compare is required")
    t0 = time.perf_counter()
    got = answers(os.path.abspath(args.tree), args.dtype)
    write(got, args.out)
    print(f"{len(got['tokens'])} cases in {time.perf_counter() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
