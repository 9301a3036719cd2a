"""The views of a comparison (`pagekv.engine.comparison`): its figures, its answers
table, its export, and how many prompts like its own a fixed pool holds (`pool_rows`,
the Capacity view, beside the committed capacity benchmark).

    figs = comparison_figures(comp, layer=0)
    rows = answers_table(comp)             # full, A and B: verdict, answer, stored, ...
    paths = export(comp, figs, folder)     # the numbers and every figure

The answers table reads each run's cells with `pagekv.runtime.result.run_cells`, the
cells the CLI's table prints too; while a run decodes, `pending_table` shows what
planning alone knows.

Drawing only: the comparison is planned and decoded below the views. What is drawn is
kept in the study's memos (`pagekv.engine.study`), each entry a dict with its `nbytes`:

- **a finished run's views** (`view_key`, in `Study.results`): the detached comparison,
  its figures and its answers table (the run handler stores them);
- **a preview's plan views** (`preview_views`, in `Study.plans`): a dragged slider draws
  them, and the run its release sends with the same settings draws only what decoding
  adds;
- **single figures by content** (`memo_figure`, in `Study.plans`): the views of head
  weights and sink mass draw tensors that the budget does not change (they come from the
  prefill's profiles, tau, n_sink and the window). Drawing a plotly figure costs tens of
  milliseconds of Python, on the thread that shares the CPU with the decode; drawing it
  once per content saves that on every release.

      fig = memo_figure(memo, "weights", (plan.weights_isolated, layer), lambda: draw())

  The key is the builder's name and a digest of its inputs' values (tensors by dtype,
  shape and bytes; numbers, strings and tuples by value), so a memoised figure is the
  one the builder would draw now.

A figure is shared by every request that draws the same content: nothing may change a
figure after it is drawn (none of our code does; Gradio only serialises it).
"""

from __future__ import annotations

import hashlib
import html
import json
import os

import numpy as np
import torch

from pagekv.app import figures
from pagekv.app.figures.style import POLICY_COLOURS
from pagekv.engine.comparison import Comparison, Side, export_data, side_labels
from pagekv.engine.memo import ByteLRU, nbytes
from pagekv.maths.metrics import sink_advantage
from pagekv.paths import CAPACITY_RESULTS_PATH
from pagekv.runtime.paged_cache import blocks_needed
from pagekv.runtime.result import run_cells

#: Views that planning alone draws (a dragged slider updates these, without decoding).
PREVIEW_VIEWS = ("frame", "retention", "uor", "stored", "memory", "capacity", "glance")
#: Plan views that decoding leaves as they are (retention is redrawn: the decoded records
#: measure what the compacted cache stores, padding included).
SAME_AFTER_DECODING = ("frame", "uor", "stored", "memory", "capacity", "glance")
#: Bytes per value a figure is counted at (plotly objects of numbers and hover strings;
#: measuring their JSON instead would cost as much as drawing them).
BYTES_PER_VALUE = 64


def view_key(spec, a: Side, b: Side, layer: int) -> tuple:
    """What identifies a finished run's views in its study: the prompt, both `Side`s,
    the layer."""
    return ("views", spec, a, b, layer)


def preview_views(comp: Comparison, key: tuple, layer: int, memo: ByteLRU) -> dict:
    """The plan views of `comp` (`PREVIEW_VIEWS`) for the run `key` (`view_key`), drawn or
    kept from a preview with the same settings (in `memo`, the study's plan memo, under
    `("preview views", *key)`)."""
    preview_key = ("preview views", *key)
    hit = memo.get(preview_key)
    if hit is not None:
        return hit["figs"]
    figs = comparison_figures(comp, layer=layer, only=PREVIEW_VIEWS, memo=memo)
    memo.put(preview_key, {"figs": figs, "nbytes": view_size(None, figs)})
    return figs


