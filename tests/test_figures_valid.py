"""Every figure the app draws passes plotly's schema check: `style.layout` skips it for speed, so
each figure is rebuilt with validation and must give the same JSON and layout."""

from __future__ import annotations

import json

import pytest

from pagekv.app.figures import style
from pagekv.app.figures.placeholder import placeholder
from tests.test_figures_readable import FIGURES, every_figure, random_plan

go = pytest.importorskip("plotly.graph_objects")


def _json(fig) -> dict:
    return json.loads(fig.to_json())


@pytest.mark.parametrize("name", FIGURES)
def test_figure_passes_plotly_validation(name):
    fig = every_figure()[name]
    checked = go.Figure(fig.to_plotly_json())  # validates: raises on an unknown property
    assert _json(checked) == _json(fig)
    assert fig.layout.template.layout.paper_bgcolor == "white"  # the lean template is in


def test_placeholder_passes_plotly_validation():
    fig = placeholder("nothing yet")
    assert _json(go.Figure(fig.to_plotly_json())) == _json(fig)


def test_validation_catches_a_bad_property():
    """The check above can fail: a layout with a property plotly does not know."""
    bad = style.layout(go.Figure(), "t").to_plotly_json()
    bad["layout"]["titel"] = "typo"
    with pytest.raises(ValueError, match="titel"):
        go.Figure(bad)


@pytest.mark.parametrize("title, height, above", [("One line", None, 0), ("Two<br>lines", 300, 22)])
def test_layout_equals_plotly_update_layout(title, height, above):
    """`layout` merges its settings as `update_layout` does, over settings the figure
    already has (a legend title and a title font colour that must survive)."""

    def base():
        fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4], name="b"))
        return fig.update_layout(
            legend_title_text="kept", title_font_color="red", margin_b=99, yaxis_range=[0, 5]
        )

    ours = style.layout(base(), title, height, above)
    ref = base().update_layout(
        **style.layout_settings(title, height, above), template=style._template()
    )
    assert _json(ours) == _json(ref)
    assert ours.layout.legend.title.text == "kept" and ours.layout.title.font.color == "red"
    assert ours.layout.margin.b == 40  # replaced, as update_layout replaces a leaf


def test_layout_leaves_its_input_settings_alone():
    """Figures share no settings through a shared dict."""
    a = style.layout(go.Figure(), "a")
    a.update_layout(legend_x=0.5)
    a.layout.template.layout.paper_bgcolor = "black"
    b = style.layout(go.Figure(), "b")
    assert b.layout.legend.x == style.LEGEND["x"] == 0.0
    assert b.layout.template.layout.paper_bgcolor == "white"


def test_head_weights_keeps_its_right_margin():
    """`head_weights_bars` sets its right margin on the figure `layout` returns."""
    from pagekv.app.figures import eviction as fp

    fig = fp.head_weights_bars(random_plan(), 0)
    assert fig.layout.margin.r == fp.HEAD_WEIGHTS_RIGHT


def test_a_figure_is_sent_as_gradio_would_send_it_once():
    """`handlers.sent`: the `PlotData` gr.Plot makes of a figure (its JSON), made once per
    figure object; Gradio passes it through; other values are left as they are."""
    import gradio as gr

    from pagekv.app import handlers

    fig = every_figure()["page_frame_needle"]
    data = handlers.sent(fig)
    assert data.type == "plotly" and data.plot == fig.to_json()
    assert gr.Plot().postprocess(fig) == data  # what Gradio itself would send
    assert gr.Plot().postprocess(data) is data
    assert handlers.sent(fig) is data  # not serialised again
    other = style.layout(go.Figure(), "another")
    assert handlers.sent(other) is not data and handlers.sent(other).plot == other.to_json()
    update = gr.update()
    assert handlers.sent(update) is update and handlers.sent(None) is None
