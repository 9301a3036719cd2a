"""The app's views of plans: page frame, head weights, sinks, retention, UOR, memory,
and the constructed mechanism. Pure functions from `Plan` objects and numbers to
plotly figures (see `pagekv.app.figures`)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import numpy as np
import torch

from pagekv.app.figures.style import (
    BLACK,
    BLUE,
    GREEN,
    NEEDLE,
    NEEDLE_MARGIN,
    ORANGE,
    POLICY_COLOURS,
    PURPLE,
    SKY,
    STATE_COLOURS,
    STATE_NAMES,
    VERMILLION,
    YELLOW,
    _go,
    layout,
)
from pagekv.maths.metrics import isolation_gain


def page_states(p) -> torch.Tensor:
    """int `[L, G, n_pages]`: 0 evicted, 1 kept, 2 protected."""
    states = p.page_keep.to(torch.int64)
    return torch.where(p.protected.expand_as(states), torch.full_like(states, 2), states)


def needle_pages(p, needle_positions: Sequence[int]) -> list[int]:
    """The sorted pages of `p` that hold a needle token.

    Example (page size 16): tokens `[990, 991, 1000]` -> pages `[61, 62]`.
    Raises ValueError when `needle_positions` is empty or leaves `[0, p.n)`.
    """
    pos = [int(t) for t in needle_positions]
    if not pos:
        raise ValueError("needle_positions is empty")
    bad = [t for t in pos if not 0 <= t < p.n]
    if bad:
        raise ValueError(f"needle positions must lie in [0, {p.n}); got {bad}")
    return sorted({t // p.config.page_size for t in pos})


def needle_page_counts(p, needle_positions: Sequence[int]) -> tuple[int, int]:
    """`(kept, total)`: how many of the `L x G` (layer, group)s of the `Plan` `p` keep
    every page that holds a needle token (head-independent plans: kept in the group's
    union, what the server stores). The page frame prints this count per side; it equals
    the number of (layer, group)s whose `Plan.needle_retention` is 1."""
    pages = needle_pages(p, needle_positions)
    kept = p.page_keep[..., pages].all(-1)  # [L, G]
    return int(kept.sum()), kept.numel()


def strip_pages(n_pages: int, pages: Sequence[int], margin: int = NEEDLE_MARGIN) -> list[int]:
    """The pages of the needle strip: every page within `margin` of a needle page,
    clipped to `[0, n_pages)`, sorted.

    Example: `strip_pages(10, [0, 5], 2)` -> `[0, 1, 2, 3, 4, 5, 6, 7]`.
    """
    if margin < 0:
        raise ValueError(f"margin must be >= 0; got {margin}")
    out = set()
    for j in pages:
        out.update(range(max(0, j - margin), min(n_pages, j + margin + 1)))
    return sorted(out)


def _needles_by_label(labels: list, needle_positions) -> dict:
    """label -> list of needle positions (empty: no needle on that side)."""
    if needle_positions is None:
        return {label: [] for label in labels}
    if isinstance(needle_positions, dict):
        unknown = set(needle_positions) - set(labels)
        if unknown:
            raise ValueError(
                f"needle_positions names plans {sorted(map(str, unknown))} that are not in "
                f"plans ({', '.join(map(str, labels))})"
            )
        return {label: list(needle_positions.get(label) or []) for label in labels}
    shared = list(needle_positions)
    return {label: shared for label in labels}


def _runs(xs: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers: `[1, 2, 3, 7]` -> `[(1, 3), (7, 7)]`."""
    runs: list[tuple[int, int]] = []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], x)
        else:
            runs.append((x, x))
    return runs


#: The narrowest a strip's side is drawn (px: one of two sides at 800 px), and a tick
#: label's width per character at the strips' tick font (10 px) plus the room between
#: two labels, for `strip_ticks`'s spacing.
STRIP_SIDE_PX, TICK_CHAR_PX, TICK_GAP_PX = 360, 6.0, 6.0


def strip_fraction(n_strip: int) -> float:
    """The share of its side a strip of `n_strip` pages takes (a quarter to a half)."""
    return min(0.5, max(0.25, n_strip / (n_strip + 20)))


