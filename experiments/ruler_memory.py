"""Physical memory on RULER: what a kept set holds in a paged cache, and each press
matched to our rows at equal memory, in a table and a figure (issue 58).

A cache paged per (layer, KV head), like `pagekv.runtime.paged_cache.PagedCache`,
holds the 16-token pages a kept set touches in each (layer, KV head). Two measures of
one answer's memory, both in pages of 16:

- `pages_sum`: those pages summed over every (layer, KV head): a cache with a block
  table per (layer, KV head) (ours, KV-Compress's, KVzip's own code);
- `pages_max`: the most-loaded (layer, KV head)'s pages times the count of (layer, KV
  head)s: a cache that gives every (layer, KV head) the same pages (vLLM's).

Each answer row of docs/ruler.jsonl that carries them has `pages_sum`, `pages_16` (the
most-loaded (layer, KV head)'s pages), `cells` (the (layer, KV head) count) and
`context_pages` (the compressed context's pages), so `fraction` is either measure over
the full cache's.
"""

from __future__ import annotations

from collections import defaultdict

#: Tokens a page holds in both measures.
PAGE = 16
MEASURES = ("pages_sum", "pages_max")


def memory_fields(pages, n_context: int) -> dict:
    """The memory fields of an answer row from `pages`, `[L][G]` pages of `PAGE` tokens
    each (layer, KV head) touches (a tensor or nested lists), for a context of
    `n_context` tokens."""
    flat = [int(p) for row in (pages.tolist() if hasattr(pages, "tolist") else pages) for p in row]
    return {
        "pages_sum": sum(flat),
        "pages_16": max(flat),
        "cells": len(flat),
        "context_pages": -(-int(n_context) // PAGE),
    }


def plan_memory(plan) -> dict:
    """`memory_fields` of a `pagekv.maths.plan.Plan`'s kept tokens (`plan.keep`, bool
    `[L, G, n]`): for a plan in pages of 16, its kept pages."""
    from pagekv.maths.paging import pages_touched

    return memory_fields(pages_touched(plan.keep, PAGE), plan.n)


def memory(row: dict, measure: str) -> int | None:
    """A row's memory in pages under `measure` (`MEASURES`); None where not recorded."""
    if row.get("pages_sum") is None:
        return None
    if measure == "pages_sum":
        return int(row["pages_sum"])
    if measure == "pages_max":
        return int(row["pages_16"]) * int(row["cells"])
    raise ValueError(f"measure {measure!r}; choose from {MEASURES}")


def fraction(row: dict, measure: str) -> float | None:
    """`memory` over the full cache's (every (layer, KV head) holding every page)."""
    got = memory(row, measure)
    return None if got is None else got / (int(row["cells"]) * int(row["context_pages"]))


def prompt_of(r: dict) -> tuple:
    return r["model"], r["length"], r["task"], r["index"], r["mode"]


def press_of(method: str) -> str:
    """A press row's press: `"kvzip 10%"` -> `"kvzip"`."""
    return method.split(" ")[0]


def match(rows: list[dict], press: str, ours: str, size) -> list[dict]:
    """Per prompt that our method `ours` answered: `press`'s run on it (of any budget)
    with the most memory (`size(row)`) that is at most ours, the one that keeps the most
    tokens among runs of equal memory (KVzip's runs may all fill the fullest (layer, KV
    head)), or its smallest run where none fits (marked `over`). The picked rows, each
    renamed `"{press} at {ours}'s memory"` and carrying `ours_score`, our score on that
    prompt."""
    runs, mine = defaultdict(list), {}
    for r in rows:
        got = size(r)
        if got is None or r.get("score") is None:
            continue
        if r["method"] == ours:
            mine[prompt_of(r)] = (got, r["score"])
        elif press_of(r["method"]) == press and r["method"] != ours:
            runs[prompt_of(r)].append((got, r))
    out = []
    for key, (limit, score) in mine.items():
        if not runs[key]:
            continue
        fits = [run for run in runs[key] if run[0] <= limit]
        most = lambda run: (run[0], run[1].get("kept_tokens") or 0)  # noqa: E731
        _, pick = max(fits, key=most) if fits else min(runs[key], key=most)
        out.append(pick | {"method": f"{press} at {ours}'s memory", "over": not fits,
                           "ours_score": score})  # fmt: skip
    return out


def task_mean(rows: list[dict], key: str = "score") -> float | None:
    """The mean over tasks of each task's mean `key` (the tables' `mean`)."""
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r[key])
    if not by_task:
        return None
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)


def equal_memory(rows: list[dict], ours: list[str], presses: list[str]) -> list[dict]:
    """Per method of `ours` with answers (of one block): its mean score, its memory (the
    mean `fraction` in each measure), and per press and measure the press matched to it
    on each prompt (`match`): both means of task means on those prompts, their count
    and how many were `over`."""
    out = []
    for name in ours:
        mine = [r for r in rows if r["method"] == name and r.get("pages_sum") is not None]
        if not mine:
            continue
        entry = {"ours": name, "score": task_mean(mine), "prompts": len(mine),
                 "memory": {m: sum(fraction(r, m) for r in mine) / len(mine) for m in MEASURES},
                 "presses": {}}  # fmt: skip
        for press in presses:
            for m in MEASURES:
                got = match(rows, press, name, lambda r, m=m: memory(r, m))
                if got:
                    entry["presses"].setdefault(press, {})[m] = {
                        "press": task_mean(got), "ours": task_mean(got, "ours_score"),
                        "prompts": len(got), "over": sum(r["over"] for r in got),
                    }  # fmt: skip
        out.append(entry)
    return out


