"""Figures of the replay harness's tables (T2, T4, T7); T1 and T3 reuse the plan views
(`uor_curve`, `sink_advantage_lines`). Inputs are the rows `experiments.replay.tables`
builds, so these are pure functions of numbers."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from pagekv.app.figures.style import (
    BLACK,
    BLUE,
    EVICTED,
    GREEN,
    ORANGE,
    PURPLE,
    SKY,
    VERMILLION,
    _go,
    layout,
)

#: Points per budget in the T2 scatter (deterministic thinning keeps files < 1 MB).
SCATTER_POINTS = 1500


def _thin(xs, n):
    return xs[:: max(1, len(xs) // n)]


def disagreement_scatter(series: dict, r: int, title: str):
    """T2: mean pairwise disagreement `D_g` against UOR, one trace per budget, with the
    two envelopes of the bounds (docs/design.md, "The data path").

    Args:
        series: `{budget: (disagreements, uors)}`, one point per (layer, group).
        r: heads per group (the envelopes depend on it).
    """
    go = _go()
    fig = go.Figure()
    colours = [BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY]
    for i, (b, (d, u)) in enumerate(series.items()):
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
    upper = [min(r, 1 + (r - 1) * x) for x in xs]
    lower = [max(1 + x, r - r * (r - 1) / 2 * (1 - x)) for x in xs]
    for ys, name, line in (
        (upper, "upper envelope 1 + (r-1) D", dict(color="grey", dash="dot")),
        (lower, "lower envelope max(1 + D, r - C(r,2)(1 - D))", dict(color="black", dash="dash")),
    ):
        fig.add_trace(go.Scatter(x=xs, y=ys, name=name, line=line))
    fig.update_layout(xaxis_title="mean pairwise disagreement D_g", yaxis_title="UOR")
    return layout(fig, title, 460)


def _wrap_name(name: str, width: int = 10) -> str:
    """A policy name broken onto short lines for a tick label: at spaces, and after an
    underscore in a word longer than `width`.

    Example: "kvpress expected_attention" -> "kvpress<br>expected_<br>attention".
    """
    lines = []
    for word in str(name).split():
        if len(word) > width and "_" in word:
            head, _, tail = word.partition("_")
            lines += [head + "_", tail]
        else:
            lines.append(word)
    return "<br>".join(lines)


#: The `scoring` of the replay's default decodes (`experiments.replay.tables`).
WINDOW_SCORING = "window/uniform"


def _bar_name(row: dict) -> str:
    """A row's policy, with its `scoring` where it has another than the default (so a
    question-agnostic entropy bar is not a second "entropy")."""
    sc = row.get("scoring", WINDOW_SCORING)
    return row["policy"] if sc == WINDOW_SCORING else f"{row['policy']} ({sc})"


def recall_bars(rows: Sequence[dict], title: str):
    """T4: needle recall per policy, one bar group per (question mode, budget).

    `rows`: dicts with `mode`, `budget`, `policy` and `recall` (not None), and
    optionally `scoring` (a bar of another scoring than the default is named by it,
    `_bar_name`). Every bar
    carries its value ("60 %"), above it and upright, so a recall of 0 (a bar of no
    height) still reads "0 %"; the y range leaves room for the labels. Policy names
    such as "kvpress expected_attention" are broken onto lines (`_wrap_name`) so the
    tick labels stay level and readable. Traces whose bars never meet a policy share a
    slot (`offsetgroup`), so a policy's group has no empty slots and its bars, with
    their labels, are as wide as the figure allows.
    """
    go = _go()
    fig = go.Figure()
    slots: list[set] = []  # the bar names each slot of a group holds so far
    for mode in sorted({x["mode"] for x in rows}):
        for b in sorted({x["budget"] for x in rows if x["mode"] == mode}):
            sel = [x for x in rows if x["mode"] == mode and x["budget"] == b]
            name = f"{mode}, budget {100 * b:g}%"
            names = {_bar_name(x) for x in sel}
            # A trace shares a slot with earlier ones that have no bar of its names (the
            # full cache's 100 % beside the others' 10 and 20 %): no empty slots.
            slot = next((i for i, held in enumerate(slots) if not held & names), len(slots))
            if slot == len(slots):
                slots.append(set())
            slots[slot] |= names
            fig.add_trace(
                go.Bar(
                    x=[_bar_name(x) for x in sel],
                    y=[x["recall"] for x in sel],
                    name=name,
                    offsetgroup=str(slot),
                    text=[f"{100 * x['recall']:.0f} %" for x in sel],  # 0.6 -> "60 %"
                    textposition="outside",
                    # Upright and full size: side by side, the bars are narrower than
                    # a level "100 %", which plotly would otherwise shrink.
                    textangle=-90,
                    constraintext="none",
                    textfont=dict(size=11),
                    cliponaxis=False,
                    hovertemplate="%{x}: %{text}<extra>" + name + "</extra>",
                )
            )
    policies = list(dict.fromkeys(_bar_name(x) for x in rows))
    fig.update_layout(
        barmode="group",
        bargap=0.08,  # wider bars: their upright labels keep apart at 800 px
        yaxis_title="needle recall",
        # Headroom over 100 % for the upright labels; ticks stop at 100 %.
        yaxis_range=[0, 1.3],
        yaxis_tickvals=[0, 0.25, 0.5, 0.75, 1.0],
        yaxis_tickformat=".0%",
        xaxis_tickmode="array",
        xaxis_tickvals=policies,
        xaxis_ticktext=[_wrap_name(p) for p in policies],
        xaxis_tickfont=dict(size=11),
    )
    return layout(fig, title, 420)


def answer_bars(rows: Sequence[dict], title: str):
    """T7: decoded answers where entropy beats, ties or loses to mean pooling, stacked
    per setting. `rows`: dicts with `setting`, `mode`, `entropy_beats`, `ties`,
    `entropy_loses`."""
    go = _go()
    fig = go.Figure()
    labels = [f"{x['setting']} ({x['mode']})" for x in rows]
    for key, colour in (("entropy_beats", BLUE), ("ties", EVICTED), ("entropy_loses", ORANGE)):
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[x[key] for x in rows],
                name=key,
                orientation="h",
                marker_color=colour,
            )
        )
    fig.update_layout(barmode="stack", xaxis_title="prompts")
    return layout(fig, title, 140 + 22 * len(rows))


#: `memory_curves`' colours, in order of the method families (Okabe-Ito).
#: One colour a RULER method family, each dark enough to show on white.
_FAMILY_COLOURS = (BLUE, VERMILLION, GREEN, PURPLE, ORANGE, SKY, BLACK, "#999999", "#8C564B",
                   "#882255")  # fmt: skip


#: What each memory measure's panel is titled after its name (short: two fit at 800 px).
_MEASURE_NAMES = {"gathered": "compacted", "in_place": "pages freed in place",
                  "uniform": "same pages in each"}  # fmt: skip
#: A title's line, at most (the figure is about 700 px wide at 800 px).
TITLE_CHARS = 64


def memory_curves(curves: dict, title: str):
    """RULER score against physical memory (a fraction of the full cache), a line per
    method family, a panel per cache layout: `curves` is `{layout: {family: [[memory,
    score, method], ...]}}`, as experiments/ruler.py writes it to
    `pagekv.paths.RULER_MEMORY_PATH`. The same family keeps one colour in every panel."""
    go = _go()
    from plotly.subplots import make_subplots

    measures = list(curves)
    fig = make_subplots(rows=1, cols=len(measures), shared_yaxes=True,
                        subplot_titles=[f"{m}: {_MEASURE_NAMES.get(m, m)}"
                                        for m in measures])  # fmt: skip
    fig.update_annotations(font_size=13)  # the panels' titles, apart at 800 px
    families = sorted({f for panel in curves.values() for f in panel})
    for col, m in enumerate(measures, start=1):
        for i, family in enumerate(families):
            points = curves[m].get(family)
            if not points:
                continue
            fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in points],
                    y=[p[1] for p in points],
                    text=[p[2] for p in points],
                    mode="lines+markers",
                    name=family,
                    legendgroup=family,
                    showlegend=col == 1,
                    line=dict(
                        color=_FAMILY_COLOURS[i % len(_FAMILY_COLOURS)],
                        width=2,
                        dash="dash" if family.startswith("mean ") else "solid",
                    ),
                    hovertemplate="%{text}: %{y:.2f} at %{x:.0%}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(range=[0, 1.02], tickformat=".0%", row=1, col=col,
                         title_text="memory, of the full cache")  # fmt: skip
    fig.update_yaxes(range=[0, 1.0], title_text="score (mean of task means)", row=1, col=1)
    title = "<br>".join(textwrap.wrap(title, TITLE_CHARS))  # inside the frame at 800 px
    return layout(fig, title, 480, above=24)  # room for the panels' titles
