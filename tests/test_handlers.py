"""The app's handlers called as functions, with no server: input checks, the answers table, a run
that streams plan views then answers and is served from memory the second time, refusals, slider
ranges, clamped contexts, long-step status and lesson 7's verdict."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from pagekv import EvictionConfig
from pagekv.app import handlers
from pagekv.app.lesson_checks import LESSON_TITLES
from pagekv.app.run_figures import ANSWER_HEADERS
from pagekv.app.run_inputs import InputError, RunInputs, min_budget_pct, parse_run
from pagekv.runtime.result import run_cells

from .app_server import answer_rows

RUN = dict(
    task="needle",
    context=300,
    depth=0.5,
    mode="after",
    budget_pct=40.0,
    seed=11,  # a prompt of its own: no other test prefills it
)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(context=10), "context length must be a whole number from 300 to 8000"),
        (dict(seed=-1), "seed must be a whole number from 0 to 2147483647; got -1"),
        (dict(budget_pct="lots"), "Budget A must be a number from the smallest budget whose"),
        (dict(budget_pct=0), "up to 100 (% of the prompt); got 0."),
        (dict(budget_pct=None), "; got no number."),
        (dict(link_b=False, budget_b=150), "100 % keeps the whole of the prompt, and no budget"),
        (dict(budget_pct=1e9), "Budget A must be a number from the smallest budget whose"),
        (dict(seed=1e21), "seed must be a whole number from 0 to 2147483647; got a number too "),
        (dict(page_size=3), "page size A must be one of 1, 4, 8, 16, 32, 64"),
        (dict(policy_b="best"), "policy B must be one of entropy"),
        (dict(mode="later"), "question position must be one of inside, after"),
        (dict(link_b="yes"), "same settings as A must be true or false"),
        (dict(link_b=False, window_b=500), "window B must be a whole number from 1 to 128"),
        (dict(scorer_a="question"), "scorer A must be one of window, reconstruct"),
        (dict(allocation_b="shared"), "allocation B must be one of uniform, global"),
        (
            dict(policy_b="head_independent", allocation_b="global"),
            "side B: allocation 'global' shares one budget",
        ),
    ],
)
def test_bad_inputs_name_the_control(change, words):
    with pytest.raises(InputError) as err:
        parse_run(RunInputs(**RUN | change))
    assert words in str(err.value)


def test_good_inputs_make_both_sides():
    spec, a, b, layer = parse_run(RunInputs(**RUN, link_b=False, budget_b=20.0))
    assert (spec.context, spec.mode, a.mode, b.mode, layer) == (300, "after", "after",
                                                                        "inside", 0)  # fmt: skip
    assert (a.config.policy, a.config.budget) == ("mean", 0.4)
    assert (b.config.policy, b.config.budget) == ("entropy", 0.2)


def test_scorer_and_allocation_are_each_sides_own_even_when_b_follows_a():
    # Linked: B takes A's budget and pages but keeps its own method (the lesson and the
    # student compare window against reconstruct at the same settings).
    _, a, b, _ = parse_run(RunInputs(**RUN, scorer_b="reconstruct", allocation_b="global"))
    a, b = a.config, b.config
    assert (a.scorer, a.allocation, a.budget) == ("window", "uniform", 0.4)
    assert (b.scorer, b.allocation, b.budget) == ("reconstruct", "global", 0.4)
    _, a, b, _ = parse_run(RunInputs(**RUN, link_b=False, scorer_a="reconstruct", budget_b=20.0))
    a, b = a.config, b.config
    assert (a.scorer, b.scorer, b.budget) == ("reconstruct", "window", 0.2)


def test_run_cells_read_the_record():
    fields = {
        "correct": False, "answer": "42", "kept_tokens": [5, 7], "uor": {"max": 1.5},
        "needle_retention": [[1.0, 0.5], [0.0, 0.5]], "timings": {"evict_s": None, "decode_s": 0.2},
    }  # fmt: skip
    c = run_cells(SimpleNamespace(**fields))  # what it reads of a RunResult
    assert (c["verdict"], c["answer"], c["stored"], c["needle"], c["uor"], c["evict_s"]) == (
        "✗ wrong", "42", 7, 0.5, 1.5, None)  # fmt: skip
    assert run_cells(SimpleNamespace(**fields | {"needle_retention": None}))["needle"] is None


@pytest.mark.slow
def test_a_run_streams_then_is_served_from_memory():
    """... and its views are kept in its study's memos (the app's caches are a study's
    three): the finished run's in the result memo, its plan views in the plan memo."""
    study = handlers.get_study("bundled")
    spec, a, b, layer = parse_run(RunInputs(**RUN))
    key = handlers.view_key(spec, a, b, layer)
    study.results.pop(key)  # a run of this test before, in this process
    steps = list(handlers.run_comparison(**RUN))
    # The steps that set the status (the answers' streaming steps leave it as it is).
    status = [s[handlers.RUN_VIEWS.index("status")] for s in steps]
    status = [s for s in status if isinstance(s, str)]
    # The longer steps say what they do first (the model's load, if any; the prefill).
    working = [s for s in status if s.startswith(("**Note:** Loading", "**Note:** Prefilling"))]
    assert working and status[len(working) - 1].startswith("**Note:** Prefilling"), status
    assert status[len(working)].startswith("**Note:** Decoding..."), status  # plan views
    first = steps[len(working)]
    assert first[handlers.RUN_VIEWS.index("frame")] is not None  # drawn before decoding
    last = steps[-1]
    assert status[-1].startswith("**Done:**"), status[-1]
    table = last[handlers.RUN_VIEWS.index("answers")]
    rows = answer_rows(table)
    assert len(rows) == 3 and all(len(row) == len(ANSWER_HEADERS) for row in rows)
    assert [row[0].split(":")[0] for row in rows] == ["full cache", "A", "B"]
    kept = study.results.get(key)
    assert kept["comp"] is last[handlers.RUN_VIEWS.index("last")] and kept["served"] is False
    assert study.plans.get(("preview views", *key))["figs"]["frame"] is kept["figs"]["frame"]
    again = list(handlers.run_comparison(**RUN))
    assert len(again) == 1 and "served from memory" in again[0][0]
    assert again[0][handlers.RUN_VIEWS.index("answers")] == table