def strip_ticks(pages: Sequence[int], needle: Sequence[int]) -> tuple[list, list]:
    """`(tickvals, ticktext)` of a needle strip: one label per run of needle pages at its
    middle ("107" or "107–108"), then the strip's first and last page where they keep
    clear of every label already placed, at the narrowest the strip is drawn. Labels at
    neighbouring positions ran into each other at 800 px ("107", "108").

    Example: pages 5..11 with needle page 8 -> ticks at positions 0, 3, 6: "5", "8", "11";
    pages 7..10 with needle pages 8, 9 -> "7", "8–9" (at 1.5), "10".
    """
    at = {j: i for i, j in enumerate(pages)}
    px = strip_fraction(len(pages)) * STRIP_SIDE_PX / max(len(pages), 1)  # per position
    placed: list[tuple[float, str]] = []

    def clear(pos: float, text: str) -> bool:
        return all(
            abs(pos - p) * px >= (len(text) + len(t)) * TICK_CHAR_PX / 2 + TICK_GAP_PX
            for p, t in placed
        )

    for a, b in _runs(needle):
        pos, text = (at[a] + at[b]) / 2, str(a) if a == b else f"{a}–{b}"
        if clear(pos, text):
            placed.append((pos, text))
    for j in (pages[0], pages[-1]):
        if all(t != str(j) for _, t in placed) and clear(at[j], str(j)):
            placed.append((at[j], str(j)))
    placed.sort()
    return [p for p, _ in placed], [t for _, t in placed]


#: Characters per line of a side's title over its overview: a label naming several
#: differing settings ("B: entropy, reconstruct scorer, global budget") wraps onto the
#: two lines the strips' titles use, instead of running into the next column at 800 px.
SIDE_TITLE_CHARS = 24


