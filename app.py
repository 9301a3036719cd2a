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


def _ms(seconds) -> str:
    """Milliseconds, or "-" for a step that did not run (the full cache evicts nothing)."""
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _answers_table(comp) -> list[list]:
    rows = []
    for key, label in (("full", "full cache"), ("A", "policy A"), ("B", "policy B")):
        rec = comp.records[key]
        stored = max(rec["kept_tokens"], default=0)  # tokens stored per (layer, group)
        from pagekv.compare import retained_fraction

        ret = retained_fraction(rec)
        rows.append(
            [
                f"{label}: {rec['policy']}",
                "✓ right" if rec["correct"] else "✗ wrong",
                rec["answer"],
                stored,
                "-" if ret != ret else f"{ret:.2f}",
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
    layer,
    progress=gr.Progress(),  # noqa: B008 (gradio injects progress through this default)
):
    """Prefill (memoised), run full / A / B, and build every view. Never raises."""
    from pagekv.compare import compare, comparison_figures, export

    try:
        spec = _spec(
            task, context, depth, seed, needles, mode, curated, haystack, needle, question, answer
        )
        cfg_a = _config(policy_a, budget_pct, page_size, n_sink, window, tau)
        cfg_b = _config(policy_b, budget_pct, page_size, n_sink, window, tau)
        progress(0.0, desc="loading the model")
        study = get_study(model)
        comp = compare(study, spec, cfg_a, cfg_b, progress=progress)
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
            f"{comp.prep.n} prompt tokens, budget {cfg_b.budget_tokens(comp.prep.n)} tokens "
            f"per (layer, group), page size {cfg_b.page_size}. "
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
        memory=figs["memory"],
        files=files,
        layer=gr.update(maximum=n_layers - 1, value=min(int(layer), n_layers - 1)),
        last=comp,
    )


