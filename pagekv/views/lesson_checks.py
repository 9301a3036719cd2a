"""A lesson's observation checked on what the app just ran (live lessons), on the
constructed group, or on the replay's committed tables; the replay's recall figure.
No Gradio here: the handlers (`pagekv.views.app_lessons`) wire it to the page."""

from __future__ import annotations

import logging

from pagekv.views.app_text import message
from pagekv.views.lessons import LESSONS, Evidence, load_replay, run_lesson

log = logging.getLogger("pagekv.app")

LESSON_TITLES = [f"{i + 1}. {x.title}" for i, x in enumerate(LESSONS)]


def lesson_of(title):
    for t, lesson in zip(LESSON_TITLES, LESSONS, strict=True):
        if t == title:
            return lesson
    return None


def settings_match(lesson, comp) -> bool:
    """Whether the last comparison ran exactly the lesson's prompt and two sides."""
    return comp is not None and comp.ran(
        lesson.prompt.spec(), lesson.a.config(), lesson.b.config(), lesson.a.mode, lesson.b.mode
    )


def check_lesson(title, comp, failed: bool = False):
    """The lesson's observation, checked on what the app just ran (live lessons), on the
    constructed group, or on the replay's committed tables. None for an unknown title.
    `failed`: the run did not complete, so there is nothing to check."""
    lesson = lesson_of(title)
    if lesson is None:
        return None
    try:
        if lesson.kind == "live" and failed:
            return (
                "**Observation:** " + lesson.observation.statement + " - *not checked: the "
                "run did not complete (the status line says why).*"
            )
        if lesson.kind == "live":
            if not settings_match(lesson, comp):
                return (
                    "**Observation:** " + lesson.observation.statement + " - *not checked: "
                    "the controls no longer hold this lesson's settings (pick the lesson "
                    "again to check it).*"
                )
            finding = lesson.observation.check(Evidence(comparison=comp))
        else:
            finding = run_lesson(None, lesson).finding
    except Exception as e:  # never a traceback on the page
        log.warning("lesson check failed: %s", e, exc_info=True)
        return message("error", f"the check could not run: {' '.join(str(e).split())}")
    mark = "**holds**" if finding.holds else "**does not hold**"
    where = {
        "live": "this run",
        "constructed": "the constructed group",
        "replay": "the replay's committed tables",
    }[lesson.kind]
    return (
        f"**Observation:** {lesson.observation.statement}: {mark}, checked now on {where}."
        f"\n\nMeasured: {finding.measured}"
    )


def replay_recall_figure():
    """Needle recall of our policies and kvpress's presses from the committed replay
    (table T4), not a live run."""
    from pagekv.views import figures
    from pagekv.views.figures.placeholder import placeholder

    try:
        tables = load_replay()["tables"]
    except (OSError, ValueError, KeyError) as e:
        return placeholder(f"The replay's results cannot be read: {e}")
    rows = [r for r in tables["T4_recall"] if r["recall"] is not None]
    rows += [
        {**r, "policy": f"kvpress {r['press']}"}
        for r in tables.get("T4_peer", [])
        if r.get("recall") is not None and "press" in r
    ]
    return figures.recall_bars(
        rows, "Replay, table T4 (measured earlier, not live): needle recall by policy"
    )
