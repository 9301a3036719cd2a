"""Page-EntroKV: mean pooling and Page-EntroKV side by side on live decoding.

    python app.py [--host 127.0.0.1] [--port 7860] [--model bundled] [--no-warm]
                  [--allow-hub-models] [--dtype auto]

Layout and wiring only: `build_demo()` lays out the page (a function per part:
`explore_controls`, `prompt_controls`, `side_controls` (side A, side B), `lesson_header`,
`view_tabs`) and the `wire_*` functions connect each control to its handler in
`pagekv.app.handlers` (`ui`: runs, previews, presets, layer, mechanism, export) and
`pagekv.app.lesson_handlers` (`lessons_ui`: lessons, warm-up), with the texts of
`pagekv.app.page_text` (`text`); inputs are checked in `pagekv.app.run_inputs`. The
model's work runs on the model worker, which `main` gives this process's main thread
(`pagekv.engine.worker`; docs/design.md, "One model worker"). Once it serves, the app
computes its live lessons (`--no-warm` skips this).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

from pagekv.app import handlers as ui  # noqa: E402
from pagekv.app import lesson_checks as checks  # noqa: E402
from pagekv.app import lesson_handlers as lessons_ui  # noqa: E402
from pagekv.app import page_text as text  # noqa: E402
from pagekv.app import run_inputs  # noqa: E402
from pagekv.app.handlers import MECH_VIEWS, POLICY_CHOICES, PRESETS, RUN_VIEWS  # noqa: E402
from pagekv.app.lesson_checks import LESSON_TITLES  # noqa: E402
from pagekv.app.lesson_handlers import LESSON_CONTROLS, TABS, warm_lessons  # noqa: E402
from pagekv.app.lessons import LESSONS  # noqa: E402
from pagekv.app.page_assets import GQA_DRAWING, launch_assets  # noqa: E402
from pagekv.app.run_figures import PREVIEW_VIEWS  # noqa: E402
from pagekv.app.run_inputs import (  # noqa: E402
    PAGE_SIZES,  # noqa: E402
    RUN_DEFAULTS,
)
from pagekv.app.share import share_js, shared_names  # noqa: E402
from pagekv.engine.worker import WORKER  # noqa: E402
from pagekv.runtime.decode import DECODE_DTYPES  # noqa: E402

#: Side B's own settings and the side A controls they show while linked.
B_OWN = ("mode_b", "budget_b", "page_size_b", "n_sink_b", "window_b", "tau_b")
A_SHARED = ("mode", "budget", "page_size", "n_sink", "window", "tau")

log = logging.getLogger("pagekv.app")
__all__ = ["build_demo", "launch_assets", "main", "warm_lessons", "RUN_DEFAULTS", "TABS"]


def slider(name: str, value, label: str, **kw) -> gr.Slider:
    """A slider over the range and step the API accepts for `name` (`LIMITS`)."""
    lo, hi, step = run_inputs.LIMITS[name]
    return gr.Slider(lo, hi, value=value, step=step, label=label, **kw)


def mech_slider(name: str, value) -> gr.Slider:
    """A mechanism slider over its range (`MECH_LIMITS`)."""
    label, lo, hi, step, _whole = ui.MECH_LIMITS[name]
    return gr.Slider(lo, hi, value=value, step=step, label=label)


def plot(**kw) -> gr.Plot:
    """A plot without Gradio's "Plot" badge (it covered the start of the title)."""
    return gr.Plot(show_label=False, **kw)


def _blocks(scope: dict) -> dict:
    """The Gradio blocks among a function's locals, by name (what it laid out)."""
    return {k: v for k, v in scope.items() if isinstance(v, gr.blocks.Block)}