def comparison_figures(
    comp: Comparison, layer: int = 0, only=None, skip=(), memo: ByteLRU | None = None
) -> dict:
    """Every view of the app, as plotly figures keyed by name (`only`: just these names,
    e.g. the plan views while a slider is dragged; `skip`: not these, e.g. views already
    drawn; building figures is most of the cost of a run served from memory). The views
    that the budget does not change are drawn once per content into `memo` (the study's
    plan memo; None: drawn every time)."""
    pa, pb = comp.plan_of("A"), comp.plan_of("B")
    labels = comp.labels or side_labels(Side(comp.configs["A"]), Side(comp.configs["B"]))
    G = comp.n_groups
    r = pb.head_weights.shape[1] // G
    needle = comp.prep.needle_positions or None
    layer = max(0, min(int(layer), pa.keep.shape[0] - 1))
    feasible = [x for x in comp.curve if x["feasible"]]
    curve = [[x[k] for x in feasible] for k in ("budget", "uor_mean", "uor_max")]
    both = (("A", labels["A"]), ("B", labels["B"]))

    def overview(name: str, values, title: str):  # a layer x head heatmap of side B
        return lambda: memo_figure(
            memo, name, (values, G), lambda: figures.layer_head_heatmap(values, G, title, zmax=1.0)
        )

    builders = {
        "frame": lambda: figures.page_frame(
            {lab: comp.plan_of(key) for key, lab in both},
            {lab: comp.needle_positions_of(key) for key, lab in both},
        ),
        # Side B's head weights and sink mass: the budget changes none of them, so
        # they are drawn once per content (`memo_figure`), not on every release.
        "weights": lambda: memo_figure(
            memo,
            "weights",
            (pb.weights_isolated, pb.weights_nosink, pb.sink_heads, G, layer),
            lambda: figures.head_weights_bars(pb, layer),
        ),
        "weights_overview": overview(
            "weights_overview", pb.weights_isolated, "Page-EntroKV head weights, every layer x head"
        ),
        "sink_mass": overview(
            "sink_mass", pb.sink_mass, "Sink mass per layer x head (first n_sink tokens)"
        ),
        "sink_advantage": lambda: memo_figure(
            memo,
            "sink_advantage",
            (pb.weights_isolated, pb.weights_nosink, pb.sink_heads, G),
            lambda: figures.sink_advantage_lines(
                sink_advantage(pb.weights_isolated, pb.sink_heads, G),
                sink_advantage(pb.weights_nosink, pb.sink_heads, G),
            ),
        ),
        # The curve does not change while a budget is dragged: drawn once per curve.
        "uor": lambda: memo_figure(
            memo, "uor", (*curve, r), lambda: figures.uor_curve(*curve, r=r)
        ),
        "memory": lambda: figures.memory_bars(comp.memory),
        "capacity": lambda: figures.capacity_bars(pool_rows(comp), measured(comp.model)),
        "stored": lambda: figures.union_over_budget_heatmap(
            {lab: comp.plan_of(key).union_tokens.tolist() for key, lab in both},
            {lab: comp.plan_of(key).budget_tokens for key, lab in both},
            r=r,
        ),
        "glance": lambda: figures.stored_glance(
            {lab: comp.plan_of(key).union_tokens.tolist() for key, lab in both},
            {lab: comp.plan_of(key).budget_tokens for key, lab in both},
            {lab: POLICY_COLOURS.get(comp.configs[key].policy) for key, lab in both},
            r=r,
        ),
    }
    if needle:
        builders["retention"] = lambda: figures.needle_retention_heatmap(
            {lab: comp.needle_retention_of(key) for key, lab in both}, G
        )
    return {
        k: build() for k, build in builders.items() if (only is None or k in only) and k not in skip
    }


def export(comp: Comparison, figs: dict, folder: str) -> list[str]:
    """Write `pagekv_run.json`, `pagekv_run.csv` (`export_data`) and
    `pagekv_figures.html` (every figure of `figs`) into `folder`; their paths."""
    paths = export_data(comp, folder)
    html = os.path.join(folder, "pagekv_figures.html")
    with open(html, "w") as f:
        f.write("<html><head><meta charset='utf-8'><title>Page-EntroKV run</title></head><body>")
        for i, (name, fig) in enumerate(figs.items()):
            f.write(f"<h2>{name}</h2>")
            f.write(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
        f.write("</body></html>")
    paths.append(html)
    return paths


def memo_figure(memo: ByteLRU | None, name: str, inputs: tuple, build):
    """The figure `build()` draws for `inputs`, drawn once per content into `memo`
    (module docstring; None: drawn now). `inputs` must hold everything `build` reads."""
    if memo is None:
        return build()
    key = content_key(name, inputs)
    hit = memo.get(key)
    if hit is not None:
        return hit["fig"]
    fig = build()
    memo.put(key, {"fig": fig, "nbytes": BYTES_PER_VALUE * max(1, figure_values(fig))})
    return fig


def content_key(name: str, inputs: tuple) -> tuple:
    """`("figure", name, digest)`: a digest of `inputs`' values (module docstring)."""
    h = hashlib.blake2b(digest_size=20)
    _feed(h, inputs)
    return "figure", name, h.hexdigest()


def _feed(h, value) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, (tuple, list)):
        h.update(f"({len(value)}".encode())
        for v in value:
            _feed(h, v)
        h.update(b")")
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    else:
        raise TypeError(f"content_key: cannot key a {type(value).__name__}")


