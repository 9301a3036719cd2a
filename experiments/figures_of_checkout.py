"""The figures of one fixed app run of a checkout, as plotly JSON, so two checkouts (say,
before and after moving code around) can be compared figure by figure.

Usage: python experiments/figures_of_checkout.py --out A.json [--tree PATH]
       python experiments/figures_of_checkout.py --compare A.json B.json

`--tree` imports `pagekv` from another checkout, e.g. a `git worktree` of an older
commit. The run: the app's own handler (`run_comparison`, what the Run button calls) on
the bundled model, a 600-token needle prompt with the question after, mean against
entropy at 20 % in pages of 16; every figure among the handler's last outputs is kept
(the plotly JSON the page receives), in output order, with the answers table but its
seconds (the status line, which holds seconds too, is printed, not compared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

RUN = dict(task="needle", context=600, depth=0.5, mode="after", budget_pct=20.0, seed=7)


def figures(tree: str) -> dict:
    """`{"status": str, "answers": HTML, "figures": [plotly JSON, ...]}` of the fixed run
    in `tree`."""
    sys.path.insert(0, tree)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        from pagekv.app import handlers
    except ModuleNotFoundError:  # a checkout from before the app's parts were pagekv/app
        from pagekv.views import app_ui as handlers
    *_, last = handlers.run_comparison(**RUN)
    texts = [x for x in last if isinstance(x, str)]
    status = next(x for x in texts if x.startswith("**"))
    # The answers table, its cells of seconds left out (they differ from run to run).
    table = next(x for x in texts if x.startswith("<table"))
    answers = re.sub(r'<td class="num">[\d.,]+ m?s</td>', '<td class="num">(time)</td>', table)
    figs = [json.loads(x.plot) for x in last if type(x).__name__ == "PlotData"]
    return {"status": status, "answers": answers, "figures": figs}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same = [x == y for x, y in zip(a["figures"], b["figures"], strict=False)]
    print(f"{a_path}: {len(a['figures'])} figures\n{b_path}: {len(b['figures'])} figures")
    for i, s in enumerate(same):
        if not s:
            title = a["figures"][i].get("layout", {}).get("title", {}).get("text")
            print(f"DIFF figure {i}: {title}")
    equal = len(a["figures"]) == len(b["figures"]) and all(same)
    tables = a["answers"] == b["answers"]
    print(f"{a_path}: {a['status']}\n{b_path}: {b['status']}")
    print(f"{sum(same)} of {max(len(a['figures']), len(b['figures']))} figures the same JSON; "
          f"the answers tables {'the same' if tables else 'differ'}")  # fmt: skip
    return 0 if equal and tables else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures here")
    ap.add_argument("--tree", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        ap.error("--out or --compare is required")
    got = figures(os.path.abspath(args.tree))
    with open(args.out, "w") as f:
        json.dump(got, f)
    print(f"{len(got['figures'])} figures -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