def build_demo(default_model: str = "bundled") -> gr.Blocks:
    """The page: free exploration on the left (below on a narrow screen), the lesson and
    its views on the right; each control wired to its handler (`wire_*`)."""
    # Gradio's own copies of served files are removed after 30 minutes (checked every 10).
    with gr.Blocks(title="Page-EntroKV", delete_cache=(600, 1800)) as demo:
        c = {"last": gr.State(None)}
        c |= first_screen()
        with gr.Row(elem_id="main-row"):
            with gr.Column(scale=1, min_width=320, elem_id="explore-col"):
                gr.Markdown("#### Free exploration")
                c |= explore_controls()
                with gr.Accordion("Prompt", open=False):
                    c |= prompt_controls(default_model)
                with gr.Accordion("Side A", open=False):
                    c |= side_controls("a")
                with gr.Accordion("Side B", open=False):
                    c |= side_controls("b")
            with gr.Column(scale=3, elem_id="lesson-col"):
                c |= lesson_header()
                with gr.Tabs(elem_id="lesson-views") as tabs:
                    c |= view_tabs()
                c["tabs"] = tabs
        c["budget_pct"] = c["budget"]  # the API names side A's budget budget_pct
        wire_runs(c)
        wire_prompt(c)
        wire_mechanism(c)
        wire_lessons(c, demo)
    return demo


def first_screen() -> dict:
    """The introduction, the drawing of the idea and the live chart beside it (`glance`:
    what each (layer, group) of the current run stores, as a multiple of the budget)."""
    with gr.Column(elem_id="intro"):
        gr.Markdown(text.INTRO)
        with gr.Row(equal_height=True, elem_id="first-screen"):
            with gr.Column(scale=3, min_width=400):
                gr.HTML(GQA_DRAWING.read_text(), elem_id="gqa-drawing")
            with gr.Column(scale=2, min_width=300):
                glance = plot(elem_id="glance")
                caption = gr.Markdown(text.GLANCE_CAPTION, elem_id="glance-caption")
    return {"glance": glance, "glance_caption": caption}


def explore_controls() -> dict:
    preset = gr.Dropdown(
        [p["title"] for p in PRESETS],
        value=None,
        label="Preset",
        info="two policies at the same settings; each title names the difference it shows, "
        "checked after the run",
    )
    run_btn = gr.Button("Run", variant="primary")
    with gr.Row(equal_height=True):
        share_btn = gr.Button("Link to these settings", size="sm", scale=1)
        share_link = gr.Textbox(
            label="Link (copy it)", interactive=False, scale=3, elem_id="share-link"
        )
    return _blocks(locals())


def prompt_controls(default_model: str) -> dict:
    first = PRESETS[0]
    model = gr.Dropdown(
        ui.known_models(),
        value=default_model,
        allow_custom_value=ui.MODELS.allow_hub,
        label="Model",
        info="bundled runs anywhere; hub models need a reachable hub",
    )
    task = gr.Radio(list(run_inputs.TASKS), value=first["task"], label="Task")
    curated = gr.Dropdown([], label="Curated task", visible=False)
    context = slider("context", first["context"], "Context length (tokens)")
    depth = slider("depth", first["depth"], "Needle depth")
    needles = slider("needles", first["needles"], "Needles")
    seed = gr.Number(
        value=first["seed"], precision=0, label="Seed",
        minimum=run_inputs.LIMITS["seed"][0], maximum=run_inputs.LIMITS["seed"][1],
    )  # fmt: skip
    with gr.Accordion("Custom text", open=False, visible=False) as custom_box:
        haystack = gr.Textbox(value="", lines=5, label="Haystack text")
        needle = gr.Textbox(value="", label="Needle sentence")
        question = gr.Textbox(value="", label="Question")
        answer = gr.Textbox(value="", label="Expected answer")
    return _blocks(locals())


