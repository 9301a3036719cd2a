"""What a lesson's screen shows, without a server or a model: a lesson with no live run
clears the last run's views, a lesson's side B follows side A when only the policy
differs, the budget's lower limit is the smallest feasible one, the answers table is
escaped text, and a failed run leaves a figure that says why (no stale views)."""

from __future__ import annotations

import json

import pytest
import torch

from pagekv import EvictionConfig, plan
from pagekv.app import handlers
from pagekv.app.lesson_checks import LESSON_TITLES, check_lesson
from pagekv.app.lesson_handlers import LESSON_CONTROLS, _lesson_run_args, pick_lesson
from pagekv.app.lessons import LESSONS
from pagekv.app.run_figures import ANSWER_HEADERS, answers_html
from pagekv.app.run_inputs import LIMITS, min_budget_pct
from pagekv.engine.comparison import answer_notes
from pagekv.engine.study import PromptSpec
from pagekv.maths.paging import BudgetError

from .app_server import answer_headers, answer_rows

N_HEAD = len(LESSON_CONTROLS) + 2  # the controls, the tabs, the lesson text


def _views(out) -> dict:
    return dict(
        zip(handlers.RUN_VIEWS, out[N_HEAD : N_HEAD + len(handlers.RUN_VIEWS)], strict=True)
    )


@pytest.mark.parametrize("i", [i for i, x in enumerate(LESSONS) if x.kind != "live"])
def test_a_lesson_without_a_live_run_clears_the_last_runs_views(i):
    (out,) = list(pick_lesson(LESSON_TITLES[i]))
    views = _views(out)
    assert views["status"].startswith("**Note:** This lesson runs no model"), views["status"]
    assert answer_rows(views["answers"]) == [] and "runs no model" in views["answers"]
    assert views["last"] is None and views["files"] is None
    for name in handlers.PLOTS:  # no figure of an earlier lesson: each says why it is empty
        fig = json.loads(views[name].plot)  # sent as gr.Plot sends it (handlers.sent)
        assert fig["data"] == [], name
        assert "runs no model" in fig["layout"]["annotations"][0]["text"], name
    assert "holds" in views["observation"], views["observation"]
    # The first screen's caption belongs to this lesson, not to the chart of a live one.
    assert "runs no model" in views["glance_caption"]
    assert "Look for" not in views["glance_caption"]


def test_a_run_s_views_give_the_first_screen_its_caption():
    from pagekv.app.page_text import GLANCE_CAPTION

    views = dict(zip(handlers.RUN_VIEWS, handlers._views(status="ran"), strict=True))
    assert views["glance_caption"] == GLANCE_CAPTION
    kept = dict(zip(handlers.RUN_VIEWS, handlers._updates(status="x"), strict=True))
    assert kept["glance_caption"] == handlers.gr.update()  # a partial update leaves it


def test_side_b_follows_a_when_a_lesson_differs_only_in_the_policy():
    """... or in its method: the policy, scorer and allocation are each side's own."""
    for title, lesson in zip(LESSON_TITLES, LESSONS, strict=True):
        if lesson.kind != "live":
            continue
        args = _lesson_run_args(lesson, title, "bundled")
        b = lesson.b
        c = b.config
        only_method = (
            lesson.a.replace(policy=c.policy, scorer=c.scorer, allocation=c.allocation) == b
        )
        assert args.link_b is only_method, lesson.id
        assert (args.scorer_b, args.allocation_b) == (c.scorer, c.allocation)
    by_id = {x.id: x for x in LESSONS}
    assert _lesson_run_args(by_id["gqa-cost"], LESSON_TITLES[0], "bundled").link_b is True
    assert _lesson_run_args(by_id["strict-test"], LESSON_TITLES[3], "bundled").link_b is False
    shared = _lesson_run_args(by_id["reconstruct"], LESSON_TITLES[4], "bundled")
    assert shared.link_b is True and shared.scorer_b == "reconstruct"
    assert (shared.scorer_a, shared.allocation_b) == ("window", "global")


@pytest.mark.parametrize(
    "n, page_size, n_sink, window",
    [(2000, 16, 4, 32), (205, 16, 4, 32), (997, 1, 0, 1), (64, 64, 4, 32)],
)
def test_the_budget_floor_is_the_smallest_feasible_budget(n, page_size, n_sink, window):
    cfg = EvictionConfig(policy="entropy", budget=0.5, page_size=page_size, n_sink=n_sink,
                         window=window)  # fmt: skip
    lo, hi, step = LIMITS["budget"]
    pct = min_budget_pct(n, cfg)
    assert lo <= pct <= hi and (pct / step).is_integer()
    profiles = torch.rand(1, 3, n)
    profiles = profiles / profiles.sum(-1, keepdim=True)
    plan(profiles, 1, cfg.replace(budget=pct / 100))  # feasible at the floor
    if pct - step >= lo:  # and not one step below it
        with pytest.raises(BudgetError):
            plan(profiles, 1, cfg.replace(budget=(pct - step) / 100))


def test_answers_table_is_escaped_text_with_named_columns():
    rows = [["A: head_independent", "✓ right", "<img src=x> 42", 436, "0.31", "27 of 90",
             "2.22", "37 ms"]]  # fmt: skip
    html = answers_html(rows)
    assert "<img" not in html and "&lt;img src=x&gt; 42" in html
    assert answer_headers(html) == ANSWER_HEADERS
    assert answer_rows(html) == [["A: head_independent", "✓ right", "<img src=x> 42", "436",
                                  "0.31", "27 of 90", "2.22", "37 ms"]]  # fmt: skip
    assert html.count('class="num"') == 2 * 5  # five numeric columns: header and cell


def test_a_custom_answer_missing_from_the_needle_is_said():
    spec = PromptSpec(task="custom", haystack="h " * 50, needle="The code is 7318.",
                      question="What is the code?", answer="7318")  # fmt: skip
    assert answer_notes(spec) == []
    notes = answer_notes(spec.replace(answer="4242"))
    assert len(notes) == 1 and "does not appear in the needle" in notes[0]
    assert answer_notes(PromptSpec(task="needle")) == []


def test_a_failed_run_is_not_checked_and_says_why():
    text = check_lesson(LESSON_TITLES[0], None, failed=True)
    assert "not checked: the run did not complete" in text and "pick the lesson" not in text
    assert check_lesson("no such lesson", None) is None
