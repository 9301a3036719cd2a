"""A chart of prompts answered right against the physical memory a paged cache of
16-token pages holds, for kvpress's KVzip at every budget of its sweep and for pagekv's
pages of 16, on the tuning and the held-out needle prompts
(the JSON files of `experiments/reconstruct_ab.py --peer kvzip --peer-sweep ...`).

    python experiments/physical_memory_chart.py runs/needles_tuning.json \
        runs/needles_heldout.json --out runs/chart

writes `chart.html` (plotly) and, where Playwright drives /usr/bin/chromium, `chart.png`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.physical_rows import matched_keys  # noqa: E402

#: A row's name -> (who, budget %): "kvpress kvzip, 14%" or "reconstruct/max, global, 20%".
ROW = re.compile(r"^(?P<who>.+), (?P<pct>[\d.]+)%$")
#: Our settings' colours, in the order a run lists them (KVzip is red), and where their
#: budget labels go (settings at one memory would write over each other).
OURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")
LABEL_AT = ("middle left", "middle right", "bottom center", "top center")


def points(rows: dict) -> dict:
    """who -> [(physical tokens per prompt, fraction right, budget %)], by budget."""
    out: dict = {}
    matched = matched_keys(rows)
    for name, r in rows.items():
        m = ROW.match(name)
        if m is None or name in matched or not r.get("prompts") or r.get("physical") is None:
            continue
        n = r["prompts"]
        out.setdefault(m["who"], []).append((r["physical"] / n, r["right"] / n, float(m["pct"])))
    return {who: sorted(p) for who, p in out.items()}


def chart(files: list[Path], titles: list[str]) -> go.Figure:
    fig = make_subplots(rows=1, cols=len(files), subplot_titles=titles, shared_yaxes=True)
    for col, path in enumerate(files, start=1):
        rows = json.loads(path.read_text())["rows"]
        ours = [who for who in points(rows) if not who.startswith("kvpress")]
        for who, pts in points(rows).items():
            peer = who.startswith("kvpress")
            i = 0 if peer else ours.index(who)
            colour = "#d62728" if peer else OURS[i % len(OURS)]
            fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in pts],
                    y=[p[1] for p in pts],
                    text=[f"{p[2]:g}%" for p in pts],
                    textposition="top center" if peer else LABEL_AT[i % len(LABEL_AT)],
                    mode="lines+markers+text" if peer else "markers+text",
                    marker=dict(size=9 if peer else 14, symbol="circle" if peer else "square"),
                    name="KVzip (kvpress), its budgets" if peer else f"pages of 16: {who}",
                    legendgroup=who,
                    showlegend=col == 1,
                    line=dict(color=colour) if peer else None,
                    marker_color=colour,
                ),  # fmt: skip
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="physical memory per prompt (tokens, pages of 16)", col=col)
    fig.update_yaxes(tickformat=".0%", range=[0, 1.15])
    fig.update_yaxes(title_text="prompts answered right", col=1)
    fig.update_layout(
        title="Question after compression: right answers against the memory a paged cache holds",
        width=1100, height=480, legend=dict(orientation="h", y=-0.25),
    )  # fmt: skip
    return fig


def screenshot(fig: go.Figure, png: Path) -> bool:
    """`fig` drawn by chromium to `png`, plotly.js inlined from the installed package (no
    network); False where Playwright or chromium is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return False
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium")
            page = browser.new_page(viewport={"width": 1120, "height": 500})
            page.set_content(fig.to_html(include_plotlyjs=True, full_html=True))
            page.wait_for_selector(".main-svg")
            page.screenshot(path=str(png))
            browser.close()
    except Exception as e:  # no chromium here: the HTML stands
        print(f"no screenshot: {e}")
        return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--titles", nargs="*", default=None)
    ap.add_argument("--out", type=Path, required=True, help="path without suffix")
    args = ap.parse_args(argv)
    fig = chart(args.files, args.titles or [f.stem.replace("_", " ") for f in args.files])
    html = args.out.with_suffix(".html")
    fig.write_html(str(html), include_plotlyjs="cdn", full_html=True)
    shot = screenshot(fig, args.out.with_suffix(".png"))
    print(f"wrote {html}" + (f" and {args.out.with_suffix('.png')}" if shot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