def side_controls(side: str) -> dict:
    """A side's policy, scorer and allocation (in one row), side B's "Same settings as A",
    then the side's question position, budget, page size, n_sink, window and tau, at the
    first preset's values. Side B's settings are named `..._b` and start locked: while
    "Same settings as A" is ticked they show A's and cannot be edited (`linked_b`, on
    every change of the link or of A's settings)."""
    first = PRESETS[0]
    b = side == "b"
    sfx, tag, kw = ("_b", " B", dict(interactive=False)) if b else ("", "", {})
    out = {
        f"policy_{side}": gr.Dropdown(
            POLICY_CHOICES, value=first[f"policy_{side}"], label=f"Policy {side.upper()}"
        )
    }
    with gr.Row():
        for name, choices, info in (
            ("scorer", run_inputs.SCORERS, text.SCORER_INFO),
            ("allocation", run_inputs.ALLOCATIONS, text.ALLOCATION_INFO),
        ):
            out[f"{name}_{side}"] = gr.Radio(
                list(choices), value=RUN_DEFAULTS[f"{name}_{side}"],
                label=f"{name.capitalize()} {side.upper()}", info=info,
            )  # fmt: skip
    if b:
        out["link_b"] = gr.Checkbox(
            value=True,
            label="Same settings as A (policy, scorer and allocation are B's own)",
            info="untick to give B its own question position, budget and pages",
        )
    out |= {
        "mode" + sfx: gr.Radio(
            list(run_inputs.MODES), value=first["mode"], label="Question position" + tag,
            info=text.MODE_INFO, **kw,
        ),
        "budget" + sfx: slider(
            "budget", 100 * first["budget"],
            "Budget B (%)" if b else "Budget (% of the prompt kept per layer and group)",
            info=None if b else "its lower limit follows the prompt: the protected pages must fit",
            **kw,
        ),
        "page_size" + sfx: gr.Dropdown(
            PAGE_SIZES, value=first["page_size"], label="Page size" + tag, **kw
        ),
    }  # fmt: skip
    with gr.Row():
        out["n_sink" + sfx] = slider("n_sink", first["n_sink"], "n_sink" + tag, **kw)
        out["window" + sfx] = slider("window", first["window"], "Window" + tag, **kw)
    out["tau" + sfx] = slider("tau", first["tau"], "tau" + tag, **kw)
    return out


def lesson_header() -> dict:
    """The lesson picker, its text and verdict, the glossary, the status and answers."""
    with gr.Row(elem_id="lesson-picker"):
        lesson = gr.Dropdown(LESSON_TITLES, value=LESSON_TITLES[0], label="Lesson", scale=4)
        prev_btn = gr.Button("Previous lesson", size="sm", scale=1, elem_id="prev-lesson")
        next_btn = gr.Button("Next lesson", size="sm", scale=1, elem_id="next-lesson")
        presenter = gr.Checkbox(
            value=False, label="Presenter view", scale=1, elem_id="presenter",
            info="the lesson and its chart only; Next keeps the chart in view",
        )  # fmt: skip
    with gr.Row(equal_height=False, elem_id="lesson-row"):
        lesson_text = gr.Markdown(text.lesson_markdown(LESSONS[0]), elem_id="lesson-text")
        observation = gr.Markdown(
            "**Observation:** " + LESSONS[0].observation.statement,
            elem_id="lesson-observation",
        )
    with gr.Accordion("Glossary", open=False, elem_id="glossary"):
        gr.Markdown(text.GLOSSARY)
    status = gr.Markdown(text.message("info", "Loading the first lesson..."), elem_id="run-status")
    stale_note = gr.Markdown(elem_id="stale-note")
    gr.Markdown(text.CAPTIONS["answers"], elem_id="answers-caption")
    answers = gr.HTML(elem_id="answers-table")
    return _blocks(locals())


def view_tabs() -> dict:
    """Every view, a tab each (`TABS` are their ids)."""
    with gr.Tab("Pages", id="frame"):
        gr.Markdown(text.CAPTIONS["frame"])
        frame = plot(elem_id="page-frame")
        gr.Markdown(text.CAPTIONS["ruler_pages"])
        plot(value=checks.ruler_pages_figure(), elem_id="ruler-pages")
    with gr.Tab("Needle", id="retention"):
        gr.Markdown(text.CAPTIONS["retention"])
        retention = plot()
    with gr.Tab("Weights", id="weights"):
        gr.Markdown(text.CAPTIONS["overview"])
        overview = plot()
        gr.Markdown(text.CAPTIONS["weights"])
        layer = gr.Slider(0, 1, value=0, step=1, label="Layer")  # a run sets its range
        weights = plot()
    with gr.Tab("Sinks", id="sinks"):
        gr.Markdown(text.CAPTIONS["sink"])
        sink_mass = plot()
        sink_adv = plot()
    with gr.Tab("UOR & memory", id="uor"):
        gr.Markdown(text.CAPTIONS["uor"])
        uor = plot()
        stored = plot()
        memory = plot()
    with gr.Tab("Capacity", id="capacity"):
        gr.Markdown(text.CAPTIONS["capacity"])
        capacity = plot(elem_id="capacity")
    with gr.Tab("Mechanism", id="mechanism"):
        mech = mechanism_controls()
    with gr.Tab("Replay", id="replay"):
        gr.Markdown(checks.replay_caption())
        plot(value=checks.replay_recall_figure(), elem_id="replay-recall")
        gr.Markdown(text.CAPTIONS["ruler_memory"])
        plot(value=checks.ruler_memory_figure(), elem_id="ruler-memory")
    with gr.Tab("Export", id="export"):
        gr.Markdown("The last run's numbers (JSON, CSV) and every figure (HTML), written when "
                    "you ask.")  # fmt: skip
        export_btn = gr.Button("Write the files of the last run")
        files = gr.File(label="Downloads", file_count="multiple")
    return _blocks(locals()) | mech


