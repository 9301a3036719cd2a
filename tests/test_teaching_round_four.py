"""Issue 42's items that no screen is needed for, through the handlers (the browser's
are in tests/test_browser_teaching.py): a short prompt with pages of 64 that runs and
keeps every slider's range, a refusal that says the verdict was not checked, a refusal
that never points at results that are gone, lesson 7's verdict following the mechanism's
inputs, and a model that is not installed said at once, with the model box showing the
model that ran."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pagekv.app import handlers
from pagekv.app.lesson_checks import LESSON_TITLES
from pagekv.app.model_registry import ModelRegistry
from pagekv.runtime import models

#: A custom prompt of about 50 tokens: three short sentences, a needle, its question.
SHORT = dict(
    task="custom",
    haystack="The river runs north. Birds sing at dawn. The market opens at nine.",
    needle="The secret word is LANTERN.",
    question="What is the secret word?",
    answer="LANTERN",
    depth=0.5,
    mode="after",
)
I = {name: i for i, name in enumerate(handlers.RUN_VIEWS)}


def _last(**inputs):
    *_, last = handlers.run_comparison(**inputs)
    return last


def test_a_slider_update_keeps_its_range():
    """Gradio refuses a slider whose minimum is not below its maximum (the page then
    locks): a range collapsed to one value keeps one step below it."""
    assert handlers.slider_range(100, 100, 100, 0.5)["minimum"] == 99.5
    assert handlers.slider_range(0, 0, 0)["minimum"] == -1  # a one-layer model's layers
    assert handlers.slider_range(12, 100, 20, 0.5)["minimum"] == 12


@pytest.mark.slow
def test_a_short_prompt_with_pages_of_64_runs_and_says_its_one_budget(bundled_study):
    """Pages of 64 on a 50-token prompt: the protected pages take every page, so only
    100 % fits. That budget runs, every slider update keeps minimum < maximum (the
    update Gradio would refuse locked the page), and the status says it in words."""
    import gradio as gr

    refused = _last(**SHORT, page_size=64, budget_pct=20)
    assert "must be a number from 100 to 100" in refused[I["status"]]
    done = _last(**SHORT, page_size=64, budget_pct=100)
    assert done[I["status"]].startswith("**Done:**"), done[I["status"]]
    for name in ("budget", "budget_b", "layer"):
        update = done[I[name]]
        limits = {k: update.get(k, 100) for k in ("minimum", "maximum", "value")}
        gr.Slider(**limits)  # Gradio's own check, which raised and locked the page
        assert limits["minimum"] < limits["maximum"], (name, update)
    assert "only 100 % fits this" in done[I["status"]], done[I["status"]]


@pytest.mark.slow
def test_a_refused_run_does_not_leave_the_verdict_checking(bundled_study):
    """Lesson 1's verdict after a refusal: not checked (nothing ran), never 'checking on
    this run...' for good; the status line keeps the refusal."""
    title = LESSON_TITLES[0]
    request = SimpleNamespace(session_hash="refusal-verdict-test")
    try:
        done = _last(**SHORT, budget_pct=100, lesson=title, request=request)
        assert done[I["status"]].startswith("**Done:**")
        out = _last(**SHORT, page_size=64, budget_pct=20, lesson=title, request=request)
        verdict = out[I["observation"]]
        assert "not checked: nothing ran" in verdict, verdict
        assert "checking on this run" not in verdict
    finally:
        handlers.SESSIONS.end(request.session_hash)


@pytest.mark.slow
def test_a_refusal_after_a_failed_run_points_at_no_results(bundled_study):
    """A failed run clears every view; a refusal after it must not say 'the budget of
    the results below' (there are none): it clears them too."""
    request = SimpleNamespace(session_hash="refusal-after-failure-test")
    try:
        done = _last(**SHORT, budget_pct=100, request=request)
        assert done[I["status"]].startswith("**Done:**")
        failed = _last(**(SHORT | dict(question="")), budget_pct=100, request=request)
        assert failed[I["status"]].startswith("**Error:**"), failed[I["status"]]
        out = _last(**SHORT, page_size=64, budget_pct=20, request=request)
        status = out[I["status"]]
        assert "must be a number from 100 to 100" in status, status
        assert "results below" not in status and "back at" not in status, status
    finally:
        handlers.SESSIONS.end(request.session_hash)