def page_frame(
    plans: dict,
    needle_positions: Sequence[int] | dict | None = None,
    title=None,
    margin: int = NEEDLE_MARGIN,
):
    """Pages x (layer, group) for one or more plans side by side, with a needle strip.

    `plans` maps a label (e.g. "A: mean") to a `Plan`. Each side has an overview: one
    cell per (layer, group, page), evicted, kept or protected. Where the side has a
    needle, a strip beside its overview zooms on the needle's pages and `margin`
    pages either side (`strip_pages`), with the same rows, so whether every
    (layer, group) keeps the needle reads at a glance; the needle's pages are
    outlined in `NEEDLE` and pointed at in both panels, and the strip's title and the
    figure's subtitle give `needle_page_counts`. Without any needle the figure is the
    overviews alone.

    `needle_positions`: prompt token indices for every plan, or a dict label ->
    indices (sides built from different prompts, e.g. question inside and after; a
    label left out or mapped to nothing has no strip).

    Traces carry `meta={"role": "overview" | "needle_strip", "label": ..., ...}`; a
    strip's meta also holds its `pages`, `needle_pages`, `kept` and `total`.
    """
    go = _go()
    from plotly.subplots import make_subplots

    needles = _needles_by_label(list(plans), needle_positions)
    # Per side: the states, and (with a needle) its pages, strip and count.
    sides = []
    for label, p in plans.items():
        side = {"label": label, "plan": p, "states": page_states(p)}  # [L, G, n_pages]
        if needles[label]:
            side["needle"] = needle_pages(p, needles[label])
            side["strip"] = strip_pages(p.n_pages, side["needle"], margin)
            side["count"] = needle_page_counts(p, needles[label])
        sides.append(side)

    # Columns: overview, then its strip when it has one. A strip's width follows its
    # page count (about a quarter to a half of its side), so cells stay wide enough
    # to read at 1280 px.
    widths, titles, cols = [], [], []
    for side in sides:
        frac = strip_fraction(len(side["strip"])) if "strip" in side else 0.0
        widths.append(1.0 - frac)
        titles.append("<br>".join(textwrap.wrap(side["label"], SIDE_TITLE_CHARS)))
        cols.append(("overview", side))
        if "strip" in side:
            kept, total = side["count"]
            widths.append(frac)
            units = "tokens" if side["plan"].config.page_size == 1 else "pages"
            titles.append(f"needle ±{margin} {units}<br>{kept}/{total} keep it")
            cols.append(("strip", side))
    fig = make_subplots(
        rows=1,
        cols=len(cols),
        subplot_titles=titles,
        shared_yaxes=True,
        column_widths=widths,
        horizontal_spacing=0.03 if len(cols) > len(sides) else 0.04,
    )
    colorscale = [[k / 3, c] for i, c in enumerate(STATE_COLOURS) for k in (i, i + 1)]
    L, G, _ = sides[0]["states"].shape
    rows = [f"L{layer} g{g}" for layer in range(L) for g in range(G)]

    def heatmap(z, x, hover, meta, gap, where="%{y}"):
        return go.Heatmap(
            z=z,
            x=x,
            y=rows,
            zmin=0,
            zmax=3,
            colorscale=colorscale,
            showscale=False,
            text=hover,
            hovertemplate=where + " %{text}<extra>" + meta["label"] + "</extra>",
            xgap=gap,
            ygap=1 if meta["role"] == "needle_strip" else 0.5,
            name=meta["label"],
            meta=meta,
            showlegend=False,
        )

    def outline(col, x0, x1, width):
        fig.add_shape(
            type="rect",
            x0=x0 - 0.5,
            x1=x1 + 0.5,
            y0=-0.5,
            y1=L * G - 0.5,
            line=dict(color=NEEDLE, width=width),
            row=1,
            col=col,
        )

    def pointer(col, x, text):
        fig.add_annotation(
            x=x,
            y=1.0,
            xref=f"x{'' if col == 1 else col}",
            yref=f"y{'' if col == 1 else col} domain",
            text=text,
            showarrow=False,
            yanchor="bottom",
            font=dict(color=NEEDLE, size=11),
        )

    for col, (kind, side) in enumerate(cols, start=1):
        p, label, st = side["plan"], side["label"], side["states"]
        P = p.config.page_size
        n_pages = st.shape[-1]
        unit = "token" if P == 1 else "page"

        def where(j, P=P, p=p):
            if P == 1:
                return f"token {j}"
            return f"page {j} (tokens {j * P}-{min((j + 1) * P, p.n) - 1})"

        if kind == "overview":
            # numpy arrays, not lists: plotly validates them whole, not cell by cell (a
            # frame is redrawn while a slider is dragged).
            z = st.reshape(L * G, n_pages).numpy().astype(np.int8)
            # Hover: the state's name only (the page is x), so that a page-size-1 frame
            # of 2000 columns does not carry 180k long strings per side.
            hover = np.asarray(STATE_NAMES)[z]
            # Gaps between columns only while a column is a few pixels wide.
            gap = 0.5 if n_pages <= 256 else 0
            meta = {"role": "overview", "label": label}
            trace = heatmap(z, np.arange(n_pages), hover, meta, gap, f"%{{y}} {unit} %{{x}}:")
            fig.add_trace(trace, 1, col)
            fig.update_xaxes(title_text=unit, row=1, col=col)
            if "needle" in side:
                # Where the strip comes from: its extent outlined, the needle pointed at.
                for a, b in _runs(side["strip"]):
                    outline(col, a, b, 1)
                for i, (a, b) in enumerate(_runs(side["needle"])):
                    pointer(col, (a + b) / 2, "▼" if i else "▼ needle")
        else:
            pages = side["strip"]
            z = st[..., pages].reshape(L * G, len(pages)).numpy().astype(np.int8)
            names = np.asarray(STATE_NAMES, dtype=object)[z]
            hover = np.asarray([f"{where(j)}: " for j in pages], dtype=object)[None, :] + names
            kept, total = side["count"]
            meta = {
                "role": "needle_strip",
                "label": label,
                "pages": pages,
                "needle_pages": side["needle"],
                "kept": kept,
                "total": total,
            }
            x = list(range(len(pages)))  # positions; gaps between runs collapse
            fig.add_trace(heatmap(z, x, hover, meta, 2), 1, col)
            at = {j: i for i, j in enumerate(pages)}
            # The needle's pages outlined and pointed at; labelled, with the strip's ends
            # where they leave room (`strip_ticks`).
            for a, b in _runs(side["needle"]):
                outline(col, at[a], at[b], 2.5)
                pointer(col, (at[a] + at[b]) / 2, "▼")
            tickvals, ticktext = strip_ticks(pages, side["needle"])
            fig.update_xaxes(
                tickvals=tickvals,
                ticktext=ticktext,
                tickfont=dict(size=10),
                tickangle=0,
                title_text=unit,
                row=1,
                col=col,
            )
    # Subplot titles sit above the needle pointers (plotly puts both at the top edge).
    if len(cols) > len(sides):
        for a in fig.layout.annotations[: len(titles)]:
            a.yshift = 14
    # One tick per layer (its first group); the rows in between are its other groups.
    fig.update_yaxes(
        autorange="reversed",
        tickmode="array",
        tickvals=rows[::G],
        ticktext=[f"L{layer}" for layer in range(L)],
        tickfont=dict(size=10),
    )
    # The legend: the three states (filled squares) and the needle (an outline).
    legend = [(n, c, dict(width=1)) for n, c in zip(STATE_NAMES, STATE_COLOURS, strict=True)]
    with_needle = [s for s in sides if "needle" in s]
    if with_needle:
        legend.append(("needle page (outlined, ▼)", "white", dict(color=NEEDLE, width=2.5)))
    for name, colour, line in legend:
        marker = dict(size=11, color=colour, symbol="square", line=line)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=marker, name=name))
    text = title or "Page frame: what each (layer, group) keeps"
    for s in with_needle:  # a line per side: two on one line ran past the figure's edge
        text += (
            f"<br><span style='font-size:12px'>{s['label']}: needle page kept in "
            f"{s['count'][0]} of {s['count'][1]} (layer, group)s</span>"
        )
    # Above the plot area: the subplot titles, and with a needle the strips' two-line
    # titles lifted over the needle pointers. The height gives every row 10 px (the
    # plot area at least 100 px) besides the top margin and about 90 px below the plot
    # (tick labels, the axis title and the one-row legend).
    # The right margin leaves room for a strip title wider than its strip at 740 px.
    fig = layout(fig, text, above=58 if len(cols) > len(sides) else 22)
    height = fig.layout.margin.t + 90 + max(100, 10 * L * G)
    return fig.update_layout(height=height, margin_r=36 if len(cols) > len(sides) else 20)