def mechanism_controls() -> dict:
    gr.Markdown(text.CAPTIONS["mechanism"])
    with gr.Row():
        m_heads = mech_slider("heads", 3)
        m_retr = mech_slider("retrieval", 0.9)
        m_dist = mech_slider("distractors", 2)
    with gr.Row():
        m_dstr = mech_slider("distractor_strength", 0.48)
        m_sink = gr.Checkbox(value=False, label="Add a sink head")
        m_n = mech_slider("n", 64)
        m_budget = mech_slider("budget_pct", 19)
    m_text = gr.Markdown()
    m_table = gr.Dataframe(
        headers=["policy", "needle page", "weights"], interactive=False, elem_id="m-table"
    )
    m_plot = plot()
    return _blocks(locals())


#: The same handler under another trigger: not listed in the API.
QUIET = dict(api_visibility="undocumented")
#: Runs of different sessions share RUN_CONCURRENCY request workers: a run finished
#: before is served from memory at once, while the model computes one job at a time.
MODEL_KW = dict(concurrency_id="model", concurrency_limit=ui.RUN_CONCURRENCY)


def wire_runs(c: dict) -> None:
    """One request per action: a run is one generator event (plan views, then the
    answers and the lesson's verdict); while a run is busy, a trigger keeps only its
    last request (always_last), and a session's runs go one at a time."""
    run_controls = [c[name] for name in RUN_DEFAULTS]
    run_kw = dict(
        fn=ui.run_comparison,
        inputs=run_controls,
        outputs=[c[name] for name in RUN_VIEWS],
        preprocess=False,  # raw values: parse_run names a wrong one in plain words
        trigger_mode="always_last",
        **MODEL_KW,
    )
    # After a run the model box shows the model that ran (the default, after a fallback).
    shown = dict(fn=ui.model_that_ran, inputs=c["model"], outputs=c["model"], queue=False,
                 show_progress="hidden", **QUIET)  # fmt: skip
    c["run_btn"].click(api_name="run", **run_kw).then(**shown)
    c["budget"].release(api_name="budget", **run_kw).then(**shown)
    for name in ("page_size", "policy_a", "policy_b", "page_size_b"):  # dropdowns: one select
        c[name].select(**run_kw, **QUIET).then(**shown)
    # Each side's question position runs at once (one rule for both, `text.MODE_INFO`).
    for name in ("mode", "mode_b", "link_b", "scorer_a", "allocation_a", "scorer_b",
                 "allocation_b"):  # fmt: skip
        c[name].input(**run_kw, **QUIET).then(**shown)
    sliders = ("budget", "tau", "window", "n_sink", "budget_b", "tau_b", "window_b", "n_sink_b")
    for name in sliders[1:]:
        c[name].release(**run_kw, **QUIET).then(**shown)
    # Live while dragging: planning alone, on the cached prefill (no decoding).
    preview_kw = dict(
        fn=ui.preview_plans, inputs=run_controls, outputs=[c[name] for name in PREVIEW_VIEWS],
        preprocess=False, concurrency_id="preview", concurrency_limit=2,
        trigger_mode="always_last", show_progress="hidden", **QUIET,
    )  # fmt: skip
    for name in sliders:
        c[name].input(**preview_kw)
    preset_targets = [c[name] for name in ui.PRESET_CONTROLS]
    c["preset"].select(
        ui.run_preset,
        [c["preset"], c["model"], c["lesson"]],
        [*preset_targets, c["link_b"], c["tabs"], *run_kw["outputs"]],
        trigger_mode="always_last",
        **MODEL_KW,
        **QUIET,
    ).then(**shown)
    # The API's /preset fills the controls only (no run), for scripts; the page's preset
    # picker above sets and runs in one request. A hidden trigger carries it.
    gr.Button(visible=False).click(ui.apply_preset, c["preset"], preset_targets, api_name="preset")
    # Linked, B's own settings show A's and are locked: the link's change sets both
    # (`linked_b`, outside the queue: no model work); a change of A's settings while
    # linked is copied in the browser alone (no request for every step of a drag).
    a_own, b_own = [c[n] for n in A_SHARED], [c[n] for n in B_OWN]
    c["link_b"].change(
        ui.linked_b, [c["link_b"], *a_own], b_own, queue=False,
        preprocess=False,  # a value out of range is the run's to refuse, not a badge
        show_progress="hidden", **QUIET,
    )  # fmt: skip
    n = len(A_SHARED)
    copy_js = f"(link, ...v) => link === true ? v.slice(0, {n}) : v.slice({n})"
    for control in a_own:
        control.change(None, [c["link_b"], *a_own, *b_own], b_own, js=copy_js, **QUIET)
    c["share_btn"].click(None, [c[n] for n in shared_names()], c["share_link"], js=share_js())
    c["layer"].release(ui.update_layer, [c["last"], c["layer"]], c["weights"], api_name="layer")
    c["export_btn"].click(ui.export_run, c["last"], c["files"], api_name="export")


