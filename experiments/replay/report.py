"""Writing the replay's outputs: results.json, one CSV per table, figures, markdown.

Figures are plotly HTML that load plotly.js from its CDN (a few hundred kB each
instead of 4 MB); PNG copies are written only when `kaleido` is importable (it is
not on the CPU machines this project runs on; its 1.x versions also need a Chrome),
and `results.json` says which.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

from experiments.replay.store import clean


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 1e-3 and v != 0 else f"{v:.3f}".rstrip("0").rstrip(".")
    if isinstance(v, list):
        return "; ".join(str(x) for x in v)
    return str(v)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "_(no rows)_\n"
    cols = list(rows[0])
    head = "| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|\n"
    body = "".join("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |\n" for r in rows)
    return head + body


def write_csv(path: Path, rows: list[dict]) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys, first seen first
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow(
                {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()}
            )


def figures(out: Path, results: dict) -> dict:
    """HTML figures (and PNG when kaleido is importable), every one built by
    `pagekv.app.figures`. Returns {name: files}."""
    try:
        import plotly  # noqa: F401
    except ImportError as e:
        return {"error": f"plotly not importable: {e}"}
    from pagekv.app import figures as F

    try:
        import kaleido  # noqa: F401

        png = True
    except ImportError:
        png = False
    made = {}
    figs = {}
    tabs = results["tables"]
    r = results.get("shape", {}).get("r") or 3

    geoms = list(dict.fromkeys(row["geometry"] for row in tabs["T1_uor"]))  # in order, once
    for g in geoms:
        rows = [x for x in tabs["T1_uor"] if x["geometry"] == g and x["measurements"]]
        if rows:
            figs[f"t1_uor_{g}"] = F.uor_curve(
                [x["budget"] for x in rows],
                [x["uor_mean"] for x in rows],
                [x["uor_max"] for x in rows],
                r,
                title=f"T1: union overhead of head-independent selection ({g})",
            )
    scatter = results["_figures"]["scatter"]
    for g in geoms:
        series = {b: du for (geom, b), du in scatter.items() if geom == g}
        figs[f"t2_scatter_{g}"] = F.disagreement_scatter(
            series, r, f"T2: disagreement against UOR, every (layer, group) measurement ({g})"
        )
    if results["_figures"].get("t3"):
        import torch

        iso, raw = (  # [L, G] grids, None (no mixed group) as NaN
            torch.tensor([[float("nan") if v is None else v for v in row] for row in grid])
            for grid in results["_figures"]["t3"]
        )
        figs["t3_sink_advantage"] = F.sink_advantage_lines(
            iso, raw, title="T3: sink advantage per layer, with and without isolation"
        )
    rec = [x for x in tabs["T4_recall"] if x["recall"] is not None]
    if rec:
        figs["t4_recall"] = F.recall_bars(rec, "T4: needle recall by policy, budget and mode")
    if tabs["T7_answers"]:
        figs["t7_answers"] = F.answer_bars(
            tabs["T7_answers"], "T7: entropy against mean pooling, decoded answers"
        )
    for name, fig in figs.items():
        path = out / "figures" / f"{name}.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.write_html(str(path), include_plotlyjs="cdn", full_html=True)
        files = [str(path.relative_to(out))]
        if png:
            try:
                fig.write_image(str(path.with_suffix(".png")))
                files.append(str(path.with_suffix(".png").relative_to(out)))
            except Exception as e:  # kaleido present but no Chrome, ...
                files.append(f"png failed: {' '.join(str(e).split())[:120]}")
        made[name] = files
    made["png"] = "written" if png else "skipped: kaleido is not importable"
    return made


def tables_markdown(results: dict) -> str:
    """Every table of `results`, under a heading that names the command that made them."""
    meta = results.get("meta", {})
    head = ""
    if "command" in meta:
        head = (
            f"# The replay's tables: the `{meta.get('grid')}` grid on `{meta.get('model')}`\n\n"
            f"Made by `{meta['command']}`: its tables.md, every table of its results.json (a"
            " CSV each beside it). What they show: docs/research.md.\n\n"
        )
    return head + "\n".join(
        f"### {name}\n\n{markdown_table(rows)}" for name, rows in results["tables"].items()
    )


def write_all(out: Path, results: dict, update_presets: Path | None = None) -> None:
    """Write results.json, one CSV per table, figures, tables.md and presets.json into
    `out`; copy presets.json to `update_presets` only when asked (the app's tracked
    `assets/presets.json` changes only by `python -m pagekv replay --update-presets`)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in results["tables"].items():
        write_csv(out / f"{name}.csv", rows)
    results["figures"] = figures(out, results)
    results.pop("_figures", None)
    (out / "presets.json").write_text(
        json.dumps(clean(results["presets"]), indent=2) + "\n", encoding="utf-8"
    )
    if update_presets is not None:
        update_presets = Path(update_presets)
        update_presets.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "presets.json", update_presets)
        results["presets_copied_to"] = str(update_presets)
    (out / "tables.md").write_text(tables_markdown(results), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(clean(results), indent=1) + "\n", encoding="utf-8")
