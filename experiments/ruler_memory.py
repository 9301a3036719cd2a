"""Physical memory on RULER: what one answer's kept set costs in three cache layouts, each
rival matched to ours at equal memory per prompt, differences with bootstrap intervals,
and a figure of score against memory.

A kept set (which tokens each (layer, KV head) keeps) costs different memory in
different caches. Counted in pages of `PAGE` tokens, per answer row:

- `gathered`: each (layer, KV head)'s kept tokens, rounded up to whole pages, summed.
  A cache that compacts after eviction holds a kept set this way: pagekv's own decode
  pool (`pagekv.runtime.paged_cache.PagedCache.gathered` copies each (layer, KV head)'s
  kept tokens into fresh blocks, `ceil(kept / P)` of them), KVzip's own code (a
  flattened cache that packs each head's kept tokens) and any compacting cache. There a
  token-level kept set costs its token count, not the pages it touches.
- `in_place`: the pages the kept tokens touch, per (layer, KV head), summed. A paged
  cache that frees a block only when none of its tokens is kept, and never moves a
  token, holds a kept set this way.
- `uniform`: the fullest (layer, KV head)'s touched pages times the count of (layer, KV
  head)s. A cache that gives every KV head of a layer the same blocks (a block table
  per layer, not per head) holds it this way.

For a plan in whole pages of `PAGE` (ours at pages of 16) `gathered == in_place`: every
kept page is full but the prompt's last. For a token-level kept set `gathered <=
in_place <= uniform`.

Row fields (`assets/results/ruler.jsonl`): `gathered_pages` (the `gathered` count), `pages_sum`
(`in_place`), `pages_16` (the fullest (layer, KV head)'s touched pages), `cells` (the
(layer, KV head)s) and `context_pages` (the compressed context's pages), so `fraction`
is any layout's memory over the full cache's. Where `gathered_pages` was not recorded
it is derived when the method fixes it (`gathered`), else unknown.
"""

from __future__ import annotations

import random
from collections import defaultdict

#: Tokens a page holds in every layout.
PAGE = 16
LAYOUTS = ("gathered", "in_place", "uniform")
#: A rival's run matches ours when its memory lies within this share of ours.
TOLERANCE = 0.10
#: Bootstrap resamples of the prompts, and the interval's coverage.
RESAMPLES = 2000
COVERAGE = 0.95


def _flat(x) -> list[int]:
    rows = x.tolist() if hasattr(x, "tolist") else x
    return [int(v) for row in rows for v in row]


