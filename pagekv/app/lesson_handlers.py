"""The lessons on the page: picking one sets every control, opens its view, runs it
and checks its observation, in one request; previous / next; the warm-up that computes
the live lessons once a server starts, so that a class gets them from memory."""

from __future__ import annotations

import html
import logging
import re
import threading
import time

import gradio as gr

from pagekv.app.handlers import (
    MECH_CONTROLS,
    MECH_VIEWS,
    RUN_VIEWS,
    SESSIONS,
    cleared_views,
    control_values,
    known_models,
    light,
    run_mechanism,
    slider_range,
    stream_run,
    update_layer,
)
from pagekv.app.lesson_checks import LESSON_TITLES, check_lesson, lesson_of
from pagekv.app.lessons import LESSONS, VIEWS, layer_for
from pagekv.app.page_text import lesson_markdown, message
from pagekv.app.run_inputs import RunInputs
from pagekv.app.share import lesson_in_query, settings_in_query

log = logging.getLogger("pagekv.app")

#: Tab ids: the views a lesson can open (`Lesson.views` names them), then Export.
TABS = (*VIEWS, "export")
#: The controls a lesson sets, in the order of `apply_lesson`'s outputs (then the
#: tabs, the lesson text and the observation).
LESSON_CONTROLS = (
    "task", "curated", "context", "depth", "seed", "needles", "mode", "budget", "page_size",
    "n_sink", "window", "tau", "policy_a", "policy_b", "link_b", "mode_b", "budget_b",
    "page_size_b", "n_sink_b", "window_b", "tau_b", "layer", "scorer_a", "allocation_a",
    "scorer_b", "allocation_b", "m_heads", "m_retr", "m_dist", "m_dstr", "m_sink", "m_n",
    "m_budget",
)  # fmt: skip


def apply_lesson(title):
    """Set every control to the lesson's settings and open its first view (`title`: a
    lesson's, `pick_lesson` makes sure)."""
    lesson = lesson_of(title)
    run = _lesson_run_args(lesson, title, "bundled") if lesson.kind == "live" else None
    values = _run_controls(run)
    if lesson.mechanism is not None:
        values.update(zip(MECH_CONTROLS, lesson.mechanism.inputs(), strict=True))
    return [
        *(values[name] for name in LESSON_CONTROLS),
        gr.Tabs(selected=lesson.views[0]),
        lesson_markdown(lesson),
        "**Observation:** " + lesson.observation.statement + " - *checking...*",
    ]


def _run_controls(run: RunInputs | None) -> dict:
    """`LESSON_CONTROLS` by name: the run controls set to the run inputs `run` (all left
    as they are without one), the mechanism's left as they are."""
    values = {name: gr.update() for name in LESSON_CONTROLS}
    if run is not None:
        names = [n for n in LESSON_CONTROLS if n not in MECH_CONTROLS]
        values.update(zip(names, control_values(run, names), strict=True))
    return values


def _lesson_run_args(lesson, title, model) -> RunInputs:
    """The run inputs of a live lesson (every control as the lesson sets it; B follows A
    where only their methods differ, otherwise it keeps its own and the status line says
    so). A layer named by a rule ("last", "strongest", "sink") starts at 0 and is resolved
    on the model once it has run (`pick_lesson`)."""
    layer = lesson.layer if isinstance(lesson.layer, int) else 0
    return RunInputs.for_sides(
        lesson.prompt, lesson.a, lesson.b, model=model, layer=layer, lesson=title
    )


@light
def pick_lesson(title, model="bundled", request: gr.Request = None):
    """Pick a lesson, in ONE request (a generator): set every control, open its first
    view, run it (live lessons: plan views first, then the answers) and check its
    observation on the result. Outputs: LESSON_CONTROLS, the tabs, the lesson text,
    RUN_VIEWS, MECH_VIEWS. A request a later lesson request of the same session has
    overtaken shows nothing more (`SessionGate.ticket`): once nothing at all, a no-change
    output (`UNCHANGED`)."""
    yield from _lesson(title, model, request)


#: `pick_lesson`'s outputs left as they are.
UNCHANGED = tuple(
    gr.update() for _ in range(len(LESSON_CONTROLS) + 2 + len(RUN_VIEWS) + len(MECH_VIEWS))
)


def _lesson(title, model, request, shown=None):
    """`pick_lesson`'s outputs, each after `shown` (the picker's new title) when given."""
    before = () if shown is None else (shown,)
    yielded = False
    for out in _lesson_views(title, model, request):
        if out is None:  # overtaken
            if not yielded:
                yield (*(() if shown is None else (gr.update(),)), *UNCHANGED)
            return
        yielded = True
        yield (*before, *out)


