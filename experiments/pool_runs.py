"""Pool `experiments/reconstruct_ab.py` runs on disjoint prompt sets (the held-out needles
of several seed offsets) into one JSON of the same shape: a row's counts and sums added
over the runs that have it, its prompts named with their run's seed offset, and the rows
at equal physical memory matched anew, per prompt, from the pooled runs.

    python experiments/pool_runs.py runs/needles_heldout*.json \
        --out runs/needles_heldout_pooled.json

A row is pooled only from runs that all have it (a sweep budget one run lacks is left
out, not counted on fewer prompts), and the runs must be on different prompts and share
the budgets, mode, contexts and physical page.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.physical_rows import (  # noqa: E402
    add_result,
    equal_physical_rows,
    matched_keys,
    new_row,
    peer_runs,
)

#: A row's per-prompt notes, pooled with the prompts' names: the needle's share kept,
#: and an adaptive page's choice and the shares it saw (`reconstruct_ab.py --adaptive`).
PER_PROMPT = ("retention", "page_sizes", "shares")

#: Settings every pooled run must share.
SHARED = ("budgets", "contexts", "curated", "mode", "physical_page", "page_size", "window")


def pool(runs: list[dict]) -> dict:
    """The pooled run of `runs` (each `{"rows": ..., "settings": ...}` as reconstruct_ab
    writes it). ValueError when two runs share a seed offset or differ in `SHARED`."""
    first = runs[0]["settings"]
    offsets = [r["settings"].get("seed_offset", 0) for r in runs]
    if len(set(offsets)) != len(offsets):
        raise ValueError(f"runs on the same prompts cannot be pooled (seed offsets {offsets})")
    for run in runs[1:]:
        for key in SHARED:
            if run["settings"].get(key) != first.get(key):
                raise ValueError(
                    f"runs differ in {key}: {first.get(key)!r}, {run['settings'].get(key)!r}"
                )
    matched = matched_keys(runs[0]["rows"])
    keys = [k for k in runs[0]["rows"] if k not in matched and all(k in r["rows"] for r in runs)]
    rows = {}
    for key in keys:
        row = new_row()
        for run, offset in zip(runs, offsets, strict=True):
            for label, p in run["rows"][key].get("per_prompt", {}).items():
                add_result(row, f"seeds+{offset}: {label}", p["right"], p["stored"], p["physical"])
            for field in PER_PROMPT:  # the per-prompt notes a row may carry
                for label, value in run["rows"][key].get(field, {}).items():
                    row.setdefault(field, {})[f"seeds+{offset}: {label}"] = value
        if all("pages" in run["rows"][key] for run in runs):  # ours: the kept pages' tokens
            row["pages"] = sum(run["rows"][key]["pages"] for run in runs)
        rows[key] = row
    settings = first.get("settings") or []
    names = list(peer_runs(rows))
    if settings and names:
        rows |= equal_physical_rows(rows, settings[0], first["budgets"], names)
    meta = {key: first.get(key) for key in SHARED} | {"seed_offsets": offsets, "settings": settings}
    return {"rows": rows, "settings": meta}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    pooled = pool([json.loads(f.read_text()) for f in args.files])
    args.out.write_text(json.dumps(pooled, indent=1))
    for name, r in pooled["rows"].items():
        physical = r.get("physical", 0) / max(r["prompts"], 1)
        print(f"{name:<64} {r['right']:>4}/{r['prompts']:<4} physical {physical:>9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
