"""Page-EntroKV: mean pooling and Page-EntroKV side by side on live decoding.

    python app.py [--host 127.0.0.1] [--port 7860] [--model bundled]

The app stays thin: `build_demo()` lays out the page, and each handler calls
`pagekv` (prefill, plan, compaction and decoding in `pagekv.study` and
`pagekv.compare`; figures in `pagekv.figures`). Bad input never raises out of a
handler: it becomes a message on the page, and the next request works.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import threading

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from pagekv import POLICIES, EvictionConfig  # noqa: E402
from pagekv.lessons import LESSONS  # noqa: E402
from pagekv.paths import CSS_PATH  # noqa: E402
from pagekv.presets import load_presets  # noqa: E402

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

_studies: dict = {}
_lock = threading.Lock()


def get_study(model_name: str):
    """The Study for `model_name` (one loaded model at a time; falls back to bundled)."""
    from pagekv.study import Study

    name = (model_name or "bundled").strip() or "bundled"
    with _lock:
        if name not in _studies:
            _studies.clear()  # free the previous model's memory first
            _studies[name] = Study.load(name, allow_fallback=True)
        return _studies[name]


def known_models() -> list[str]:
    from pagekv.models import KNOWN_MODELS

    return list(KNOWN_MODELS)


# ----------------------------------------------------------------- handlers


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


def _answers_table(comp) -> list[list]:
    from pagekv.figures import needle_page_counts

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
        from pagekv.compare import retained_fraction

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


def _spec(task, context, depth, seed, needles, mode, curated, haystack, needle, question, answer):
    from pagekv.study import PromptSpec
    from pagekv.tasks import needle_depth

    kw = dict(
        task=task,
        context_tokens=int(context),
        depth=float(depth),
        seed=int(seed),
        n_needles=int(needles),
        mode=mode,
    )
    if task in ("qa", "code"):
        kw["name"] = curated or None
    if task == "custom":
        kw.update(haystack=haystack, needle=needle, question=question, answer=answer)
        kw["depth"] = needle_depth(haystack, needle, kw["depth"])
    return PromptSpec(**kw)


def _config(policy, budget_pct, page_size, n_sink, window, tau):
    return EvictionConfig(
        policy=policy,
        budget=float(budget_pct) / 100.0,
        page_size=int(page_size),
        n_sink=int(n_sink),
        window=int(window),
        tau=float(tau),
    )


EMPTY = None


@gpu
def run_comparison(
    model,
    task,
    context,
    depth,
    seed,
    needles,
    mode,
    curated,
    haystack,
    needle,
    question,
    answer,
    budget_pct,
    page_size,
    n_sink,
    window,
    tau,
    policy_a,
    policy_b,
    link_b=True,
    mode_b="inside",
    budget_b=20.0,
    page_size_b=16,
    n_sink_b=4,
    window_b=32,
    tau_b=1.0,
    layer=0,
    progress=gr.Progress(),  # noqa: B008 (gradio injects progress through this default)
):
    """Prefill (memoised), run full / A / B, and build every view. Never raises.

    Side A is the shared controls (question position, budget, page size, n_sink, window,
    tau) with policy A; side B uses policy B and, with `link_b`, the same settings as A,
    otherwise its own (`mode_b`, `budget_b`, ...): each side is a full configuration.
    """
    from pagekv.compare import compare, comparison_figures, export

    try:
        spec = _spec(
            task, context, depth, seed, needles, mode, curated, haystack, needle, question, answer
        )
        cfg_a = _config(policy_a, budget_pct, page_size, n_sink, window, tau)
        if link_b:
            cfg_b, mode_b = cfg_a.replace(policy=policy_b), mode
        else:
            cfg_b = _config(policy_b, budget_b, page_size_b, n_sink_b, window_b, tau_b)
        progress(0.0, desc="loading the model")
        study = get_study(model)
        comp = compare(study, spec, cfg_a, cfg_b, progress=progress, mode_a=mode, mode_b=mode_b)
        figs = comparison_figures(comp, layer=int(layer))
        folder = tempfile.mkdtemp(prefix="pagekv_")
        files = export(comp, figs, folder)
    except Exception as e:  # bad input or an unexpected failure: say it on the page
        log.warning("run failed: %s", e, exc_info=not isinstance(e, ValueError))
        msg = " ".join(str(e).split()) or type(e).__name__
        return _views(status=_message("error", msg))
    loaded = study.loaded
    rec_b = comp.records["B"]
    status = [
        _message(
            "ok",
            f"**{loaded.name}** on {rec_b['device']} ({rec_b['backend']} backend): "
            f"{comp.prep.n} prompt tokens, budget {cfg_a.budget_tokens(comp.prep.n)} tokens "
            f"per (layer, group), page size {cfg_a.page_size}"
            + _side_b_note(comp, cfg_a, cfg_b)
            + ". "
            f"Question: *{comp.prep.task.question}* Expected: **{comp.prep.task.answer}**",
        )
    ]
    if loaded.fell_back:
        status.append(_message("info", loaded.note))
    status += [_message("info", n) for n in comp.notes]
    t = rec_b["timings"]
    status.append(
        f"<small>prefill {t['prefill_s']:.2f}s (once per prompt), "
        f"eviction {_ms(t['evict_s'])}, decode {t['decode_s']:.2f}s</small>"
    )
    n_layers = int(comp.plan_of("B").keep.shape[0])  # read from the model that ran
    return _views(
        status="\n\n".join(status),
        answers=_answers_table(comp),
        frame=figs["frame"],
        retention=figs.get("retention"),
        weights=figs["weights"],
        overview=figs["weights_overview"],
        sink_mass=figs["sink_mass"],
        sink_adv=figs["sink_advantage"],
        uor=figs["uor"],
        stored=figs["stored"],
        memory=figs["memory"],
        files=files,
        layer=gr.update(maximum=n_layers - 1, value=min(int(layer), n_layers - 1)),
        last=comp,
    )


#: What a run fills, in the order of the run's outputs (`build_demo` wires the
#: components of the same names); `_views` turns keyword values into that tuple.
RUN_VIEWS = (
    "status", "answers", "frame", "retention", "weights", "overview", "sink_mass", "sink_adv",
    "uor", "stored", "memory", "files", "layer", "last",
)  # fmt: skip


def _views(**values):
    """The run's outputs in `RUN_VIEWS` order; views not given are cleared (the layer
    slider is left as it is)."""
    unknown = set(values) - set(RUN_VIEWS)
    if unknown:
        raise KeyError(f"not a run view: {sorted(unknown)}")
    default = {"layer": gr.update()}
    return tuple(values.get(name, default.get(name, EMPTY)) for name in RUN_VIEWS)


def update_layer(comp, layer):
    """Redraw the per-layer head weights from the last comparison (no model work)."""
    from pagekv import figures

    if comp is None:
        return None
    p = comp.plan_of("B")
    layer = max(0, min(int(layer), p.keep.shape[0] - 1))
    return figures.head_weights_bars(p, layer)


def run_mechanism(heads, retrieval, distractors, distractor_strength, sink_head, n, budget_pct):
    """The constructed instance of the retention bound (no model involved)."""
    from pagekv import figures
    from pagekv.compare import mechanism_view

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
    except ValueError as e:
        return _message("error", " ".join(str(e).split())), None, None
    s, w = view.s_star, view.w_star
    text = _message(
        "info",
        f"Constructed profiles, not a model. The retrieval head puts s* = {s:.3f} on the "
        f"needle; its entropy weight is w* = {w:.3f} (mean pooling: 1/r = "
        f"{1 / int(heads):.3f}). The needle page is kept whenever w* s* = {w * s:.3f} "
        "beats the page that would otherwise be kept last.",
    )
    return text, view.rows, figures.mechanism_figure(view.mech, view.plans)


#: The controls a preset sets, in the order of `apply_preset`'s outputs.
PRESET_CONTROLS = (
    "task", "curated", "context", "depth", "seed", "needles", "mode", "budget", "page_size",
    "n_sink", "window", "tau", "policy_a", "policy_b",
)  # fmt: skip


def apply_preset(title):
    """Fill the controls from a preset (the Run that follows uses them)."""
    for p in PRESETS:
        if p["title"] == title:
            values = {
                "task": p["task"],
                "curated": curated_choices(p["task"], p["name"]),
                "context": p["context_tokens"],
                "depth": p["depth"],
                "seed": p["seed"],
                "needles": p["n_needles"],
                "mode": p["mode"],
                "budget": round(100 * p["budget"], 1),
                "page_size": p["page_size"],
                "n_sink": p["n_sink"],
                "window": p["window"],
                "tau": p["tau"],
                "policy_a": p["policy_a"],
                "policy_b": p["policy_b"],
            }
            return [values[name] for name in PRESET_CONTROLS]
    return [gr.update()] * len(PRESET_CONTROLS)


def curated_choices(task, name=None):
    """The curated-task picker: visible with that kind's tasks for qa/code."""
    from pagekv.tasks import task_names

    if task in ("qa", "code"):
        names = task_names(task)
        return gr.update(choices=names, value=name if name in names else names[0], visible=True)
    return gr.update(visible=False)


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
        p, a, b = lesson.prompt, lesson.a, lesson.b
        values.update(
            task=p.task,
            curated=curated_choices(p.task, p.name),
            context=p.context_tokens,
            depth=p.depth,
            seed=p.seed,
            needles=p.n_needles,
            mode=a.mode,
            budget=round(100 * a.budget, 1),
            page_size=a.page_size,
            n_sink=a.n_sink,
            window=a.window,
            tau=a.tau,
            policy_a=a.policy,
            policy_b=b.policy,
            link_b=False,
            mode_b=b.mode,
            budget_b=round(100 * b.budget, 1),
            page_size_b=b.page_size,
            n_sink_b=b.n_sink,
            window_b=b.window,
            tau_b=b.tau,
            layer=gr.update(value=lesson.layer),
        )
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