def memory_fields(pages, n_context: int, kept=None) -> dict:
    """The memory fields of an answer row.

    Args:
        pages: `[L][G]` pages of `PAGE` tokens each (layer, KV head)'s kept set touches
            (a tensor or nested lists).
        n_context: the compressed context's tokens.
        kept: `[L][G]` tokens each (layer, KV head) keeps; None: `gathered_pages` is
            not recorded.

    >>> memory_fields([[2, 3], [1, 3]], 40, kept=[[17, 40], [3, 33]])
    {'pages_sum': 9, 'pages_16': 3, 'cells': 4, 'context_pages': 3, 'gathered_pages': 9}
    """
    flat = _flat(pages)
    out = {
        "pages_sum": sum(flat),
        "pages_16": max(flat),
        "cells": len(flat),
        "context_pages": -(-int(n_context) // PAGE),
    }
    if kept is not None:
        out["gathered_pages"] = sum(-(-k // PAGE) for k in _flat(kept))
    return out


def plan_memory(plan) -> dict:
    """`memory_fields` of a `pagekv.maths.plan.Plan`'s kept tokens (`plan.keep`, bool
    `[L, G, n]`), in every layout."""
    from pagekv.maths.paging import pages_touched

    return memory_fields(pages_touched(plan.keep, PAGE), plan.n, kept=plan.keep.sum(-1))


def press_of(method: str) -> str:
    """A press row's press: `"kvzip 10%"` -> `"kvzip"`."""
    return method.split(" ")[0]


def family_of(method: str) -> str:
    """A method less its budget: `"kvzip 10%"` -> `"kvzip"`, `"entropy reconstruct/global
    10% (pages of 1)"` -> `"entropy reconstruct/global (pages of 1)"`."""
    return " ".join(w for w in method.split(" ") if not w.endswith("%")) or method


def gathered(row: dict) -> int | None:
    """A row's `gathered` pages: as recorded, else where its method fixes them, else
    None. Fixed by the method:

    - a page plan of ours in pages of `PAGE` (`page_size` given as `PAGE`): its kept
      pages are full but the prompt's last, so `ceil(kept / PAGE)` is the pages touched:
      `pages_sum`;
    - kvpress's ChunkKV in chunks of `PAGE` (`chunk_length`): its chunks start at
      multiples of the chunk length and every head of a layer keeps the same ones, so a
      chunk is a page: `pages_sum`;
    - a kvpress scorer press that keeps the same count in every head (KeyDiff,
      SnapKV: `ScorerPress` keeps `int(n * (1 - ratio))` per head; the row's mean and
      fullest (layer, KV head) agree): `cells * ceil(kept / PAGE)`.

    KVzip keeps a different count in each (layer, KV head); its rows need
    `gathered_pages` recorded."""
    if row.get("gathered_pages") is not None:
        return int(row["gathered_pages"])
    if row.get("pages_sum") is None:
        return None
    if row.get("page_size") == PAGE or row.get("chunk_length") == PAGE:
        return int(row["pages_sum"])
    kept, most = row.get("kept_tokens"), row.get("kept_tokens_max")
    if row.get("per_head_count") and kept is not None and kept == most:
        return int(row["cells"]) * -(-int(kept) // PAGE)
    return None


def memory(row: dict, layout: str) -> int | None:
    """A row's memory in pages under `layout` (`LAYOUTS`); None where not recorded."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}; choose from {LAYOUTS}")
    if row.get("pages_sum") is None:
        return None
    if layout == "gathered":
        return gathered(row)
    if layout == "in_place":
        return int(row["pages_sum"])
    return int(row["pages_16"]) * int(row["cells"])


def full_pages(row: dict) -> int:
    """The full cache's pages: every (layer, KV head) holding every context page."""
    return int(row["cells"]) * int(row["context_pages"])


def fraction(row: dict, layout: str) -> float | None:
    """`memory` over the full cache's."""
    got = memory(row, layout)
    return None if got is None else got / full_pages(row)


def prompt_of(r: dict) -> tuple:
    return r["model"], r["length"], r["task"], r["index"], r["mode"]


def match(rows: list[dict], rival: str, ours: str, layout: str) -> tuple[list[dict], int]:
    """Per prompt that our method `ours` answered with its memory known in `layout`: the
    run of the family `rival` (`family_of`, any budget) whose memory is nearest ours
    (the smallest `|log(theirs / ours)|`; among equals the one keeping the most tokens),
    provided it lies within `TOLERANCE` of ours.

    Returns the picked rows, each carrying `ours_score` (ours on that prompt) and
    `ratio` (its memory over ours), and the count of prompts where the rival ran but no
    run lay within the tolerance (left out)."""
    import math

    runs, mine = defaultdict(list), {}
    for r in rows:
        got = memory(r, layout)
        if got is None or r.get("score") is None:
            continue
        if r["method"] == ours:
            mine[prompt_of(r)] = (got, r["score"])
        elif family_of(r["method"]) == rival:
            runs[prompt_of(r)].append((got, r))
    out, unmatched = [], 0
    for key, (limit, score) in mine.items():
        if not runs[key]:
            continue
        got, pick = min(runs[key], key=lambda run, limit=limit: (
            abs(math.log(max(run[0], 1) / max(limit, 1))), -(run[1].get("kept_tokens") or 0)
        ))  # fmt: skip
        ratio = got / limit if limit else float("inf")
        if abs(ratio - 1) > TOLERANCE:
            unmatched += 1
            continue
        out.append(pick | {"ours_score": score, "ratio": ratio})
    return out, unmatched


def task_mean(rows: list[dict], key: str = "score") -> float | None:
    """The mean over tasks of each task's mean `key` (the tables' `mean`)."""
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r[key])
    if not by_task:
        return None
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)


def bootstrap(pairs: list[tuple[str, float]], seed: int = 0) -> tuple[float, float, float]:
    """A difference's mean of task means and its `COVERAGE` percentile interval:
    `pairs` are `(task, difference)` per prompt; each resample draws, within every task,
    as many prompts as it has, with replacement (`RESAMPLES` times, seeded)."""
    by_task = defaultdict(list)
    for task, d in pairs:
        by_task[task].append(d)
    tasks = [v for _, v in sorted(by_task.items())]

    def mean_of(groups):
        return sum(sum(g) / len(g) for g in groups) / len(groups)

    rng = random.Random(seed)
    draws = sorted(mean_of([rng.choices(v, k=len(v)) for v in tasks]) for _ in range(RESAMPLES))
    tail = (1 - COVERAGE) / 2
    lo, hi = draws[int(tail * RESAMPLES)], draws[int((1 - tail) * RESAMPLES) - 1]
    return mean_of(tasks), lo, hi


def compare(rows: list[dict], rival: str, ours: str, layout: str) -> dict | None:
    """The rival family against our method at equal memory in `layout` (`match`): both
    means of task means on the matched prompts, the difference `rival - ours` with its
    bootstrap interval (`bootstrap`), `leader` ("rival", "ours", or "tie" where the
    interval holds 0), the memory ratios the matches used, and the counts of matched and
    left-out prompts. None where no prompt matched."""
    got, unmatched = match(rows, rival, ours, layout)
    if not got:
        if not unmatched:
            return None
        return {"rival": rival, "ours": ours, "layout": layout, "leader": "none",
                "prompts": 0, "unmatched": unmatched}  # fmt: skip
    diff, lo, hi = bootstrap([(r["task"], r["score"] - r["ours_score"]) for r in got])
    ratios = [r["ratio"] for r in got]
    leader = "tie" if lo <= 0 <= hi else "rival" if diff > 0 else "ours"
    return {
        "rival": rival, "ours": ours, "layout": layout, "leader": leader,
        "rival_score": task_mean(got), "ours_score": task_mean(got, "ours_score"),
        "diff": diff, "low": lo, "high": hi,
        "ratio_mean": sum(ratios) / len(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios), "prompts": len(got), "unmatched": unmatched,
    }  # fmt: skip


def verdict(c: dict, rival: str, ours: str) -> str:
    """Who leads in `c` (`compare`), in words, with the lead's 95 % interval: a lead
    needs an interval clear of 0, else it is a tie. The lessons' words
    (`pagekv.app.lessons.said`), and the prompts where no run matched."""
    if c["leader"] == "none":
        return f"no {rival} run within {TOLERANCE:.0%} of ours' memory ({c['unmatched']} prompts)"
    from pagekv.app.lessons import said

    return said(c, rival, ours)


def equal_memory(rows: list[dict], ours: list[str], rivals: list[str]) -> list[dict]:
    """Per method of `ours` with answers: its mean score and prompts, its mean memory
    `fraction` in each layout (over the rows where known), and per rival family and
    layout its `compare`."""
    out = []
    for name in ours:
        mine = [r for r in rows if r["method"] == name and r.get("pages_sum") is not None]
        if not mine:
            continue
        mem = {}
        for lay in LAYOUTS:
            known = [f for f in (fraction(r, lay) for r in mine) if f is not None]
            mem[lay] = sum(known) / len(known) if known else None
        entry = {"ours": name, "score": task_mean(mine), "prompts": len(mine), "memory": mem,
                 "rivals": {}}  # fmt: skip
        for rival in rivals:
            if rival == family_of(name):
                continue
            for lay in LAYOUTS:
                got = compare(rows, rival, name, lay)
                if got:
                    entry["rivals"].setdefault(rival, {})[lay] = got
        out.append(entry)
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def equal_memory_table(rows: list[dict], ours: list[str], rivals: list[str]) -> list[str]:
    """Markdown of `equal_memory`: a line per (our method, rival, layout) with both
    scores on the matched prompts, the difference and its interval, the memory ratio
    the matches used, and the prompts matched and left out."""
    head = ["ours", "memory (gathered / in place / uniform)", "rival", "layout",
            "rival vs ours", "difference (95 % interval)", "memory ratio", "prompts"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for e in equal_memory(rows, ours, rivals):
        mem = " / ".join(_pct(e["memory"][lay]) for lay in LAYOUTS)
        for rival, by_layout in e["rivals"].items():
            for lay, c in by_layout.items():
                if c["leader"] == "none":
                    none = f"- | no run within {TOLERANCE:.0%} | - | 0, {c['unmatched']} left out"
                    lines.append(f"| {e['ours']} | {mem} | {rival} | {lay} | {none} |")
                    continue
                tie = ", tie" if c["leader"] == "tie" else ""
                left = f", {c['unmatched']} left out" if c["unmatched"] else ""
                lines.append(
                    f"| {e['ours']} | {mem} | {rival} | {lay} | {c['rival_score']:.2f} vs "
                    f"{c['ours_score']:.2f} | {c['diff']:+.2f} ({c['low']:+.2f} to "
                    f"{c['high']:+.2f}{tie}) | {c['ratio_mean']:.2f} ({c['ratio_min']:.2f}-"
                    f"{c['ratio_max']:.2f}) | {c['prompts']}{left} |"
                )
    return [*lines, ""]


def curves(rows: list[dict], layout: str) -> dict[str, list[tuple[float, float, str]]]:
    """Per method family (`family_of`), its points `(mean memory fraction, mean of task
    means, method)` in order of memory, over the rows given (one block's, on one prompt
    set) whose memory is known in `layout`."""
    by_method = defaultdict(list)
    for r in rows:
        if memory(r, layout) is not None and r.get("score") is not None:
            by_method[r["method"]].append(r)
    out = defaultdict(list)
    for method, got in by_method.items():
        x = sum(fraction(r, layout) for r in got) / len(got)
        out[family_of(method)].append((x, task_mean(got), method))
    return {k: sorted(v) for k, v in sorted(out.items())}


#: Line colours of the figure, in order of the families (a colour-blind-safe set).
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#999999", "#8C564B", "#882255")  # fmt: skip


def figure_svg(panels: dict, title: str, full: float | None = None) -> str:
    """An SVG: score against memory as a fraction of the full cache, one line per method
    family (mean pooling's dashed), a panel per layout (`panels`: `{layout: curves(rows,
    layout)}`); `full`, the full cache's score, a point at 100 % in each panel."""
    W, H, pad, gap = 300, 250, 48, 56
    panels = [panels[lay] for lay in LAYOUTS]
    families = sorted({f for p in panels for f in p})
    colour = {f: COLOURS[i % len(COLOURS)] for i, f in enumerate(families)}
    width = len(LAYOUTS) * W + (len(LAYOUTS) - 1) * gap + 2 * pad
    height = H + 2 * pad + 18 * (len(families) + (full is not None))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{pad}" y="20" font-size="14">{_esc(title)}</text>']  # fmt: skip
    for i, (layout, panel) in enumerate(zip(LAYOUTS, panels, strict=True)):
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
                   f'{layout}: memory, share of the full cache</text>')  # fmt: skip
        if i == 0:
            out.append(f'<text x="14" y="{y0 + H / 2}" transform="rotate(-90 14 {y0 + H / 2})" '
                       'text-anchor="middle">score (mean of task means)</text>')  # fmt: skip
        for family, points in panel.items():
            path = " ".join(f"{X(x):.1f},{Y(s):.1f}" for x, s, _ in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour[family]}" '
                       f'stroke-width="2"{_dash(family)}/>')  # fmt: skip
            for x, s, method in points:
                out.append(f'<circle cx="{X(x):.1f}" cy="{Y(s):.1f}" r="3" '
                           f'fill="{colour[family]}"><title>{_esc(method)}: {s:.2f} at '
                           f'{x:.1%}</title></circle>')  # fmt: skip
        if full is not None:
            out.append(f'<rect x="{X(1) - 4:.1f}" y="{Y(full) - 4:.1f}" width="8" height="8" '
                       f'fill="#000"><title>full cache: {full:.2f}</title></rect>')  # fmt: skip
    legend = [(f, colour[f], "line") for f in families]
    if full is not None:
        legend.append(("full cache", "#000", "square"))
    for j, (name, c, kind) in enumerate(legend):
        y = pad + H + 50 + 18 * j
        if kind == "line":
            out.append(f'<line x1="{pad}" x2="{pad + 24}" y1="{y - 4}" y2="{y - 4}" '
                       f'stroke="{c}" stroke-width="3"{_dash(name)}/>')  # fmt: skip
        else:
            out.append(f'<rect x="{pad + 8}" y="{y - 8}" width="8" height="8" fill="{c}"/>')
        out.append(f'<text x="{pad + 30}" y="{y}">{_esc(name)}</text>')
    return "\n".join([*out, "</svg>"]) + "\n"


def _dash(family: str) -> str:
    """Mean pooling's lines are dashed, so a family's pooling reads apart from its colour."""
    return ' stroke-dasharray="6,3"' if family.startswith("mean ") else ""


def _esc(text: str) -> str:
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
