"""The charts read at 1280 and 800 px, checked on the figure objects (no renderer): ticks, anchors,
trace names, bar texts. Each test fails on a defect the review found."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

import pagekv
from pagekv.app.figures import eviction as fp
from pagekv.app.figures import replay as fr
from pagekv.app.figures import style
from pagekv.maths.config import EvictionConfig
from pagekv.maths.constructed import mechanism_profiles
from pagekv.maths.mechanism import mechanism_view

pytest.importorskip("plotly")

NAN = float("nan")


def random_plan(L=2, G=2, r=3, n=64, seed=0):
    torch.manual_seed(seed)
    prof = torch.rand(L, G * r, n) ** 4
    prof[..., :4] += 2.0  # sink-heavy heads, so some are flagged as sinks
    prof = prof / prof.sum(-1, keepdim=True)
    cfg = EvictionConfig(budget=0.3, page_size=4, n_sink=4, window=4)
    return pagekv.plan(prof, G, cfg)


def mechanism(**kw):
    """The Mechanism tab's figure (`mechanism_view`)."""
    view = mechanism_view(n=64, budget=0.19, **kw)
    return fp.mechanism_figure(view.mech, view.plans)


RECALL_ROWS = [
    {"mode": "after", "budget": 0.2, "policy": "entropy", "recall": 0.6},
    {"mode": "after", "budget": 0.2, "policy": "mean", "recall": 0.0},
    {"mode": "after", "budget": 0.2, "policy": "kvpress knorm", "recall": 0.0},
    {"mode": "after", "budget": 0.2, "policy": "kvpress snapkv", "recall": 1 / 15},
    {"mode": "after", "budget": 0.2, "policy": "kvpress expected_attention", "recall": 1.0},
    {"mode": "inside", "budget": 1.0, "policy": "full", "recall": 1.0},
]


@functools.cache
def every_figure():
    """One of each figure, by name (the app's and the replay's); built once, read only."""
    p = random_plan()
    adv = torch.tensor([[NAN, NAN], [7.24, 7.24], [0.3, 0.5]])
    return {
        "page_frame": fp.page_frame({"A": p, "B": p}),
        "page_frame_needle": fp.page_frame({"A": p, "B": p}, [33]),
        "head_weights": fp.head_weights_bars(p, 0),
        "layer_head": fp.layer_head_heatmap(p.weights_isolated, 2, "weights"),
        "sink_advantage": fp.sink_advantage_lines(adv, adv),
        "retention": fp.needle_retention_heatmap({"A": torch.ones(2, 2)}, 2),
        "uor": fp.uor_curve([0.1, 0.2], [1.5, 1.3], [2.0, 1.8], 3),
        "stored": fp.union_over_budget_heatmap({"A": [[3, 4], [5, 6]]}, {"A": 3}, 3),
        "memory": fp.memory_bars([{"policy": "entropy", "tokens": 10, "bytes": 2**20}]),
        "glance": fp.stored_glance(
            {"A": [[3, 7], [5, 6]], "B": [[3, 3], [2, 3]]}, {"A": 3, "B": 3}, {"A": "#D55E00"}, 3
        ),
        "mechanism": mechanism(),
        "scatter": fr.disagreement_scatter({0.1: ([0.1, 0.5], [1.2, 2.0])}, 3, "T2"),
        "recall": fr.recall_bars(RECALL_ROWS, "T4"),
        "answers": fr.answer_bars(
            [
                {
                    "setting": "s",
                    "mode": "after",
                    "entropy_beats": 1,
                    "ties": 2,
                    "entropy_loses": 0,
                }
            ],
            "T7",
        ),
    }


FIGURES = (
    "page_frame",
    "page_frame_needle",
    "head_weights",
    "layer_head",
    "sink_advantage",
    "retention",
    "uor",
    "stored",
    "memory",
    "glance",
    "mechanism",
    "scatter",
    "recall",
    "answers",
)


def test_every_figure_is_checked():
    assert tuple(every_figure()) == FIGURES


