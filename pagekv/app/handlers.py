"""The app's handlers: what each control and API endpoint does, with Gradio's updates.

`app.py` lays out the page and wires these; they call `pagekv` (prefill, plans,
decoding on the model worker; figures in `pagekv.app.figures`). Bad input never
raises out of a handler: it becomes a message on the page, and the next request works.
Nothing here starts a thread or holds a lock while the model works: decoding is a job
on the model worker (`pagekv.engine.worker`), and a run streams its answers by
waiting on that job (docs/design.md, "One model worker").

The API's endpoints and their inputs: `/run` and `/budget` (`run_comparison`),
`/preset` (`apply_preset`), `/layer` (`update_layer`), `/mechanism` (`run_mechanism`),
`/export` (`export_run`), `/lesson` (`pagekv.app.lesson_handlers.pick_lesson`).
"""

from __future__ import annotations

import contextlib
import functools
import html
import inspect
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import gradio as gr
from gradio.components.plot import PlotData

from pagekv.app import allocator
from pagekv.app.figures.style import is_figure
from pagekv.app.lesson_checks import check_lesson, lesson_of, verdict_text
from pagekv.app.lessons import lesson_prompts
from pagekv.app.model_registry import ModelRegistry, model_key
from pagekv.app.page_text import STALE_NOTE, message
from pagekv.app.presets import check_preset, load_presets, preset_matches, preset_sides
from pagekv.app.run_figures import (
    PREVIEW_VIEWS,
    SAME_AFTER_DECODING,
    answers_html,
    answers_table,
    comparison_figures,
    export,
    ms,
    pending_table,
    preview_views,
    view_key,
    view_size,
)
from pagekv.app.run_inputs import (
    LIMITS,
    BudgetInputError,
    InputError,
    RunInputs,
    budget_pct,
    check_budgets,
    min_budget_pct,
    nearest_in_range,
    parse_run,
    shown_value,
    takes_run_inputs,
)
from pagekv.app.sessions import SessionGate
from pagekv.engine.comparison import METHOD_FIELDS, Decoding, differing, preview_comparison
from pagekv.engine.study import settings_text
from pagekv.engine.worker import WORKER, keep_this_thread_light
from pagekv.maths.config import POLICIES
from pagekv.runtime.models import KNOWN_MODELS
from pagekv.tasks import default_max_new_tokens

log = logging.getLogger("pagekv.app")
POLICY_CHOICES = list(POLICIES)
PRESETS = load_presets()
#: Runs served at once (sessions' runs waiting for the model or served from memory).
RUN_CONCURRENCY = 8
#: The answers stream into the table at most this often (each update is sent to the
#: browser and redrawn there; a token takes about 60 ms on 2 CPU cores).
STREAM_EVERY_S = 0.25
#: How long a run waits for the same run started by another session before doing it.
SAME_RUN_WAIT_S = 600
#: Export folders older than this are removed when a new one is made.
EXPORT_MAX_AGE_S = 1800

try:  # ZeroGPU on Hugging Face Spaces: run the GPU work inside spaces.GPU.
    import spaces

    gpu = spaces.GPU
except Exception:  # not on a Space: a no-op decorator

    def gpu(fn):
        return fn


# ----------------------------------------------------------------- server state

#: Loaded models by name, shared by every session (pagekv/app/model_registry.py):
#: the default stays loaded, at most two others besides it, and names the server does
#: not offer are refused (`configure`).
MODELS = ModelRegistry(default="bundled", max_others=2)
#: One run at a time per session; entries dropped when a session ends.
SESSIONS = SessionGate()


def configure(
    default_model: str = "bundled", allow_hub_models: bool = False, decode_dtype: str = "auto"
) -> None:
    """The server's model settings: `default_model` stays loaded (the warm-up uses it);
    other hub names load only with `allow_hub_models`; every model decodes with
    `decode_dtype` (`pagekv.runtime.decode.resolve_decode`)."""
    MODELS.set_default(default_model)
    MODELS.allow_hub = bool(allow_hub_models)
    MODELS.decode_dtype = decode_dtype


#: The live lessons' prompts (`lessons.lesson_prompts`).
LESSON_PROMPTS = lesson_prompts()


def get_study(model_name: str):
    """The Study for `model_name` (loaded once, shared; falls back to the default model
    with `study.loaded.fell_back` and a note when the name cannot load; ModelRefused,
    in one sentence, for a name the server does not offer). Its memos keep the
    lessons' prompts apart from exploration (`Study.keep_prompts`)."""
    study = MODELS.get(model_name)
    study.keep_prompts(LESSON_PROMPTS)
    return study


def model_that_ran(name):
    """The model box after a run: the model that ran (the default, where `name` could
    not load and the run fell back to it)."""
    return MODELS.serving(name if isinstance(name, str) else "")


def known_models() -> list[str]:
    """The model control's choices: the default first, then the known models."""
    return [MODELS.default] + [m for m in KNOWN_MODELS if m != MODELS.default]