def _lesson_views(title, model, request):
    """`pick_lesson`'s outputs; None once a later lesson request of the session came."""
    lesson = lesson_of(title)
    if lesson is None:
        title, lesson = LESSON_TITLES[0], LESSONS[0]
    session = getattr(request, "session_hash", None)
    ticket = SESSIONS.ticket(session)  # a later lesson request of the session wins
    *head, waiting = apply_lesson(title)  # the controls, the tabs and the lesson text
    i_obs = RUN_VIEWS.index("observation")
    mech = tuple(gr.update() for _ in MECH_VIEWS)
    if lesson.mechanism is not None:
        mech = run_mechanism(*lesson.mechanism.inputs())
    if lesson.kind == "live":
        for views in stream_run(_lesson_run_args(lesson, title, model), request):
            views = list(views)
            if views[i_obs] is None or isinstance(views[i_obs], dict):  # not checked yet
                views[i_obs] = waiting
            _open_lesson_layer(lesson, views)
            # Overtaken by a later request of the session (a lesson, or a run started by
            # a control changed meanwhile): its outputs are the screen's from here on.
            if not SESSIONS.is_latest(session, ticket):
                yield None
                return
            yield (*head, *views, *mech)
        return
    # Constructed or replay: no live run belongs to this lesson, so nothing of the last
    # one stays on screen (its status, answers and views are cleared).
    where = {
        "constructed": "the Mechanism tab shows it",
        "replay": "the Replay tab shows the replay's committed results",
    }[lesson.kind]
    if not SESSIONS.is_latest(session, ticket):
        yield None
        return
    # The session's last results are cleared: a refused budget later has none to keep.
    SESSIONS.remember(session)
    views = cleared_views(
        f"Lesson {LESSON_TITLES.index(title) + 1} runs no model: {where}.",
        status=message("info", f"This lesson runs no model; {where}."),
        observation=check_lesson(title, None),  # a lesson's title: never None
    )
    yield (*head, *views, *mech)


def _open_lesson_layer(lesson, views: list) -> None:
    """A finished live run of a lesson whose layer is a rule: open the head-weights
    view on the layer the rule names for the model that ran (in place)."""
    comp = views[RUN_VIEWS.index("last")]
    if isinstance(lesson.layer, int) or comp is None or isinstance(comp, dict):
        return
    p = comp.plan_of("B")
    layer = layer_for(lesson, p)
    views[RUN_VIEWS.index("weights")] = update_layer(comp, layer)
    views[RUN_VIEWS.index("layer")] = slider_range(0, int(p.keep.shape[0]) - 1, layer)


def lesson_step(title, step: int):
    """The lesson `step` places after `title` (wrapping), for the previous / next buttons."""
    i = LESSON_TITLES.index(title) if title in LESSON_TITLES else 0
    return LESSON_TITLES[(i + step) % len(LESSON_TITLES)]


@light
def previous_lesson(title, model="bundled", request: gr.Request = None):
    """The lesson before `title` (the picker's, or the one the last press asked for:
    app.js), as `pick_lesson`, its title first."""
    yield from _lesson(lesson_step(title, -1), model, request, shown=lesson_step(title, -1))


@light
def next_lesson(title, model="bundled", request: gr.Request = None):
    """The lesson after `title`, as `previous_lesson`."""
    yield from _lesson(lesson_step(title, 1), model, request, shown=lesson_step(title, 1))


#: The lesson text of a page opened by a link to settings, and of one whose settings
#: do not run.
SHARED_TEXT = (
    "### Shared settings\nThis page was opened by a link to settings: every control holds "
    "them and the run below is theirs. The lesson picker above starts a lesson."
)
SHARED_BAD_TEXT = (
    "### Shared settings\nThis page was opened by a link to settings that do not run: the "
    "status line says which one is wrong, and nothing below is theirs. Correct it and press "
    "Run, or pick a lesson above."
)


