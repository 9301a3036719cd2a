"""The look every figure shares: colours, page states and the layout.

Colours are the Okabe-Ito palette (colour-blind safe); evicted cells are a pale grey,
so what was thrown away reads as absence. Policy colours follow the registry's
order (`pagekv.maths.policies.POLICIES`), so a new policy gets the next colour.
"""

from __future__ import annotations

import functools

from pagekv.maths.policies import POLICIES

#: Okabe-Ito colours.
BLUE, ORANGE, GREEN, VERMILLION = "#0072B2", "#E69F00", "#009E73", "#D55E00"
SKY, PURPLE, YELLOW, BLACK = "#56B4E9", "#CC79A7", "#F0E442", "#000000"
EVICTED = "#EDEDED"
#: One colour per policy, in registry order (entropy blue, mean orange, ...).
_PALETTE = (BLUE, SKY, ORANGE, PURPLE, VERMILLION, GREEN, BLACK, YELLOW)
POLICY_COLOURS = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(POLICIES)}
#: Page states in the page-frame heatmap: 0 evicted, 1 kept, 2 protected.
STATE_COLOURS = [EVICTED, BLUE, ORANGE]
STATE_NAMES = ["evicted", "kept", "protected"]
#: The needle marker of the page frame: an outline and a pointer, never a fill, so it
#: cannot be mistaken for a page state (orange already means "protected"). Black is the
#: one Okabe-Ito colour that is apart from every state in hue and in lightness.
NEEDLE = BLACK
#: Pages shown on each side of the needle's pages in the page frame's needle strip.
NEEDLE_MARGIN = 3


def _go():
    import plotly.graph_objects as go

    return go


def is_figure(value) -> bool:
    """Whether `value` is a plotly figure (without importing plotly for other values'
    sake: plotly stays inside `pagekv/app/figures/`)."""
    if not type(value).__module__.startswith("plotly"):
        return False
    from plotly.basedatatypes import BaseFigure

    return isinstance(value, BaseFigure)


#: What our figures take of plotly's "plotly_white": its page look (backgrounds, grid,
#: font, colour scales), not its per-trace defaults for the dozens of trace types we
#: never draw; plotly copies a template into every figure, and the whole one costs
#: more than drawing a page frame.
TEMPLATE_KEYS = (
    "autotypenumbers", "colorway", "colorscale", "font", "hovermode", "hoverlabel",
    "paper_bgcolor", "plot_bgcolor", "xaxis", "yaxis", "title",
)  # fmt: skip


@functools.cache
def _template():
    """A lean copy of "plotly_white" (`TEMPLATE_KEYS`), built once."""
    import plotly.io as pio

    white = pio.templates["plotly_white"].layout.to_plotly_json()
    return _go().layout.Template(layout={k: white[k] for k in TEMPLATE_KEYS if k in white})


#: Pixels kept free above every figure's title: a host may draw a label badge in the
#: top-left corner of a plot's frame (Gradio's "Plot" badge hid the start of titles).
TITLE_PAD = 28
#: The title's left edge, as a fraction of the figure's width (15 px at 740 px).
TITLE_X = 0.02
#: Pixels per title line (15 px font, lines 1.3 em apart; a smaller `<br>` subtitle
#: line fits).
TITLE_LINE = 20
#: Plotly drops the cap-height shift of a top-anchored title of several lines (its
#: first baseline sits at the pad): this much more pad puts its top where a one-line
#: title's is.
TITLE_CAP = 11
#: Pixels between the title's last line and the plot area (or what `above` reserves).
TITLE_GAP = 12
#: The legend of every figure: horizontal, at the bottom of the figure, positioned in
#: the container (not the plot area). Plotly reserves the legend's height under the
#: margin that the automargined x-axis tick labels and title push (the template's
#: `automargin`), so a legend never covers an axis title, at any width or height and
#: however many rows it wraps to. A paper-referenced legend below the plot (the old
#: `y=-0.06`) sat at a fraction of the plot's height: on the axis title of short plots.
LEGEND = dict(
    orientation="h",
    yref="container",
    y=0.0,
    yanchor="bottom",
    xref="paper",
    x=0.0,
    xanchor="left",
)


def layout(fig, title, height=None, above=0):
    """Title, white template, margins and legend, the same for every figure. Returns
    the figure to use from here on (a new one: see below).

    The title is at the top left, `TITLE_PAD` px down and `TITLE_X` of the width in,
    so no badge in the frame's corner covers its first characters; the top margin
    holds its lines (`<br>`) and `above` more px between it and the plot area, for
    what a figure draws there (subplot titles, notes, pointers). The legend is
    `LEGEND`: below the x-axis title, never on it.

    Plotly's `update_layout` checks every property path it is given against its
    schema, and that cost tens of milliseconds a figure, on the thread that shares
    the CPU with the decode. Here the figure's layout JSON (already checked when it
    was set) gets these settings merged in as plotly's own update would, and the
    traces and that layout become a new figure without the check. `tests/test_figures_valid.py`
    re-checks every figure the app draws against plotly's schema.
    """
    lay = merge(fig.layout.to_plotly_json(), layout_settings(title, height, above))
    lay["template"] = _template_json()
    return _go().Figure(data=fig.data, layout=lay, _validate=False)


def layout_settings(title, height=None, above=0) -> dict:
    """What `layout` sets (the template apart), as `update_layout` arguments."""
    lines = title.count("<br>") + 1
    pad = TITLE_PAD + (TITLE_CAP if lines > 1 else 0)
    settings = dict(
        title=dict(
            text=title,
            x=TITLE_X,
            xanchor="left",
            xref="container",
            y=1.0,
            yanchor="top",
            yref="container",
            pad=dict(t=pad),
            font=dict(size=15),
        ),
        margin=dict(l=60, r=20, t=pad + TITLE_LINE * lines + TITLE_GAP + above, b=40),
        legend=LEGEND,
    )
    if height:
        settings["height"] = height
    return settings


def merge(into: dict, update: dict) -> dict:
    """`update` merged into `into` as plotly's `update_layout` merges: nested dicts key
    by key, anything else replaced. Returns `into`."""
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


@functools.cache
def _template_json() -> dict:
    """`_template()` as the JSON a figure holds, made once (a figure built from JSON
    copies what it is given, so figures share nothing through it)."""
    return _template().to_plotly_json()
