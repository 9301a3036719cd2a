"""Where a budget release's time goes, in one process, threaded as the app is.

Usage: python benchmarks/bench_release.py [--budgets 12 15 18 22 25 30] [--dtype auto]
                                          [--json PATH]

The app's first preset (2000 tokens, question after compression). The main thread
serves the model worker (`WORKER.serve_forever`, as `python app.py` does) and a second
thread plays the request threads: for each budget it sends what dragging the slider
sends (`preview_plans`: the plan views) and then what releasing it sends
(`run_comparison`, the handler behind `/budget`), and times the release from the call to
its last update. Then, for each budget, its parts on their own (a budget + 0.5
percentage points, so nothing is served from a memo of finished runs): the plan of
both sides; the decode of the pair (the full cache is memoised per prompt, as in the
app); the views drawn while the pair decodes, with the figures drawn once per content
(`pagekv.app.run_figures.memo_figure`, in the study's plan memo) warm, as on a release,
and without that memo; and the retention view drawn after decoding.

In the app the views are drawn on the request thread while the model decodes on the
main thread, so a release is not the sum of its parts: on 2 cores they compete.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import app  # noqa: E402
from pagekv.app import handlers  # noqa: E402
from pagekv.app.run_figures import (
    SAME_AFTER_DECODING,  # noqa: E402
    comparison_figures,  # noqa: E402
)
from pagekv.app.run_inputs import (
    RunInputs,  # noqa: E402
    parse_run,  # noqa: E402
)
from pagekv.engine.comparison import Decoding, preview_comparison
from pagekv.engine.worker import WORKER  # noqa: E402
from pagekv.runtime.decode import DECODE_DTYPES  # noqa: E402


def release(run: dict, pct: float) -> dict:
    """Preview then release at `pct` %, as a client would; seconds."""
    kw = dict(run, budget_pct=pct, budget_b=pct)
    t0 = time.perf_counter()
    handlers.preview_plans(*[kw[k] for k in app.RUN_DEFAULTS])
    t1 = time.perf_counter()
    first = None
    for _ in handlers.run_comparison(**kw):
        first = time.perf_counter() - t1 if first is None else first
    return {"preview_s": t1 - t0, "release_s": time.perf_counter() - t1, "first_s": first}


def parts(run: dict, pct: float) -> dict:
    """The parts of a release at `pct` %, each on its own; seconds."""
    kw = dict(run, budget_pct=pct, budget_b=pct)
    spec, a, b, layer = parse_run(RunInputs(**kw))
    study = handlers.get_study(kw["model"])
    t0 = time.perf_counter()
    comp = preview_comparison(study, spec, a, b)
    t1 = time.perf_counter()
    for _ in Decoding(study, comp).stream():
        pass
    t2 = time.perf_counter()
    skip = {*SAME_AFTER_DECODING, "retention"}
    comparison_figures(comp, layer=layer, skip=skip, memo=study.plans)  # warm (the release's)
    t3 = time.perf_counter()
    comparison_figures(comp, layer=layer, skip=skip)  # no memo: every view drawn
    t4 = time.perf_counter()
    comparison_figures(comp, layer=layer, only={"retention"})
    t5 = time.perf_counter()
    return {
        "plan_s": t1 - t0,
        "pair_decode_s": t2 - t1,
        "pair_tokens": max(len(comp.records[k].tokens) for k in "AB"),
        "views_during_decode_s": t3 - t2,
        "views_during_decode_unmemoised_s": t4 - t3,
        "retention_view_s": t5 - t4,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=[12, 15, 18, 22, 25, 30])
    ap.add_argument("--dtype", default="auto", choices=DECODE_DTYPES, help="the decode")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    handlers.configure("bundled", decode_dtype=args.dtype)
    run = handlers._preset_run_args(app.PRESETS[0]).as_dict()
    out: dict = {}

    def client():
        try:
            for _ in handlers.run_comparison(**run):  # the prefill, the first run
                pass
            out["rows"] = [
                {"budget_pct": p, **release(run, p), **parts(run, p + 0.5)} for p in args.budgets
            ]
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            out["error"] = e
        finally:
            stop.set()

    stop = threading.Event()
    threading.Thread(target=client, name="client", daemon=True).start()
    WORKER.serve_forever(stop)
    if "error" in out:
        raise out["error"]
    rows = out["rows"]
    cols = (
        ("budget_pct", "budget %", "{:.0f}"),
        ("release_s", "release", "{:.2f}"),
        ("first_s", "1st update", "{:.2f}"),
        ("plan_s", "plan", "{:.2f}"),
        ("pair_decode_s", "pair decode", "{:.2f}"),
        ("pair_tokens", "tokens", "{:d}"),
        ("views_during_decode_s", "views (memo)", "{:.3f}"),
        ("views_during_decode_unmemoised_s", "views (drawn)", "{:.3f}"),
        ("retention_view_s", "retention", "{:.3f}"),
    )
    print(f"decode: {handlers.get_study('bundled').runner.decode_path}; seconds")
    print("".join(f"{h:>14}" for _, h, _ in cols))
    for r in rows:
        print("".join(f"{f.format(r[k]):>14}" for k, _, f in cols))
    med = {k: statistics.median(r[k] for r in rows) for k, _, _ in cols[1:]}
    print("median" + "".join(f"{f.format(med[k]) if k != 'pair_tokens' else '':>14}"
                             for k, _, f in cols[1:]))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"decode": args.dtype, "rows": rows, "median": med}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