def end_session(request: gr.Request = None) -> None:
    """A browser tab closed: drop what the server holds for its session."""
    SESSIONS.end(getattr(request, "session_hash", None))


# ----------------------------------------------------------------- handlers


def light(fn):
    """A handler that uses torch on Gradio's worker threads: each call (each step of a
    generator, which Gradio may run on different threads) first makes its thread
    single-threaded for torch while the main thread serves the model
    (`pagekv.engine.worker.keep_this_thread_light`)."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def steps(*args, **kwargs):
            with contextlib.closing(fn(*args, **kwargs)) as it:
                keep_this_thread_light()  # before each step: the first and every next one
                for value in it:
                    yield value
                    keep_this_thread_light()

        return steps

    @functools.wraps(fn)
    def call(*args, **kwargs):
        keep_this_thread_light()
        return fn(*args, **kwargs)

    return call


def _side_b_note(comp) -> str:
    """What side B does differently, for the status line ("" when only its method: the
    policy, scorer and allocation are each side's own)."""
    own = differing(comp.side("B"), comp.side("A"), skip=METHOD_FIELDS)
    cfg_b = comp.configs["B"]
    if not own:
        return ""
    n_b = comp.preps["B"].n
    return (
        f". Side B keeps its own settings ('Same settings as A' is unticked): "
        f"{', '.join(own)}; {n_b} prompt tokens, budget {cfg_b.budget_tokens(n_b)} tokens"
    )


#: What a run fills, in the order of the run's outputs (`build_demo` wires the
#: components of the same names); `_views` turns keyword values into that tuple.
RUN_VIEWS = (
    "status", "answers", "frame", "retention", "weights", "overview", "sink_mass", "sink_adv",
    "uor", "stored", "memory", "capacity", "glance", "glance_caption", "files", "layer",
    "observation",
    "budget", "budget_b", "stale_note", "last",
)  # fmt: skip
#: The run's plot views (an error shows a placeholder in each: no empty frames).
PLOTS = (
    "frame", "retention", "weights", "overview", "sink_mass", "sink_adv", "uor", "stored",
    "memory", "capacity", "glance",
)  # fmt: skip
#: The figure (`comparison_figures`' name) each plot view shows, where the names differ.
FIGURE_OF = {"overview": "weights_overview", "sink_adv": "sink_advantage"}
#: Run views a run leaves as they are unless it sets them.
KEPT_UNLESS_SET = ("layer", "observation", "budget", "budget_b")


def _views(**values):
    """The run's outputs in `RUN_VIEWS` order; views not given are cleared (None; the
    layer slider, the lesson's observation and the budget sliders are left as they are;
    the first screen's caption says what its chart of a live run shows)."""
    from pagekv.app.page_text import GLANCE_CAPTION

    unknown = set(values) - set(RUN_VIEWS)
    if unknown:
        raise KeyError(f"not a run view: {sorted(unknown)}")
    default = {name: gr.update() for name in KEPT_UNLESS_SET} | {"glance_caption": GLANCE_CAPTION}
    return tuple(sent(values.get(name, default.get(name))) for name in RUN_VIEWS)


def _updates(**values):
    """The run's outputs with only `values` set: every other view is left as it is."""
    return tuple(values.get(name, gr.update()) for name in RUN_VIEWS)


def sent(value):
    """A plotly figure as `gr.Plot` sends it (`PlotData`: its JSON), made once per
    figure object and kept on it; anything else as it is. A run's plan views are sent
    by the preview, again by the release's first update and again with its answers,
    and a finished run's by every request it is served to: the page frame's JSON alone
    took tens of milliseconds each time, on the thread that shares the CPU with the
    decode. Figures are never changed once drawn (`pagekv.app.run_figures`), so the
    JSON stays theirs."""
    if not is_figure(value):
        return value
    data = getattr(value, "_pagekv_sent", None)
    if data is None:
        data = PlotData(type="plotly", plot=value.to_json())
        value._pagekv_sent = data
    return data


def _failed(text: str, lesson, refused: bool = False):
    """The views of a run that did not complete (`refused`: that nothing ran): the
    status line says why (`text`)."""
    return cleared_views(
        "No result: the run did not complete (the status line above says why).",
        status=message("error", text),
        observation=_observation(lesson, None, failed=not refused, refused=refused),
    )


def cleared_views(why: str, **values):
    """Every run view cleared, each plot replaced by a figure that says `why` (a
    lesson without a live run, a failed run): nothing of an earlier run stays."""
    from pagekv.app.figures.placeholder import placeholder

    figure = placeholder(why)
    answers = f'<p class="no-answers">{html.escape(why, quote=False)}</p>'
    values.setdefault("glance_caption", why)  # not the caption of a chart that is not there
    return _views(**{name: figure for name in PLOTS}, answers=answers, **values)


def slider_range(minimum: float, maximum: float, value, step: float = 1):
    """A slider's update that keeps `minimum < maximum` (Gradio refuses a slider whose
    range is one value, and the page's boxes would lock): a range collapsed to one value
    keeps `maximum` and starts one step below it (the run's own rule refuses that
    value; the status line says the range in words, `collapsed_note`)."""
    if minimum >= maximum:
        minimum = maximum - step
    return gr.update(minimum=minimum, maximum=maximum, value=value)


def _budget_limits(comp) -> dict:
    """The budget sliders: each shows the budget that ran (so a box never holds a value
    other than its results'), from the smallest feasible budget of its side for this
    prompt and these settings (a range of one value kept a step wide)."""
    _, hi, step = LIMITS["budget"]
    limits = {}
    for key, side in (("budget", "A"), ("budget_b", "B")):
        cfg, n = comp.configs[side], comp.preps[side].n
        limits[key] = slider_range(min_budget_pct(n, cfg), hi, budget_pct(cfg), step)
    return limits


def collapsed_note(comp) -> str | None:
    """The sentence for a side whose budget range is one value (its protected pages
    take the whole prompt): only 100 % runs there. None when every side has a range."""
    hi = LIMITS["budget"][1]
    sides = [
        (side, cfg)
        for side, cfg in comp.configs.items()
        if min_budget_pct(comp.preps[side].n, cfg) >= hi
    ]
    if not sides:
        return None
    names = " and ".join(side for side, _ in sides)
    cfg = sides[0][1]
    return (
        f"Budget {names}: only {hi:g} % fits this {comp.preps[sides[0][0]].n}-token prompt at "
        f"pages of {cfg.page_size} (its protected pages, the first {cfg.n_sink} tokens and the "
        f"last {cfg.window}, take every page), so nothing is evicted; a longer prompt or "
        "smaller pages leave a range."
    )


def _status(study, comp, decoded: bool, served: bool = False) -> str:
    loaded, cfg_a = study.loaded, comp.configs["A"]
    n = comp.prep.n
    head = (
        f"**{loaded.name}**, {loaded.origin} ({study.runner.backend} backend on "
        f"{study.runner.device}): "
        f"{n} prompt tokens, budget {cfg_a.budget_tokens(n)} tokens per (layer, group), "
        f"page size {cfg_a.page_size}" + _side_b_note(comp) + ". "
        f"Question: *{_shown(comp.prep.task.question)}* "
        f"Expected: **{_shown(comp.prep.task.answer)}**"
    )
    parts = [message("ok" if decoded else "info", head if decoded else "Decoding... " + head)]
    notes = [loaded.note if loaded.fell_back else None, loaded.caveat, *comp.notes]
    notes.append(collapsed_note(comp))
    parts += [message("info", note) for note in notes if note]
    if decoded:
        t = comp.records["B"].timings
        rec_s = [comp.records[s].timings.get("reconstruct_s") for s in ("A", "B")]
        rec_s = next((x for x in rec_s if x is not None), None)
        parts.append(
            f"<small>prefill {t['prefill_s']:.2f}s (once per prompt), "
            + ("" if rec_s is None else f"reconstruction {rec_s:.2f}s (once per prompt), ")
            + f"eviction {ms(t['evict_s'])}, decode {t['decode_s']:.2f}s"
            + (" (this run was computed earlier: served from memory)" if served else "")
            + "</small>"
        )
    return "\n\n".join(parts)


def _shown(text: str) -> str:
    """A visitor's text shown as text in Markdown: HTML escaped (a tag in a custom
    question is displayed, never rendered), Markdown's emphasis marks escaped."""
    escaped = html.escape(" ".join(str(text).split()), quote=False)
    return "".join("\\" + c if c in "*_`[]" else c for c in escaped)


@light
@gpu
def stream_run(inputs: RunInputs, request: gr.Request = None):
    """Prefill (memoised), plan both sides and show every plan view at once, then decode
    full / A / B and show the answers, and check the lesson's observation. A generator:
    plan views, answers as they stream, then everything. A run already finished (by any
    session) is served from memory in one update. Never raises: bad input becomes a
    message and the next request works. `inputs`: `RunInputs` (each side a full
    configuration)."""
    session = getattr(request, "session_hash", None)
    with SESSIONS.turn(session):
        yield from _run(inputs, session)


#: The API's /run and /budget: `stream_run` with every run input by name or position.
def _run_event(inputs: RunInputs, request: gr.Request = None):
    """A run the page's controls asked for: it takes a ticket of its session
    (`SessionGate.ticket`), so that a lesson still running in the session leaves the
    screen, controls included, to it: a control changed while a lesson loads keeps its
    value."""
    SESSIONS.ticket(getattr(request, "session_hash", None))
    yield from stream_run(inputs, request)


run_comparison = takes_run_inputs(gr.Request, "run_comparison")(_run_event)


def prompt_in_range(v: RunInputs) -> tuple[RunInputs, list[str]]:
    """The page's rule for a prompt slider's value outside its range, for a link and the
    API too: the nearest end, and a sentence that says so (the browser's box does the
    same for a value typed into the page). A value that is no number is left for
    `parse_run` to refuse."""
    notes, changes = [], {}
    for name, label in PROMPT_SLIDERS.items():
        lo, hi, _step = LIMITS[name]
        value = getattr(v, name)
        x, where = nearest_in_range(value, lo, hi)
        if where in ("below", "above"):
            changes[name] = int(x) if name in ("context", "needles") else x
            notes.append(f"{label}: {_outside(value, where, lo, hi)}, using {x:g}.")
    return (v.replace(**changes) if changes else v), notes


def _outside(value, where: str, lo: float, hi: float) -> str:
    """`value` said to be `where` ("below" or "above") its range, `lo` to `hi`."""
    return f"{shown_value(value)} is {where} its range ({lo:g} to {hi:g})"


def _run(v: RunInputs, session=None):
    lesson, study = v.lesson, None
    v, range_notes = prompt_in_range(v)
    try:
        try:
            spec, a, b, layer = parse_run(v)
            refused = None
        except BudgetInputError as e:  # said with the prompt's floor: the model tells it
            refused = e
        name = model_key(v.model if isinstance(v.model, str) else "")
        loading = name not in MODELS.loaded_names() and MODELS.unavailable(name) is None
        if MODELS.offered(name) and loading:  # a model that cannot load says so at once
            yield _working(f"Loading the model {name} (once)", lesson)
        study = get_study(name)
        if refused is not None:
            raise refused
        key, finished = view_key(spec, a, b, layer), study.results
        t0 = time.perf_counter()
        waited = key not in finished  # another request may be computing it
        done = finished.get_or_wait(key, timeout=SAME_RUN_WAIT_S)
        if done is None:
            with finished.computing(key):
                modes = sorted({a.mode, b.mode})
                preps = yield from _step(
                    lambda: {m: study.prepare(spec.replace(mode=m)) for m in modes},
                    f"Prefilling the prompt on {study.loaded.name}",
                    lambda: _estimate(study, "prefill", spec, modes),
                    lesson,
                    runs=not all(spec.replace(mode=m) in study.prefills for m in modes),
                )
                check_budgets(
                    (label, side.config, spec.replace(mode=side.mode), preps[side.mode].n)
                    for label, side in (("A", a), ("B", b))
                )
                fresh = _unreconstructed(preps, a, b)
                preview = lambda: preview_comparison(study, spec, a, b)  # noqa: E731
                if fresh:  # planning runs the reconstruction pass first: its own step
                    comp = yield from _step(
                        preview,
                        "Reconstruction pass: the model reads the prompt again to score it",
                        lambda: sum(study.estimate("reconstruct", p.n) or 0 for p in fresh) or None,
                        lesson,
                    )
                else:
                    comp = preview()
                n_layers = int(comp.plan_of("B").keep.shape[0])  # from the model that ran
                layer = min(layer, n_layers - 1)
                decoding = Decoding(study, comp)  # queued now: the model works while we draw
                preview_figs = preview_views(comp, key, layer, study.plans)
                yield _views(
                    status=_status(study, comp, decoded=False),
                    answers=answers_html(pending_table(comp)),
                    **{k: preview_figs.get(k) for k in PREVIEW_VIEWS},
                    layer=slider_range(0, n_layers - 1, layer),
                    observation=_checking(lesson),
                    **_budget_limits(comp),
                )
                # Decoding changes no plan: the plan views drawn above stand, and the
                # views of head weights and sinks are drawn while the model decodes;
                # only the retention of the stored caches waits for the decoded records.
                figs = {k: f for k, f in preview_figs.items() if k in SAME_AFTER_DECODING}
                figs |= comparison_figures(
                    comp, layer=layer, skip={*figs, "retention"}, memo=study.plans
                )
                most = default_max_new_tokens(comp.prep.task)
                decoding_status = _status(study, comp, decoded=False)
                for tokens in decoding.stream(poll_s=STREAM_EVERY_S):
                    rows = pending_table(comp, tokens, study.tokenizer)
                    k = max(len(t) for t in tokens)
                    yield _updates(
                        answers=answers_html(rows),
                        status=f"{decoding_status}\n\nA and B: token {k} of at most {most} "
                        f'<progress value="{k}" max="{most}"></progress>',
                    )
                figs |= comparison_figures(comp, layer=layer, only={"retention"})
                comp = comp.detached()  # what is kept holds no prefill
                done = dict(comp=comp, figs=figs, table=answers_table(comp), layer=layer,
                            n_layers=n_layers, served=False)  # fmt: skip
                done["nbytes"] = view_size(comp, figs)
                finished.put(key, done)
            allocator.trim()  # the run's working memory back to the system
        else:
            done = dict(done, served=True)
            log.info(
                "run %s | views served from memory %s",
                settings_text(spec.replace(mode=a.mode), a.config, b.config)
                + ("" if b.mode == a.mode else f", B asked {b.mode}"),
                f"in {1000 * (time.perf_counter() - t0):.0f} ms"
                + (" (waiting for the same run, started by another request)" if waited else ""),
            )
    except BudgetInputError as e:  # the budget's one rule, with this prompt's floor
        yield _refused_budget(study, e, session, lesson)
        return
    except InputError as e:  # any other refused input: nothing ran, as for a budget
        yield _refused_input(e, session, lesson)
        return
    except Exception as e:  # bad input or an unexpected failure: say it on the page
        log.warning("run failed: %s", e, exc_info=not isinstance(e, ValueError))
        SESSIONS.remember(session)  # the views are cleared: no results to go back to
        yield _failed(
            html.escape(" ".join(str(e).split()) or type(e).__name__, quote=False), lesson
        )
        return
    comp, figs = done["comp"], done["figs"]
    SESSIONS.remember(session, budget=budget_pct(a.config), budget_b=budget_pct(b.config))
    yield _views(
        status="\n\n".join(
            [_status(study, comp, decoded=True, served=done["served"])]
            + [message("info", note) for note in range_notes]
        ),
        answers=answers_html(done["table"]),
        # Every figure but retention (drawn only where a needle is) must be there.
        **{v: figs[FIGURE_OF.get(v, v)] for v in PLOTS if v != "retention"},
        retention=figs.get("retention"),
        files=None,  # the Export tab writes the files of this run on request
        layer=slider_range(0, done["n_layers"] - 1, done["layer"]),
        observation=_observation(lesson, comp),
        last=comp,
        **_budget_limits(comp),
    )


def _refused_budget(study, e: BudgetInputError, session, lesson):
    """A budget outside its rule: the sentence with this prompt's floor (the prompt is
    prepared for it, as the run would have been). Nothing runs. In a session whose last
    run finished, its results stay and the boxes go back to the budgets they were
    computed at (the browser's box would otherwise show the refused or a clamped
    value); otherwise every view is cleared, as for any failed run."""
    if e.n is None and study is not None:
        with contextlib.suppress(Exception):  # the prompt's own error is said by the next run
            e = e.for_prompt(study.prepare(e.spec).n)
    log.info("run refused: %s", e)
    before = SESSIONS.recall(session)
    text = html.escape(str(e), quote=False)
    if not before:
        return _failed(text, lesson, refused=True)
    a, b = before["budget"], before["budget_b"]
    text += (
        f" Nothing ran: the budget is back at {a:g} %, the budget of the results below."
        if a == b
        else f" Nothing ran: the budgets are back at {a:g} % (A) and {b:g} % (B), those of "
        "the results below."
    )
    return _nothing_ran(text, lesson, budget=gr.update(value=a), budget_b=gr.update(value=b))


def _refused_input(e: InputError, session, lesson):
    """An input outside its rule (a policy that cannot share a budget, a value no
    control takes): the one sentence that says why. Nothing ran, so as for a refused
    budget, a session's last finished results stay; without them every view is
    cleared, as for any failed run."""
    log.info("run refused: %s", e)
    text = html.escape(" ".join(str(e).split()), quote=False)
    if not SESSIONS.recall(session):
        return _failed(text, lesson, refused=True)
    return _nothing_ran(text + " Nothing ran: the results below are the last run's.", lesson)


def _nothing_ran(text: str, lesson, **boxes):
    """A refusal over the session's last results: the status line says `text`, the
    lesson's verdict says nothing ran, `boxes` are set and every other view stays."""
    return _updates(
        status=message("error", text), observation=_observation(lesson, None, refused=True),
        **boxes,
    )  # fmt: skip


def _observation(lesson, comp, failed: bool = False, refused: bool = False):
    """The lesson's verdict on `comp` (`failed`: the run did not complete; `refused`:
    nothing ran), or no change for a run with no lesson or an unknown one."""
    if not lesson:
        return gr.update()
    checked = check_lesson(lesson, comp, failed=failed, refused=refused)
    return gr.update() if checked is None else checked


@light
def export_run(comp):
    """The last run's numbers (JSON, CSV) and figures (HTML), written on request."""
    if comp is None:
        raise gr.Error("Nothing to export yet: run a comparison first.")
    return export(comp, comparison_figures(comp), _export_folder())


def _export_folder() -> str:
    """A new folder for one run's export under one root; old ones are removed."""
    root = os.path.join(tempfile.gettempdir(), "pagekv-exports")
    os.makedirs(root, exist_ok=True)
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        with contextlib.suppress(OSError):
            if now - os.path.getmtime(path) > EXPORT_MAX_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix="run_", dir=root)