def test_a_refused_model_is_one_sentence_and_the_next_run_is_unaffected(monkeypatch):
    monkeypatch.setattr(handlers.MODELS, "allow_hub", False)
    (out,) = list(handlers.run_comparison(**(RUN | dict(model="org/anything"))))
    status = out[handlers.RUN_VIEWS.index("status")]
    assert status.startswith("**Error:** this server does not offer the model 'org/anything'")
    assert "\n" not in status and "org/anything" not in handlers.MODELS.loaded_names()


def test_the_status_says_which_side_asks_inside():
    from pagekv.engine.comparison import mode_notes

    assert mode_notes({"A": "after", "B": "after"}) == []
    (both,) = mode_notes({"A": "inside", "B": "inside"})
    assert both.startswith("Question inside the prompt") and "choose 'after'" in both
    (one,) = mode_notes({"A": "inside", "B": "after"})
    assert one.startswith("Side A asks the question inside the prompt")
    assert "side B asks it after compression" in one and "choose 'after'" not in one


@pytest.mark.slow
def test_html_in_a_custom_question_is_shown_as_text():
    question = "What is the <img src=x> code?"
    custom = dict(task="custom", haystack="The river ran past the mill. " * 20,
                  needle="The vault code is 4417.", question=question, answer="4417")  # fmt: skip
    *_, last = handlers.run_comparison(**(RUN | custom))
    status = last[handlers.RUN_VIEWS.index("status")]
    assert "<img" not in status and "&lt;img src=x&gt;" in status, status
    assert "Expected: **4417**" in status


