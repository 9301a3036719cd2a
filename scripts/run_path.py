"""The files of this repository one app run enters, in the order it first enters them.

    python scripts/run_path.py [--tree CHECKOUT] [--json]

Runs one comparison through the app's own handler (`run_comparison`, as the page's Run
button does) on the bundled model, on a prompt no run has prefilled: prefill, scoring,
planning, compaction, decoding, the result and its figures. The model is loaded first,
untraced. Every Python call made meanwhile, on every thread (the model worker's
included), is recorded by `sys.setprofile` / `threading.setprofile`; the printout lists
the repository's files entered (`pagekv/`, `kernels/`, `app.py`), counts the calls
that cross from one of them into another, and lists every climb: a call from the library
(`pagekv/` outside `pagekv/app/`, `kernels/`) into the app (`pagekv/app/`, `app.py`),
as `caller file:function -> callee file:function` with its count. `--tree` measures
another checkout the same way (its handler module is `pagekv.app.handlers`, or
`pagekv.views.app_ui` before the app's parts were one folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args()
    root = Path(args.tree).resolve()
    sys.path.insert(0, str(root))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        from pagekv.app import handlers
    except ModuleNotFoundError:
        from pagekv.views import app_ui as handlers  # the layout before pagekv/app
    inputs = dict(task="needle", context=600, depth=0.5, mode="after", budget_pct=20.0)
    ours = (str(root / "pagekv") + os.sep, str(root / "kernels") + os.sep)
    entered: dict[str, int] = {}  # file -> calls into it from another file
    climbs: dict[str, int] = {}  # "library file:function -> app file:function" -> calls
    lock = threading.Lock()
    active = threading.Event()  # set while the traced run runs

    def rel(path: str) -> str | None:
        if path.startswith(ours) or path == str(root / "app.py"):
            return os.path.relpath(path, root)
        return None

    def is_app(path: str) -> bool:
        return path.startswith("pagekv/app/") or path == "app.py"

    def profile(frame, event, arg):
        if event != "call" or not active.is_set():
            return
        callee = rel(frame.f_code.co_filename)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and rel(caller.f_code.co_filename) is None:
            caller = caller.f_back  # through torch, transformers or the standard library
        origin = None if caller is None else rel(caller.f_code.co_filename)
        if origin != callee:
            with lock:
                entered[callee] = entered.get(callee, 0) + 1
                if origin is not None and is_app(callee) and not is_app(origin):
                    key = f"{origin}:{caller.f_code.co_name} -> {callee}:{frame.f_code.co_name}"
                    climbs[key] = climbs.get(key, 0) + 1

    # Installed before any thread starts (the model worker starts on the first run), and
    # active only during the traced run.
    threading.setprofile(profile)
    sys.setprofile(profile)
    for _ in handlers.run_comparison(**inputs, seed=101):  # loads the model, untraced
        pass
    active.set()
    try:
        for _ in handlers.run_comparison(**inputs, seed=202):  # a prompt of its own
            pass
    finally:
        active.clear()
        sys.setprofile(None)
        threading.setprofile(None)
    files = list(entered)
    if args.json:
        out = {"tree": str(root), "files": entered, "count": len(files), "climbs": climbs}
        print(json.dumps(out))
        return 0
    print(f"{len(files)} files of {root} entered by one app run, in order:")
    for f in files:
        print(f"  {f}  ({entered[f]} calls in from another file)")
    print(f"calls crossing into another file: {sum(entered.values())}")
    print(f"calls from the library into the app: {sum(climbs.values())}")
    for key, count in climbs.items():
        print(f"  {key}  ({count})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