#: How often a long step's status line is redrawn while it runs (`_step`).
STEP_EVERY_S = 1.0
#: A step done within this long shows no status line of its own (a memo hit).
STEP_QUIET_S = 0.3
#: The threads that wait for a run's long steps while its request shows their progress
#: (each waits on the model worker holding nothing, as a request thread would).
_STEP_WAITERS = ThreadPoolExecutor(max_workers=RUN_CONCURRENCY, thread_name_prefix="pagekv-step")


def _step(fn, what: str, estimate, lesson, runs: bool = True):
    """`fn()` (a wait for the model worker) on a waiting thread while the request shows
    the step in the status line every `STEP_EVERY_S` (`_progress`: the seconds so far
    and, where `estimate()` knows one, the seconds expected and a bar); returns fn's
    value, or raises its error. A generator: `value = yield from _step(...)`. `runs`:
    the step is known to compute (not served from memory), so it is said at once;
    otherwise only once it has taken `STEP_QUIET_S`."""

    def waiting():
        keep_this_thread_light()
        return fn()

    future = _STEP_WAITERS.submit(waiting)
    t0 = time.perf_counter()
    expected, timeout = None, (0.0 if runs else STEP_QUIET_S)
    while True:
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            if expected is None:
                expected = estimate() or 0.0
            yield _working(_progress(what, time.perf_counter() - t0, expected), lesson)
            timeout = STEP_EVERY_S


