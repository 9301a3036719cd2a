"""The figures of a comparison (`pagekv.app.comparison`), and its export.

    figs = comparison_figures(comp, layer=0)
    paths = export(comp, figs, folder)     # the numbers and every figure

Drawing only: the comparison is planned and decoded below the views. What is drawn once
is kept in the one memo of drawn views (`pagekv.app.view_memo`).
"""

from __future__ import annotations

import os

from pagekv.app import figures
from pagekv.app.comparison import Comparison, export_data, side_labels
from pagekv.app.figures.style import POLICY_COLOURS
from pagekv.app.side import Side
from pagekv.app.view_memo import memo_figure, view_memo, view_size
from pagekv.maths.metrics import sink_advantage

#: Views that planning alone draws (a dragged slider updates these, without decoding).
PLAN_VIEWS = ("frame", "retention", "uor", "stored", "memory", "glance")
#: Plan views that decoding leaves as they are (retention is redrawn: the decoded records
#: measure what the compacted cache stores, padding included).
SAME_AFTER_DECODING = ("frame", "uor", "stored", "memory", "glance")


def plan_views(comp: Comparison, key: tuple, layer: int) -> dict:
    """The plan views of `comp` (`PLAN_VIEWS`) for the run `key` (`view_key`), drawn or
    kept from a preview with the same settings (`view_memo`, under `("plan", *key)`)."""
    plan_key = ("plan", *key)
    hit = view_memo.get(plan_key)
    if hit is not None:
        return hit["figs"]
    figs = comparison_figures(comp, layer=layer, only=PLAN_VIEWS)
    view_memo.put(plan_key, {"figs": figs, "nbytes": view_size(None, figs)})
    return figs


def comparison_figures(comp: Comparison, layer: int = 0, only=None, skip=()) -> dict:
    """Every view of the app, as plotly figures keyed by name (`only`: just these names,
    e.g. the plan views while a slider is dragged; `skip`: not these, e.g. views already
    drawn; building figures is most of the cost of a run served from memory)."""
    pa, pb = comp.plan_of("A"), comp.plan_of("B")
    labels = comp.labels or side_labels(Side(comp.configs["A"]), Side(comp.configs["B"]))
    G = comp.n_groups
    r = pb.head_weights.shape[1] // G
    needle = comp.prep.needle_positions or None
    layer = max(0, min(int(layer), pa.keep.shape[0] - 1))
    feasible = [x for x in comp.curve if x["feasible"]]
    curve = [[x[k] for x in feasible] for k in ("budget", "uor_mean", "uor_max")]
    both = (("A", labels["A"]), ("B", labels["B"]))

    def overview(name: str, values, title: str):  # a layer x head heatmap of side B
        return lambda: memo_figure(
            name, (values, G), lambda: figures.layer_head_heatmap(values, G, title, zmax=1.0)
        )

    builders = {
        "frame": lambda: figures.page_frame(
            {lab: comp.plan_of(key) for key, lab in both},
            {lab: comp.needle_positions_of(key) for key, lab in both},
        ),
        # Side B's head weights and sink mass: the budget changes none of them, so
        # they are drawn once per content (`memo_figure`), not on every release.
        "weights": lambda: memo_figure(
            "weights",
            (pb.weights_isolated, pb.weights_nosink, pb.sink_heads, G, layer),
            lambda: figures.head_weights_bars(pb, layer),
        ),
        "weights_overview": overview(
            "weights_overview", pb.weights_isolated, "Page-EntroKV head weights, every layer x head"
        ),
        "sink_mass": overview(
            "sink_mass", pb.sink_mass, "Sink mass per layer x head (first n_sink tokens)"
        ),
        "sink_advantage": lambda: memo_figure(
            "sink_advantage",
            (pb.weights_isolated, pb.weights_nosink, pb.sink_heads, G),
            lambda: figures.sink_advantage_lines(
                sink_advantage(pb.weights_isolated, pb.sink_heads, G),
                sink_advantage(pb.weights_nosink, pb.sink_heads, G),
            ),
        ),
        # The curve does not change while a budget is dragged: drawn once per curve.
        "uor": lambda: memo_figure("uor", (*curve, r), lambda: figures.uor_curve(*curve, r=r)),
        "memory": lambda: figures.memory_bars(comp.memory),
        "stored": lambda: figures.union_over_budget_heatmap(
            {lab: comp.plan_of(key).union_tokens.tolist() for key, lab in both},
            {lab: comp.plan_of(key).budget_tokens for key, lab in both},
            r=r,
        ),
        "glance": lambda: figures.stored_glance(
            {lab: comp.plan_of(key).union_tokens.tolist() for key, lab in both},
            {lab: comp.plan_of(key).budget_tokens for key, lab in both},
            {lab: POLICY_COLOURS.get(comp.configs[key].policy) for key, lab in both},
            r=r,
        ),
    }
    if needle:
        builders["retention"] = lambda: figures.needle_retention_heatmap(
            {lab: comp.needle_retention_of(key) for key, lab in both}, G
        )
    return {
        k: build() for k, build in builders.items() if (only is None or k in only) and k not in skip
    }


def export(comp: Comparison, figs: dict, folder: str) -> list[str]:
    """Write `pagekv_run.json`, `pagekv_run.csv` (`export_data`) and
    `pagekv_figures.html` (every figure of `figs`) into `folder`; their paths."""
    paths = export_data(comp, folder)
    html = os.path.join(folder, "pagekv_figures.html")
    with open(html, "w") as f:
        f.write("<html><head><meta charset='utf-8'><title>Page-EntroKV run</title></head><body>")
        for i, (name, fig) in enumerate(figs.items()):
            f.write(f"<h2>{name}</h2>")
            f.write(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
        f.write("</body></html>")
    paths.append(html)
    return paths