def view_size(comp, figs: dict) -> int:
    """Bytes a run's views hold (about): the comparison's tensors and records (none for
    `comp=None`), and the figures' data arrays at `BYTES_PER_VALUE` a value."""
    held = 0 if comp is None else nbytes(comp)
    return held + BYTES_PER_VALUE * sum(figure_values(f) for f in figs.values() if f is not None)


def figure_values(fig) -> int:
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


# ------------------------------------------------------------------ the answers table

#: The answers table's columns (the caption explains stored, needle and needle pages).
ANSWER_HEADERS = [
    "run", "verdict", "answer", "stored max", "needle kept", "needle pages", "UOR max", "evict",
]  # fmt: skip
#: What each column holds, shown when the pointer rests on its header.
HEADER_TITLES = {
    "stored max": "tokens stored by the (layer, group) that stores the most",
    "needle kept": "fraction of the needle's tokens kept, mean over every (layer, group)",
    "needle pages": "(layer, group)s that keep every needle page, of all",
    "UOR max": "union of the heads' picks / the tokens one head keeps, largest (layer, group)",
    "evict": "time to plan and compact the cache",
}
#: Columns of numbers: never broken inside a figure.
NUMERIC = {"stored max", "needle kept", "needle pages", "UOR max", "evict"}
#: The rows of a comparison, in order.
ROWS = ("full", "A", "B")


def ms(seconds) -> str:
    """Milliseconds, or "-" for a step that did not run (the full cache evicts nothing)."""
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _labels(comp) -> dict:
    return {"full": "full cache", "A": comp.labels["A"], "B": comp.labels["B"]}


def answers_html(rows: list[list]) -> str:
    """The answers table as HTML: headers wrap between words only, figures never break,
    the answer column takes the room that is left; every cell is escaped text (a
    model's answer is shown, never rendered)."""

    def cell(value, header: str) -> str:
        text = html.escape(str(value), quote=False)
        if header == "run":  # long policy names may break after an underscore
            text = text.replace("_", "_<wbr>")
        cls = "num" if header in NUMERIC else header.replace(" ", "-")
        return f'<td class="{cls}">{text}</td>'

    head = "".join(
        f'<th title="{html.escape(HEADER_TITLES.get(h, h))}" '
        f'class="{"num" if h in NUMERIC else ""}">{html.escape(h)}</th>'
        for h in ANSWER_HEADERS
    )
    body = "".join(
        "<tr>" + "".join(cell(v, h) for v, h in zip(row, ANSWER_HEADERS, strict=True)) + "</tr>"
        for row in rows
    )
    return f'<table class="answers"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _needle_pages(comp, key) -> str:
    needle = comp.needle_positions_of(key)
    if not needle:
        return "-"
    kept, total = figures.needle_page_counts(comp.plan_of(key), needle)
    return f"{kept} of {total}"


def answers_table(comp) -> list[list]:
    """The decoded comparison's rows (`ANSWER_HEADERS`)."""
    rows = []
    for key in ROWS:
        c = run_cells(comp.records[key])
        needle = "-" if c["needle"] is None else f"{c['needle']:.2f}"
        rows.append(
            [_labels(comp)[key], c["verdict"], c["answer"], c["stored"], needle,
             _needle_pages(comp, key), f"{c['uor']:.2f}", ms(c["evict_s"])]
        )  # fmt: skip
    return rows