def lesson_step(title, step: int):
    """The lesson `step` places after `title` (wrapping), for the previous / next buttons."""
    i = LESSON_TITLES.index(title) if title in LESSON_TITLES else 0
    return LESSON_TITLES[(i + step) % len(LESSON_TITLES)]


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
    from pagekv.lessons import Evidence, run_lesson

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


def run_for_lesson(title, *inputs):
    """Run the comparison for a live lesson. A replay lesson shows the replay's T4 recall
    in the retention view (measured earlier, titled so); a constructed one leaves the
    views as they are (its view is the mechanism tab)."""
    lesson = _lesson_of(title)
    if lesson is not None and lesson.kind == "live":
        return run_comparison(*inputs)
    keep = {name: gr.update() for name in RUN_VIEWS}
    if lesson is not None and lesson.kind == "replay":
        keep["retention"] = replay_recall_figure()
    return tuple(keep[name] for name in RUN_VIEWS)


def replay_recall_figure():
    """Needle recall of our policies and kvpress's presses from the committed replay
    (table T4), not a live run."""
    from pagekv import figures
    from pagekv.lessons import load_replay

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
    with gr.Blocks(title="Page-EntroKV") as demo:
        gr.Markdown(INTRO)
        last = gr.State(None)
        with gr.Row():
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
                    with gr.Accordion("Custom text", open=False):
                        haystack = gr.Textbox(lines=5, label="Haystack text")
                        needle = gr.Textbox(label="Needle sentence")
                        question = gr.Textbox(label="Question")
                        answer = gr.Textbox(label="Expected answer")
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
                with gr.Row(equal_height=False):
                    lesson_text = gr.Markdown(lesson_markdown(LESSONS[0]), elem_id="lesson-text")
                    observation = gr.Markdown(
                        "**Observation:** " + LESSONS[0].observation.statement,
                        elem_id="lesson-observation",
                    )
                status = gr.Markdown(_message("info", "Loading the first lesson..."))
                gr.Markdown(CAPTIONS["answers"])
                answers = gr.Dataframe(
                    headers=["run", "verdict", "answer", "stored tokens", "needle kept",
                             "needle page kept", "UOR max", "eviction"],
                    interactive=False,
                    wrap=True,
                    column_widths=["18%", "8%", "32%", "8%", "8%", "10%", "7%", "9%"],
                )  # fmt: skip
                with gr.Tabs() as tabs:
                    with gr.Tab("Page frame", id="frame"):
                        gr.Markdown(CAPTIONS["frame"])
                        frame = gr.Plot(elem_id="page-frame")
                    with gr.Tab("Needle retention", id="retention"):
                        gr.Markdown(CAPTIONS["retention"])
                        retention = gr.Plot()
                    with gr.Tab("Head weights", id="weights"):
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
                    with gr.Tab("UOR and memory", id="uor"):
                        gr.Markdown(CAPTIONS["uor"])
                        uor = gr.Plot()
                        stored = gr.Plot()
                        memory = gr.Plot()
                    with gr.Tab("Mechanism (constructed)", id="mechanism"):
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
                        gr.Markdown("The run's numbers (JSON, CSV) and every figure (HTML).")
                        files = gr.File(label="Downloads", file_count="multiple")

        components = locals()
        run_inputs = [
            model, task, context, depth, seed, needles, mode, curated, haystack, needle,
            question, answer, budget, page_size, n_sink, window, tau, policy_a, policy_b,
            link_b, mode_b, budget_b, page_size_b, n_sink_b, window_b, tau_b, layer,
        ]  # fmt: skip
        run_outputs = [components[name] for name in RUN_VIEWS]
        preset_targets = [components[name] for name in PRESET_CONTROLS]
        lesson_targets = [components[name] for name in LESSON_CONTROLS]
        run_kw = dict(fn=run_comparison, inputs=run_inputs, outputs=run_outputs)
        quiet = dict(api_visibility="undocumented")  # the same handler under another trigger
        # After a free-exploration run the lesson's verdict is re-read: it says "not
        # checked" once the controls no longer hold the lesson's settings.
        recheck = dict(fn=check_lesson, inputs=[lesson, last], outputs=observation, **quiet)
        run_btn.click(api_name="run", **run_kw).then(**recheck)
        budget.release(api_name="budget", **run_kw).then(**recheck)
        for control in (page_size, policy_a, policy_b, page_size_b, link_b, mode_b):
            control.input(**run_kw, **quiet).then(**recheck)
        for control in (tau, window, n_sink, budget_b, tau_b, window_b, n_sink_b):
            control.release(**run_kw, **quiet).then(**recheck)
        preset.input(apply_preset, preset, preset_targets, api_name="preset").then(
            **run_kw, **quiet
        ).then(**recheck)
        task.input(curated_choices, task, curated, **quiet)
        layer.release(update_layer, [last, layer], weights, api_name="layer")
        mech_io = dict(
            fn=run_mechanism,
            inputs=[m_heads, m_retr, m_dist, m_dstr, m_sink, m_n, m_budget],
            outputs=[m_text, m_table, m_plot],
        )
        m_retr.release(api_name="mechanism", **mech_io)
        for control in (m_heads, m_dist, m_dstr, m_n, m_budget):
            control.release(**mech_io, **quiet)
        m_sink.input(**mech_io, **quiet)

        apply_io = dict(
            fn=apply_lesson,
            inputs=lesson,
            outputs=[*lesson_targets, tabs, lesson_text, observation],
        )

        def then_run_and_check(event):
            """After a lesson set the controls: run it (live lessons), redraw the
            mechanism, check the observation."""
            return (
                event.then(run_for_lesson, [lesson, *run_inputs], run_outputs, **quiet)
                .then(**mech_io, **quiet)
                .then(check_lesson, [lesson, last], observation, **quiet)
            )

        then_run_and_check(lesson.input(api_name="lesson", **apply_io))
        for button, step in ((prev_btn, -1), (next_btn, 1)):
            picked = button.click(lambda t, s=step: lesson_step(t, s), lesson, lesson, **quiet)
            then_run_and_check(picked.then(**apply_io, **quiet))
        then_run_and_check(demo.load(**apply_io, **quiet))
    return demo


def main(argv=None):
    ap = argparse.ArgumentParser(description="Page-EntroKV app")
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    ap.add_argument("--model", default="bundled", help="model loaded first (default: bundled)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    demo = build_demo(default_model=args.model)
    demo.queue(default_concurrency_limit=1, max_size=32)
    css = CSS_PATH.read_text() if CSS_PATH.exists() else None
    demo.launch(server_name=args.host, server_port=args.port, css=css, show_error=False)


if __name__ == "__main__":
    main()
