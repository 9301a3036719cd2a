"""The run's inputs as one dataclass (`pagekv.app.run_inputs.RunInputs`): the `/run`
handler Gradio sees takes them by name and position and gets its request after them;
a lesson, a preset and a link build the same inputs the page's controls would send."""

from __future__ import annotations

import gradio as gr
import pytest
from gradio.helpers import special_args
from gradio.utils import get_function_params

from pagekv import EvictionConfig
from pagekv.app import handlers
from pagekv.app.lessons import LESSONS
from pagekv.app.presets import load_presets, preset_inputs
from pagekv.app.run_inputs import RUN_DEFAULTS, RunInputs, budget_rule, min_budget_pct, parse_run
from pagekv.engine.comparison import Side
from pagekv.engine.study import PromptSpec


def test_gradio_lists_the_run_inputs_by_name_with_their_defaults():
    params = get_function_params(handlers.run_comparison)  # what the API page shows
    assert handlers.run_comparison.__name__ == "run_comparison"  # as Gradio's queue names it
    assert [name for name, *_ in params] == list(RUN_DEFAULTS)
    assert {name: default for name, _, default, _ in params} == RUN_DEFAULTS


def test_gradio_passes_the_request_after_the_inputs(monkeypatch):
    seen = []

    def fake_run(v, session=None):
        seen.append((v, v.lesson, session))
        yield ("done",)

    monkeypatch.setattr(handlers, "_run", fake_run)
    values = list(RunInputs(budget_pct=33.0, lesson="a lesson").as_dict().values())
    request = gr.Request(session_hash="s-1")
    args, *_ = special_args(handlers.run_comparison, inputs=list(values), request=request)
    assert args[len(RUN_DEFAULTS)] is request
    assert list(handlers.run_comparison(*args)) == [("done",)]
    ((v, lesson, session),) = seen
    assert v == RunInputs(budget_pct=33.0, lesson="a lesson")
    assert (lesson, session) == ("a lesson", "s-1")
    # By name, as scripts and the tests call it; an unknown name is refused.
    list(handlers.run_comparison(task="qa", request=request))
    assert seen[-1][0] == RunInputs(task="qa")
    try:
        list(handlers.run_comparison(budget=5))
    except TypeError as e:
        assert "budget" in str(e)
    else:
        raise AssertionError("an input the run does not have must be refused")


def test_for_sides_links_b_only_when_the_sides_differ_in_their_method_alone():
    prompt = PromptSpec(task="needle", context=900, seed=3)
    a = Side.of("mean", budget=0.25, page_size=8)
    same = RunInputs.for_sides(prompt, a, a.replace(policy="entropy", scorer="reconstruct"),
                               model="m")  # fmt: skip
    assert same.link_b is True and (same.budget_pct, same.budget_b) == (25.0, 25.0)
    assert (same.context, same.seed, same.page_size, same.scorer_b) == (900, 3, 8, "reconstruct")
    apart = RunInputs.for_sides(prompt, a, a.replace(budget=0.3), model="m")
    assert apart.link_b is False and apart.budget_b == 30.0
    asked_after = RunInputs.for_sides(prompt, a, a.replace(mode="after"), model="m")
    assert asked_after.link_b is False and asked_after.mode_b == "after"


def test_a_preset_and_a_lesson_run_what_they_name():
    for p in load_presets():
        run = handlers._preset_run_args(p)
        assert parse_run(run)[:3] == preset_inputs(p)
        spec, a, b, _ = parse_run(run)
        assert (spec.context, a.config.budget, b.config.policy) == (
            p["context"], p["budget"], p["policy_b"],
        )  # fmt: skip
    for lesson in LESSONS:
        if lesson.kind != "live":
            continue
        run = RunInputs.for_sides(lesson.prompt, lesson.a, lesson.b, model="bundled")
        spec, a, b, _ = parse_run(run)
        assert (spec, a, b) == (lesson.prompt.replace(mode=lesson.a.mode), lesson.a, lesson.b)
    r = RunInputs(context=300, link_b=False)
    assert RunInputs(**r.as_dict()) == r and r.replace(context=400).context == 400


@pytest.mark.slow
def test_the_readme_s_shortest_context_is_what_the_budgets_fit(bundled_study):
    """docs/app.md: the shortest context (300) fits the default budget (20 %), its floor
    16 %; the lessons' 10 % needs at least 600 (floor 9.5 %), and 500 does not fit it."""
    from pathlib import Path

    from pagekv import EvictionConfig
    from pagekv.app.run_inputs import LIMITS, RunInputs, min_budget_pct
    from pagekv.engine.study import PromptSpec

    readme = (Path(__file__).resolve().parents[1] / "docs" / "app.md").read_text()
    cfg = EvictionConfig(page_size=16, n_sink=4, window=32)

    def floor(context, mode="inside"):
        spec = PromptSpec(task="needle", context=context, depth=0.5, seed=0, mode=mode)
        return min_budget_pct(bundled_study.prepare(spec).n, cfg)

    assert LIMITS["context"][0] == 300 and RunInputs().budget_pct == 20.0
    assert floor(300) == 16.0 and floor(300, "after") <= 16.0
    assert floor(600) == 9.5 and floor(600, "after") <= 10 < floor(500)
    said = (
        "300-8000: the shortest fits the default budget of 20 %, its protected pages needing "
        "16 % at pages of 16; the lessons' 10 % needs at least 600, whose floor is 9.5 %"
    )
    assert said in readme


CFG = EvictionConfig(page_size=16, n_sink=4, window=32)


@pytest.mark.parametrize("got", [1e9, 150, "100.5", 101])
def test_a_budget_above_100_is_refused_with_the_upper_limits_reason(got):
    """A budget above 100 gets the upper limit's reason, never the floor's."""
    said = budget_rule("A", got, CFG, n=2000)
    floor = min_budget_pct(2000, CFG)
    assert said.startswith(f"Budget A must be a number from {floor:g} to 100 (% of the prompt)")
    assert "100 % keeps the whole of this 2000-token prompt, and no budget keeps more" in said
    assert "protected pages" not in said and "do not fit" not in said
    without_n = budget_rule("B", got, CFG)
    assert "keeps the whole of the prompt" in without_n and "do not fit" not in without_n


@pytest.mark.parametrize("got", [1, 0, -5, "abc", None])
def test_a_budget_below_the_floor_keeps_the_floors_reason(got):
    said = budget_rule("A", got, CFG, n=2000)
    assert "the protected pages (the first 4 tokens and the last 32" in said
    assert "keeps the whole" not in said