@light
def open_page(title, model="bundled", request: gr.Request = None):
    """The page's load, in ONE request: a link's lesson (`?lesson=3`) or settings
    (`?budget_pct=25&...`, `pagekv.app.share`) set, run and checked, else the first
    lesson. Outputs: the lesson picker, the model, then `pick_lesson`'s."""
    query = dict(getattr(request, "query_params", None) or {})
    settings = settings_in_query(query)
    i_status = len(LESSON_CONTROLS) + 2 + RUN_VIEWS.index("status")
    if settings is None:
        asked = str(query.get("lesson", "")).strip()
        found = lesson_in_query(query)
        title = found or title
        note = None
        if asked and found is None:  # a link to no lesson: said, not silently lesson 1
            note = message(
                "info",
                f"The link asked for lesson {html.escape(asked[:40], quote=False)!r}, which "
                f"does not exist (lessons 1 to {len(LESSONS)}, or a lesson's id); "
                f"lesson {title.split('.')[0]} opened instead.",
            )
        for shown, *out in _lesson(title, model, request, shown=title):
            if note and isinstance(out[i_status], str):
                out[i_status] = note + "\n\n" + out[i_status]
            yield (shown, gr.update(), *out)  # the picker, the model box, the rest
        return
    run = RunInputs(model=model).replace(**settings, lesson=None)
    shown_model = run.model if run.model in known_models() else gr.update()
    head = (gr.update(value=None), shown_model, *_run_controls(run).values(), gr.update())
    keep_mech = tuple(gr.update() for _ in MECH_VIEWS)
    for views in stream_run(run, request):
        views = list(views)
        views[RUN_VIEWS.index("observation")] = "**Observation:** none: no lesson is picked."
        status = views[RUN_VIEWS.index("status")]
        failed = isinstance(status, str) and status.startswith("**Error:**")
        yield (*head, SHARED_BAD_TEXT if failed else SHARED_TEXT, *views, *keep_mech)


class WarmSteps:
    """The console's side of a lesson's warm-up: each step its run's status line names
    (loading, prefill, reconstruction pass, decoding token k of n) logged once when it
    starts and again every `every_s` while it lasts, with the seconds and estimate the
    status line gives (`_progress`), its HTML left out."""

    def __init__(self, where: str, every_s: float = 10.0):
        self.where, self.every_s = where, every_s
        self.step, self.said_at = None, 0.0

    @staticmethod
    def text(status) -> str:
        """The status line as plain text (no label, tags or bold): its paragraph that
        counts decoded tokens, or else its first, at most 120 characters."""
        paras = str(status).strip().split("\n\n")
        para = next((p for p in paras if re.search(r"token \d+ of at most", p)), paras[0])
        para = re.sub(r"<[^>]+>|\*\*(Note|Done|Error):\*\*|\*\*", "", para)
        text = " ".join(para.split())
        return text if len(text) <= 120 else text[:119] + "…"

    def show(self, status) -> None:
        text = self.text(status)
        if not status or str(status).startswith(("**Done:**", "**Error:**")) or not text:
            return
        step = re.split(r":? \d", text, maxsplit=1)[0]  # the words before the numbers
        now = time.perf_counter()
        if step != self.step or now - self.said_at >= self.every_s:
            log.info("%s: %s", self.where, text)
            self.step, self.said_at = step, now


def warm_lessons(model: str = "bundled") -> int:
    """Run every live lesson once, as a visitor's pick would (its views then wait in
    memory for the class); returns how many ran. The app does this once it serves,
    with requests arriving meanwhile taking their turns on the model. Logs a line when
    it starts, each step of a lesson as it starts (`WarmSteps`: at most every 10 s while
    it lasts) and one line per lesson, with the seconds since the start."""
    t0 = time.perf_counter()
    live = [(t, x) for t, x in zip(LESSON_TITLES, LESSONS, strict=True) if x.kind == "live"]
    log.info("warming the %d live lessons on %s (a class then gets them from memory)",
             len(live), model)  # fmt: skip
    n = 0
    for title, lesson in live:
        last, said = None, WarmSteps(f"lesson {n + 1} of {len(live)}")
        for last in stream_run(_lesson_run_args(lesson, title, model)):
            said.show(last[RUN_VIEWS.index("status")])
        status = last[RUN_VIEWS.index("status")]
        if str(status).startswith("**Error:**"):  # e.g. no model: the runs say why
            log.warning("lessons not warmed: %s", status)
            return n
        n += 1
        log.info("lesson ready (%d of %d): %s [%.1f s]", n, len(live), title,
                 time.perf_counter() - t0)  # fmt: skip
    log.info("lessons ready: %d live lessons computed in %.1f s", n, time.perf_counter() - t0)
    return n


def warm_in_background(model: str = "bundled") -> threading.Thread:
    """`warm_lessons(model)` on a thread of its own (a daemon), started now: the server
    serves meanwhile, and requests take their turns on the model worker with it."""
    thread = threading.Thread(target=warm_lessons, args=(model,), name="pagekv-warm", daemon=True)
    thread.start()
    return thread