#: Right margin (px) of `head_weights_bars`: room for the mean-pooling line's label.
HEAD_WEIGHTS_RIGHT = 100


def head_weights_bars(p, layer: int, title=None):
    """Weights of the heads of each group at one layer, with and without isolation."""
    go = _go()
    H = p.weights_isolated.shape[1]
    r = H // p.n_groups
    heads = [
        f"g{h // r} h{h}" + (" (sink)" if bool(p.sink_heads[layer, h]) else "") for h in range(H)
    ]
    fig = go.Figure()
    for w, name, colour in (
        (p.weights_isolated, "sink-isolated (Page-EntroKV)", BLUE),
        (p.weights_nosink, "without isolation", SKY),
    ):
        fig.add_trace(go.Bar(x=heads, y=w[layer].tolist(), name=name, marker_color=colour))

    def mark(h: int, text: str, ay: int) -> None:
        top = float(max(p.weights_isolated[layer, h], p.weights_nosink[layer, h]))
        fig.add_annotation(
            x=heads[h],
            y=top,
            text=text,
            showarrow=True,
            arrowhead=2,
            ax=0,
            ay=ay,
            font=dict(size=11),
        )

    # Among the heads that are not sinks: where the weight isolation takes from the sink
    # heads goes (lesson 3's text), never a sink head itself.
    h, gain = isolation_gain(
        p.weights_isolated[layer], p.weights_nosink[layer], p.sink_heads[layer]
    )
    if gain > 0:  # where isolation moves the sinks' weight to
        mark(h, "gains most<br>with isolation", -34)
    # And where it is taken from: the head losing most, with its sink mass, whether or not
    # it is over the sink threshold that labels it "(sink)".
    loss = (p.weights_nosink[layer] - p.weights_isolated[layer]).float()
    lost = int(loss.argmax())
    if float(loss[lost]) > 0:
        mass = float(p.sink_mass[layer, lost])
        mark(lost, f"loses most<br>with isolation<br>(sink mass {mass:.2f})", -44)
    fig.add_hline(y=1 / r, line_dash="dot", line_color=ORANGE)
    # The line's label sits outside the plot area, right of the line's end, in a right
    # margin kept for it: inside, it lay on the last bars.
    fig.add_annotation(
        text=f"mean pooling<br>1/r = {1 / r:.2f}",
        xref="paper",
        x=1.0,
        xanchor="left",
        xshift=4,
        yref="y",
        y=1 / r,
        yanchor="middle",
        align="left",
        showarrow=False,
        font=dict(size=11),
    )
    fig.update_layout(barmode="group", yaxis_title="weight within group", yaxis_range=[0, 1])
    fig = layout(fig, title or f"Head weights at layer {layer}", 360)
    return fig.update_layout(margin_r=HEAD_WEIGHTS_RIGHT)


def layer_head_heatmap(
    values: torch.Tensor, n_groups: int, title: str, zmax=None, colorscale="Cividis"
):
    """A layer x head overview (e.g. weights or sink mass), groups separated by gaps."""
    go = _go()
    L, H = values.shape
    r = H // n_groups
    fig = go.Figure(
        go.Heatmap(
            z=values.tolist(),
            x=[f"g{h // r} h{h}" for h in range(H)],
            y=[f"L{layer}" for layer in range(L)],
            colorscale=colorscale,
            zmin=0,
            zmax=zmax,
            hovertemplate="%{y} %{x}: %{z:.3f}<extra></extra>",
        )
    )
    for g in range(1, n_groups):
        fig.add_vline(x=g * r - 0.5, line_color="white", line_width=3)
    fig.update_yaxes(autorange="reversed")
    return layout(fig, title, 120 + 14 * L)


