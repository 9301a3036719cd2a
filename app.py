"""Page-EntroKV: mean pooling and Page-EntroKV side by side on live decoding.

    python app.py [--host 127.0.0.1] [--port 7860] [--model bundled] [--no-warm]

Once it serves, the app computes its live lessons (a class then gets them from
memory; `--no-warm` skips this), and its main thread runs the model's work
(`pagekv.serving.worker`).

The app stays thin: `build_demo()` lays out the page, and each handler calls
`pagekv` (prefill, plan, compaction and decoding in `pagekv.serving.study` and
`pagekv.views.comparison`; figures in `pagekv.views.figures`). Bad input never raises out of a
handler: it becomes a message on the page, and the next request works.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import os
import queue
import shutil
import tempfile
import threading
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import numpy as np  # noqa: E402

from pagekv import POLICIES, EvictionConfig
from pagekv.paths import CSS_PATH  # noqa: E402
from pagekv.serving import allocator  # noqa: E402
from pagekv.serving.memo import ByteLRU, nbytes  # noqa: E402
from pagekv.serving.study import settings_text  # noqa: E402
from pagekv.serving.worker import MODEL_THREAD, keep_this_thread_light  # noqa: E402
from pagekv.views.lessons import LESSONS  # noqa: E402
from pagekv.views.presets import load_presets  # noqa: E402

log = logging.getLogger("pagekv.app")
PAGE_SIZES = [1, 4, 8, 16, 32, 64]
POLICY_CHOICES = list(POLICIES)
MAX_CONTEXT = 8000

try:  # ZeroGPU on Hugging Face Spaces: run the GPU work inside spaces.GPU.
    import spaces

    gpu = spaces.GPU
except Exception:  # not on a Space: a no-op decorator

    def gpu(fn=None, **_kw):
        return fn if fn is not None else (lambda f: f)


PRESETS = load_presets()


# ----------------------------------------------------------------- model state

from pagekv.serving.model_registry import ModelRegistry  # noqa: E402

#: Loaded models by name, shared by every session (pagekv/registry.py): the default
#: model stays loaded, at most two others besides it (least recently used evicted), and
#: a name that cannot load evicts nothing (its runs use the default, with a note).
_registry = ModelRegistry(default="bundled", max_others=2)
_studies = _registry.studies  # name -> Study (tests read and reset it under _lock)
_lock: threading.Lock = _registry.lock


def get_study(model_name: str):
    """The Study for `model_name` (loaded once, shared; falls back to the default model
    with `study.loaded.fell_back` and a note when the name cannot load)."""
    return _registry.get(model_name)


def known_models() -> list[str]:
    from pagekv.runtime.models import KNOWN_MODELS

    return list(KNOWN_MODELS)


# ----------------------------------------------------------------- handlers


def light(fn):
    """A handler that uses torch on Gradio's worker threads: each call (each step of a
    generator, which Gradio may run on different threads) first makes its thread
    single-threaded for torch while the main thread serves the model
    (`pagekv.serving.worker.keep_this_thread_light`)."""
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def steps(*args, **kwargs):
            it = fn(*args, **kwargs)
            try:
                while True:
                    keep_this_thread_light()
                    try:
                        value = next(it)
                    except StopIteration:
                        return
                    yield value
            finally:
                it.close()

        return steps

    @functools.wraps(fn)
    def call(*args, **kwargs):
        keep_this_thread_light()
        return fn(*args, **kwargs)

    return call


def _message(kind: str, text: str) -> str:
    # Words, not emoji: emoji depend on the viewer's fonts.
    label = {"error": "**Error:**", "info": "**Note:**", "ok": "**Done:**"}[kind]
    return f"{label} {text}"


def _side_b_note(comp, cfg_a, cfg_b) -> str:
    """What side B does differently, for the status line ("" when only the policy)."""
    label = comp.labels["B"].split(", ", 1)
    if len(label) == 1:
        return ""
    n_b = comp.preps["B"].n
    return f" (B: {label[1]}; {n_b} prompt tokens, budget {cfg_b.budget_tokens(n_b)} tokens)"


def _ms(seconds) -> str:
    """Milliseconds, or "-" for a step that did not run (the full cache evicts nothing)."""
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


#: The answers table's columns (the caption explains stored, needle and needle pages).
ANSWER_HEADERS = ["run", "verdict", "answer", "stored", "needle", "needle pages", "UOR", "evict"]


def _answers_table(comp) -> list[list]:
    from pagekv.views.figures import needle_page_counts

    rows = []
    labels = {"full": "full cache: full", "A": comp.labels["A"], "B": comp.labels["B"]}
    for key in ("full", "A", "B"):
        rec = comp.records[key]
        needle = comp.needle_positions_of(key)
        if needle:
            kept, total = needle_page_counts(comp.plan_of(key), needle)
            pages = f"{kept} of {total}"
        else:
            pages = "-"
        stored = max(rec["kept_tokens"], default=0)  # tokens stored per (layer, group)
        from pagekv.views.comparison import retained_fraction

        ret = retained_fraction(rec)
        rows.append(
            [
                labels[key],
                "✓ right" if rec["correct"] else "✗ wrong",
                rec["answer"],
                stored,
                "-" if ret != ret else f"{ret:.2f}",
                pages,
                f"{rec['uor']['max']:.2f}",
                _ms(rec["timings"]["evict_s"]),
            ]
        )
    return rows


# ----------------------------------------------------------------- inputs

TASKS = ("needle", "qa", "code", "custom")
MODES = ("inside", "after")


class InputError(ValueError):
    """A control's value has the wrong type or is out of range (API callers)."""


def _num(name: str, value, lo: float, hi: float, integer: bool = False):
    """`value` as a number in [lo, hi], or an InputError that names the control."""
    if isinstance(value, bool) or value is None:
        raise InputError(f"{name} must be a number from {lo:g} to {hi:g}; got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number from {lo:g} to {hi:g}; got {value!r}") from None
    if x != x or not lo <= x <= hi or (integer and x != int(x)):
        kind = "a whole number" if integer else "a number"
        raise InputError(f"{name} must be {kind} from {lo:g} to {hi:g}; got {value!r}")
    return int(x) if integer else x