def test_the_glance_sorts_each_sides_stored_tokens_over_its_budget():
    """The first screen's chart, hand-worked: each (layer, group)'s
    stored tokens over its side's budget, fullest first; the budget and r as lines."""
    fig = fp.stored_glance(
        {"A: hi": [[3, 7], [5, 6]], "B: mean": [[2, 4], [4, 4]]},
        {"A: hi": 4, "B: mean": 4},
        {"A: hi": "#D55E00", "B: mean": "#E69F00"},
        r=3,
    )
    a, b = fig.data
    assert list(a.y) == [1.75, 1.5, 1.25, 0.75] and list(a.x) == [1, 2, 3, 4]
    assert list(b.y) == [1.0, 1.0, 1.0, 0.5]
    assert (a.line.color, b.line.color, a.line.dash, b.line.dash) == (
        "#D55E00",
        "#E69F00",
        None,
        "dash",
    )
    assert sorted(s.y0 for s in fig.layout.shapes) == [1, 3]


def test_sink_advantage_axis_has_ticks_across_the_data():
    # Per layer (the mean over groups): no value, 7.24x, 0.4x.
    raw = torch.tensor([[NAN, NAN], [7.24, 7.24], [0.3, 0.5]])
    iso = torch.tensor([[1.0, NAN], [2.0, 2.0], [1.0, 1.0]])
    fig = fp.sink_advantage_lines(iso, raw)
    y = fig.layout.yaxis
    assert y.type == "log" and y.tickmode == "array"
    ticks = list(y.tickvals)
    assert ticks == [0.25, 0.5, 1, 2, 4, 8]  # 7.24x reads off between 4x and 8x
    assert list(y.ticktext) == ["0.25x", "0.5x", "1x", "2x", "4x", "8x"]
    # The range (log10 units on a log axis) shows every tick and every value.
    lo, hi = y.range
    assert lo <= math.log10(0.25) and hi >= math.log10(8)
    assert 10**lo <= 0.4 and 10**hi >= 7.24
    # The reference line at 1 (no advantage) stays.
    assert any(s.y0 == s.y1 == 1.0 and s.line.dash == "dot" for s in fig.layout.shapes)
    # Hover gives the exact value.
    assert all("%{y:.2f}x" in t.hovertemplate for t in fig.data)
    # Whole layers on the x axis (no "0.5" layer ticks).
    assert (fig.layout.xaxis.tick0, fig.layout.xaxis.dtick) == (0, 1)


@pytest.mark.parametrize(
    "values, ticks",
    [
        ([0.3, 7.24], [0.25, 0.5, 1, 2, 4, 8]),
        ([1.2, 1.9], [1, 1.5, 2]),  # narrow: halfway ticks too
        ([1.0], [0.5, 0.75, 1, 1.5, 2]),
        ([None, NAN, 0.0, -1.0], [0.5, 1, 2]),  # nothing a log axis can show
        ([3.0, 40.0], [1, 2, 4, 8, 16, 32, 64]),  # 1 is always a tick
    ],
    ids=["wide", "narrow", "one", "none", "above-1"],
)
def test_ratio_ticks(values, ticks):
    assert fp.ratio_ticks(values) == ticks


def test_ratio_ticks_thin_a_wide_range_but_keep_1():
    ticks = fp.ratio_ticks([1e-3, 1e4])
    assert len(ticks) <= 9 and 1.0 in ticks
    assert ticks[0] <= 1e-3 and ticks[-1] >= 1e4
    exps = [math.log2(t) for t in ticks]
    assert len({b - a for a, b in itertools.pairwise(exps)}) == 1  # evenly spaced


def test_mean_pooling_label_is_outside_the_bars():
    p = random_plan()
    fig = fp.head_weights_bars(p, 0)
    assert [t.type for t in fig.data] == ["bar", "bar"]  # the app's test reads these
    (label,) = [a for a in fig.layout.annotations if "mean pooling" in a.text]
    # The bars fill the plot area, paper x in [0, 1]; the label starts right of it, in
    # a right margin wide enough for "mean pooling" at 11 px.
    assert label.xref == "paper" and label.x >= 1.0 and label.xanchor == "left"
    assert not label.showarrow
    assert fig.layout.margin.r >= 90
    assert max(len(line) for line in label.text.split("<br>")) <= 14
    # At the height of the 1/r line it names.
    r = 3
    assert label.yref == "y" and label.y == pytest.approx(1 / r)
    assert any(s.y0 == pytest.approx(1 / r) for s in fig.layout.shapes)