def _progress(what: str, elapsed: float, expected: float) -> str:
    """`"What: 12 s of about 30 s <progress>"`, or `"What: 12 s (no estimate yet...)"`."""
    if not expected:
        return f"{what}: {elapsed:.0f} s so far (no estimate yet: the first on this model)"
    shown = min(elapsed, expected)
    return (f"{what}: {elapsed:.0f} s of about {expected:.0f} s "
            f'<progress value="{shown:.1f}" max="{expected:.1f}"></progress>')  # fmt: skip


def _estimate(study, step: str, spec, modes) -> float | None:
    """The seconds `step` should take on `spec`'s prompt in `modes` (those not in memory
    yet), from `Study.estimate` on the prompt's tokens (the spec's context length for a
    needle prompt, else none known before tokenizing)."""
    todo = [m for m in modes if spec.replace(mode=m) not in study.prefills]
    tokens = spec.context if spec.task == "needle" else None
    each = study.estimate(step, tokens) if tokens else None
    return each * len(todo) if each and todo else None


def _unreconstructed(preps: dict, *sides) -> list:
    """The prepared prompts (of `preps`, by question position) that a `Side` of `sides`
    scores by the reconstruction pass and that have not had it."""
    todo = {side.mode for side in sides if side.config.scorer == "reconstruct"}
    return [preps[m] for m in sorted(todo) if preps[m].prefill.reconstruction is None]