#: What a run fills, in the order of the run's outputs (`build_demo` wires the
#: components of the same names); `_views` turns keyword values into that tuple.
RUN_VIEWS = (
    "status", "answers", "frame", "retention", "weights", "overview", "sink_mass", "sink_adv",
    "uor", "memory", "files", "layer", "last",
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


# ----------------------------------------------------------------- layout

INTRO = """
# Page-EntroKV: which KV pages should a GQA group keep?
Under grouped-query attention, the *r* query heads of a group share one KV cache.
**Mean pooling** averages their attention and can drown the one head that found the
needle; **Page-EntroKV** weights each head by how *focused* it is (collision entropy,
after removing the attention-sink tokens) and keeps whole pages per (layer, group).
Pick a preset, then move the budget: only eviction and decoding re-run.

*What to expect on the bundled SmolLM2-135M (r = 3):* its heads within a group are
alike, so mean and entropy pooling keep 94-96 % of the same tokens and their answers
rarely differ (measured in `docs/results.md` of the repository); the
measured presets show where their caches differ most. The **Mechanism** tab shows, on
constructed heads, when the difference decides the answer.
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
                preset = gr.Dropdown(
                    [p["title"] for p in PRESETS], value=first["title"], label="Preset"
                )
                run_btn = gr.Button("Run", variant="primary")
                with gr.Accordion("Prompt", open=True):
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
                    demo.load(
                        lambda: curated_choices(first["task"], first["name"]),
                        None,
                        curated,
                        api_visibility="undocumented",
                    )
                    context = gr.Slider(
                        200, MAX_CONTEXT, value=first["context_tokens"], step=100,
                        label="Context length (tokens)",
                    )  # fmt: skip
                    depth = gr.Slider(0, 1, value=first["depth"], step=0.05, label="Needle depth")
                    needles = gr.Slider(1, 4, value=first["n_needles"], step=1, label="Needles")
                    seed = gr.Number(value=first["seed"], precision=0, label="Seed")
                    mode = gr.Radio(
                        ["inside", "after"],
                        value=first["mode"],
                        label="Question position",
                        info="after = asked after compression (the strict test)",
                    )
                    with gr.Accordion("Custom text", open=False):
                        haystack = gr.Textbox(lines=5, label="Haystack text")
                        needle = gr.Textbox(label="Needle sentence")
                        question = gr.Textbox(label="Question")
                        answer = gr.Textbox(label="Expected answer")
                with gr.Accordion("Eviction", open=True):
                    budget = gr.Slider(
                        1, 60, value=100 * first["budget"], step=0.5,
                        label="Budget (% of the prompt kept per layer and group)",
                    )  # fmt: skip
                    page_size = gr.Dropdown(PAGE_SIZES, value=first["page_size"], label="Page size")
                    policy_a = gr.Dropdown(
                        POLICY_CHOICES, value=first["policy_a"], label="Policy A"
                    )
                    policy_b = gr.Dropdown(
                        POLICY_CHOICES, value=first["policy_b"], label="Policy B"
                    )
                    with gr.Row():
                        n_sink = gr.Slider(0, 16, value=first["n_sink"], step=1, label="n_sink")
                        window = gr.Slider(1, 128, value=first["window"], step=1, label="Window")
                    tau = gr.Slider(0.1, 4.0, value=first["tau"], step=0.1, label="tau")
            with gr.Column(scale=3):
                status = gr.Markdown(_message("info", "Loading the first preset..."))
                gr.Markdown(CAPTIONS["answers"])
                answers = gr.Dataframe(
                    headers=["run", "verdict", "answer", "stored tokens", "needle kept", "UOR max",
                             "eviction"],
                    interactive=False,
                    wrap=True,
                    column_widths=["17%", "9%", "38%", "9%", "9%", "8%", "10%"],
                )  # fmt: skip
                with gr.Tabs():
                    with gr.Tab("Page frame"):
                        gr.Markdown(CAPTIONS["frame"])
                        frame = gr.Plot(elem_id="page-frame")
                    with gr.Tab("Needle retention"):
                        gr.Markdown(CAPTIONS["retention"])
                        retention = gr.Plot()
                    with gr.Tab("Head weights"):
                        gr.Markdown(CAPTIONS["overview"])
                        overview = gr.Plot()
                        gr.Markdown(CAPTIONS["weights"])
                        # Its range comes from the model of each run (RUN_VIEWS "layer").
                        layer = gr.Slider(0, 1, value=0, step=1, label="Layer")
                        weights = gr.Plot()
                    with gr.Tab("Sinks"):
                        gr.Markdown(CAPTIONS["sink"])
                        sink_mass = gr.Plot()
                        sink_adv = gr.Plot()
                    with gr.Tab("UOR and memory"):
                        gr.Markdown(CAPTIONS["uor"])
                        uor = gr.Plot()
                        memory = gr.Plot()
                    with gr.Tab("Mechanism (constructed)"):
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
                    with gr.Tab("Export"):
                        gr.Markdown("The run's numbers (JSON, CSV) and every figure (HTML).")
                        files = gr.File(label="Downloads", file_count="multiple")

        run_inputs = [
            model, task, context, depth, seed, needles, mode, curated, haystack, needle,
            question, answer, budget, page_size, n_sink, window, tau, policy_a, policy_b, layer,
        ]  # fmt: skip
        components = locals()
        run_outputs = [components[name] for name in RUN_VIEWS]
        preset_targets = [components[name] for name in PRESET_CONTROLS]
        run_kw = dict(fn=run_comparison, inputs=run_inputs, outputs=run_outputs)
        quiet = dict(api_visibility="undocumented")  # the same handler under another trigger
        run_btn.click(api_name="run", **run_kw)
        budget.release(api_name="budget", **run_kw)
        for control in (page_size, policy_a, policy_b):
            control.input(**run_kw, **quiet)
        for control in (tau, window, n_sink):
            control.release(**run_kw, **quiet)
        preset.input(apply_preset, preset, preset_targets, api_name="preset").then(
            **run_kw, **quiet
        )
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
        demo.load(**run_kw, **quiet).then(**mech_io, **quiet)
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