def test_an_error_that_echoes_a_value_shows_it_as_text():
    bad = dict(task="qa", curated="<b>x</b>")  # an unknown curated task, echoed back
    (out,) = list(handlers.run_comparison(**(RUN | bad)))
    status = out[handlers.RUN_VIEWS.index("status")]
    assert status.startswith("**Error:** curated qa task must be one of"), status
    assert "<b>" not in status and "&lt;b&gt;x&lt;/b&gt;" in status, status


@pytest.mark.slow
def test_a_preset_run_says_whether_its_difference_holds():
    """Picking a preset runs it and ends the status with its check, done on that run."""
    preset = handlers.PRESETS[1]
    *_, last = handlers.run_preset(preset["title"], "bundled", None)
    status = last[len(handlers.PRESET_CONTROLS) + 2 + handlers.RUN_VIEWS.index("status")]
    assert status.startswith("**Done:**"), status
    assert f"**Preset:** {preset['shows']} Its check **holds**, checked now on this run" in status
    assert "Measured: " in status.split("**Preset:**")[1]


@pytest.mark.slow
def test_a_refused_run_keeps_a_sessions_last_results_and_says_why():
    """A budget below this prompt's floor, or a shared budget for a per-head policy: refused in
    one sentence; a session's last results stay (its boxes back at their budget), else the views
    clear."""
    i_status, i_budget = handlers.RUN_VIEWS.index("status"), handlers.RUN_VIEWS.index("budget")
    i_last = handlers.RUN_VIEWS.index("last")
    shared = dict(policy_b="head_independent", allocation_b="global")
    (out,) = list(handlers.run_comparison(**(RUN | dict(budget_pct=1))))[-1:]
    status = out[i_status]
    n = int(re.search(r"in this (\d+)-token prompt", status).group(1))
    floor = min_budget_pct(n, EvictionConfig(page_size=16, n_sink=4, window=32))
    assert status.startswith(f"**Error:** Budget A must be a number from {floor:g} to 100"), status
    assert status.endswith("; got 1.") and "Nothing ran" not in status, status
    assert out[i_last] is None  # no session: every view cleared
    (out,) = list(handlers.run_comparison(**RUN, **shared))
    assert "side B: allocation 'global' shares one budget" in out[i_status]
    assert out[i_last] is None

    request = SimpleNamespace(session_hash="budget-rule-test")
    try:
        *_, done = handlers.run_comparison(**RUN, request=request)
        assert done[i_status].startswith("**Done:**")
        assert done[i_budget]["value"] == 40.0  # the box shows what ran
        for refused in (*(dict(budget_pct=typed) for typed in (0, -5, None, "abc")), shared):
            (out,) = list(handlers.run_comparison(**(RUN | refused), request=request))
            status = out[i_status]
            assert status.startswith("**Error:**") and "Nothing ran" in status, status
            if refused is not shared:
                assert f"Budget A must be a number from {floor:g} to 100" in status, status
                assert "Nothing ran: the budget is back at 40 %" in status, status
                assert out[i_budget]["value"] == 40.0
            kept = [out[handlers.RUN_VIEWS.index(k)] for k in ("answers", "frame", "last")]
            assert all(v == {"__type__": "update"} for v in kept), kept
    finally:
        handlers.SESSIONS.end(request.session_hash)


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
    """Pages of 64 on 50 tokens: only 100 % fits, it runs, sliders keep min < max."""
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
def test_a_refusal_in_a_session_says_what_ran_and_what_did_not(bundled_study):
    """After a refusal lesson 1's verdict is "not checked: nothing ran" (never "checking" for
    good); after a failed run a refusal points at no results below."""
    title = LESSON_TITLES[0]
    request = SimpleNamespace(session_hash="refusal-in-a-session")
    try:
        done = _last(**SHORT, budget_pct=100, lesson=title, request=request)
        assert done[I["status"]].startswith("**Done:**")
        out = _last(**SHORT, page_size=64, budget_pct=20, lesson=title, request=request)
        verdict = out[I["observation"]]
        assert "not checked: nothing ran" in verdict, verdict
        assert "checking on this run" not in verdict
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