def ratio_ticks(values, most: int = 9) -> list[float]:
    """Tick values for a log axis of ratios: powers of two from one at or below the
    smallest finite positive value to one at or above the largest, always with 1.

    A narrow range (at most 4 powers) also gets 1.5x each power between them, so there
    are always at least 3 ticks; a wide one keeps every second, third ... power, at
    most `most` ticks, so the labels never crowd.

    Example: `[0.3, 7.24]` -> `[0.25, 0.5, 1, 2, 4, 8]`; `[1.2, 1.9]` -> `[1, 1.5, 2]`;
    no usable value -> `[0.5, 1, 2]`.
    """
    ok = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    if not ok:
        return [0.5, 1.0, 2.0]
    lo = min(0, math.floor(math.log2(min(ok)) + 1e-9))
    hi = max(0, math.ceil(math.log2(max(ok)) - 1e-9))
    if lo == hi == 0:  # every value is 1
        lo, hi = -1, 1
    if hi - lo + 1 <= 4:
        powers = [2.0**e for e in range(lo, hi + 1)]
        return [t for a in powers for t in (a, 1.5 * a)][:-1]
    # Exponents that are multiples of `step` only, so 1 (2**0) stays, widened to cover
    # both ends; the smallest step that gives at most `most` ticks.
    step = 1
    while math.ceil(hi / step) - math.floor(lo / step) + 1 > max(most, 3):
        step += 1
    lo, hi = step * math.floor(lo / step), step * math.ceil(hi / step)
    return [2.0**e for e in range(lo, hi + 1, step)]


def _ratio_label(v: float) -> str:
    """`2.0` -> "2x", `0.25` -> "0.25x", `1.5` -> "1.5x", `1/64` -> "1/64x",
    `4096.0` -> "4,096x"."""
    if v >= 1 and float(v).is_integer():
        return f"{v:,.0f}x"
    if v >= 1 / 8:
        return f"{v:g}x"
    return f"1/{round(1 / v):,}x"


def sink_advantage_lines(adv_iso: torch.Tensor, adv_raw: torch.Tensor, title=None):
    """Per layer: the mean over groups (where defined) of the sink advantage.

    A log axis labelled at powers of two covering the data (`ratio_ticks`: "0.5x",
    "1x", "2x", ...), so a value such as 7.24x reads off between 4x and 8x, with a
    dotted reference line at 1x (no advantage).
    """
    go = _go()

    def per_layer(adv):
        defined = [row[~torch.isnan(row)] for row in adv]
        return [float(ok.mean()) if ok.numel() else None for ok in defined]

    L = adv_iso.shape[0]
    raw, iso = per_layer(adv_raw), per_layer(adv_iso)
    fig = go.Figure()
    for ys, name, colour in ((raw, "without isolation", SKY), (iso, "sink-isolated", BLUE)):
        fig.add_trace(
            go.Scatter(
                x=list(range(L)),
                y=ys,
                name=name,
                mode="lines+markers",
                line_color=colour,
                hovertemplate="layer %{x}: %{y:.2f}x<extra>" + name + "</extra>",
            )
        )
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    ticks = ratio_ticks(raw + iso)
    fig.update_layout(
        xaxis_title="layer",
        xaxis_tick0=0,
        xaxis_dtick=max(1, math.ceil(L / 16)),  # whole layers only
        yaxis_title="sink / non-sink mean weight",
        yaxis_type="log",
        yaxis_tickmode="array",
        yaxis_tickvals=ticks,
        yaxis_ticktext=[_ratio_label(v) for v in ticks],
        # A log axis's range is in log10 units: the end ticks, with a little room.
        yaxis_range=[math.log10(ticks[0]) - 0.05, math.log10(ticks[-1]) + 0.05],
    )
    above = 0
    if any(v is None for v in raw):
        above = 16
        fig.add_annotation(
            text="gaps: no group of that layer mixes sink and non-sink heads",
            xref="paper",
            yref="paper",
            x=0,
            y=1.0,
            showarrow=False,
            xanchor="left",
            yanchor="bottom",
            font=dict(size=11, color="grey"),
        )
    return layout(fig, title or "Sink advantage (the masquerade)", 360, above=above)


def needle_retention_heatmap(retentions: dict, n_groups: int, title=None):
    """Fraction of the needle kept per (layer, group) for each policy, side by side."""
    go = _go()
    from plotly.subplots import make_subplots

    labels = list(retentions)
    fig = make_subplots(rows=1, cols=len(labels), subplot_titles=labels, shared_yaxes=True)
    for col, label in enumerate(labels, start=1):
        ret = torch.as_tensor(retentions[label], dtype=torch.float64)
        L, G = ret.shape
        fig.add_trace(
            go.Heatmap(
                z=ret.tolist(),
                x=[f"g{g}" for g in range(G)],
                y=[f"L{layer}" for layer in range(L)],
                zmin=0,
                zmax=1,
                colorscale=[[0, VERMILLION], [0.5, YELLOW], [1, BLUE]],
                showscale=col == len(labels),
                hovertemplate="%{y} %{x}: %{z:.2f}<extra>" + label + "</extra>",
                xgap=1,
                ygap=1,
            ),
            row=1,
            col=col,
        )
    fig.update_yaxes(autorange="reversed")
    L = torch.as_tensor(retentions[labels[0]]).shape[0]
    return layout(fig, title or "Needle retention per (layer, group)", 160 + 12 * L, above=22)