def _choice(name: str, value, choices):
    if value not in choices:
        raise InputError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def _text(name: str, value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputError(f"{name} must be text; got {value!r}")
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false; got {value!r}")
    return value


def _page_size(name: str, value) -> int:
    return _choice(name, _num(name, value, 1, max(PAGE_SIZES), integer=True), PAGE_SIZES)


def parse_run(v: dict):
    """The run's raw inputs (the API's and the page's alike) -> `(spec, cfg_a, cfg_b,
    mode_a, mode_b, layer)`; InputError names the control that is wrong."""
    from pagekv.serving.study import PromptSpec
    from pagekv.tasks import needle_depth

    task = _choice("task", v["task"], TASKS)
    mode = _choice("question position", v["mode"], MODES)
    kw = dict(
        task=task,
        context_tokens=_num("context length", v["context"], 64, MAX_CONTEXT, integer=True),
        depth=_num("needle depth", v["depth"], 0, 1),
        seed=_num("seed", v["seed"], 0, 2**31 - 1, integer=True),
        n_needles=_num("needles", v["needles"], 1, 4, integer=True),
        mode=mode,
    )
    if task in ("qa", "code"):
        from pagekv.tasks import task_names

        name = v["curated"] or None
        if name is not None:
            _choice(f"curated {task} task", name, task_names(task))
        kw["name"] = name
    if task == "custom":
        texts = {k: _text(k, v[k]) for k in ("haystack", "needle", "question", "answer")}
        kw.update(texts)
        kw["depth"] = needle_depth(texts["haystack"], texts["needle"], kw["depth"])
    spec = PromptSpec(**kw)
    cfg_a = _side_config(v, "", v["policy_a"])
    if _flag("same settings as A", v["link_b"]):
        cfg_b, mode_b = cfg_a.replace(policy=_choice("policy B", v["policy_b"], POLICIES)), mode
    else:
        cfg_b = _side_config(v, "_b", v["policy_b"])
        mode_b = _choice("question position B", v["mode_b"], MODES)
    layer = _num("layer", v["layer"], 0, 1024, integer=True)
    return spec, cfg_a, cfg_b, mode, mode_b, layer


def _side_config(v: dict, suffix: str, policy) -> EvictionConfig:
    side = "B" if suffix else "A"
    return EvictionConfig(
        policy=_choice(f"policy {side}", policy, POLICIES),
        budget=_num(f"budget {side} (%)", v["budget_b" if suffix else "budget_pct"], 0.5, 100)
        / 100.0,
        page_size=_page_size(f"page size {side}", v["page_size" + suffix]),
        n_sink=_num(f"n_sink {side}", v["n_sink" + suffix], 0, 64, integer=True),
        window=_num(f"window {side}", v["window" + suffix], 1, 128, integer=True),
        tau=_num(f"tau {side}", v["tau" + suffix], 0.05, 100),
    )


EMPTY = None
#: What a run fills, in the order of the run's outputs (`build_demo` wires the
#: components of the same names); `_views` turns keyword values into that tuple.
RUN_VIEWS = (
    "status", "answers", "frame", "retention", "weights", "overview", "sink_mass", "sink_adv",
    "uor", "stored", "memory", "files", "layer", "observation", "last",
)  # fmt: skip
#: Views that planning alone draws (a dragged slider updates these, without decoding).
PLAN_VIEWS = ("frame", "retention", "uor", "stored", "memory")
#: Plan views that decoding leaves as they are (retention is redrawn: the decoded records
#: measure what the compacted cache stores, padding included).
SAME_AFTER_DECODING = ("frame", "uor", "stored", "memory")


def _views(**values):
    """The run's outputs in `RUN_VIEWS` order; views not given are cleared (the layer
    slider and the lesson's observation are left as they are)."""
    unknown = set(values) - set(RUN_VIEWS)
    if unknown:
        raise KeyError(f"not a run view: {sorted(unknown)}")
    default = {"layer": gr.update(), "observation": gr.update()}
    return tuple(values.get(name, default.get(name, EMPTY)) for name in RUN_VIEWS)


def _status(study, comp, cfg_a, cfg_b, decoded: bool, served: bool = False) -> str:
    loaded = study.loaded
    n = comp.prep.n
    head = (
        f"**{loaded.name}**, {loaded.origin} ({study.runner.backend} backend on "
        f"{study.runner.device}): "
        f"{n} prompt tokens, budget {cfg_a.budget_tokens(n)} tokens per (layer, group), "
        f"page size {cfg_a.page_size}" + _side_b_note(comp, cfg_a, cfg_b) + ". "
        f"Question: *{comp.prep.task.question}* Expected: **{comp.prep.task.answer}**"
    )
    parts = [_message("ok" if decoded else "info", head if decoded else "Decoding... " + head)]
    if loaded.fell_back:
        parts.append(_message("info", loaded.note))
    if loaded.caveat:
        parts.append(_message("info", loaded.caveat))
    parts += [_message("info", note) for note in comp.notes]
    if decoded:
        t = comp.records["B"]["timings"]
        parts.append(
            f"<small>prefill {t['prefill_s']:.2f}s (once per prompt), "
            f"eviction {_ms(t['evict_s'])}, decode {t['decode_s']:.2f}s"
            + (" (this run was computed earlier: served from memory)" if served else "")
            + "</small>"
        )
    return "\n\n".join(parts)


def _pending_table(comp) -> list[list]:
    """The answers table while decoding: the plan's numbers, answers to come."""
    from pagekv.views.figures import needle_page_counts

    rows = []
    labels = {"full": "full cache: full", "A": comp.labels["A"], "B": comp.labels["B"]}
    for key in ("full", "A", "B"):
        p = comp.plan_of(key)
        needle = comp.needle_positions_of(key)
        pages = "-"
        if needle:
            kept, total = needle_page_counts(p, needle)
            pages = f"{kept} of {total}"
        rec = comp.records[key]
        if "answer" in rec:  # already decoded (the full cache comes first)
            verdict, answer = ("✓ right" if rec["correct"] else "✗ wrong"), rec["answer"]
        else:
            verdict, answer = "...", "decoding..."
        rows.append(
            [labels[key], verdict, answer, int(p.union_tokens.max()), "-", pages,
             f"{float(p.uor.max()):.2f}", "-"]
        )  # fmt: skip
    return rows


def _run_values(args) -> dict:
    return dict(zip(RUN_INPUTS, args, strict=True))


#: Finished runs' views, shared by every session (a class running one lesson draws its
#: figures once): the detached comparison, its figures and answers table, keyed by the
#: model and every setting of the run. Bounded by bytes (`_view_size`).
VIEW_MEMO_BYTES = 96 * 2**20
_view_memo = ByteLRU(VIEW_MEMO_BYTES, size_of=lambda v: v["nbytes"])
#: How long a run waits for the same run started by another session before doing it.
SAME_RUN_WAIT_S = 600
#: Runs served at once (sessions' runs waiting for the model or served from memory).
RUN_CONCURRENCY = 8


#: Plan views drawn by a preview (a dragged slider), reused by the run its release
#: sends with the same settings (the run then draws only what decoding adds).
_plan_views_memo = ByteLRU(32 * 2**20, size_of=lambda v: v["nbytes"])


def _plan_views(comp, key, layer) -> dict:
    """The plan views of `comp` (`PLAN_VIEWS`), drawn or from `_plan_views_memo`."""
    from pagekv.views.comparison import comparison_figures

    hit = _plan_views_memo.get(key)
    if hit is not None:
        return hit["figs"]
    figs = comparison_figures(comp, layer=layer, only=PLAN_VIEWS)
    _plan_views_memo.put(key, {"figs": figs, "nbytes": _view_size(None, figs)})
    return figs


def _view_key(study, spec, cfg_a, cfg_b, mode_a, mode_b, layer) -> tuple:
    loaded = study.loaded
    return (loaded.name, loaded.origin, spec, cfg_a, cfg_b, mode_a, mode_b, layer)


def _view_size(comp, figs: dict) -> int:
    """Bytes a finished run's views hold (about): the comparison's tensors and records,
    and the figures' data arrays at 64 bytes a value (plotly objects of numbers and
    hover strings; measuring their JSON instead would cost as much as drawing them)."""
    held = 0 if comp is None else nbytes(comp)
    return held + 64 * sum(_figure_values(f) for f in figs.values() if f is not None)


def _figure_values(fig) -> int:
    """How many values a figure's traces hold (z, x, y, text, customdata)."""
    n = 0
    for trace in fig.data:
        for name in ("z", "x", "y", "text", "customdata"):
            v = trace[name] if name in trace else None
            if v is not None and not isinstance(v, str):
                n += int(np.size(v)) if isinstance(v, np.ndarray) else _count(v)
    return n


def _count(v) -> int:
    return sum(_count(x) for x in v) if isinstance(v, (list, tuple)) else 1


@contextlib.contextmanager
def _one_run_per_session(request):
    """A session's runs go one at a time: a second one waits for the first (its lesson,
    preset or slider events each keep only their last request, `always_last`)."""
    sid = getattr(request, "session_hash", None)
    if sid is None:  # called from Python, not through the queue
        yield
        return
    with _session_locks_lock:
        lock = _session_locks.setdefault(sid, threading.Lock())
    with lock:
        yield


_session_locks: dict = {}
_session_locks_lock = threading.Lock()


@light
@gpu
def run_comparison(
    model="bundled",
    task="needle",
    context=2000,
    depth=0.5,
    seed=0,
    needles=1,
    mode="inside",
    curated=None,
    haystack="",
    needle="",
    question="",
    answer="",
    budget_pct=20.0,
    page_size=16,
    n_sink=4,
    window=32,
    tau=1.0,
    policy_a="mean",
    policy_b="entropy",
    link_b=True,
    mode_b="inside",
    budget_b=20.0,
    page_size_b=16,
    n_sink_b=4,
    window_b=32,
    tau_b=1.0,
    layer=0,
    lesson=None,
    request: gr.Request = None,
):
    """Prefill (memoised), plan both sides and show every plan view at once, then decode
    full / A / B and show the answers, and check the lesson's observation. A generator:
    plan views, answers as they stream, then everything. A run already finished (by any
    session) is served from memory in one update. Never raises: bad input becomes a
    message and the next request works.

    Side A is the shared controls (question position, budget, page size, n_sink, window,
    tau) with policy A; side B uses policy B and, with `link_b`, the same settings as A,
    otherwise its own (`mode_b`, `budget_b`, ...): each side is a full configuration.
    """
    v = {k: val for k, val in locals().items() if k in RUN_INPUTS}
    with _one_run_per_session(request):
        yield from _run(v, lesson)


def _run(v: dict, lesson):
    from pagekv.views.comparison import comparison_figures, plan_comparison

    try:
        spec, cfg_a, cfg_b, mode_a, mode_b, layer = parse_run(v)
        study = get_study(v["model"] if isinstance(v["model"], str) else "")
        key = _view_key(study, spec, cfg_a, cfg_b, mode_a, mode_b, layer)
        t0 = time.perf_counter()
        waited = key not in _view_memo  # another request may be computing it
        done = _view_memo.get_or_wait(key, timeout=SAME_RUN_WAIT_S)
        if done is None:
            with _view_memo.computing(key):
                comp = plan_comparison(study, spec, cfg_a, cfg_b, mode_a=mode_a, mode_b=mode_b)
                n_layers = int(comp.plan_of("B").keep.shape[0])  # from the model that ran
                layer = min(layer, n_layers - 1)
                decoding = _start_decoding(study, comp)  # the model works while we draw
                plan_figs = _plan_views(comp, key, layer)
                yield _views(
                    status=_status(study, comp, cfg_a, cfg_b, decoded=False),
                    answers=_pending_table(comp),
                    **{k: plan_figs.get(k) for k in PLAN_VIEWS},
                    layer=gr.update(maximum=n_layers - 1, value=layer),
                )
                # Decoding changes no plan: the plan views drawn above stand, and the
                # views of head weights and sinks are drawn while the model decodes;
                # only the retention of the stored caches waits for the decoded records.
                figs = {k: f for k, f in plan_figs.items() if k in SAME_AFTER_DECODING}
                figs |= comparison_figures(comp, layer=layer, skip={*figs, "retention"})
                for partial in decoding:
                    if partial is not None:  # answers so far: stream them into the table
                        yield _stream_views(partial)
                figs |= comparison_figures(comp, layer=layer, only={"retention"})
                comp = comp.detached()  # what is kept holds no prefill
                done = dict(comp=comp, figs=figs, table=_answers_table(comp), layer=layer,
                            n_layers=n_layers, served=False)  # fmt: skip
                done["nbytes"] = _view_size(comp, figs)
                _view_memo.put(key, done)
            allocator.trim()  # the run's working memory back to the system
        else:
            done = dict(done, served=True)
            log.info(
                "run %s | views served from memory %s",
                settings_text(spec.replace(mode=mode_a), cfg_a, cfg_b)
                + ("" if mode_b == mode_a else f", B asked {mode_b}"),
                f"in {1000 * (time.perf_counter() - t0):.0f} ms"
                + (" (waiting for the same run, started by another request)" if waited else ""),
            )
    except Exception as e:  # bad input or an unexpected failure: say it on the page
        log.warning("run failed: %s", e, exc_info=not isinstance(e, ValueError))
        msg = " ".join(str(e).split()) or type(e).__name__
        yield _views(status=_message("error", msg), observation=check_lesson(lesson, None))
        return
    comp, figs = done["comp"], done["figs"]
    yield _views(
        status=_status(study, comp, cfg_a, cfg_b, decoded=True, served=done["served"]),
        answers=done["table"],
        frame=figs["frame"],
        retention=figs.get("retention"),
        weights=figs["weights"],
        overview=figs["weights_overview"],
        sink_mass=figs["sink_mass"],
        sink_adv=figs["sink_advantage"],
        uor=figs["uor"],
        stored=figs["stored"],
        memory=figs["memory"],
        files=None,  # the Export tab writes the files of this run on request
        layer=gr.update(maximum=done["n_layers"] - 1, value=done["layer"]),
        observation=check_lesson(lesson, comp),
        last=comp,
    )


@light
def export_run(comp):
    """The last run's numbers (JSON, CSV) and figures (HTML), written on request."""
    from pagekv.views.comparison import comparison_figures, export

    if comp is None:
        raise gr.Error("Nothing to export yet: run a comparison first.")
    done = next((v for _, v in reversed(_view_memo.items()) if v["comp"] is comp), None)
    figs = done["figs"] if done else comparison_figures(comp)
    return export(comp, figs, _export_folder())


#: Export folders older than this are removed when a new one is made.
EXPORT_MAX_AGE_S = 1800


def _export_folder() -> str:
    """A new folder for one run's export under one root; old ones are removed."""
    root = os.path.join(tempfile.gettempdir(), "pagekv-exports")
    os.makedirs(root, exist_ok=True)
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if now - os.path.getmtime(path) > EXPORT_MAX_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
    return tempfile.mkdtemp(prefix="run_", dir=root)


#: The answers stream into the table at most this often (each update is sent to the
#: browser and redrawn there; a token takes about 60 ms on 2 CPU cores).
STREAM_EVERY_S = 0.25


def _start_decoding(study, comp):
    """Start decoding `comp` (full, then A and B, batched where they share a shape) in a
    worker thread now; return a generator of the answers table as tokens arrive, then
    None when done. Errors of the decode are raised by the generator."""
    from pagekv.views.comparison import decode_comparison

    updates: queue.Queue = queue.Queue()
    outcome: dict = {}

    def on_token(tokens_a, tokens_b):
        updates.put((tokens_a, tokens_b))

    def work():
        keep_this_thread_light()
        try:
            decode_comparison(study, comp, on_token=on_token)
        except Exception as e:  # handed to the caller
            outcome["error"] = e
        finally:
            updates.put(None)

    worker = threading.Thread(target=work, name="pagekv-decode", daemon=True)
    worker.start()
    return _stream_answers(study, comp, worker, updates, outcome)


def _stream_answers(study, comp, worker, updates, outcome):
    last = time.perf_counter()
    while True:
        item = updates.get()
        while item is not None and not updates.empty():  # keep only the latest tokens
            nxt = updates.get()
            if nxt is None:
                updates.put(None)
                break
            item = nxt
        if item is None:
            break
        if time.perf_counter() - last < STREAM_EVERY_S:
            continue  # the next token (or the end) shows these
        last = time.perf_counter()
        rows = _pending_table(comp)
        for row, tokens in zip(rows[1:], item, strict=True):
            row[2] = study.tokenizer.decode(tokens, skip_special_tokens=True) + " ..."
        yield rows
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    yield None


def _stream_views(rows):
    """Only the answers table changes while decoding streams."""
    return tuple(rows if name == "answers" else gr.update() for name in RUN_VIEWS)


#: The run's inputs in order, and their defaults (the API's too): read from the
#: signature of `run_comparison`, the one place they are written.
#: (`request` is Gradio's, not an input.)
RUN_DEFAULTS = {
    k: p.default for k, p in inspect.signature(run_comparison).parameters.items() if k != "request"
}
RUN_INPUTS = tuple(RUN_DEFAULTS)
#: Controls named otherwise than the run input they feed.
CONTROL_INPUT = {"budget": "budget_pct"}


def control_values(run_args: dict, names) -> list:
    """The controls `names` set to a run's inputs `run_args` (the curated-task picker as
    an update with its choices, the layer as an update: its range follows the model)."""
    out = []
    for name in names:
        value = run_args[CONTROL_INPUT.get(name, name)]
        if name == "curated":
            value = curated_choices(run_args["task"], value)[0]
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
    from pagekv.views.comparison import plan_comparison

    v = _run_values(args)
    try:
        spec, cfg_a, cfg_b, mode_a, mode_b, layer = parse_run(v)
        study = get_study(v["model"] if isinstance(v["model"], str) else "")
        comp = plan_comparison(
            study, spec, cfg_a, cfg_b, mode_a=mode_a, mode_b=mode_b, cached_only=True
        )
        key = _view_key(study, spec, cfg_a, cfg_b, mode_a, mode_b, layer)  # as the run's
        layer = min(layer, int(comp.plan_of("B").keep.shape[0]) - 1)
        figs = _plan_views(comp, key, layer)
    except Exception as e:
        log.debug("preview skipped: %s", e)
        return tuple(gr.update() for _ in PLAN_VIEWS)
    return tuple(figs.get(k) for k in PLAN_VIEWS)


@light
def update_layer(comp, layer):
    """Redraw the per-layer head weights from the last comparison (no model work)."""
    from pagekv.views import figures

    if comp is None:
        return None
    p = comp.plan_of("B")
    layer = max(0, min(int(layer), p.keep.shape[0] - 1))
    return figures.head_weights_bars(p, layer)


@light
def run_mechanism(heads, retrieval, distractors, distractor_strength, sink_head, n, budget_pct):
    """The constructed instance of the retention bound (no model involved)."""
    from pagekv.views import figures
    from pagekv.views.comparison import mechanism_view

    try:
        view = mechanism_view(
            heads=int(heads),
            retrieval=float(retrieval),
            distractors=int(distractors),
            distractor_strength=float(distractor_strength),
            sink_head=bool(sink_head),
            n=int(n),
            budget=float(budget_pct) / 100,
        )
    except (ValueError, TypeError) as e:
        return _message("error", " ".join(str(e).split())), None, None
    s, w = view.s_star, view.w_star
    text = _message(
        "info",
        f"Constructed profiles, not a model. The retrieval head puts s* = {s:.3f} on the "
        f"needle; its entropy weight is w* = {w:.3f} (mean pooling: 1/r = "
        f"{1 / int(heads):.3f}). The needle page is kept whenever w* s* = {w * s:.3f} "
        "beats the page that would otherwise be kept last."
        + ("".join(f" {note}" for note in view.notes) if getattr(view, "notes", None) else ""),
    )
    return text, view.rows, figures.mechanism_figure(view.mech, view.plans)


MECH_CONTROLS = ("m_heads", "m_retr", "m_dist", "m_dstr", "m_sink", "m_n", "m_budget")
MECH_VIEWS = ("m_text", "m_table", "m_plot")

#: The controls a preset sets, in the order of `apply_preset`'s outputs.
PRESET_CONTROLS = (
    "task", "curated", "context", "depth", "seed", "needles", "mode", "budget", "page_size",
    "n_sink", "window", "tau", "policy_a", "policy_b",
)  # fmt: skip


def _preset_of(title):
    return next((p for p in PRESETS if p["title"] == title), None)


def apply_preset(title):
    """Fill the controls from a preset (the API's /preset: no run)."""
    p = _preset_of(title)
    if p is None:
        return [gr.update()] * len(PRESET_CONTROLS)
    return control_values(_preset_run_args(p), PRESET_CONTROLS)


def _preset_run_args(p, model="bundled", lesson_title=None) -> dict:
    """The run inputs of a preset (side B follows A; only the policy differs)."""
    return dict(
        RUN_DEFAULTS, model=model, task=p["task"], context=p["context_tokens"],
        depth=p["depth"], seed=p["seed"], needles=p["n_needles"], mode=p["mode"],
        curated=p["name"], budget_pct=round(100 * p["budget"], 1), page_size=p["page_size"],
        n_sink=p["n_sink"], window=p["window"], tau=p["tau"], policy_a=p["policy_a"],
        policy_b=p["policy_b"], link_b=True, lesson=lesson_title,
    )  # fmt: skip


@light
def run_preset(title, model, lesson_title, request: gr.Request = None):
    """Pick a preset: set the controls and run, in ONE request (a generator)."""
    p = _preset_of(title)
    if p is None:
        yield (*([gr.update()] * (len(PRESET_CONTROLS) + 1)), *_views())
        return
    run = _preset_run_args(p, model, lesson_title)
    controls = control_values(run, PRESET_CONTROLS)
    for views in run_comparison(**run, request=request):
        yield (*controls, True, *views)


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
    needle_task = task in ("needle", "custom")
    return (
        curated,
        gr.update(visible=needle_task),  # depth: where a (custom) needle is inserted
        gr.update(visible=task == "needle"),  # needles
        gr.update(visible=task == "needle"),  # seed
        gr.update(visible=task == "custom"),  # the custom text
    )


# ----------------------------------------------------------------- lessons

LESSON_TITLES = [f"{i + 1}. {x.title}" for i, x in enumerate(LESSONS)]
#: Tab ids of the views (`Lesson.views` names them).
TABS = ("frame", "retention", "weights", "sinks", "uor", "mechanism", "export")
#: The controls a lesson sets, in the order of `apply_lesson`'s outputs (then the
#: tabs, the lesson text and the observation).
LESSON_CONTROLS = (
    "task", "curated", "context", "depth", "seed", "needles", "mode", "budget", "page_size",
    "n_sink", "window", "tau", "policy_a", "policy_b", "link_b", "mode_b", "budget_b",
    "page_size_b", "n_sink_b", "window_b", "tau_b", "layer", "m_heads", "m_retr", "m_dist",
    "m_dstr", "m_sink", "m_n", "m_budget",
)  # fmt: skip


def _lesson_of(title):
    for t, lesson in zip(LESSON_TITLES, LESSONS, strict=True):
        if t == title:
            return lesson
    return None


def lesson_markdown(lesson) -> str:
    kind = {
        "live": "Live on the model: both sides decode now.",
        "constructed": "Constructed: no model; a group of heads built to show the mechanism.",
        "replay": f"Measured earlier by the replay harness, not live here: {lesson.cites}.",
    }[lesson.kind]
    return f"### {lesson.title}\n{lesson.text}\n\n*{kind}*"


def apply_lesson(title):
    """Set every control to the lesson's settings and open its first view."""
    lesson = _lesson_of(title)
    keep = [gr.update()] * len(LESSON_CONTROLS)
    if lesson is None:
        return [*keep, gr.update(), gr.update(), gr.update()]
    values = dict(zip(LESSON_CONTROLS, keep, strict=True))
    if lesson.kind == "live":
        names = [n for n in LESSON_CONTROLS if n not in MECH_CONTROLS]
        run = _lesson_run_args(lesson, title, "bundled")
        values.update(zip(names, control_values(run, names), strict=True))
    if lesson.mechanism is not None:
        m = lesson.mechanism
        values.update(
            m_heads=m.heads,
            m_retr=m.retrieval,
            m_dist=m.distractors,
            m_dstr=m.distractor_strength,
            m_sink=m.sink_head,
            m_n=m.n,
            m_budget=round(100 * m.budget),
        )
    waiting = "**Observation:** " + lesson.observation.statement + " - *checking...*"
    return [
        *(values[name] for name in LESSON_CONTROLS),
        gr.Tabs(selected=lesson.views[0]),
        lesson_markdown(lesson),
        waiting,
    ]


def _lesson_run_args(lesson, title, model) -> dict:
    """The run inputs of a live lesson (every control as the lesson sets it)."""
    p, a, b = lesson.prompt, lesson.a, lesson.b
    return dict(
        RUN_DEFAULTS, model=model, task=p.task, context=p.context_tokens, depth=p.depth,
        seed=p.seed, needles=p.n_needles, mode=a.mode, curated=p.name,
        budget_pct=round(100 * a.budget, 1), page_size=a.page_size, n_sink=a.n_sink,
        window=a.window, tau=a.tau, policy_a=a.policy, policy_b=b.policy, link_b=False,
        mode_b=b.mode, budget_b=round(100 * b.budget, 1), page_size_b=b.page_size,
        n_sink_b=b.n_sink, window_b=b.window, tau_b=b.tau, layer=lesson.layer, lesson=title,
    )  # fmt: skip


@light
def pick_lesson(title, model="bundled", request: gr.Request = None):
    """Pick a lesson, in ONE request (a generator): set every control, open its first
    view, run it (live lessons: plan views first, then the answers) and check its
    observation on the result. Outputs: LESSON_CONTROLS, the tabs, the lesson text,
    RUN_VIEWS, MECH_VIEWS."""
    lesson = _lesson_of(title)
    if lesson is None:
        title, lesson = LESSON_TITLES[0], LESSONS[0]
    *controls, tabs, text, waiting = apply_lesson(title)
    head = (*controls, tabs, text)
    i_obs = RUN_VIEWS.index("observation")
    keep_mech = tuple(gr.update() for _ in MECH_VIEWS)
    mech = keep_mech
    if lesson.mechanism is not None:
        m = lesson.mechanism
        mech = run_mechanism(
            m.heads, m.retrieval, m.distractors, m.distractor_strength, m.sink_head, m.n,
            round(100 * m.budget),
        )  # fmt: skip
    if lesson.kind == "live":
        for views in run_comparison(**_lesson_run_args(lesson, title, model), request=request):
            views = list(views)
            if views[i_obs] is None or isinstance(views[i_obs], dict):  # not checked yet
                views[i_obs] = waiting
            yield (*head, *views, *mech)
        return
    views = {name: gr.update() for name in RUN_VIEWS}
    if lesson.kind == "replay":
        views["retention"] = replay_recall_figure()
    views["observation"] = check_lesson(title, None)
    yield (*head, *(views[name] for name in RUN_VIEWS), *mech)


def lesson_step(title, step: int):
    """The lesson `step` places after `title` (wrapping), for the previous / next buttons."""
    i = LESSON_TITLES.index(title) if title in LESSON_TITLES else 0
    return LESSON_TITLES[(i + step) % len(LESSON_TITLES)]


@light
def previous_lesson(title, model="bundled", request: gr.Request = None):
    new = lesson_step(title, -1)
    for out in pick_lesson(new, model, request):
        yield (new, *out)


@light
def next_lesson(title, model="bundled", request: gr.Request = None):
    new = lesson_step(title, 1)
    for out in pick_lesson(new, model, request):
        yield (new, *out)


def _settings_match(lesson, comp) -> bool:
    """Whether the last comparison ran exactly the lesson's two sides."""
    if comp is None:
        return False
    return (
        comp.configs["A"] == lesson.a.config()
        and comp.configs["B"] == lesson.b.config()
        and comp.modes == {"A": lesson.a.mode, "B": lesson.b.mode}
    )


def check_lesson(title, comp):
    """The lesson's observation, checked on what the app just ran (live lessons), on the
    constructed group, or on the replay's committed tables."""
    from pagekv.views.lessons import Evidence, run_lesson

    lesson = _lesson_of(title)
    if lesson is None:
        return gr.update()
    try:
        if lesson.kind == "live":
            if not _settings_match(lesson, comp):
                return (
                    "**Observation:** " + lesson.observation.statement + " - *not checked: "
                    "the last run did not use this lesson's settings (pick the lesson again).*"
                )
            finding = lesson.observation.check(Evidence(comparison=comp))
        else:
            finding = run_lesson(None, lesson).finding
    except Exception as e:  # never a traceback on the page
        log.warning("lesson check failed: %s", e, exc_info=True)
        return _message("error", f"the check could not run: {' '.join(str(e).split())}")
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
    from pagekv.views.lessons import load_replay

    tables = load_replay()["tables"]
    rows = [r for r in tables["T4_recall"] if r["recall"] is not None]
    rows += [
        {**r, "policy": f"kvpress {r['press']}"}
        for r in tables.get("T4_peer", [])
        if r.get("recall") is not None and "press" in r
    ]
    return figures.recall_bars(
        rows, "Replay, table T4 (measured earlier, not live): needle recall by policy"
    )


# ----------------------------------------------------------------- layout

INTRO = """
# Page-EntroKV: which KV pages should a GQA group keep?
Under grouped-query attention, the *r* query heads of a group share one KV cache.
**Mean pooling** averages their attention and can drown the one head that found the
needle; **Page-EntroKV** weights each head by how *focused* it is (collision entropy,
after removing the attention-sink tokens) and keeps whole pages per (layer, group).
**Start with the lessons**: each sets both sides, runs the real model, and checks its
claim on what the model just did. Free exploration (presets and every control) is
below them.
"""

CAPTIONS = {
    "frame": "Each row is one (layer, group), each column one page of the prompt. "
    "**Look for** the outlined needle page: blue (kept) under one policy, grey (evicted) "
    "under the other.",
    "retention": "The fraction of the needle's answer tokens each (layer, group) kept. "
    "**Look for** layers where one policy holds the needle and the other lost it.",
    "answers": "The model's real greedy answers from the full and the evicted caches. "
    "*stored*: tokens each (layer, group) stores; *needle*: fraction of the needle's tokens "
    "kept; *needle pages*: (layer, group)s that keep every needle page. "
    "**Look for** whether the needle survives eviction in the answer, not only in the cache.",
    "weights": "Head weights within each group for the chosen layer, with and without sink "
    "isolation; the dotted line is mean pooling's 1/r. **Look for** sink heads that gain "
    "weight when isolation is off.",
    "overview": "Page-EntroKV's weights for every layer and head (groups separated by white "
    "lines). **Look for** groups dominated by a single head: there pooling matters most.",
    "sink": "Attention mass on the first n_sink tokens per head, and the sink heads' weight "
    "relative to the others. **Look for** the masquerade: a ratio far above 1 without "
    "isolation that drops with it.",
    "uor": "Head-independent selection must store the union of its heads' picks: UOR = union "
    "/ the tokens each head keeps. **Look for** how far above 1 it climbs at small budgets; "
    "pooled policies stay at exactly 1.",
    "mechanism": "Edit a constructed group of heads. **Look for** the retrieval head's weight "
    "w*: when w* s* beats the distractor page, entropy pooling keeps the needle while mean "
    "pooling (1/r) may not. This is a construction, shown beside the live model's results.",
}


def build_demo(default_model: str = "bundled") -> gr.Blocks:
    first = PRESETS[0]
    # Gradio's own copies of served files are removed after 30 minutes (checked every 10).
    with gr.Blocks(title="Page-EntroKV", delete_cache=(600, 1800)) as demo:
        gr.Markdown(INTRO)
        last = gr.State(None)
        with gr.Row(elem_id="main-row"):
            with gr.Column(scale=1, min_width=320):
                with gr.Group():
                    lesson = gr.Dropdown(LESSON_TITLES, value=LESSON_TITLES[0], label="Lesson")
                    with gr.Row():
                        prev_btn = gr.Button("Previous lesson", size="sm")
                        next_btn = gr.Button("Next lesson", size="sm")
                gr.Markdown("#### Free exploration")
                preset = gr.Dropdown([p["title"] for p in PRESETS], value=None, label="Preset")
                run_btn = gr.Button("Run", variant="primary")
                with gr.Accordion("Prompt", open=False):
                    model = gr.Dropdown(
                        known_models(),
                        value=default_model,
                        allow_custom_value=True,
                        label="Model",
                        info="bundled runs anywhere; hub models need a reachable hub",
                    )
                    task = gr.Radio(
                        ["needle", "qa", "code", "custom"], value=first["task"], label="Task"
                    )
                    curated = gr.Dropdown([], label="Curated task", visible=False)
                    context = gr.Slider(
                        200, MAX_CONTEXT, value=first["context_tokens"], step=100,
                        label="Context length (tokens)",
                    )  # fmt: skip
                    depth = gr.Slider(0, 1, value=first["depth"], step=0.05, label="Needle depth")
                    needles = gr.Slider(1, 4, value=first["n_needles"], step=1, label="Needles")
                    seed = gr.Number(value=first["seed"], precision=0, label="Seed")
                    with gr.Accordion("Custom text", open=False, visible=False) as custom_box:
                        haystack = gr.Textbox(value="", lines=5, label="Haystack text")
                        needle = gr.Textbox(value="", label="Needle sentence")
                        question = gr.Textbox(value="", label="Question")
                        answer = gr.Textbox(value="", label="Expected answer")
                with gr.Accordion("Side A", open=False):
                    policy_a = gr.Dropdown(
                        POLICY_CHOICES, value=first["policy_a"], label="Policy A"
                    )
                    mode = gr.Radio(
                        ["inside", "after"],
                        value=first["mode"],
                        label="Question position",
                        info="after = asked after compression (the strict test)",
                    )
                    budget = gr.Slider(
                        1, 60, value=100 * first["budget"], step=0.5,
                        label="Budget (% of the prompt kept per layer and group)",
                    )  # fmt: skip
                    page_size = gr.Dropdown(PAGE_SIZES, value=first["page_size"], label="Page size")
                    with gr.Row():
                        n_sink = gr.Slider(0, 16, value=first["n_sink"], step=1, label="n_sink")
                        window = gr.Slider(1, 128, value=first["window"], step=1, label="Window")
                    tau = gr.Slider(0.1, 4.0, value=first["tau"], step=0.1, label="tau")
                with gr.Accordion("Side B", open=False):
                    policy_b = gr.Dropdown(
                        POLICY_CHOICES, value=first["policy_b"], label="Policy B"
                    )
                    link_b = gr.Checkbox(
                        value=True,
                        label="Same settings as A (only the policy differs)",
                        info="untick to give B its own question position, budget and pages",
                    )
                    mode_b = gr.Radio(
                        ["inside", "after"], value=first["mode"], label="Question position B"
                    )
                    budget_b = gr.Slider(
                        1, 60, value=100 * first["budget"], step=0.5, label="Budget B (%)"
                    )
                    page_size_b = gr.Dropdown(
                        PAGE_SIZES, value=first["page_size"], label="Page size B"
                    )
                    with gr.Row():
                        n_sink_b = gr.Slider(0, 16, value=first["n_sink"], step=1, label="n_sink B")
                        window_b = gr.Slider(
                            1, 128, value=first["window"], step=1, label="Window B"
                        )
                    tau_b = gr.Slider(0.1, 4.0, value=first["tau"], step=0.1, label="tau B")
            with gr.Column(scale=3):
                with gr.Row(equal_height=False, elem_id="lesson-row"):
                    lesson_text = gr.Markdown(lesson_markdown(LESSONS[0]), elem_id="lesson-text")
                    observation = gr.Markdown(
                        "**Observation:** " + LESSONS[0].observation.statement,
                        elem_id="lesson-observation",
                    )
                status = gr.Markdown(
                    _message("info", "Loading the first lesson..."), elem_id="run-status"
                )
                stale_note = gr.Markdown(elem_id="stale-note")
                gr.Markdown(CAPTIONS["answers"])
                answers = gr.Dataframe(
                    headers=ANSWER_HEADERS,
                    interactive=False,
                    wrap=True,
                    elem_id="answers-table",
                    column_widths=["17%", "10%", "30%", "9%", "8%", "11%", "7%", "8%"],
                )  # fmt: skip
                with gr.Tabs() as tabs:
                    with gr.Tab("Pages", id="frame"):
                        gr.Markdown(CAPTIONS["frame"])
                        frame = gr.Plot(elem_id="page-frame")
                    with gr.Tab("Needle", id="retention"):
                        gr.Markdown(CAPTIONS["retention"])
                        retention = gr.Plot()
                    with gr.Tab("Weights", id="weights"):
                        gr.Markdown(CAPTIONS["overview"])
                        overview = gr.Plot()
                        gr.Markdown(CAPTIONS["weights"])
                        # Its range comes from the model of each run (RUN_VIEWS "layer").
                        layer = gr.Slider(0, 1, value=0, step=1, label="Layer")
                        weights = gr.Plot()
                    with gr.Tab("Sinks", id="sinks"):
                        gr.Markdown(CAPTIONS["sink"])
                        sink_mass = gr.Plot()
                        sink_adv = gr.Plot()
                    with gr.Tab("UOR & memory", id="uor"):
                        gr.Markdown(CAPTIONS["uor"])
                        uor = gr.Plot()
                        stored = gr.Plot()
                        memory = gr.Plot()
                    with gr.Tab("Mechanism", id="mechanism"):
                        gr.Markdown(CAPTIONS["mechanism"])
                        with gr.Row():
                            m_heads = gr.Slider(2, 8, value=3, step=1, label="Heads per group")
                            m_retr = gr.Slider(0, 1, value=0.9, step=0.05, label="Retrieval s*")
                            m_dist = gr.Slider(0, 6, value=2, step=1, label="Distractor heads")
                        with gr.Row():
                            m_dstr = gr.Slider(0, 0.5, value=0.48, step=0.01, label="Distractor")
                            m_sink = gr.Checkbox(value=False, label="Add a sink head")
                            m_n = gr.Slider(32, 1024, value=64, step=32, label="Tokens")
                            m_budget = gr.Slider(5, 60, value=19, step=1, label="Budget %")
                        m_text = gr.Markdown()
                        m_table = gr.Dataframe(
                            headers=["policy", "needle page", "weights"], interactive=False
                        )
                        m_plot = gr.Plot()
                    with gr.Tab("Export", id="export"):
                        gr.Markdown(
                            "The last run's numbers (JSON, CSV) and every figure (HTML), "
                            "written when you ask."
                        )
                        export_btn = gr.Button("Write the files of the last run")
                        files = gr.File(label="Downloads", file_count="multiple")

        components = locals()
        components["budget_pct"] = budget  # the API names side A's budget budget_pct
        run_inputs = [components[name] for name in RUN_INPUTS]
        run_outputs = [components[name] for name in RUN_VIEWS]
        preset_targets = [components[name] for name in PRESET_CONTROLS]
        lesson_targets = [components[name] for name in LESSON_CONTROLS]
        mech_inputs = [components[name] for name in MECH_CONTROLS]
        mech_outputs = [components[name] for name in MECH_VIEWS]
        quiet = dict(api_visibility="undocumented")  # the same handler under another trigger
        # One request per action: a run is one generator event (plan views, then the
        # answers and the lesson's verdict); while a run is busy, a trigger keeps only its
        # last request (always_last), and a session's runs go one at a time. Runs of
        # different sessions share RUN_CONCURRENCY workers: a run finished before is
        # served from memory at once, while the model itself computes one run at a time
        # (Study's lock).
        model_kw = dict(concurrency_id="model", concurrency_limit=RUN_CONCURRENCY)
        run_kw = dict(
            fn=run_comparison,
            inputs=run_inputs,
            outputs=run_outputs,
            preprocess=False,  # raw values: parse_run names a wrong one in plain words
            trigger_mode="always_last",
            **model_kw,
        )
        run_btn.click(api_name="run", **run_kw)
        budget.release(api_name="budget", **run_kw)
        for control in (page_size, policy_a, policy_b, page_size_b):  # dropdowns: one select
            control.select(**run_kw, **quiet)
        for control in (mode_b, link_b):
            control.input(**run_kw, **quiet)
        for control in (tau, window, n_sink, budget_b, tau_b, window_b, n_sink_b):
            control.release(**run_kw, **quiet)
        # Live while dragging: planning alone, on the cached prefill (no decoding).
        preview_kw = dict(
            fn=preview_plans,
            inputs=run_inputs,
            outputs=[components[name] for name in PLAN_VIEWS],
            preprocess=False,
            concurrency_id="preview",
            concurrency_limit=2,
            trigger_mode="always_last",
            show_progress="hidden",
            **quiet,
        )
        for control in (budget, tau, window, n_sink, budget_b, tau_b, window_b, n_sink_b):
            control.input(**preview_kw)
        preset.select(
            run_preset,
            [preset, model, lesson],
            [*preset_targets, link_b, *run_outputs],
            trigger_mode="always_last",
            **model_kw,
            **quiet,
        )
        # The API's /preset fills the controls only (no run), for scripts; the page's
        # preset picker above sets and runs in one request. A hidden trigger carries it.
        preset_api = gr.Button(visible=False)
        preset_api.click(apply_preset, preset, preset_targets, api_name="preset")
        task.input(
            curated_choices,
            task,
            [curated, depth, needles, seed, custom_box],
            show_progress="hidden",
            **quiet,
        )
        # Prompt controls changed without a run: say the results are stale (in the
        # browser only: no request to the server).
        stale_js = (
            "() => '**Note:** the prompt controls changed; the results below are for the "
            "previous prompt until you press Run.'"
        )
        for control in (task, context, depth, seed, needles, mode, curated, haystack, needle,
                        question, answer, model):  # fmt: skip
            control.input(None, None, stale_note, js=stale_js, **quiet)
        for control in (run_btn,):
            control.click(None, None, stale_note, js="() => ''", **quiet)
        layer.release(update_layer, [last, layer], weights, api_name="layer")
        mech_io = dict(fn=run_mechanism, inputs=mech_inputs, outputs=mech_outputs)
        m_retr.release(api_name="mechanism", **mech_io)
        for control in (m_heads, m_dist, m_dstr, m_n, m_budget):
            control.release(**mech_io, **quiet)
        m_sink.input(**mech_io, **quiet)

        lesson_outputs = [*lesson_targets, tabs, lesson_text, *run_outputs, *mech_outputs]
        lesson_kw = dict(trigger_mode="always_last", **model_kw)
        export_btn.click(export_run, last, files, api_name="export")
        lesson.select(pick_lesson, [lesson, model], lesson_outputs, api_name="lesson", **lesson_kw)
        prev_btn.click(
            previous_lesson, [lesson, model], [lesson, *lesson_outputs], **quiet, **lesson_kw
        )
        next_btn.click(
            next_lesson, [lesson, model], [lesson, *lesson_outputs], **quiet, **lesson_kw
        )
        demo.load(pick_lesson, [lesson, model], lesson_outputs, **quiet, **lesson_kw)
    return demo


def warm_lessons(model: str = "bundled") -> int:
    """Run every live lesson once, as a visitor's pick would (its views then wait in
    memory for the class); returns how many ran. The app does this once it serves,
    with requests arriving meanwhile taking their turns on the model."""
    t0 = time.perf_counter()
    n = 0
    for title, lesson in zip(LESSON_TITLES, LESSONS, strict=True):
        if lesson.kind == "live":
            *_, last = run_comparison(**_lesson_run_args(lesson, title, model))
            status = last[RUN_VIEWS.index("status")]
            if str(status).startswith("**Error:**"):  # e.g. no model: the runs say why
                log.warning("lessons not warmed: %s", status)
                return n
            n += 1
    log.info("lessons ready: %d live lessons computed in %.1f s", n, time.perf_counter() - t0)
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description="Page-EntroKV app")
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    ap.add_argument("--model", default="bundled", help="model loaded first (default: bundled)")
    ap.add_argument(
        "--no-warm",
        action="store_true",
        help="do not compute the live lessons once the app serves (by default they are, "
        "so that a class gets them from memory)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    demo = build_demo(default_model=args.model)
    demo.queue(default_concurrency_limit=1, max_size=128)  # a class: ~30 pages x a few events
    css = CSS_PATH.read_text() if CSS_PATH.exists() else None
    # The model's work runs on this (the main) thread, the first to compute with torch:
    # its OpenMP workers stay hot (pagekv/model_thread.py). Load the default model here.
    import torch

    torch.ones(1 << 17).add_(1).sum()  # this thread's OpenMP team comes first
    try:
        get_study(args.model)
    except Exception as e:  # no model here: the app serves and each run says what to do
        log.warning("no model loaded at start: %s", " ".join(str(e).split()))
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        css=css,
        show_error=False,
        prevent_thread_lock=True,
    )
    if not args.no_warm:
        threading.Thread(
            target=warm_lessons, args=(args.model,), name="pagekv-warm", daemon=True
        ).start()
    try:
        MODEL_THREAD.serve_forever()
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        demo.close()


if __name__ == "__main__":
    main()
