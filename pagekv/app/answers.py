"""The answers table: one builder for the app's table and the CLI's.

`run_cells(result)` (`pagekv.runtime.result`) reads what a finished run shows
(verdict, answer, stored tokens, needle kept, UOR, eviction time) from its `RunResult`
(docs/schema.md); the app lays the cells out as a table row (`answers_table`), the CLI
as text (`pagekv.cli`).
While a run decodes, `pending_table` shows what planning alone knows.
"""

from __future__ import annotations

import html

from pagekv.app.figures import needle_page_counts
from pagekv.runtime.result import run_cells

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
    kept, total = needle_page_counts(comp.plan_of(key), needle)
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