@pytest.mark.parametrize("name", FIGURES)
def test_legend_below_the_axis_titles(name):
    fig = every_figure()[name]
    legend = fig.layout.legend
    # Horizontal, at the bottom of the figure in container coordinates: plotly then
    # reserves the legend's height below what the axes' tick labels and titles push.
    assert legend.orientation == "h"
    assert (legend.yref, legend.y, legend.yanchor) == ("container", 0, "bottom")
    assert (legend.xref, legend.x, legend.xanchor) == ("paper", 0, "left")
    # The axes push the margin for their labels and titles (automargin).
    tmpl = fig.layout.template.layout
    assert tmpl.xaxis.automargin is True and tmpl.yaxis.automargin is True
    for ax in [k for k in fig.layout if k.startswith("xaxis")]:
        assert fig.layout[ax].automargin in (None, True)


def test_page_frame_legend_off_the_token_axis_title():
    """The page frame of the teacher's report: the legend was on "token"/"page"."""
    p = random_plan()
    fig = fp.page_frame({"A": p, "B": p}, [33])
    assert fig.layout.xaxis.title.text == "page" and fig.layout.xaxis2.title.text == "page"
    assert fig.layout.legend.yref == "container" and fig.layout.legend.y == 0
    assert style.LEGEND == fig.layout.legend.to_plotly_json()
    # Every row keeps about 10 px besides the margins.
    rows = 2 * 2
    assert fig.layout.height >= fig.layout.margin.t + 90 + 10 * rows


@pytest.mark.parametrize("name", FIGURES)
def test_title_clear_of_the_frame_corner(name):
    fig = every_figure()[name]
    t = fig.layout.title
    assert t.x >= 0.02 and t.xanchor == "left" and t.xref == "container"
    assert (t.y, t.yanchor, t.yref) == (1.0, "top", "container")
    assert t.pad.t >= 24  # below a label badge in the frame's top-left corner
    lines = t.text.count("<br>") + 1
    assert fig.layout.margin.t >= t.pad.t + 20 * lines


def test_page_frame_title_leaves_room_for_the_strip_titles():
    p = random_plan()
    fig = fp.page_frame({"A": p, "B": p}, [33])
    t = fig.layout.title
    assert t.text.startswith("Page frame: what each (layer, group) keeps")
    assert t.x >= 0.02 and t.pad.t >= 24
    # Title and count line, then the two-line strip titles over the needle pointers.
    assert fig.layout.margin.t >= t.pad.t + 2 * 20 + 56


def profile_traces(fig):
    return [t for t in fig.data if t.xaxis in (None, "x") and t.mode == "lines"]


def test_identical_distractors_drawn_once_and_named():
    fig = mechanism(heads=3, distractors=2)
    curves = profile_traces(fig)
    assert [t.name for t in curves] == [
        "h0 retrieval",
        "h1, h2: distractor heads ×2 (identical)",
    ]
    assert [t.meta["heads"] for t in curves] == [[0], [1, 2]]
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert any("×2 (identical)" in name for name in names)  # the legend says it


def test_every_head_in_exactly_one_curve():
    fig = mechanism(heads=6, distractors=2, sink_head=True)
    curves = profile_traces(fig)
    assert [t.meta["heads"] for t in curves] == [[0], [1, 2], [3], [4, 5]]
    assert [t.name for t in curves] == [
        "h0 retrieval",
        "h1, h2: distractor heads ×2 (identical)",
        "h3 sink",
        "h4, h5: diffuse heads ×2 (identical)",
    ]
    # Different profiles stay different curves: a 0.5 distractor is not a 0.48 one.
    assert len({tuple(t.y) for t in curves}) == len(curves)