def uor_curve(
    budgets: Sequence[float],
    uor_mean: Sequence[float],
    uor_max: Sequence[float],
    r: int,
    title=None,
):
    """UOR of head-independent selection across budgets, against the pooled 1.0."""
    go = _go()
    x = [100 * b for b in budgets]
    fig = go.Figure()
    for ys, name, mode, line in (
        (uor_max, "head-independent, max", "lines+markers", dict(color=VERMILLION)),
        (uor_mean, "head-independent, mean", "lines+markers", dict(color=VERMILLION, dash="dash")),
        ([1.0] * len(x), "pooled policies (exactly 1)", "lines", dict(color=BLUE)),
    ):
        fig.add_trace(go.Scatter(x=x, y=list(ys), name=name, mode=mode, line=line))
    fig.add_hline(y=r, line_dash="dot", line_color="grey", annotation_text=f"r = {r} (worst case)")
    fig.update_layout(
        xaxis_title="budget (% of prompt)",
        yaxis_title="union overhead ratio",
        yaxis_range=[0.9, r + 0.2],
    )
    return layout(fig, title or "Union overhead of head-independent selection", 340)


def union_over_budget_heatmap(sides: dict, budget_tokens: dict, r: int, title=None):
    """What each (layer, group) must store, as a multiple of the budget, per side.

    Args:
        sides: label -> `[L][G]` tokens the policy keeps (`union_tokens`: the union of
            the heads' picks for head_independent).
        budget_tokens: label -> `k`.
        r: heads per group; `r x` the budget is the worst case a union can reach, and
            the colour scale ends there.
    """
    go = _go()
    from plotly.subplots import make_subplots

    labels = list(sides)
    ratios = {
        label: [[u / max(int(budget_tokens[label]), 1) for u in row] for row in sides[label]]
        for label in labels
    }  # [L][G] each
    top = max(max(map(max, z)) for z in ratios.values())
    # The scale ends at r, or higher where a shared (global) budget gives one (layer,
    # group) more than r budgets: no cell is beyond its end.
    zmax = float(max(r, math.ceil(top)))
    step = 1 if zmax <= 10 else math.ceil(zmax / 10)
    titles = ["<br>".join(textwrap.wrap(label, SIDE_TITLE_CHARS)) for label in labels]
    fig = make_subplots(rows=1, cols=len(labels), subplot_titles=titles, shared_yaxes=True)
    for i, label in enumerate(labels):
        z = ratios[label]
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=[f"g{g}" for g in range(len(z[0]))],
                y=list(range(len(z))),
                zmin=0.0,
                zmax=zmax,
                colorscale="Cividis",
                showscale=i == len(labels) - 1,
                colorbar=dict(
                    title=dict(text="x budget", side="right"),  # on top it met the last tick
                    tickvals=list(range(0, int(zmax) + 1, step)),
                ),
                hovertemplate="layer %{y}, group %{x}: %{z:.2f}x the budget<extra></extra>",
            ),
            row=1,
            col=i + 1,
        )
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=1)
    lines = max(t.count("<br>") + 1 for t in titles)
    text = title or (
        "Tokens each (layer, group) stores, as a multiple of the budget<br>"
        f"<span style='font-size:12px'>head-independent: at most r = {r}x; a shared (global) "
        "budget may give one (layer, group) more, the total stays within</span>"
    )
    return layout(fig, text, 420, above=8 + 16 * lines)