def _working(what: str, lesson):
    """A run's longer step has begun: only the status line changes, with the model
    worker's queue (each step is one job on it: a run on another model waits for one job
    at most), and the lesson's verdict, which is of the run before, says it is being
    checked."""
    ahead = WORKER.pending()
    queue = f"; {ahead} job{'s' if ahead != 1 else ''} on the model worker now" if ahead else ""
    return _updates(status=message("info", f"{what}...{queue}"), observation=_checking(lesson))


def _checking(lesson):
    """While a run goes on: a live lesson's observation says it is being checked on
    this run (its verdict on screen was of the run before); no change otherwise."""
    x = lesson_of(lesson) if lesson else None
    if x is None or x.kind != "live":
        return gr.update()
    return "**Observation:** " + x.observation.statement + " - *checking on this run...*"


#: Controls named otherwise than the run input they feed.
CONTROL_INPUT = {"budget": "budget_pct"}


def control_values(run: RunInputs, names) -> list:
    """The controls `names` set to a run's inputs `run` (the curated-task picker as an
    update with its choices, the layer as an update: its range follows the model)."""
    out = []
    for name in names:
        value = getattr(run, CONTROL_INPUT.get(name, name))
        if name == "curated":
            value = curated_choices(run.task, value)[0]
        elif name == "layer":
            value = gr.update(value=value)
        out.append(value)
    return out