def test_profile_groups_exact_and_mixed_roles():
    prof = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.5, 0.5], [1.0, 0.0]])
    assert fp.profile_groups(prof) == [[0, 3], [1, 2]]
    roles = ("retrieval", "distractor", "distractor", "diffuse")
    assert fp._heads_name([0, 3], roles) == "h0, h3: retrieval / diffuse ×2 (identical)"
    # A retrieval head of strength 0 is uniform, like the diffuse head: one curve.
    mech = mechanism_profiles(n=32, heads=3, retrieval_strength=0.0, distractor_heads=1)
    assert fp.profile_groups(mech.profiles[0]) == [[0, 2], [1]]


def test_recall_bars_label_every_bar_including_zero():
    fig = fr.recall_bars(RECALL_ROWS, "T4")
    labels = {}
    for t in fig.data:
        assert t.type == "bar" and t.textposition == "outside" and t.cliponaxis is False
        assert len(t.text) == len(t.y)
        labels.update(zip(t.x, t.text, strict=True))
    assert labels == {
        "entropy": "60 %",
        "mean": "0 %",
        "kvpress knorm": "0 %",  # a bar of no height still reads "0 %"
        "kvpress snapkv": "7 %",
        "kvpress expected_attention": "100 %",
        "full": "100 %",
    }
    # Room above 100 % for the upright labels; the ticks stop at 100 %.
    y = fig.layout.yaxis
    assert y.range[1] >= 1.2 and max(y.tickvals) == 1.0 and y.tickformat == ".0%"
    assert all(t.textangle == -90 and t.constraintext == "none" for t in fig.data)


def test_recall_bars_leave_no_empty_slot_in_a_policys_group():
    """Traces that never share a policy share a bar slot, so no slot is empty at 800 px."""
    rows = RECALL_ROWS + [{"mode": "inside", "budget": 0.2, "policy": "entropy", "recall": 0.9}]
    fig = fr.recall_bars(rows, "T4")
    slots = {t.name: t.offsetgroup for t in fig.data}
    assert slots == {
        "after, budget 20%": "0",
        "inside, budget 20%": "1",
        "inside, budget 100%": "0",
    }
    for slot in set(slots.values()):  # no two bars of one policy in one slot
        names = [x for t in fig.data if t.offsetgroup == slot for x in t.x]
        assert len(names) == len(set(names)), slot


def test_recall_bars_policy_names_break_onto_lines():
    fig = fr.recall_bars(RECALL_ROWS, "T4")
    x = fig.layout.xaxis
    ticks = dict(zip(x.tickvals, x.ticktext, strict=True))
    assert ticks["kvpress snapkv"] == "kvpress<br>snapkv"
    assert ticks["kvpress expected_attention"] == "kvpress<br>expected_<br>attention"
    assert ticks["entropy"] == "entropy" and ticks["full"] == "full"
    assert set(ticks) == {r["policy"] for r in RECALL_ROWS}  # every bar's name, once
    # The data keep the names; only the tick labels are broken.
    assert "kvpress snapkv" in fig.data[0].x
    assert fr._wrap_name("entropy_nosink") == "entropy_<br>nosink"
    assert fr._wrap_name("kvpress streaming_llm") == "kvpress<br>streaming_<br>llm"


def test_recall_bars_name_a_question_agnostic_row_by_its_scoring():
    """A reconstruction-scored entropy row is its own bar, named by its scoring."""
    from experiments.replay.tables import WINDOW_SCORING

    assert fr.WINDOW_SCORING == WINDOW_SCORING
    rows = [
        {"mode": "after", "budget": 0.2, "policy": "entropy", "recall": 0.1,
         "scoring": WINDOW_SCORING},
        {"mode": "after", "budget": 0.2, "policy": "entropy", "recall": 0.9,
         "scoring": "reconstruct/global, w8"},
        {"mode": "after", "budget": 0.2, "policy": "kvpress kvzip", "recall": 1.0},
    ]  # fmt: skip
    fig = fr.recall_bars(rows, "T4")
    (bars,) = fig.data
    assert dict(zip(bars.x, bars.y, strict=True)) == {
        "entropy": 0.1,
        "entropy (reconstruct/global, w8)": 0.9,
        "kvpress kvzip": 1.0,
    }
    assert list(fig.layout.xaxis.tickvals) == list(bars.x)
