"""The lesson handlers (`pagekv.app.lesson_handlers`): a lesson request overtaken by a
later one of its session shows nothing more, and a link (`?lesson=`, settings) that
names no lesson, settings that do not run, or a context out of its range says so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagekv.app import handlers
from pagekv.app.lesson_checks import LESSON_TITLES
from pagekv.app.lesson_handlers import LESSON_CONTROLS, open_page

STATUS = handlers.RUN_VIEWS.index("status")
#: `open_page`'s outputs: the picker, the tabs, the lesson's controls, the lesson text and
#: its views, then the run's views.
OPEN_STATUS = 2 + len(LESSON_CONTROLS) + 2 + STATUS


def test_a_lesson_request_overtaken_by_a_later_one_shows_nothing(monkeypatch):
    """Quick Next presses end on the last press's lesson, a control changed meanwhile keeps its
    value, and an overtaken request changes no output."""
    import gradio as gr

    from pagekv.app import lesson_handlers as lh
    from pagekv.app.sessions import SessionGate

    gate = SessionGate()
    first, second = gate.ticket("s"), gate.ticket("s")
    assert (gate.is_latest("s", first), gate.is_latest("s", second)) == (False, True)
    assert gate.is_latest(None, 0) and gate.ticket(None) == 0
    request = SimpleNamespace(session_hash="overtaken")
    arrives = []  # while the lesson runs: what else of whose session starts

    def stream_run(run, req):
        yield tuple(gr.update() for _ in lh.RUN_VIEWS)  # the plan views
        for start in arrives:
            start()
        yield tuple(gr.update() for _ in lh.RUN_VIEWS)  # the answers

    monkeypatch.setattr(lh, "stream_run", stream_run)
    monkeypatch.setattr(handlers, "stream_run", lambda inputs, req: iter(()))
    one, two = lh.LESSON_TITLES[0], lh.LESSON_TITLES[1]  # lesson 2 runs the model
    head = len(lh.LESSON_CONTROLS) + 2
    other = SimpleNamespace(session_hash="another session")
    cases = {
        "alone": [],
        "another session's press": [lambda: lh.SESSIONS.ticket(other.session_hash)],
        "a later press": [lambda: lh.SESSIONS.ticket(request.session_hash)],
        "a control changed": [lambda: list(handlers.run_comparison(request=request))],
    }
    try:
        for case, arrives[:] in cases.items():
            outs = list(lh.next_lesson(one, request=request))
            overtaken = case in ("a later press", "a control changed")
            assert len(outs) == (1 if overtaken else 2), case
            assert all(len(o) == 1 + len(lh.UNCHANGED) for o in outs)
            assert outs[0][0] == two  # the first output came before anything else
            if not overtaken:  # each output sets the lesson's controls
                assert all(o[0] == two and o[1 : 1 + head] == outs[0][1 : 1 + head] for o in outs)
    finally:
        lh.SESSIONS.end(request.session_hash)
        lh.SESSIONS.end(other.session_hash)


@pytest.mark.slow
@pytest.mark.parametrize("asked", ["99", "abc", "0"])
def test_a_link_to_no_lesson_says_why(asked, bundled_study):
    """`?lesson=99`, `abc` or `0` open lesson 1 and say why in the status line."""
    request = SimpleNamespace(session_hash=None, query_params={"lesson": asked})
    *_, last = open_page(LESSON_TITLES[0], "bundled", request)
    status = last[OPEN_STATUS]
    assert last[0] == LESSON_TITLES[0]
    said = (
        f"**Note:** The link asked for lesson '{asked}', which does not exist (lessons 1 to "
        "9, or a lesson's id); lesson 1 opened instead."
    )
    assert status.startswith(said), status
    good = SimpleNamespace(session_hash=None, query_params={"lesson": "2"})
    *_, last = open_page(LESSON_TITLES[0], "bundled", good)
    assert "The link asked for" not in last[OPEN_STATUS]


@pytest.mark.slow
def test_a_bad_link_says_its_settings_do_not_run(bundled_study):
    """A link whose settings do not run: the lesson text says so (it said 'the run below
    is theirs' above an error); a good link keeps the usual text."""
    from pagekv.app.lesson_handlers import SHARED_BAD_TEXT, SHARED_TEXT

    i_text = 2 + len(LESSON_CONTROLS) + 1
    bad = SimpleNamespace(session_hash=None, query_params={"page_size": "3"})
    *_, last = open_page(LESSON_TITLES[0], "bundled", bad)
    assert last[i_text] == SHARED_BAD_TEXT
    assert last[i_text + 1 + STATUS].startswith("**Error:** page size A must be one of")
    good = SimpleNamespace(
        session_hash=None,
        query_params={"context": "300", "budget_pct": "40", "seed": "13", "mode": "after"},
    )
    *_, last = open_page(LESSON_TITLES[0], "bundled", good)
    assert last[i_text] == SHARED_TEXT, last[i_text + 1 + STATUS]


@pytest.mark.slow
def test_a_link_with_a_context_outside_its_range_runs_at_the_nearest_end(bundled_study):
    """A link's context below its range runs at 300 tokens and says so, as on the page and API."""
    query = {"context": "20", "budget_pct": "40", "seed": "13", "mode": "after"}
    request = SimpleNamespace(session_hash=None, query_params=query)
    *_, last = open_page(LESSON_TITLES[0], "bundled", request)
    status = last[OPEN_STATUS]
    assert status.startswith("**Done:**"), status
    assert "Context length: 20 is below its range (300 to 8000), using 300." in status