def test_lesson_7_verdict_follows_the_mechanism_inputs():
    """With 4 heads and 128 tokens the table and the verdict speak of the same group:
    the verdict is checked again on those inputs and says they are not the lesson's."""
    title = LESSON_TITLES[6]
    own = (3, 0.9, 2, 0.48, False, 64, 19)
    changed = (4, 0.9, 2, 0.48, False, 128, 19)
    for inputs in (own, changed):
        _, rows, _ = handlers.run_mechanism(*inputs)
        kept = {row[0]: row[1] for row in rows}
        verdict = handlers.mechanism_observation(title, *inputs)
        assert f"entropy: {kept['entropy']}, mean: {kept['mean']}" in verdict, verdict
        holds = kept["entropy"] == "kept" and kept["mean"] == "evicted"
        assert ("**holds**" in verdict) == holds, verdict
    assert "not the lesson's own" in handlers.mechanism_observation(title, *changed)
    assert "not the lesson's own" not in handlers.mechanism_observation(title, *own)
    assert handlers.mechanism_observation(LESSON_TITLES[0], *changed) == {"__type__": "update"}


@pytest.fixture
def qwen_missing(monkeypatch, tmp_path):
    """qwen-coder-0.5b neither installed nor converted; the hub, if asked, fails loudly."""
    spec = models.BUNDLED_MODELS["qwen-coder-0.5b"]
    parts = dataclasses.replace(spec.parts, packages=("pagekv_no_such_part_1",))
    absent = dataclasses.replace(spec, parts=parts, cache_name="pagekv-test-not-converted")
    monkeypatch.setitem(models.BUNDLED_MODELS, "qwen-coder-0.5b", absent)
    asked = []

    def hub(*args, **kwargs):
        asked.append(args[0])
        raise models.ModelLoadError("the hub was asked")

    monkeypatch.setattr(models, "_load_hub", hub)
    return asked


def test_a_model_not_installed_is_said_at_once_without_the_hub(qwen_missing, bundled_study):
    """Without hub models allowed, the missing install is known before any attempt (no
    'Loading' line, no hub retries) and the request gets the default model, which the
    model box then shows. With hub models allowed, the hub copy is tried."""
    from pagekv.engine.study import Study

    def factory(name):
        if name == "bundled":
            return bundled_study
        return Study(models.load_model(name, device="cpu", hub_copy=registry.allow_hub))

    registry = ModelRegistry(factory=factory)
    why = registry.unavailable("qwen-coder-0.5b")
    assert why is not None and "setup.sh --models" in why, why
    study = registry.get("qwen-coder-0.5b")
    assert study.loaded.fell_back and study.loaded.name == "bundled"
    assert qwen_missing == []  # no hub attempt
    assert registry.serving("qwen-coder-0.5b") == "bundled"
    assert registry.serving("bundled") == "bundled"
    hub = ModelRegistry(factory=factory, allow_hub=True)
    registry = hub
    assert hub.unavailable("qwen-coder-0.5b") is None  # the hub copy may serve it
    assert hub.get("qwen-coder-0.5b").loaded.fell_back
    assert qwen_missing == ["Qwen/Qwen2.5-Coder-0.5B-Instruct"], qwen_missing


@pytest.mark.slow
def test_the_run_does_not_say_loading_for_a_model_that_cannot_load(
    qwen_missing, monkeypatch, bundled_study
):
    """The app's run: no 'Loading the model' line for a model that is not installed; it
    runs on the default model, says why, and the model box goes back to it."""
    from pagekv.engine.study import Study

    def factory(name):  # as the app's: no hub copy without hub models
        if name == "bundled":
            return bundled_study
        return Study(models.load_model(name, device="cpu", hub_copy=False))

    registry = ModelRegistry(factory=factory)
    monkeypatch.setattr(handlers, "MODELS", registry)
    steps = list(handlers.run_comparison(**SHORT, budget_pct=100, model="qwen-coder-0.5b"))
    statuses = [s[I["status"]] for s in steps if isinstance(s[I["status"]], str)]
    assert not any("Loading the model" in s for s in statuses), statuses
    assert "setup.sh --models" in statuses[-1] and "fell back" in statuses[-1], statuses[-1]
    assert handlers.model_that_ran("qwen-coder-0.5b") == "bundled"
    assert qwen_missing == []


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