@light
def preview_plans(*args):
    """While a slider is dragged: plan both sides on the cached prefill and redraw the
    plan views (page frame, retention, UOR, stored, memory); no decoding, and no
    prefill (a prompt not prefilled yet waits for the run). Answers come when the
    slider is released (the run). Quietly does nothing on bad input."""
    v = RunInputs(*args)
    try:
        spec, a, b, layer = parse_run(v)
        study = get_study(v.model if isinstance(v.model, str) else "")
        comp = preview_comparison(study, spec, a, b, cached_only=True)
        key = view_key(spec, a, b, layer)  # as the run's
        layer = min(layer, int(comp.plan_of("B").keep.shape[0]) - 1)
        figs = preview_views(comp, key, layer, study.plans)
    except Exception as e:
        log.debug("preview skipped: %s", e)
        return tuple(gr.update() for _ in PREVIEW_VIEWS)
    return tuple(sent(figs.get(k)) for k in PREVIEW_VIEWS)


@light
def update_layer(comp, layer):
    """The per-layer head weights of the last comparison (no model work): the run's own
    view for that layer (`comparison_figures` clamps the layer)."""
    if comp is None:
        return None
    return sent(comparison_figures(comp, layer=int(layer), only={"weights"})["weights"])


#: The mechanism's sliders: (label, lowest, highest, step, whole numbers), by input.
MECH_LIMITS = {
    "heads": ("Heads per group", 2, 8, 1, True),
    "retrieval": ("Retrieval s*", 0.0, 1.0, 0.05, False),
    "distractors": ("Distractor heads", 0, 6, 1, True),
    "distractor_strength": ("Distractor", 0.0, 0.5, 0.01, False),
    "n": ("Tokens", 32, 1024, 32, True),
    "budget_pct": ("Budget %", 5, 60, 1, False),
}