def stored_glance(sides: dict, budget_tokens: dict, colours: dict, r: int, title=None):
    """The first screen's live chart: every (layer, group)'s stored tokens as a
    multiple of its side's budget, sorted from the fullest, one line per side, against
    the budget (1x) and the worst a union can reach (r x).

    Args:
        sides: label -> `[L][G]` tokens the side keeps (`union_tokens`).
        budget_tokens: label -> `k`.
        colours: label -> the line's colour (its policy's; the second side's is dashed).
        r: heads per group.
    """
    go = _go()
    fig = go.Figure()
    top = float(r)
    for i, (label, rows) in enumerate(sides.items()):
        k = max(int(budget_tokens[label]), 1)
        ys = sorted((u / k for row in rows for u in row), reverse=True)
        top = max(top, ys[0] if ys else 0.0)
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(ys) + 1)),
                y=ys,
                name=label,
                mode="lines",
                # The second side dashed: two sides of one policy stay apart.
                line=dict(color=colours.get(label, BLACK), width=3, dash="dash" if i else None),
                hovertemplate="the %{x}th fullest (layer, group): %{y:.2f}x the budget"
                "<extra>" + label + "</extra>",
            )
        )
    fig.add_hline(y=1, line_dash="dash", line_color="grey", annotation_text="budget")
    fig.add_hline(y=r, line_dash="dot", line_color="grey", annotation_text=f"r = {r}")
    # No x-axis title: the subtitle says what the points are (the chart must fit the
    # first screen at 800 px with the lesson's title under it).
    fig.update_layout(yaxis_title="stored / budget", yaxis_range=[0, 1.1 * top])
    text = title or (
        "Live: each (layer, group)'s stored tokens / budget<br><span style='font-size:12px'>"
        "a line per side, a point per (layer, group), fullest first</span>"
    )
    return layout(fig, text, 215)


def memory_bars(rows: Sequence[dict], title=None):
    """Cache kept per policy: rows of {policy, tokens, bytes} and, where given, a
    `label` naming how it was planned (scorer, allocation, padding)."""
    go = _go()
    fig = go.Figure(
        go.Bar(
            x=[r.get("label", r["policy"]) for r in rows],
            y=[r["bytes"] / 2**20 for r in rows],
            marker_color=[POLICY_COLOURS.get(r["policy"], BLACK) for r in rows],
            # The label names its unit: the axis is in MiB, the label in tokens.
            text=[f"{r['tokens']} tokens" for r in rows],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{x}: %{y:.2f} MiB, %{text} per (layer, group)<extra></extra>",
        )
    )
    top = max((r["bytes"] for r in rows), default=1) / 2**20
    fig.update_layout(
        yaxis_title="KV cache kept (MiB)", yaxis_range=[0, 1.15 * top], xaxis_tickfont_size=10
    )
    text = title or (
        "Cache each policy must hold at side B's settings<br><span style='font-size:12px'>"
        "on each bar: mean tokens per (layer, group); under each: its scorer and allocation"
        "</span>"
    )
    return layout(fig, text, 340)


#: The capacity benchmark's sides, in the order `capacity_bars` draws them, with colours.
MEASURED_SIDES = ("full", "entropy 20%", "entropy 10%", "transformers CB")
_MEASURED_COLOURS = {"full": BLACK, "transformers CB": GREEN}


def capacity_bars(live: dict, measured: dict | None):
    """Three panels: how many prompts like this one the pool holds at each side's
    budget and with the full cache (`live`: `pagekv.app.run_figures.pool_rows`); and, from
    the committed benchmark (`measured`: `pagekv.app.run_figures.measured`, None where
    missing), the sequences it held at once and the decode's tokens per second."""
    go = _go()
    from plotly.subplots import make_subplots

    mib = live["pool_bytes"] / 2**20
    of = "" if measured is None else f" (of {measured['prompts']})"
    titles = [f"live: prompts a {mib:.0f} MiB pool holds", f"measured earlier: held at once{of}",
              "measured earlier: decode tokens/s"]  # fmt: skip
    fig = make_subplots(rows=1, cols=3, subplot_titles=titles, horizontal_spacing=0.09)
    fig.update_annotations(font_size=12)
    rows = live["rows"]
    fig.add_trace(
        go.Bar(
            x=[r["label"] for r in rows],
            y=[r["held"] for r in rows],
            marker_color=[POLICY_COLOURS.get(r["policy"], BLACK) for r in rows],
            text=[str(r["held"]) for r in rows],
            textposition="outside",
            cliponaxis=False,
            customdata=[r["bytes"] / 2**20 for r in rows],
            hovertemplate="%{x}: %{y} prompts, %{customdata:.1f} MiB each<extra></extra>",
            showlegend=False,
        ),
        row=1,
        col=1,
    )
    if measured is not None:
        sides = [s for s in MEASURED_SIDES if s in measured["sides"]]
        colours = [_MEASURED_COLOURS.get(s, POLICY_COLOURS["entropy"]) for s in sides]
        held = [measured["sides"][s]["held"] for s in sides]
        fig.add_trace(
            go.Bar(x=sides, y=held, marker_color=colours, text=[str(h) for h in held],
                   textposition="outside", cliponaxis=False, showlegend=False,
                   hovertemplate="%{x}: %{y} sequences at once<extra></extra>"),
            row=1, col=2,
        )  # fmt: skip
        ours = [s for s in sides if measured["sides"][s]["decode_tok_s"] is not None]
        tps = [measured["sides"][s]["decode_tok_s"] for s in ours]
        fig.add_trace(
            go.Bar(x=ours, y=tps, marker_color=colours[: len(ours)],
                   text=[f"{t:.1f}" for t in tps], textposition="outside", cliponaxis=False,
                   showlegend=False, hovertemplate="%{x}: %{y:.1f} tokens/s<extra></extra>"),
            row=1, col=3,
        )  # fmt: skip
        note = (
            f"measured earlier, not live: {measured['prompts']} prompts of "
            f"{measured['prompt_tokens'][0]}-{measured['prompt_tokens'][1]} tokens on "
            f"{measured['model']}, "
            f"{measured['cpu']} (benchmarks/bench_capacity.py)"
        )
    else:
        note = "the capacity benchmark's results are missing: run benchmarks/bench_capacity.py"
    for col in (1, 2, 3):
        fig.update_xaxes(tickfont_size=10, row=1, col=col)
    top = max((r["held"] for r in rows), default=1)
    fig.update_yaxes(range=[0, 1.2 * max(top, 1)], title_text="prompts", row=1, col=1)
    title = (
        f"What a budget buys: prompts of {live['prompt_tokens']} tokens in one pool"
        f"<br><span style='font-size:12px'>{note}</span>"
    )
    return layout(fig, title, 420, above=24)


