"""Figures drawn once per content (`pagekv.app.view_memo.memo_figure`), and the app's views of
head weights and sink mass drawn from it: the same across budgets, new when what they
draw changes."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from pagekv.app import view_memo as fm
from pagekv.app.figures import eviction as fp
from pagekv.app.run_figures import comparison_figures
from tests.test_figures_readable import random_plan

pytest.importorskip("plotly")

MEMOISED = ("weights", "weights_overview", "sink_mass", "sink_advantage")


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch):
    monkeypatch.setattr(fm, "view_memo", fm.ByteLRU(fm.VIEW_MEMO_BYTES, lambda v: v["nbytes"]))


def counting(draw):
    calls = []

    def build():
        calls.append(1)
        return draw()

    return build, calls


def test_same_content_draws_once():
    w = torch.tensor([[0.25, 0.75]])
    build, calls = counting(lambda: fp.layer_head_heatmap(w, 1, "w"))
    a = fm.memo_figure("heat", (w, 1), build)
    b = fm.memo_figure("heat", (w.clone(), 1), build)  # equal values, another tensor
    assert a is b and len(calls) == 1


@pytest.mark.parametrize(
    "other",
    [
        (torch.tensor([[0.25, 0.7500001]]), 1),  # one value moved by an ulp
        (torch.tensor([[0.25, 0.75]], dtype=torch.float64), 1),  # another dtype
        (torch.tensor([0.25, 0.75]), 1),  # another shape, the same bytes
        (torch.tensor([[0.25, 0.75]]), 2),  # another number
        (torch.tensor([[0.25, 0.75]]), "1"),  # a string, not the number
    ],
)
def test_different_content_draws_again(other):
    w = torch.tensor([[0.25, 0.75]])
    build, calls = counting(lambda: fp.layer_head_heatmap(w, 1, "w"))
    fm.memo_figure("heat", (w, 1), build)
    fm.memo_figure("heat", other, build)
    assert len(calls) == 2


def test_the_name_is_part_of_the_key():
    w = torch.tensor([[0.5, 0.5]])
    a = fm.memo_figure("a", (w,), lambda: fp.layer_head_heatmap(w, 1, "a"))
    b = fm.memo_figure("b", (w,), lambda: fp.layer_head_heatmap(w, 1, "b"))
    assert a is not b and b.layout.title.text == "b"


def test_an_unkeyable_input_is_refused():
    with pytest.raises(TypeError, match="cannot key a object"):
        fm.content_key("x", (object(),))


def test_the_memo_is_bounded():
    memo = fm.ByteLRU(3 * fm.BYTES_PER_VALUE * 4, lambda v: v["nbytes"])
    fm.view_memo = memo  # the fixture restores the module's memo
    for i in range(5):
        w = torch.full((2, 2), float(i))
        fm.memo_figure("heat", (w,), lambda w=w: fp.layer_head_heatmap(w, 1, "w"))
    assert len(memo) < 5 and memo.nbytes <= memo.max_bytes


def test_one_memo_with_one_bound_holds_runs_plan_views_and_figures(monkeypatch):
    """The app's drawn views have one memo: the run handler's finished runs, the
    previews' plan views and single figures are entries of the same ByteLRU, so one
    cap bounds them all."""
    from pagekv.app import handlers, run_figures

    memo = handlers.view_memo
    assert run_figures.view_memo is memo and memo.max_bytes == fm.VIEW_MEMO_BYTES
    monkeypatch.setattr(fm, "view_memo", memo)  # the module's own (the fixture's is fresh)
    w = torch.tensor([[0.125, 0.875]])
    fig = fm.memo_figure("heat", (w, 1), lambda: fp.layer_head_heatmap(w, 1, "w"))
    key = fm.content_key("heat", (w, 1))
    try:
        assert memo.get(key)["fig"] is fig and key[0] == "figure"
    finally:
        memo.pop(key)


def fake_comparison(plan_b):
    """What `comparison_figures` reads for the memoised views (side B's plan)."""
    return SimpleNamespace(
        plan_of=lambda side: plan_b,
        labels={"A": "A", "B": "B"},
        configs={},
        n_groups=plan_b.n_groups,
        prep=SimpleNamespace(needle_positions=None),
        curve=[],
    )


def test_app_views_are_drawn_once_across_budgets():
    """Two plans of one profile at different budgets keep different pages but have the
    same head weights and sink mass: their views are the same figure objects, equal to
    a fresh draw."""
    p20, p50 = random_plan(), random_plan()
    p50 = dataclasses.replace(p50, page_keep=~p50.page_keep)  # another keep
    a = comparison_figures(fake_comparison(p20), layer=1, only=MEMOISED)
    b = comparison_figures(fake_comparison(p50), layer=1, only=MEMOISED)
    for name in MEMOISED:
        assert a[name] is b[name], name
    fresh = fp.head_weights_bars(p20, 1)
    assert json.loads(a["weights"].to_json()) == json.loads(fresh.to_json())


@pytest.mark.parametrize("change", ["layer", "weights", "sink_mass", "sink_heads"])
def test_app_views_redrawn_when_what_they_draw_changes(change):
    p = random_plan()
    a = comparison_figures(fake_comparison(p), layer=0, only=MEMOISED)
    layer, q = 0, p
    if change == "layer":
        layer = 1
    elif change == "weights":
        q = dataclasses.replace(p, weights_isolated=p.weights_isolated.flip(-1))
    elif change == "sink_mass":
        q = dataclasses.replace(p, sink_mass=p.sink_mass * 0.5)
    else:
        q = dataclasses.replace(p, sink_heads=~p.sink_heads)
    b = comparison_figures(fake_comparison(q), layer=layer, only=MEMOISED)
    redrawn = {name for name in MEMOISED if a[name] is not b[name]}
    expected = {
        "layer": {"weights"},
        "weights": {"weights", "weights_overview", "sink_advantage"},
        "sink_mass": {"sink_mass"},
        "sink_heads": {"weights", "sink_advantage"},
    }[change]
    assert redrawn == expected


def test_the_layer_control_redraws_from_the_same_memo():
    """`handlers.update_layer` (the layer slider) sends the run's own weights view: the
    layer clamped to the model's, drawn once per content, the same JSON as a fresh draw."""
    from pagekv.app import handlers

    p = random_plan()  # 2 layers
    comp = fake_comparison(p)
    sent = handlers.update_layer(comp, 99)
    assert sent.plot == fp.head_weights_bars(p, 1).to_json()
    assert handlers.update_layer(comp, 1) is sent  # memoised figure, its JSON made once
    drawn = comparison_figures(comp, layer=1, only={"weights"})["weights"]
    assert handlers.sent(drawn) is sent
    assert handlers.update_layer(None, 0) is None
