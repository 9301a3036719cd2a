"""A figure that says why a view has nothing to show (no empty plot frame on screen)."""

from __future__ import annotations

import textwrap


def placeholder(text: str, height: int = 160):
    """An empty figure with `text` in its middle and no axes; lines of at most 48
    characters, so the text fits the first screen's narrow chart (`glance`) too."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_annotation(
        text="<br>".join(textwrap.wrap(text, 48)),
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        showarrow=False,
        font=dict(size=14, color="#555555"),
    )
    fig.update_layout(
        xaxis=dict(visible=False),
        yaxis=dict(visible=False),
        height=height,
        margin=dict(l=10, r=10, t=10, b=10),
        plot_bgcolor="white",
        paper_bgcolor="white",
    )
    return fig