def pending_table(comp, tokens=None, tokenizer=None) -> list[list]:
    """The rows while decoding: the plan's numbers, the answers so far (`tokens`: A's
    and B's token ids from a streaming pass, decoded with `tokenizer`) or to come."""
    rows = []
    for i, key in enumerate(ROWS):
        p = comp.plan_of(key)
        if key in comp.records:  # already decoded (the full cache comes first)
            c = run_cells(comp.records[key])
            verdict, answer = c["verdict"], c["answer"]
        elif tokens is not None and key != "full":
            verdict = "..."
            answer = tokenizer.decode(tokens[i - 1], skip_special_tokens=True) + " ..."
        else:
            verdict, answer = "...", "decoding..."
        rows.append(
            [_labels(comp)[key], verdict, answer, int(p.union_tokens.max()), "-",
             _needle_pages(comp, key), f"{float(p.uor.max()):.2f}", "-"]
        )  # fmt: skip
    return rows


# ------------------------------------------------------------------ what a fixed pool holds
#
# What a budget buys: how many prompts like the current one a fixed pool holds at each
# side's budget, from the plans' kept pages (live), beside what the committed benchmark
# measured in such a pool (`benchmarks/bench_capacity.py`, measured earlier, not live).
# The pool holds `POOL_FULL_PROMPTS` full caches of this prompt with `ANSWER_TOKENS`
# answer tokens, in pages of 16 (the benchmark's pool, sized by its longest prompt).
# A prompt takes, per (layer, KV head), its stored tokens plus its question and answer
# tokens rounded up to its pages (what `Runner.serve` reserves at admission).

#: The benchmark's pool: the bytes of this many full caches of the prompt.
POOL_FULL_PROMPTS = 2
#: The answer tokens every prompt reserves (the benchmark's `--new`).
ANSWER_TOKENS = 24
#: The full cache's page size (the benchmark's).
FULL_PAGE = 16


def prompt_bytes(stored, extra: int, page: int, token_bytes: int) -> int:
    """The bytes a prompt whose (layer, KV head)s store `stored[l][g]` tokens takes in a
    pool of pages of `page` tokens, with `extra` more tokens each: the blocks
    `Runner.serve` reserves for it (`pagekv.runtime.paged_cache.blocks_needed`)."""
    return blocks_needed(stored, extra, page) * page * token_bytes


def pool_rows(comp) -> dict:
    """The pool and, for the full cache and each side, the bytes one prompt like
    `comp`'s takes and how many of them the pool holds."""
    pre = comp.prep.prefill
    token_bytes = pre.token_bytes
    L, G = pre.n_layers, pre.n_groups
    extra = len(pre.question_ids or ()) + ANSWER_TOKENS
    full = prompt_bytes([[comp.prep.n] * G] * L, extra, FULL_PAGE, token_bytes)
    pool = POOL_FULL_PROMPTS * full
    rows = [{"side": "full", "label": "full cache", "policy": "full", "bytes": full,
             "held": pool // full}]  # fmt: skip
    for key in ("A", "B"):
        prep, p = comp.preps.get(key, comp.prep), comp.plan_of(key)
        extra = len(prep.prefill.question_ids or ()) + ANSWER_TOKENS
        size = prompt_bytes(p.stored_counts(), extra, p.config.page_size, token_bytes)
        rows.append({"side": key, "label": comp.labels.get(key, key),
                     "policy": p.config.policy, "bytes": size, "held": pool // size})  # fmt: skip
    return {"pool_bytes": pool, "prompt_tokens": comp.prep.n, "rows": rows}


def load_capacity() -> dict | None:
    """The committed capacity benchmark (`CAPACITY_RESULTS_PATH`, written by
    `benchmarks/bench_capacity.py`), or None where it is missing."""
    try:
        return json.loads(CAPACITY_RESULTS_PATH.read_text())
    except FileNotFoundError:
        return None


def measured(model: str = "bundled", data: dict | None = None) -> dict | None:
    """The benchmark's block for `model` (`results[i]`, its `sides` keyed by name), with
    the CPU and the command; None where it was not measured."""
    data = load_capacity() if data is None else data
    if data is None:
        return None
    block = next((r for r in data["results"] if r["model"] == model), None)
    if block is None:
        return None
    return block | {"cpu": data["cpu"]["model"], "command": data["command"]}