def wire_prompt(c: dict) -> None:
    """The prompt's controls: the task's own controls, and the note that the results are
    stale (in the browser only: no request to the server). The note is a run output:
    every run clears it. A browser-side clear on the run's own trigger does not work:
    Gradio does not run a JS-only listener on a trigger that also has a Python one."""
    follow_task = [c[n] for n in ("curated", "depth", "needles", "seed", "custom_box")]
    c["task"].input(ui.curated_choices, c["task"], follow_task, show_progress="hidden", **QUIET)
    prompt = ("task", "context", "depth", "seed", "needles", "curated", "haystack",
              "needle", "question", "answer", "model")  # fmt: skip
    for name in prompt:
        c[name].input(None, None, c["stale_note"], js=f"() => {text.STALE_NOTE!r}", **QUIET)
    # A prompt slider's value typed outside its range: the box then holds the nearest
    # end, and the note says so (no model work, outside the queue).
    for name in ui.PROMPT_SLIDERS:
        c[name].release(
            ui.prompt_range_note(name), c[name], c["stale_note"], queue=False, preprocess=False,
            show_progress="hidden", **QUIET,
        )  # fmt: skip


def wire_mechanism(c: dict) -> None:
    mech = [c[name] for name in ui.MECH_CONTROLS]
    # Raw values: a value typed outside a slider's range is said, never an error badge.
    mech_io = dict(
        fn=ui.run_mechanism, inputs=mech, outputs=[c[n] for n in MECH_VIEWS], preprocess=False
    )
    # A constructed lesson's verdict follows the inputs (`mechanism_observation`).
    verdict = dict(
        fn=ui.mechanism_observation,
        inputs=[c["lesson"], *mech],
        outputs=[c["observation"]],
        preprocess=False,
        **QUIET,
    )
    c["m_retr"].release(api_name="mechanism", **mech_io).then(**verdict)
    for name in ("m_heads", "m_dist", "m_dstr", "m_n", "m_budget"):
        c[name].release(**mech_io, **QUIET).then(**verdict)
    c["m_sink"].input(**mech_io, **QUIET).then(**verdict)