def test_the_served_study_keeps_the_lessons_prompts_apart(bundled_study):
    """The app's study keeps the live lessons' prompts in its memos' kept parts."""
    from pagekv.app import handlers

    study = handlers.get_study("bundled")
    assert study.kept_prompts == handlers.LESSON_PROMPTS
    assert {(s.task, s.context, s.mode) for s in study.kept_prompts} == {
        ("needle", 2000, "inside"),
        ("needle", 2000, "after"),
    }
    assert study.prefills.kept_bytes >= 2 * 100 * 2**20  # two such prefills, 100 MiB each


def test_a_long_step_says_what_runs_for_how_long_and_how_long_it_should(bundled_study, monkeypatch):
    """Each long step says which step runs, its seconds, and the expected seconds."""
    from pagekv.app import handlers

    monkeypatch.setattr(handlers, "STEP_QUIET_S", 0.0)  # every step shows, however short
    monkeypatch.setattr(handlers, "STEP_EVERY_S", 0.05)
    monkeypatch.setattr(handlers, "STREAM_EVERY_S", 0.0)
    i_status = handlers.RUN_VIEWS.index("status")
    run = dict(task="needle", context=400, depth=0.5, mode="after", budget_pct=40.0,
               scorer_a="reconstruct", scorer_b="reconstruct")  # fmt: skip

    def statuses(seed):
        outs = list(handlers.run_comparison(**run, seed=seed))
        said = list(dict.fromkeys(o[i_status] for o in outs if isinstance(o[i_status], str)))
        assert said[-1].startswith("**Done:**"), said[-1]
        return said

    statuses(41)  # a first prompt: the steps are measured on this model from here on
    said = statuses(42)
    prefill = [s for s in said if "Prefilling the prompt on" in s]
    rebuild = [s for s in said if s.startswith("**Note:** Reconstruction pass")]
    assert prefill and rebuild, [s[:80] for s in said]
    for step in (prefill[-1], rebuild[-1]):
        assert re.search(r": \d+ s of about \d+ s <progress value=\"[\d.]+\" max=\"[\d.]+\">", step)
    tokens = [s for s in said if re.search(r"A and B: token \d+ of at most \d+ <progress", s)]
    assert tokens, said
    study = handlers.get_study("bundled")  # the app's own, which ran them
    # Both kinds measured, each linear in the tokens (which is faster is the CPU's to say:
    # the pass reads the prompt twice, but short prompts' prefills carry fixed costs).
    for step in ("prefill", "reconstruct"):
        assert study.estimate(step, 800) == pytest.approx(2 * study.estimate(step, 400))
        assert study.estimate(step, 400) > 0
    assert study.estimate("nothing measured", 400) is None


def test_after_a_preset_the_lesson_box_defers_to_the_presets_verdict(monkeypatch):
    """After a preset, the lesson box says no observation belongs to the run and points
    at the preset's verdict in the status line (not a second verdict at odds)."""
    import gradio as gr

    from pagekv.app import handlers

    i_obs = handlers.RUN_VIEWS.index("observation")

    def stream_run(run, request):
        views = [gr.update() for _ in handlers.RUN_VIEWS]
        views[i_obs] = "**Observation:** something - *not checked: the controls no longer hold*"
        yield tuple(views)

    monkeypatch.setattr(handlers, "stream_run", stream_run)
    from pagekv.app.lesson_checks import LESSON_TITLES

    lesson_of_one = LESSON_TITLES[0]
    preset = handlers.load_presets()[0]
    (out,) = list(handlers.run_preset(preset["title"], "bundled", lesson_of_one))
    said = out[len(handlers.PRESET_CONTROLS) + 2 + i_obs]
    assert "not checked" not in said and preset["title"] in said and "status line" in said
