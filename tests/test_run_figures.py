"""A run's figures (`pagekv.app.run_figures`): drawn once per content into a study's plan memo, the
same across budgets and new when their content changes; the UOR chart and stored heatmap scale at
the model's r."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from pagekv import EvictionConfig, PromptSpec
from pagekv.app import run_figures as fm
from pagekv.app.figures import eviction as fp
from pagekv.app.run_figures import comparison_figures
from pagekv.engine.comparison import Side, preview_comparison
from pagekv.engine.memo import ByteLRU
from pagekv.engine.worker import ModelWorker
from tests.test_figures_readable import random_plan
from tests.test_worker_stress import _tiny_study, tokenizer  # noqa: F401 (a fixture)

pytest.importorskip("plotly")

MEMOISED = ("weights", "weights_overview", "sink_mass", "sink_advantage")


@pytest.fixture
def memo():
    return ByteLRU(2**20, lambda v: v["nbytes"])


def counting(draw):
    calls = []

    def build():
        calls.append(1)
        return draw()

    return build, calls


def test_same_content_draws_once(memo):
    w = torch.tensor([[0.25, 0.75]])
    build, calls = counting(lambda: fp.layer_head_heatmap(w, 1, "w"))
    a = fm.memo_figure(memo, "heat", (w, 1), build)
    b = fm.memo_figure(memo, "heat", (w.clone(), 1), build)  # equal values, another tensor
    assert a is b and len(calls) == 1
    c = fm.memo_figure(None, "heat", (w, 1), build)  # no memo: drawn now
    assert c is not a and len(calls) == 2


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
def test_different_content_draws_again(other, memo):
    w = torch.tensor([[0.25, 0.75]])
    build, calls = counting(lambda: fp.layer_head_heatmap(w, 1, "w"))
    fm.memo_figure(memo, "heat", (w, 1), build)
    fm.memo_figure(memo, "heat", other, build)
    assert len(calls) == 2


def test_the_name_is_part_of_the_key(memo):
    w = torch.tensor([[0.5, 0.5]])
    a = fm.memo_figure(memo, "a", (w,), lambda: fp.layer_head_heatmap(w, 1, "a"))
    b = fm.memo_figure(memo, "b", (w,), lambda: fp.layer_head_heatmap(w, 1, "b"))
    assert a is not b and b.layout.title.text == "b"


def test_an_unkeyable_input_is_refused():
    with pytest.raises(TypeError, match="cannot key a object"):
        fm.content_key("x", (object(),))


def test_the_memo_is_bounded():
    memo = ByteLRU(3 * fm.BYTES_PER_VALUE * 4, lambda v: v["nbytes"])
    for i in range(5):
        w = torch.full((2, 2), float(i))
        fm.memo_figure(memo, "heat", (w,), lambda w=w: fp.layer_head_heatmap(w, 1, "w"))
    assert len(memo) < 5 and memo.nbytes <= memo.max_bytes


def test_no_module_of_the_app_holds_a_cache_of_its_own():
    """No module-level `ByteLRU` or argument-keyed cache in the app or engine."""
    import importlib
    import inspect
    import pkgutil

    import pagekv.app
    import pagekv.engine

    names = [m.name for m in pkgutil.walk_packages(pagekv.app.__path__, "pagekv.app.")]
    names += [m.name for m in pkgutil.walk_packages(pagekv.engine.__path__, "pagekv.engine.")]
    modules = [importlib.import_module(name) for name in ["app", *names]]
    held = [
        f"{mod.__name__}.{attr}"
        for mod in modules
        for attr, value in vars(mod).items()
        if isinstance(value, ByteLRU)
        or (hasattr(value, "cache_info") and inspect.signature(value).parameters)
    ]
    assert len(modules) > 20 and held == []


def test_the_study_memos_count_drawn_views_at_their_own_size(tokenizer):  # noqa: F811
    """A dict of drawn views is counted at its `nbytes` (not by walking plotly objects);
    a plan or a result by `nbytes`; views never go to the lessons' kept part."""
    from pagekv.engine.study import _entry_bytes
    from pagekv.engine.worker import ModelWorker

    assert _entry_bytes({"figs": {}, "nbytes": 1234}) == 1234
    assert _entry_bytes(torch.zeros(8)) == 32
    study = _tiny_study(tokenizer, ModelWorker())
    memos = [name for name, value in vars(study).items() if isinstance(value, ByteLRU)]
    assert memos == ["prefills", "plans", "results"]  # a study's three caches, no other
    study.kept_prompts = frozenset({"lesson"})
    assert study.results.keep_if((("lesson", "digest"), "config", 32))
    assert not study.results.keep_if(fm.view_key("lesson", "a", "b", 0))
    assert not study.plans.keep_if(("preview views", *fm.view_key("lesson", "a", "b", 0)))
    assert not study.plans.keep_if(fm.content_key("weights", (1,)))


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