def profile_groups(prof: torch.Tensor) -> list[list[int]]:
    """The heads of `prof` `[r, n]` grouped by identical profile, in head order.

    Example: retrieval, distractor, distractor, diffuse -> `[[0], [1, 2], [3]]`.
    """
    groups: list[list[int]] = []
    for h in range(prof.shape[0]):
        for g in groups:
            if torch.equal(prof[g[0]], prof[h]):
                g.append(h)
                break
        else:
            groups.append([h])
    return groups


def _heads_name(heads: list[int], roles) -> str:
    """Legend name of a profile shared by `heads`: "h0 retrieval" for one head,
    "h1, h2: distractor heads ×2 (identical)" for several."""
    if len(heads) == 1:
        return f"h{heads[0]} {roles[heads[0]]}"
    which = ", ".join(f"h{h}" for h in heads)
    kinds = sorted({roles[h] for h in heads}, key=[roles[h] for h in heads].index)
    kind = f"{kinds[0]} heads" if len(kinds) == 1 else " / ".join(kinds)
    return f"{which}: {kind} ×{len(heads)} (identical)"


def mechanism_figure(mech, plans: dict, title=None):
    """Constructed profiles: each head's profile, and which tokens each policy keeps."""
    go = _go()
    from plotly.subplots import make_subplots

    prof = mech.profiles[0]  # [r, n]
    r, n = prof.shape
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.65, 0.35],
        vertical_spacing=0.08,
        subplot_titles=["constructed head profiles a_h(t)", "tokens kept"],
    )
    palette = [VERMILLION, ORANGE, PURPLE, GREEN, SKY, YELLOW, BLACK, BLUE]
    # Heads with identical profiles (the distractors, the diffuse heads: identical by
    # construction) are one curve, named with how many heads share it: drawn once per
    # head they lay exactly on top of each other and read as one head.
    for heads in profile_groups(prof):
        h = heads[0]
        fig.add_trace(
            go.Scatter(
                x=list(range(n)),
                y=prof[h].tolist(),
                mode="lines",
                name=_heads_name(heads, mech.roles),
                line=dict(color=palette[h % len(palette)], width=1.5),
                meta={"heads": heads},
            ),
            row=1,
            col=1,
        )
    for label, plan in plans.items():
        xs = torch.nonzero(plan.keep[0, 0]).flatten().tolist()
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[label] * len(xs),
                mode="markers",
                marker=dict(symbol="square", size=6, color=POLICY_COLOURS.get(label, BLACK)),
                name=f"kept by {label}",
                showlegend=False,
            ),
            row=2,
            col=1,
        )
    for t, colour, name in [(mech.needle_token, VERMILLION, "needle")] + [
        (mech.distractor_tokens[0], ORANGE, "distractor")
    ]:
        fig.add_vline(
            x=t,
            line_dash="dot",
            line_color=colour,
            annotation_text=name,
            annotation_position="top right",
            row=1,
            col=1,
        )
    fig.update_xaxes(title_text="token", row=2, col=1)
    fig.update_yaxes(title_text="attention", row=1, col=1)
    return layout(fig, title or "Mechanism (constructed profiles, not a model)", 520, above=22)