def _in_range(name: str, value, notes: list):
    """A mechanism input within its slider's range: a value outside it (or no number)
    becomes the nearest end, as the browser's box shows it, and `notes` says so."""
    label, lo, hi, _step, whole = MECH_LIMITS[name]
    x, where = nearest_in_range(value, lo, hi)  # no number: `lo`
    if where is not None:
        said = "no number" if where == "no number" else _outside(value, where, lo, hi)
        notes.append(f"{label}: {said}, using {x:g}.")
    return int(round(x)) if whole else x


def _mechanism(heads, retrieval, distractors, distractor_strength, sink_head, n, budget_pct):
    """`(view, values, notes)`: the constructed view of the mechanism inputs, each taken
    within its slider's range (`notes` says which were not)."""
    from pagekv.maths.mechanism import mechanism_view

    raw = dict(heads=heads, retrieval=retrieval, distractors=distractors,
               distractor_strength=distractor_strength, n=n, budget_pct=budget_pct)  # fmt: skip
    clamped: list[str] = []
    v = {name: _in_range(name, value, clamped) for name, value in raw.items()}
    same = {k: x for k, x in v.items() if k != "budget_pct"}
    view = mechanism_view(**same, sink_head=sink_head is True, budget=v["budget_pct"] / 100)
    return view, v, clamped


@light
def run_mechanism(heads, retrieval, distractors, distractor_strength, sink_head, n, budget_pct):
    """The constructed instance of the retention bound (no model involved). Every input
    gives a view: one outside its slider's range is taken at the nearest end, and the
    text says so (no error badge, no silent change)."""
    from pagekv.app import figures

    try:
        view, v, clamped = _mechanism(
            heads, retrieval, distractors, distractor_strength, sink_head, n, budget_pct
        )
    except (ValueError, TypeError) as e:
        return message("error", " ".join(str(e).split())), None, None
    s, w = view.s_star, view.w_star
    text = message(
        "info",
        f"Constructed profiles, not a model. The retrieval head puts s* = {s:.3f} on the "
        f"needle; its entropy weight is w* = {w:.3f} (mean pooling: 1/r = "
        f"{1 / v['heads']:.3f}). The needle page is kept whenever w* s* = {w * s:.3f} "
        "beats the page that would otherwise be kept last."
        + "".join(f" {note}" for note in [*clamped, *(getattr(view, "notes", None) or [])]),
    )
    return text, view.rows, figures.mechanism_figure(view.mech, view.plans)


@light
def mechanism_observation(title, *mech):
    """A constructed lesson's verdict, checked again on the mechanism's inputs as they
    are now (`MECH_CONTROLS` order): the table beside it and the verdict always speak of
    the same group. No change for any other lesson, or for inputs that give no view."""
    lesson = lesson_of(title)
    if lesson is None or lesson.kind != "constructed":
        return gr.update()
    try:
        view, v, _ = _mechanism(*mech)
    except (ValueError, TypeError):
        return gr.update()
    checked = lesson.observation.check(view)
    own = lesson.mechanism
    is_own = (
        (v["heads"], v["retrieval"], v["distractors"], v["distractor_strength"], v["n"])
        == (own.heads, own.retrieval, own.distractors, own.distractor_strength, own.n)
        and abs(v["budget_pct"] - 100 * own.budget) < 1e-9
        and (mech[4] is True) == own.sink_head
    )
    where = (
        "the constructed group"
        if is_own
        else f"the constructed group as the controls set it now (heads {v['heads']}, tokens "
        f"{v['n']}, budget {v['budget_pct']:g} %, not the lesson's own)"
    )
    return verdict_text(lesson, checked, where)


MECH_CONTROLS = ("m_heads", "m_retr", "m_dist", "m_dstr", "m_sink", "m_n", "m_budget")
MECH_VIEWS = ("m_text", "m_table", "m_plot")

#: The controls a preset sets, in the order of `apply_preset`'s outputs.
PRESET_CONTROLS = (
    "task", "curated", "context", "depth", "seed", "needles", "mode", "budget", "page_size",
    "n_sink", "window", "tau", "policy_a", "policy_b", "scorer_a", "allocation_a", "scorer_b",
    "allocation_b", "model",
)  # fmt: skip


def _preset_of(title):
    return next((p for p in PRESETS if p["title"] == title), None)


