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

from .store import clean

#: Points per budget in the T2 scatter (deterministic thinning keeps files < 1 MB).
SCATTER_POINTS = 1500
ASSETS_PRESETS = Path(__file__).resolve().parents[2] / "assets" / "presets.json"


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


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "_(no rows)_\n"
    cols = columns or list(rows[0])
    head = "| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|\n"
    body = "".join("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |\n" for r in rows)
    return head + body


def write_csv(path: Path, rows: list[dict]) -> None:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow(
                {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()}
            )


def _thin(xs, n):
    step = max(1, len(xs) // n)
    return xs[::step]


def figures(out: Path, results: dict) -> dict:
    """HTML figures (and PNG when kaleido is importable). Returns {name: files}."""
    try:
        import plotly.graph_objects as go
    except ImportError as e:
        return {"error": f"plotly not importable: {e}"}
    from .. import figures as F

    try:
        import kaleido  # noqa: F401

        png = True
    except ImportError:
        png = False
    made = {}
    figs = {}
    tabs = results["tables"]
    r = results.get("shape", {}).get("r") or 3

    geoms = []
    for row in tabs["T1_uor"]:
        if row["geometry"] not in geoms:
            geoms.append(row["geometry"])
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
        fig = go.Figure()
        colours = [F.BLUE, F.ORANGE, F.GREEN, F.VERMILLION, F.PURPLE, F.SKY]
        for i, ((_geom, b), (d, u)) in enumerate(x for x in scatter.items() if x[0][0] == g):
            if not d:
                continue
            fig.add_trace(
                go.Scattergl(
                    x=[round(v, 4) for v in _thin(d, SCATTER_POINTS)],
                    y=[round(v, 4) for v in _thin(u, SCATTER_POINTS)],
                    mode="markers",
                    marker=dict(size=4, opacity=0.5, color=colours[i % len(colours)]),
                    name=f"budget {100 * b:g}%",
                )
            )
        xs = [i / 100 for i in range(101)]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[min(r, 1 + (r - 1) * x) for x in xs],
                name="upper envelope 1 + (r-1) D",
                line=dict(color="grey", dash="dot"),
            )
        )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[max(1 + x, r - r * (r - 1) / 2 * (1 - x)) for x in xs],
                name="lower envelope max(1 + D, r - C(r,2)(1 - D))",
                line=dict(color="black", dash="dash"),
            )
        )
        fig.update_layout(xaxis_title="mean pairwise disagreement D_g", yaxis_title="UOR")
        figs[f"t2_scatter_{g}"] = F._layout(
            fig, f"T2: disagreement against UOR, every (layer, group) measurement ({g})", 460
        )
    if results["_figures"].get("t3"):
        import torch

        iso, raw = results["_figures"]["t3"]
        nan = float("nan")
        t_iso = torch.tensor([[nan if v is None else v for v in row] for row in iso])
        t_raw = torch.tensor([[nan if v is None else v for v in row] for row in raw])
        figs["t3_sink_advantage"] = F.sink_advantage_lines(
            t_iso, t_raw, title="T3: sink advantage per layer, with and without isolation"
        )
    rec = [x for x in tabs["T4_recall"] if x["recall"] is not None]
    if rec:
        fig = go.Figure()
        for mode in sorted({x["mode"] for x in rec}):
            for b in sorted({x["budget"] for x in rec if x["mode"] == mode}):
                rows = [x for x in rec if x["mode"] == mode and x["budget"] == b]
                fig.add_trace(
                    go.Bar(
                        x=[x["policy"] for x in rows],
                        y=[x["recall"] for x in rows],
                        name=f"{mode}, budget {100 * b:g}%",
                    )
                )
        fig.update_layout(barmode="group", yaxis_title="needle recall", yaxis_range=[0, 1.05])
        figs["t4_recall"] = F._layout(fig, "T4: needle recall by policy, budget and mode", 380)
    ans = tabs["T7_answers"]
    if ans:
        fig = go.Figure()
        labels = [f"{x['setting']} ({x['mode']})" for x in ans]
        for key, colour in (
            ("entropy_beats", F.BLUE),
            ("ties", F.EVICTED),
            ("entropy_loses", F.ORANGE),
        ):
            fig.add_trace(
                go.Bar(
                    y=labels,
                    x=[x[key] for x in ans],
                    name=key,
                    orientation="h",
                    marker_color=colour,
                )
            )
        fig.update_layout(barmode="stack", xaxis_title="prompts")
        figs["t7_answers"] = F._layout(
            fig, "T7: entropy against mean pooling, decoded answers", 140 + 22 * len(ans)
        )
    for name, fig in figs.items():
        files = []
        path = out / "figures" / f"{name}.html"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.write_html(str(path), include_plotlyjs="cdn", full_html=True)
        files.append(str(path.relative_to(out)))
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
    parts = []
    for name, rows in results["tables"].items():
        parts.append(f"### {name}\n\n{markdown_table(rows)}")
    return "\n".join(parts)


def write_all(out: Path, results: dict, copy_presets: bool = False) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in results["tables"].items():
        write_csv(out / f"{name}.csv", rows)
    results["figures"] = figures(out, results)
    results.pop("_figures", None)
    (out / "presets.json").write_text(
        json.dumps(clean(results["presets"]), indent=2) + "\n", encoding="utf-8"
    )
    if copy_presets:
        ASSETS_PRESETS.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "presets.json", ASSETS_PRESETS)
        results["presets_copied_to"] = str(ASSETS_PRESETS)
    (out / "tables.md").write_text(tables_markdown(results), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(clean(results), indent=1) + "\n", encoding="utf-8")
