"""Shareable links: `?lesson=3` opens a lesson, `?budget_pct=25&policy_a=mean...` a run.

A link names run inputs by their API names (`RUN_DEFAULTS`); what it leaves out takes
its default. The page's "Link to these settings" button writes one in the browser
(`pagekvShareLink` in assets/app.js, given `share_js`); the page's load reads it
(`pagekv.app.lesson_handlers.open_page`). A value a link gets wrong is said by the run
as any other input is (`pagekv.app.run_inputs.parse_run`).

    >>> lesson_in_query({"lesson": "3"}).startswith("3. ")
    True
    >>> settings_in_query({"budget_pct": "25", "link_b": "false"})["budget_pct"]
    25.0
"""

from __future__ import annotations

import json

from pagekv.app.lesson_checks import LESSON_TITLES
from pagekv.app.lessons import LESSONS
from pagekv.app.run_inputs import RUN_DEFAULTS

__all__ = ["lesson_in_query", "settings_in_query", "share_js", "shared_names"]

#: Run inputs a link does not carry: the lesson (a link is a lesson or settings).
NOT_SHARED = ("lesson",)


def shared_names() -> list[str]:
    return [k for k in RUN_DEFAULTS if k not in NOT_SHARED]


def share_js() -> str:
    """The browser-side listener of the share button: the shared inputs' values in,
    the link out (no request to the server)."""
    names = shared_names()
    defaults = {k: RUN_DEFAULTS[k] for k in names}
    return f"(...values) => pagekvShareLink({json.dumps(names)}, {json.dumps(defaults)}, values)"


def lesson_in_query(query: dict) -> str | None:
    """The lesson a link names (`lesson=3`, its number, or `lesson=sink-masquerade`, its
    id), as its title; None if it names none or no such lesson."""
    said = str(query.get("lesson", "")).strip()
    if said.isdigit() and 1 <= int(said) <= len(LESSONS):
        return LESSON_TITLES[int(said) - 1]
    titles = {lesson.id: title for title, lesson in zip(LESSON_TITLES, LESSONS, strict=True)}
    return titles.get(said)


def settings_in_query(query: dict) -> dict | None:
    """The run inputs a link sets (text as typed: numbers read as numbers, true/false
    as flags, anything unreadable passed on for the run to name), or None when it sets
    none."""
    names = set(shared_names())
    given = {k: v for k, v in query.items() if k in names}
    if not given and "settings" not in query:
        return None
    out = {}
    for name, text in given.items():
        default = RUN_DEFAULTS[name]
        if isinstance(default, bool):
            out[name] = {"true": True, "false": False}.get(str(text).lower(), text)
        elif isinstance(default, int | float):
            try:
                out[name] = float(text)
            except ValueError:
                out[name] = text
        else:
            out[name] = text or None if default is None else text
    return out