def apply_preset(title):
    """Fill the controls from a preset (the API's /preset: no run)."""
    p = _preset_of(title)
    if p is None:
        return [gr.update()] * len(PRESET_CONTROLS)
    return control_values(_preset_run_args(p, MODELS.default), PRESET_CONTROLS)


def _preset_run_args(p, model="bundled", lesson_title=None) -> RunInputs:
    """The run inputs of a preset (side B follows A; only the method differs), on the
    preset's model where it names one, else on `model`."""
    return RunInputs.for_sides(
        *preset_sides(p), model=p.get("model") or model, layer=p["layer"], lesson=lesson_title
    )


@light
def run_preset(title, model, lesson_title, request: gr.Request = None):
    """Pick a preset: set the controls, open the view where what it shows can be seen
    (its `view`, on its `layer`) and run, in ONE request (a generator). Outputs:
    PRESET_CONTROLS, "Same settings as A", the tabs, RUN_VIEWS."""
    p = _preset_of(title)
    if p is None:
        yield (*([gr.update()] * (len(PRESET_CONTROLS) + 2)), *_views())
        return
    SESSIONS.ticket(getattr(request, "session_hash", None))  # as `_run_event`
    run = _preset_run_args(p, model, lesson_title)
    controls = control_values(run, PRESET_CONTROLS)
    tabs = gr.Tabs(selected=p["view"])
    i_obs = RUN_VIEWS.index("observation")
    for views in stream_run(run, request):
        views = list(_with_preset_verdict(p, views))
        # The lesson box speaks of the preset, whose verdict is the status line's: "not
        # checked" beside a status that says "holds" read as two verdicts.
        if isinstance(views[i_obs], str):
            views[i_obs] = PRESET_OBSERVATION.format(title=p["title"])
        yield (*controls, True, tabs, *views)


#: The lesson box after a preset ran: no lesson's observation belongs to that run.
PRESET_OBSERVATION = (
    "**Observation:** none for this run: the preset *{title}* ran, and whether its check "
    "holds is on the status line. Pick a lesson to check its observation."
)


def _with_preset_verdict(preset: dict, views) -> tuple:
    """A finished run of a preset: the status line ends with what the preset shows and
    whether its check holds on this run, with the figures it measured."""
    comp = views[RUN_VIEWS.index("last")]
    if comp is None or isinstance(comp, dict) or not preset_matches(preset, comp):
        return views
    try:
        found = check_preset(preset, comp)
    except Exception as e:  # never a traceback on the page
        log.warning("preset check failed: %s", e, exc_info=True)
        return views
    mark = "**holds**" if found.holds else "**does not hold**"
    views = list(views)
    views[RUN_VIEWS.index("status")] += (
        f"\n\n**Preset:** {preset['shows']} Its check {mark}, checked now on this run.\n\n"
        f"Measured: {_shown(found.measured)}"
    )
    return tuple(views)


def linked_b(link, *a_values):
    """Side B's own settings (question position, budget, page size, n_sink, window,
    tau) while "Same settings as A" is ticked: A's values, not editable; unticked,
    editable (starting from A's values, which they show)."""
    if link is True:
        return tuple(gr.update(value=v, interactive=False) for v in a_values)
    return tuple(gr.update(interactive=True) for _ in a_values)


#: The prompt's sliders and their labels: a value typed outside the range is said.
PROMPT_SLIDERS = {"context": "Context length", "depth": "Needle depth", "needles": "Needles"}


def prompt_range_note(name: str):
    """The handler of a prompt slider's release (no model work): the stale-results note,
    and where the value typed is outside the slider's range, which the browser's box
    then replaces by the nearest end, a sentence that says so."""
    label = PROMPT_SLIDERS[name]
    lo, hi, _step = LIMITS[name]

    def note(value):
        x, where = nearest_in_range(value, lo, hi)
        if where is None:
            return STALE_NOTE
        if where == "no number":
            said = f"the box held no number (its range is {lo:g} to {hi:g}); it now holds {lo:g}"
        else:
            said = f"{_outside(value, where, lo, hi)}; the box now holds {x:g}"
        return (
            f"**Note:** {label}: {said}. The results below are for the previous prompt until "
            "you press Run."
        )

    note.__name__ = f"{name}_range_note"
    return note


def curated_choices(task, name=None):
    """Controls that follow the task: the curated-task picker (qa/code), the needle
    controls (needle), the custom text (custom). Returns updates in the order
    (curated, depth, needles, seed, custom_box)."""
    from pagekv.tasks import task_names

    if task in ("qa", "code"):
        names = task_names(task)
        curated = gr.update(choices=names, value=name if name in names else names[0], visible=True)
    else:
        curated = gr.update(visible=False)
    return (
        curated,
        gr.update(visible=task in ("needle", "custom")),  # depth: where a (custom) needle goes
        gr.update(visible=task == "needle"),  # needles
        gr.update(visible=task == "needle"),  # seed
        gr.update(visible=task == "custom"),  # the custom text
    )
