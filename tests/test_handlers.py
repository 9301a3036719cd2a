"""The app's handlers called as functions, with no server: input checks in plain words,
the answers table's cells, and a run that streams its plan views first, then its
answers, and is served from memory the second time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagekv.app import handlers
from pagekv.app.run_figures import ANSWER_HEADERS
from pagekv.app.run_inputs import InputError, RunInputs, parse_run
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
def test_a_budget_below_the_floor_is_refused_and_a_session_keeps_its_results():
    """The budget's one rule with this prompt's floor; in a session whose last run
    finished, nothing else changes and the boxes go back to that run's budget."""
    import re
    from types import SimpleNamespace

    from pagekv import EvictionConfig
    from pagekv.app.run_inputs import min_budget_pct

    i_status, i_budget = handlers.RUN_VIEWS.index("status"), handlers.RUN_VIEWS.index("budget")
    (out,) = list(handlers.run_comparison(**(RUN | dict(budget_pct=1))))[-1:]
    status = out[i_status]
    n = int(re.search(r"in this (\d+)-token prompt", status).group(1))
    floor = min_budget_pct(n, EvictionConfig(page_size=16, n_sink=4, window=32))
    assert status.startswith(f"**Error:** Budget A must be a number from {floor:g} to 100"), status
    assert status.endswith("; got 1.") and "Nothing ran" not in status, status
    assert out[handlers.RUN_VIEWS.index("last")] is None  # no session: every view cleared

    request = SimpleNamespace(session_hash="budget-rule-test")
    try:
        *_, done = handlers.run_comparison(**RUN, request=request)
        assert done[i_status].startswith("**Done:**")
        assert done[i_budget]["value"] == 40.0  # the box shows what ran
        for typed in (0, -5, None, "abc"):
            (out,) = list(
                handlers.run_comparison(**(RUN | dict(budget_pct=typed)), request=request)
            )
            status = out[i_status]
            assert f"Budget A must be a number from {floor:g} to 100" in status, status
            assert "Nothing ran: the budget is back at 40 %" in status, status
            assert out[i_budget]["value"] == 40.0
            kept = [out[handlers.RUN_VIEWS.index(k)] for k in ("answers", "frame", "last")]
            assert all(isinstance(v, dict) and v.get("__type__") == "update" for v in kept)
    finally:
        handlers.SESSIONS.end(request.session_hash)
