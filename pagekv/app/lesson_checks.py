"""A lesson's observation checked on what the app just ran (live lessons), on the
constructed group, or on the replay's committed tables; the replay's recall figure.
No Gradio here: the handlers (`pagekv.app.lesson_handlers`) wire it to the page."""

from __future__ import annotations

import logging

from pagekv.app.lessons import LESSONS, load_replay, run_lesson
from pagekv.app.page_text import CAPTIONS, message

log = logging.getLogger("pagekv.app")

LESSON_TITLES = [f"{i + 1}. {x.title}" for i, x in enumerate(LESSONS)]


def lesson_of(title):
    return dict(zip(LESSON_TITLES, LESSONS, strict=True)).get(title)


def settings_match(lesson, comp) -> bool:
    """Whether the last comparison ran exactly the lesson's prompt and two sides."""
    return comp is not None and comp.ran(lesson.prompt, lesson.a, lesson.b)


def check_lesson(title, comp, failed: bool = False, refused: bool = False):
    """The lesson's observation, checked on what the app just ran (live lessons), on the
    constructed group, or on the replay's committed tables. None for an unknown title.
    `failed`: the run did not complete, so there is nothing to check; `refused`: nothing
    ran (a budget outside its rule), so the verdict is of no run."""
    lesson = lesson_of(title)
    if lesson is None:
        return None
    try:
        if lesson.kind == "live" and (failed or refused):
            why = "nothing ran" if refused else "the run did not complete"
            return (
                "**Observation:** " + lesson.observation.statement + f" - *not checked: {why} "
                "(the status line says why).*"
            )
        if lesson.kind == "live":
            if not settings_match(lesson, comp):
                return (
                    "**Observation:** " + lesson.observation.statement + " - *not checked: "
                    "the controls no longer hold this lesson's settings (pick the lesson "
                    "again to check it).*"
                )
            checked = lesson.observation.check(comp)
        else:
            checked = run_lesson(None, lesson).verdict
    except Exception as e:  # never a traceback on the page
        log.warning("lesson check failed: %s", e, exc_info=True)
        return message("error", f"the check could not run: {' '.join(str(e).split())}")
    where = {
        "live": "this run",
        "constructed": "the constructed group",
        "replay": "the replay's committed tables",
    }[lesson.kind]
    return verdict_text(lesson, checked, where)


def verdict_text(lesson, verdict, where: str) -> str:
    """The lesson's observation checked on `where`: whether it holds, and what was measured."""
    mark = "**holds**" if verdict.holds else "**does not hold**"
    return (
        f"**Observation:** {lesson.observation.statement}: {mark}, checked now on {where}."
        f"\n\nMeasured: {verdict.measured}"
    )


def _recall_rows(tables: dict) -> list[dict]:
    """T4's recall rows of our policies and of kvpress's presses (named "kvpress X")."""
    rows = [r for r in tables["T4_recall"] if r["recall"] is not None]
    rows += [
        {**r, "policy": f"kvpress {r['press']}"}
        for r in tables.get("T4_peer", [])
        if r.get("recall") is not None and "press" in r
    ]
    return rows


def replay_caption(tables: dict | None = None) -> str:
    """The replay view's caption, its "look for" counted on the file's bars (`tables`,
    read when not given): of the (policy, budget) pairs measured with the question
    inside and after (the full cache aside), how many score lower, the same and higher
    after compression."""
    try:
        rows = _recall_rows(load_replay()["tables"] if tables is None else tables)
    except (OSError, ValueError, KeyError):
        return CAPTIONS["replay"]
    by: dict = {}
    for r in rows:
        if r["policy"] != "full":
            by.setdefault((r["policy"], r["budget"]), {})[r["mode"]] = r["recall"]
    both = [v for v in by.values() if {"inside", "after"} <= set(v)]
    lower = sum(v["after"] < v["inside"] for v in both)
    higher = sum(v["after"] > v["inside"] for v in both)
    same = len(both) - lower - higher
    return (
        f"{CAPTIONS['replay']} **Look for** the bars with the question asked after "
        f"compression: of the {len(both)} policies and presses measured both ways at a "
        f"budget, {lower} score lower after, {same} the same and {higher} higher (counted "
        "on the file's numbers)."
    )


def ruler_memory_figure(families=None, layouts=None, title: str | None = None):
    """RULER's score against memory, from the committed results (`RULER_MEMORY_PATH`,
    written by experiments/ruler.py), not a live run: every layout and method family, or
    those named."""
    from pagekv.app import figures
    from pagekv.app.figures.placeholder import placeholder
    from pagekv.app.lessons import read_memory_summary

    try:
        summary = read_memory_summary()
    except (OSError, ValueError) as e:
        return placeholder(f"RULER's memory comparison cannot be read: {e}")
    curves = {
        lay: {f: pts for f, pts in panel.items() if families is None or f in families}
        for lay, panel in summary["curves"].items()
        if layouts is None or lay in layouts
    }
    if not any(curves.values()):
        return placeholder("The committed RULER results hold none of these rows.")
    return figures.memory_curves(curves, f"{title or summary['title']} (measured, not live)")


#: Lesson 2's chart: our entropy rows in pages of 16, 4 and 1.
PAGE_FAMILIES = tuple(
    f"entropy reconstruct/global{'' if p == 16 else f' (pages of {p})'}" for p in (16, 4, 1)
)


def ruler_pages_figure():
    """Pages against tokens on RULER in the gathered and in-place layouts (lesson 2)."""
    return ruler_memory_figure(PAGE_FAMILIES, ("gathered", "in_place"),
                               "RULER: pages of 16, 4 and 1 at equal memory")  # fmt: skip


def replay_recall_figure():
    """Needle recall of our policies and kvpress's presses from the committed replay
    (table T4), not a live run."""
    from pagekv.app import figures
    from pagekv.app.figures.placeholder import placeholder

    try:
        tables = load_replay()["tables"]
    except (OSError, ValueError, KeyError) as e:
        return placeholder(f"The replay's results cannot be read: {e}")
    rows = _recall_rows(tables)
    return figures.recall_bars(
        rows, "Replay, table T4 (measured earlier, not live): needle recall by policy"
    )
