"""The look every figure shares: colours, page states and the layout.

Colours are the Okabe-Ito palette (colour-blind safe); evicted cells are a pale grey,
so what was thrown away reads as absence. Policy colours follow the registry's
order (`pagekv.maths.policies.POLICIES`), so a new policy gets the next colour.
"""

from __future__ import annotations

from pagekv.maths.policies import POLICIES

#: Okabe-Ito colours.
BLUE, ORANGE, GREEN, VERMILLION, SKY, PURPLE, YELLOW, BLACK = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#D55E00",
    "#56B4E9",
    "#CC79A7",
    "#F0E442",
    "#000000",
)
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


_TEMPLATE = []
#: What our figures take of plotly's "plotly_white": its page look (backgrounds, grid,
#: font, colour scales), not its per-trace defaults for the dozens of trace types we
#: never draw; plotly copies a template into every figure, and the whole one costs
#: more than drawing a page frame.
TEMPLATE_KEYS = (
    "autotypenumbers", "colorway", "colorscale", "font", "hovermode", "hoverlabel",
    "paper_bgcolor", "plot_bgcolor", "xaxis", "yaxis", "title",
)  # fmt: skip


def _template():
    """A lean copy of "plotly_white" (`TEMPLATE_KEYS`), built once."""
    if not _TEMPLATE:
        import plotly.io as pio

        white = pio.templates["plotly_white"].layout.to_plotly_json()
        lean = {k: white[k] for k in TEMPLATE_KEYS if k in white}
        _TEMPLATE.append(_go().layout.Template(layout=lean))
    return _TEMPLATE[0]


def layout(fig, title, height=None, legend_below=False):
    """Title, white template, margins and a horizontal legend (below the plot for
    figures with subplot titles, so it never covers them). Returns `fig`."""
    legend = dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1.0)
    margin = dict(l=60, r=20, t=60, b=45)
    if legend_below:
        legend = dict(orientation="h", yanchor="top", y=-0.06, xanchor="left", x=0.0)
        margin["b"] = 90
    fig.update_layout(
        title=dict(text=title, x=0.01, font=dict(size=15)),
        template=_template(),
        margin=margin,
        legend=legend,
    )
    if height:
        fig.update_layout(height=height)
    return fig