@pytest.mark.slow
def test_a_context_outside_its_range_runs_at_the_nearest_end_everywhere(bundled_study):
    """One rule for the page, a link and the API: 1e9 tokens run at 8000 (the page's box
    holds the same), and the status line says so; no number is still refused."""
    v, notes = handlers.prompt_in_range(handlers.RunInputs(context=1e9, depth=-1))
    assert (v.context, v.depth) == (8000, 0.0)
    assert notes == [
        "Context length: 1000000000 is above its range (300 to 8000), using 8000.",
        "Needle depth: -1 is below its range (0 to 1), using 0.",
    ]
    v, notes = handlers.prompt_in_range(handlers.RunInputs(context="abc"))
    assert v.context == "abc" and notes == []  # parse_run names it
    done = _last(task="needle", context=50, depth=0.5, seed=13, mode="after", budget_pct=40)
    status = done[I["status"]]
    assert status.startswith("**Done:**") and "300 prompt tokens" not in status
    assert "Context length: 50 is below its range (300 to 8000), using 300." in status, status


@pytest.mark.slow
@pytest.mark.parametrize("asked", ["99", "abc", "0"])
def test_a_link_to_no_lesson_says_why(asked, bundled_study):
    """`?lesson=99`, `?lesson=abc` and `?lesson=0` open lesson 1 and say why, in the
    status line (they opened it silently)."""
    from pagekv.app.lesson_handlers import LESSON_CONTROLS, open_page

    request = SimpleNamespace(session_hash=None, query_params={"lesson": asked})
    *_, last = open_page(LESSON_TITLES[0], "bundled", request)
    status = last[2 + len(LESSON_CONTROLS) + 2 + I["status"]]
    assert last[0] == LESSON_TITLES[0]
    said = (
        f"**Note:** The link asked for lesson '{asked}', which does not exist (lessons 1 to "
        "8, or a lesson's id); lesson 1 opened instead."
    )
    assert status.startswith(said), status
    good = SimpleNamespace(session_hash=None, query_params={"lesson": "2"})
    *_, last = open_page(LESSON_TITLES[0], "bundled", good)
    assert "The link asked for" not in last[2 + len(LESSON_CONTROLS) + 2 + I["status"]]


@pytest.mark.slow
def test_a_bad_link_says_its_settings_do_not_run(bundled_study):
    """A link whose settings do not run: the lesson text says so (it said 'the run below
    is theirs' above an error); a good link keeps the usual text."""
    from pagekv.app.lesson_handlers import (
        LESSON_CONTROLS,
        SHARED_BAD_TEXT,
        SHARED_TEXT,
        open_page,
    )

    i_text = 2 + len(LESSON_CONTROLS) + 1
    bad = SimpleNamespace(session_hash=None, query_params={"page_size": "3"})
    *_, last = open_page(LESSON_TITLES[0], "bundled", bad)
    assert last[i_text] == SHARED_BAD_TEXT
    assert last[i_text + 1 + I["status"]].startswith("**Error:** page size A must be one of")
    good = SimpleNamespace(
        session_hash=None,
        query_params={"context": "300", "budget_pct": "40", "seed": "13", "mode": "after"},
    )
    *_, last = open_page(LESSON_TITLES[0], "bundled", good)
    assert last[i_text] == SHARED_TEXT, last[i_text + 1 + I["status"]]


def test_the_readme_counts_the_live_lessons_the_console_warms():
    """The app's guide (docs/app.md) counts the live lessons the console warms."""
    from pathlib import Path

    from pagekv.app.lessons import LESSONS

    words = {5: "five", 6: "six", 7: "seven", 8: "eight"}
    live = sum(x.kind == "live" for x in LESSONS)
    readme = (Path(__file__).resolve().parents[1] / "docs" / "app.md").read_text()
    assert f"the app computes its {words[live]} live lessons" in readme


@pytest.mark.slow
def test_a_link_with_a_context_outside_its_range_runs_at_the_nearest_end(bundled_study):
    """The same rule for a link as for the page and the API: a context below its range
    runs at 300 tokens and says so (a link refused `context=1e9` while the page clamped
    it to 8000; below the range is the cheaper prefill to test)."""
    from pagekv.app.lesson_handlers import LESSON_CONTROLS, open_page

    query = {"context": "20", "budget_pct": "40", "seed": "13", "mode": "after"}
    request = SimpleNamespace(session_hash=None, query_params=query)
    *_, last = open_page(LESSON_TITLES[0], "bundled", request)
    status = last[2 + len(LESSON_CONTROLS) + 2 + I["status"]]
    assert status.startswith("**Done:**"), status
    assert "Context length: 20 is below its range (300 to 8000), using 300." in status