def wire_lessons(c: dict, demo: gr.Blocks) -> None:
    lesson, model = c["lesson"], c["model"]
    chosen = [lesson, model]  # what every lesson event reads
    outputs = [
        *(c[name] for name in LESSON_CONTROLS), c["tabs"], c["lesson_text"],
        *(c[name] for name in RUN_VIEWS), *(c[name] for name in MECH_VIEWS),
    ]  # fmt: skip
    kw = dict(trigger_mode="always_last", **MODEL_KW)
    # In the presenter view, a lesson picked brings its chart into view (browser only).
    show_chart = dict(fn=None, js="() => pagekvShowChart()")
    shown = dict(fn=ui.model_that_ran, inputs=model, outputs=model, queue=False, **QUIET)
    # A lesson picked from the list ends any run of Next / Previous presses (app.js).
    forget = "(title, model) => { pagekvLanded(null); return [title, model]; }"
    picked = lesson.select(lessons_ui.pick_lesson, chosen, outputs, api_name="lesson", js=forget,
                           **kw)  # fmt: skip
    picked.then(**show_chart).then(**shown)
    # Presses in a row step on from the lesson the last one asked for (app.js): three
    # quick presses of Next go three lessons on, whatever has loaded meanwhile.
    titles = json.dumps(list(lessons_ui.LESSON_TITLES))
    landed = dict(fn=None, inputs=lesson, js="(title) => pagekvLanded(title)")
    steps = {"prev_btn": (lessons_ui.previous_lesson, -1), "next_btn": (lessons_ui.next_lesson, 1)}
    for button, (step, delta) in steps.items():
        step_js = f"(title, model) => [pagekvStepFrom({titles}, {delta}, title), model]"
        stepped = c[button].click(step, chosen, [lesson, *outputs], js=step_js, **QUIET, **kw)
        stepped.then(**landed).then(**show_chart).then(**shown)
    c["presenter"].change(None, c["presenter"], None, js="(on) => pagekvPresenter(on)")
    # The page's load: a link's lesson or settings (`?lesson=3`), else the first lesson.
    demo.load(lessons_ui.open_page, chosen, [lesson, model, *outputs], **QUIET, **kw)
    demo.unload(ui.end_session)  # what the server holds for a closed tab goes


def main(argv=None):
    ap = argparse.ArgumentParser(description="Page-EntroKV app")
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    ap.add_argument("--model", default="bundled", help="the default model: loaded at "
                    "start, kept loaded, and the one the lessons are warmed on")  # fmt: skip
    ap.add_argument("--no-warm", action="store_true", help="do not compute the live "
                    "lessons once serving (by default a class gets them from memory)")  # fmt: skip
    ap.add_argument(
        "--allow-hub-models", action="store_true",
        default=os.environ.get("PAGEKV_ALLOW_HUB_MODELS") == "1",
        help="also load hub models or local folders not in the model list (off by default: "
        "a public server loads only what it offers; PAGEKV_ALLOW_HUB_MODELS=1 turns it on)",
    )  # fmt: skip
    ap.add_argument("--dtype", default="auto", choices=DECODE_DTYPES, help="the decode step's "
                    "linear weights: auto (default; float16 on the CPU, about twice as fast as "
                    "float32), float32 (the prefill's numerics), float16 or bfloat16")  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ui.configure(args.model, allow_hub_models=args.allow_hub_models, decode_dtype=args.dtype)
    demo = build_demo(default_model=ui.MODELS.default)
    demo.queue(default_concurrency_limit=1, max_size=128)  # a class: ~30 pages x a few events
    # The model worker runs on this (the main) thread, the first to compute with torch:
    # its OpenMP workers stay hot (pagekv/engine/worker.py). Load the default model here.
    import torch

    torch.ones(1 << 17).add_(1).sum()  # this thread's OpenMP team comes first
    try:
        ui.get_study(args.model)
    except Exception as e:  # no model here: the app serves and each run says what to do
        log.warning("no model loaded at start: %s", " ".join(str(e).split()))
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        show_error=False,
        **launch_assets(),
        prevent_thread_lock=True,
    )
    if not args.no_warm:
        lessons_ui.warm_in_background(ui.MODELS.default)
    try:
        WORKER.serve_forever()
    except KeyboardInterrupt:
        log.info("stopping")
    finally:
        demo.close()


if __name__ == "__main__":
    main()