def equal_memory_table(rows: list[dict], ours: list[str], presses: list[str]) -> list[str]:
    """Markdown of `equal_memory`: a row per method of ours, a column per press and
    measure, each cell `press vs ours (prompts, N over)`."""
    head = ["ours", "score", "memory (sum / max)"]
    head += [f"{p} at {m}" for p in presses for m in MEASURES]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for e in equal_memory(rows, ours, presses):
        fr = e["memory"]
        cells = [e["ours"], f"{e['score']:.2f}", f"{fr['pages_sum']:.1%} / {fr['pages_max']:.1%}"]
        for press in presses:
            for m in MEASURES:
                got = e["presses"].get(press, {}).get(m)
                over = f", {got['over']} over" if got and got["over"] else ""
                cells.append(f"{got['press']:.2f} vs {got['ours']:.2f} ({got['prompts']}{over})"
                             if got else "-")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def curves(rows: list[dict], measure: str) -> dict[str, list[tuple[float, float, str]]]:
    """Per method family (a method less its budget: `"kvzip"`, `"entropy
    reconstruct/global"`), its points `(mean memory fraction, mean of task means,
    method)` in order of memory, over the rows given (one block's, on one prompt set)."""
    by_method = defaultdict(list)
    for r in rows:
        if r.get("pages_sum") is not None and r.get("score") is not None:
            by_method[r["method"]].append(r)
    out = defaultdict(list)
    for method, got in by_method.items():
        family = " ".join(w for w in method.split(" ") if not w.endswith("%")) or method
        x = sum(fraction(r, measure) for r in got) / len(got)
        out[family].append((x, task_mean(got), method))
    return {k: sorted(v) for k, v in sorted(out.items())}


#: Line colours of the figure, in order of the families (a colour-blind-safe set).
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#999999")  # fmt: skip


def figure_svg(panels: dict, title: str) -> str:
    """An SVG: score against physical memory as a fraction of the full cache, one line
    per method family, a panel per measure (`panels`: `{measure: curves(rows, measure)}`)."""
    W, H, pad, gap = 330, 260, 48, 70
    panels = [panels[m] for m in MEASURES]
    families = sorted({f for p in panels for f in p})
    colour = {f: COLOURS[i % len(COLOURS)] for i, f in enumerate(families)}
    width = 2 * W + gap + 2 * pad
    height = H + 2 * pad + 18 * len(families)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{pad}" y="20" font-size="14">{_esc(title)}</text>']  # fmt: skip
    for i, (measure, panel) in enumerate(zip(MEASURES, panels, strict=True)):
        x0, y0 = pad + i * (W + gap), pad
        X = lambda f, x0=x0: x0 + f * W  # noqa: E731
        Y = lambda s, y0=y0: y0 + (1 - s) * H  # noqa: E731
        out.append(f'<rect x="{x0}" y="{y0}" width="{W}" height="{H}" fill="none" '
                   'stroke="#444"/>')  # fmt: skip
        for t in (0, 0.25, 0.5, 0.75, 1.0):
            out.append(f'<text x="{X(t):.0f}" y="{y0 + H + 14}" text-anchor="middle">'
                       f'{t:.0%}</text>')  # fmt: skip
            out.append(f'<text x="{x0 - 6}" y="{Y(t) + 4:.0f}" text-anchor="end">{t:.2f}</text>')
            out.append(f'<line x1="{x0}" x2="{x0 + W}" y1="{Y(t):.0f}" y2="{Y(t):.0f}" '
                       'stroke="#ddd"/>')  # fmt: skip
        out.append(f'<text x="{x0 + W / 2}" y="{y0 + H + 30}" text-anchor="middle">'
                   f'{measure}: memory, fraction of the full cache</text>')  # fmt: skip
        if i == 0:
            out.append(f'<text x="14" y="{y0 + H / 2}" transform="rotate(-90 14 {y0 + H / 2})" '
                       'text-anchor="middle">score (mean of task means)</text>')  # fmt: skip
        for family, points in panel.items():
            path = " ".join(f"{X(x):.1f},{Y(s):.1f}" for x, s, _ in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour[family]}" '
                       'stroke-width="2"/>')  # fmt: skip
            for x, s, method in points:
                out.append(f'<circle cx="{X(x):.1f}" cy="{Y(s):.1f}" r="3" '
                           f'fill="{colour[family]}"><title>{_esc(method)}: {s:.2f} at '
                           f'{x:.1%}</title></circle>')  # fmt: skip
    for j, family in enumerate(families):
        y = pad + H + 50 + 18 * j
        out.append(f'<line x1="{pad}" x2="{pad + 24}" y1="{y - 4}" y2="{y - 4}" '
                   f'stroke="{colour[family]}" stroke-width="3"/>')  # fmt: skip
        out.append(f'<text x="{pad + 30}" y="{y}">{_esc(family)}</text>')
    return "\n".join([*out, "</svg>"]) + "\n"


def _esc(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