def test_app_views_are_drawn_once_across_budgets(memo):
    """Two budgets of one profile share their weights and sink views, equal to a fresh draw."""
    p20, p50 = random_plan(), random_plan()
    p50 = dataclasses.replace(p50, page_keep=~p50.page_keep)  # another keep
    a = comparison_figures(fake_comparison(p20), layer=1, only=MEMOISED, memo=memo)
    b = comparison_figures(fake_comparison(p50), layer=1, only=MEMOISED, memo=memo)
    for name in MEMOISED:
        assert a[name] is b[name], name
    fresh = fp.head_weights_bars(p20, 1)
    assert json.loads(a["weights"].to_json()) == json.loads(fresh.to_json())


@pytest.mark.parametrize("change", ["layer", "weights", "sink_mass", "sink_heads"])
def test_app_views_redrawn_when_what_they_draw_changes(change, memo):
    p = random_plan()
    a = comparison_figures(fake_comparison(p), layer=0, only=MEMOISED, memo=memo)
    layer, q = 0, p
    if change == "layer":
        layer = 1
    elif change == "weights":
        q = dataclasses.replace(p, weights_isolated=p.weights_isolated.flip(-1))
    elif change == "sink_mass":
        q = dataclasses.replace(p, sink_mass=p.sink_mass * 0.5)
    else:
        q = dataclasses.replace(p, sink_heads=~p.sink_heads)
    b = comparison_figures(fake_comparison(q), layer=layer, only=MEMOISED, memo=memo)
    redrawn = {name for name in MEMOISED if a[name] is not b[name]}
    expected = {
        "layer": {"weights"},
        "weights": {"weights", "weights_overview", "sink_advantage"},
        "sink_mass": {"sink_mass"},
        "sink_heads": {"weights", "sink_advantage"},
    }[change]
    assert redrawn == expected


def test_the_layer_control_draws_the_runs_own_view():
    """`handlers.update_layer` (the layer slider) sends the run's own weights view: the
    layer clamped to the model's, the same JSON as a fresh draw."""
    from pagekv.app import handlers

    p = random_plan()  # 2 layers
    comp = fake_comparison(p)
    sent = handlers.update_layer(comp, 99)
    assert sent.plot == fp.head_weights_bars(p, 1).to_json()
    assert handlers.update_layer(comp, 0).plot == fp.head_weights_bars(p, 0).to_json()
    drawn = comparison_figures(comp, layer=1, only={"weights"})["weights"]
    assert handlers.sent(drawn).plot == sent.plot
    assert handlers.update_layer(None, 0) is None


def test_the_uor_chart_and_stored_scale_are_at_r(tokenizer):  # noqa: F811
    """At r = 7 the UOR chart's worst case and the stored scale end at 7."""
    study = _tiny_study(tokenizer, ModelWorker(), n_heads=14, family="qwen2")
    assert study.loaded.group_size == 7
    spec = PromptSpec(task="needle", context=300, depth=0.5, seed=2)
    base = EvictionConfig(budget=0.3, page_size=4, window=8)
    a, b = Side(base.replace(policy="head_independent")), Side(base.replace(policy="entropy"))
    figs = comparison_figures(preview_comparison(study, spec, a, b), only={"uor", "stored"})
    uor = figs["uor"]
    assert any(s.y0 == s.y1 == 7 for s in uor.layout.shapes)  # the worst case's line
    assert "r = 7" in uor.layout.annotations[0].text
    assert uor.layout.yaxis.range[1] > 7
    top = max(max(t.y) for t in uor.data if t.name == "head-independent, max")
    assert 1.0 < top <= 7.0  # the union of 7 heads' picks: above 1, at most r
    assert {t.zmax for t in figs["stored"].data if t.type == "heatmap"} == {7.0}
