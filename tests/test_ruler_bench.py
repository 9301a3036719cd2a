"""experiments/ruler.py's bookkeeping: the cases already answered (what a resumed run
skips) and the table of everything answered, on hand-made rows. The measurement itself
runs lm-eval's task code and the model (python experiments/ruler.py; docs/ruler.md)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import ruler  # noqa: E402


def _row(method, task, index, score, mode="inside", seconds=1.5):
    return {"model": "bundled", "length": 2048, "task": task, "index": index, "mode": mode,
            "method": method, "score": score, "seconds": seconds}  # fmt: skip


def test_a_resumed_run_knows_what_is_done(tmp_path):
    out = tmp_path / "r.jsonl"
    assert ruler.done_cases(out) == {}
    rows = [_row("full", "ruler_vt", 0, 1.0), _row("entropy 20%", "ruler_vt", 0, 0.4, "after")]
    for r in rows:
        r["prompt"] = ruler.prompt_sha("the prompt")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    done = ruler.done_cases(out)
    assert set(done) == {
        ("bundled", 2048, "ruler_vt", 0, "inside", "full"),
        ("bundled", 2048, "ruler_vt", 0, "after", "entropy 20%"),
    }
    key = ("bundled", 2048, "ruler_vt", 0)
    ruler.check_same_prompt(done, key, ruler.prompt_sha("the prompt"))  # the same: on
    ruler.check_same_prompt(done, ("bundled", 2048, "ruler_vt", 1), "anything")  # new case
    with pytest.raises(SystemExit, match="not the prompt the earlier answers"):
        ruler.check_same_prompt(done, key, ruler.prompt_sha("another prompt"))


def test_the_table_averages_each_task_and_counts_its_samples():
    rows = [
        _row("entropy 20%", "niah_single_1", 0, 1.0),
        _row("entropy 20%", "niah_single_1", 1, 0.0),
        _row("entropy 20%", "ruler_vt", 0, 0.6),
        _row("mean 20%", "niah_single_1", 0, 1.0, seconds=2.0),
        _row("full", "niah_single_1", 0, 1.0, mode="after"),
    ]
    text = ruler.table(rows)
    assert "### bundled, 2048 tokens, question inside" in text
    assert "### bundled, 2048 tokens, question after" in text
    line = next(x for x in text.splitlines() if x.startswith("| entropy 20% |"))
    # niah_single_1: 0.5 over 2 samples; vt 0.6 over 1; the mean of the task means 0.55
    assert line == "| entropy 20% | 0.50 (2) | - | - | 0.60 (1) | - | - | 0.55 | 4 |"
    assert "| mean 20% | 1.00 (1) | - | - | - | - | - | 1.00 | 2 |" in text
    assert set(ruler.methods()) == {"full"} | {
        f"{p} {b}%" for p in ("mean", "entropy", "head_independent") for b in (10, 20)
    }


def test_a_press_is_matched_at_our_physical_memory_per_prompt():
    """Per prompt, the press's run with the most physical memory (16-token pages touched,
    in the (layer, KV head) that touches most) still at most ours; where none fits, its
    smallest, counted as over. Runs of equal memory: the one keeping most tokens."""
    ours = [_row("entropy 10%", "ruler_vt", i, 1.0) | {"kept_tokens": 100} for i in (0, 1)]
    ours[1]["kept_tokens"] = 40  # 48 tokens of pages: no press run fits on sample 1
    press = [
        _row("snapkv 10%", "ruler_vt", 0, 1.0) | {"pages_16": 20},  # 320 tokens
        _row("snapkv 4%", "ruler_vt", 0, 0.0) | {"pages_16": 7, "kept_tokens": 90},
        _row("snapkv 5%", "ruler_vt", 0, 0.5) | {"pages_16": 7, "kept_tokens": 100},  # 112:
        # the most that fits, and of the two runs of that memory the one keeping more
        _row("snapkv 3%", "ruler_vt", 0, 0.0) | {"pages_16": 6},  # 96
        _row("snapkv 5%", "ruler_vt", 1, 0.25) | {"pages_16": 5},
        _row("snapkv 3%", "ruler_vt", 1, 0.75) | {"pages_16": 4},  # 64, the smallest
    ]
    assert ruler.physical(ours[0]) == 112 and ruler.physical(press[0]) == 320
    picked = ruler.physical_match(ours + press, "snapkv", "entropy 10%")
    assert [(r["index"], r["score"], r["over"]) for r in picked] == [
        (0, 0.5, False),
        (1, 0.75, True),
    ]
    assert {r["method"] for r in picked} == {"snapkv at entropy 10%'s memory"}
    text = ruler.table(ours + press)
    # vt: the mean of 0.5 and 0.75 over the two samples, one of them over
    assert "| snapkv at entropy 10%'s memory (1 over) | - | - | - | 0.62 (2) |" in text
    runs = [x.split(" |")[0] for x in text.splitlines() if x.startswith("| snapkv ")]
    assert runs[:4] == ["| snapkv 3%", "| snapkv 4%", "| snapkv 5%", "| snapkv 10%"]  # by budget
    assert ruler.peer_methods(["snapkv"], [0.3, 0.5]) == {
        f"snapkv {b}%": ("snapkv", b / 100) for b in (3, 5, 6, 10, 20)
    }


def test_a_block_with_presses_repeats_every_method_on_the_presses_prompts():
    """Ours over all its samples, then every row again on the prompts every press
    answered (sample 0 of vt: kvzip has not answered sample 1), so all sides are read on
    the same prompts."""
    rows = [_row("entropy 10%", "ruler_vt", i, s) for i, s in ((0, 1.0), (1, 0.0), (2, 0.0))]
    rows += [_row("full", "ruler_vt", i, 1.0) for i in (0, 1, 2)]
    rows += [_row("snapkv 10%", "ruler_vt", i, s) for i, s in ((0, 0.5), (1, 0.25))]
    rows += [_row("kvzip 10%", "ruler_vt", 0, 0.75), _row("full", "ruler_vt", 0, 1.0, "after")]
    text = ruler.table(rows)
    inside = text.split("question inside")[1]
    whole, same = inside.split("On the 1 prompts every press answered:")
    assert "| entropy 10% | - | - | - | 0.33 (3) |" in whole
    assert "| snapkv 10% | - | - | - | 0.38 (2) |" in whole
    assert "| entropy 10% | - | - | - | 1.00 (1) |" in same
    assert "| full | - | - | - | 1.00 (1) |" in same
    assert "| snapkv 10% | - | - | - | 0.50 (1) |" in same
    assert "| kvzip 10% | - | - | - | 0.75 (1) |" in same
    # No press answered with the question after: that block has one table.
    assert "On the" not in text.split("question after")[1].split("###")[0]


def _section(text: str, mode: str, length: int = 2048, model: str = "bundled") -> str:
    """The table's section for `mode` (`model`, `length` tokens), its first table (all
    samples; the one on the presses' prompts left out)."""
    section = text.split(f"### {model}, {length} tokens, question {mode}", 1)[1]
    return section.split("###")[0].split("\nOn the ")[0]


def _means(text: str, mode: str, length: int = 2048, model: str = "bundled") -> dict[str, str]:
    """The `mean` column of the table's section for `mode`."""
    lines = _section(text, mode, length, model).splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ")]
    return {r[0].lstrip("| "): r[-2] for r in rows[1:]}


def _counts(text: str, mode: str, length: int = 2048, model: str = "bundled") -> list[int]:
    """Every cell's sample count in our window-scored rows of the table's section for
    `mode` (a press's rows and the question-agnostic ones count their own samples)."""
    rows = [x for x in _section(text, mode, length, model).splitlines() if x.startswith("| ")]
    ours = [x for x in rows if x.split(" | ")[0].lstrip("| ") in ruler.methods()]
    return [int(c) for x in ours for c in re.findall(r"\((\d+)\)", x)]


def _quote_4k(text: str) -> str:
    """What docs/research.md says of the 4,096-token tables."""
    inside, after = _means(text, "inside", 4096), _means(text, "after", 4096)
    samples = min(_counts(text, "inside", 4096) + _counts(text, "after", 4096))
    evicted_after = sorted(v for k, v in after.items() if k in ruler.OUR_METHODS - {"full"})
    return (
        f"At 4,096 tokens ({samples} samples a task) it is the same: question inside, "
        f"{inside['mean 10%']} for mean pooling and {inside['entropy 10%']} for entropy at "
        f"10 %, {inside['mean 20%']} and {inside['entropy 20%']} at 20 % (the full cache "
        f"{inside['full']}); question after, {evicted_after[0]}-{evicted_after[-1]}."
    )


def _quote_qwen(text: str, rows: list[dict]) -> str:
    """What docs/research.md says of qwen-coder-0.5b's tables (2,048 tokens)."""
    model = "qwen-coder-0.5b"
    inside, after = _means(text, "inside", model=model), _means(text, "after", model=model)
    samples = min(_counts(text, "inside", model=model) + _counts(text, "after", model=model))
    scores, kept = {}, {}
    for r in rows:
        if r["model"] == model:
            scores.setdefault((r["mode"], r["method"], r["task"]), []).append(r["score"])
            kept.setdefault(r["method"], []).append(r["kept_tokens"])
    avg = lambda xs: sum(xs) / len(xs)  # noqa: E731
    gap, mode, b, task = max(
        (abs(avg(scores[mode, f"mean {b}%", t]) - avg(scores[mode, f"entropy {b}%", t])),
         mode, b, t)
        for mode in ("inside", "after") for b in (10, 20) for t in ruler.TASKS
    )  # fmt: skip
    m, e = (avg(scores[mode, f"{p} {b}%", task]) for p in ("mean", "entropy"))
    union = [avg(kept[f"head_independent {b}%"]) / avg(kept[f"entropy {b}%"]) for b in (10, 20)]
    apart = max(abs(float(t[f"mean {b}%"]) - float(t[f"entropy {b}%"]))
                for t in (inside, after) for b in (10, 20))  # fmt: skip
    return (
        f"On qwen-coder-0.5b (r = 7: seven query heads share each KV head; {samples} samples "
        f"a task at 2,048 tokens) the poolings' averages are again within {apart:.2f} of "
        f"each other: question inside, "
        f"{inside['mean 10%']} for mean pooling and {inside['entropy 10%']} for entropy at "
        f"10 %, {inside['mean 20%']} and {inside['entropy 20%']} at 20 % (the full cache "
        f"{inside['full']}); question after, {after['mean 10%']} and {after['entropy 10%']}, "
        f"{after['mean 20%']} and {after['entropy 20%']}. Their largest gap on one task is "
        f"{gap:.2f} ({task}, question {mode}, {b} %: mean {m:.2f}, entropy {e:.2f}). "
        f"Head-independent selection scored higher ({inside['head_independent 10%']} and "
        f"{inside['head_independent 20%']} inside), but its group stores the union of seven "
        f"heads' picks: {union[0]:.1f}x the tokens of a pooled policy at 10 %, "
        f"{union[1]:.1f}x at 20 %."
    )


def _same_prompts(text: str, mode: str) -> tuple[int, int, dict[str, str], dict[str, int]]:
    """On the table of the prompts every press answered (2,048 tokens, the bundled
    model): their number, the fewest samples of any cell, each row's `mean`, and each
    row's `(N over)` count."""
    block = text.split(f"### bundled, 2048 tokens, question {mode}", 1)[1].split("###")[0]
    table = block.split("\nOn the ", 1)[1]
    means, over = {}, {}
    for cells in (x.split(" | ") for x in table.splitlines()[3:] if x.startswith("| ")):
        name, _, count = cells[0].lstrip("| ").partition(" (")
        means[name], over[name] = cells[-2], int(count.split(" ")[0]) if count else 0
    fewest = min(int(c) for c in re.findall(r"\((\d+)\)", table))
    return int(table.split(" ", 1)[0]), fewest, means, over


def _least_touched(rows: list[dict]) -> int:
    """The least share (%, floored) of a prompt's 16-token pages that a run's kept tokens
    touch in their fullest (layer, KV head), over `rows`."""
    return int(min(100 * r["pages_16"] / -(-r["prompt_tokens"] // 16) for r in rows))


def _quote_presses(text: str, rows: list[dict]) -> str:
    """What docs/research.md says of kvpress's presses on RULER."""
    n, fewest, after, over = _same_prompts(text, "after")
    _, _, inside, over_inside = _same_prompts(text, "inside")
    # "one fits in the memory of our 10 % on 0 ...": prompts where no KVzip run fits
    # (its smallest, 1 %, stands in) are `over`; the rest have a run that fits.
    fits = {
        b: [n - o[f"kvzip at entropy {b}%'s memory"] for o in (over, over_inside)] for b in (10, 20)
    }
    # "At equal kept tokens KVzip did best": at each budget, in each mode.
    for means in (after, inside):
        for b in (10, 20):
            rest = [
                float(means[f"{m} {b}%"]) for m in (*ruler.POOLINGS, "head_independent", "snapkv")
            ]
            assert float(means[f"kvzip {b}%"]) >= max(rest), (b, means)
    kvzip = [
        r
        for r in rows
        if r["method"].startswith("kvzip ") and (r["model"], r["length"]) == ("bundled", 2048)
    ]
    seconds = [r["seconds"] for r in kvzip]
    # "at 10 and 20 %, ... they touch at least N %": the runs at our budgets.
    touched = _least_touched([r for r in kvzip if r["method"] in ("kvzip 10%", "kvzip 20%")])
    snap_at = "snapkv at entropy 10%'s memory"
    so_far = " so far" if fewest < ruler.SAMPLES else ""  # until the command's target
    return (
        f"whose answers took {round(min(seconds))}-{round(max(seconds))} s each here, most "
        f"near {round(statistics.median(seconds), -1):.0f} s: the long ones while the "
        f"machine ran other work), are in the same tables (at least {fewest} samples a task"
        f"{so_far}, {n} prompts: too few to order methods a few hundredths apart). At equal "
        f"kept tokens KVzip did best: with "
        f"the question after the context it scored {after['kvzip 10%']} at 10 % (the full "
        f"cache {after['full']}; on the same prompts mean pooling {after['mean 10%']}, "
        f"entropy {after['entropy 10%']}, SnapKV {after['snapkv 10%']}), and with the "
        f"question inside {inside['kvzip 10%']} (mean {inside['mean 10%']}, entropy "
        f"{inside['entropy 10%']}, SnapKV {inside['snapkv 10%']}). But the tokens it keeps "
        f"are scattered: at 10 and 20 %, in some (layer, KV head) they touch at least "
        f"{touched} % of the prompt's 16-token pages, so a paged cache of them holds nearly "
        f"the whole prompt. Of its runs, down to 1 % (a tenth of our smallest budget), one "
        f"fits in the memory of our 10 % on {fits[10][0]} of the {n} prompts with the "
        f"question after and {fits[10][1]} with it inside, and in that of our 20 % on "
        f"{fits[20][0]} and {fits[20][1]}; yet at 1 % it scored {after['kvzip 1%']} with the "
        f"question after and {inside['kvzip 1%']} with it inside. SnapKV at the memory of "
        f"our 10 % (its largest run that fits, or its smallest, 3 %, where none does) scored "
        f"{after[snap_at]} with the question after and {inside[snap_at]} with it inside."
    )


def guide_memory(m: dict) -> str:
    """Lesson 8's row of docs/app.md on RULER at equal physical memory."""
    return (
        f"at the same memory on {m['mem_model']} ({m['mem_prompts_sum']} prompts), "
        "Page-EntroKV scored by the reconstruction pass with one shared budget "
        f"{m['mem_ours_sum']} at 10 %, KVzip {m['mem_press_sum']} and ChunkKV "
        f"{m['mem_chunk_sum']} in no more pages summed over (layer, KV head), and "
        f"{m['mem_press_max']} against {m['mem_ours_max']} where every (layer, KV head) "
        "gets the fullest one's pages"
    )


def test_the_quoted_ruler_figures_are_the_committed_answers():
    """docs/ruler.md is the command's table of docs/ruler.jsonl, and lesson 6 and the
    researcher's page (docs/research.md) quote that table."""
    from pagekv.app.lessons import memory_numbers, ruler_numbers

    path = ROOT / "docs" / "ruler.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    text = ruler.table(rows)
    assert (ROOT / "docs" / "ruler.md").read_text() == ruler.HEADER + "\n" + text + "\n"
    inside, after = _means(text, "inside"), _means(text, "after")
    samples = min(_counts(text, "inside") + _counts(text, "after"))
    n, _, shared, _ = _same_prompts(text, "after")
    kvzip10 = [
        r
        for r in rows
        if r["method"] == "kvzip 10%" and (r["model"], r["length"]) == ("bundled", 2048)
    ]
    touched10 = _least_touched(kvzip10)
    kvzip1 = [
        r
        for r in rows
        if r["method"] == "kvzip 1%" and (r["model"], r["length"]) == ("bundled", 2048)
    ]
    touched1 = _least_touched(kvzip1)
    assert ruler_numbers(rows) == {
        "ruler_mean10": inside["mean 10%"], "ruler_entropy10": inside["entropy 10%"],
        "ruler_mean20": inside["mean 20%"], "ruler_entropy20": inside["entropy 20%"],
        "ruler_samples": samples, "ruler_press_prompts": n,
        **{f"ruler_press_{m}": shared[f"{m} 10%"] for m in ("kvzip", "snapkv", "entropy", "mean")},
        "ruler_press_full": shared["full"],
        "ruler_kvzip_pages": touched10, "ruler_press_kvzip1": shared["kvzip 1%"],
        "ruler_kvzip1_pages": touched1,
    }  # fmt: skip
    readme = " ".join((ROOT / "docs" / "research.md").read_text().split())
    # "On no task, mode, budget or length do the two poolings' means differ by more than
    # 0.05" (the bundled model, at both lengths).
    scores: dict = {}
    for r in rows:
        if r["model"] == "bundled":
            key = (r["length"], r["mode"], r["method"], r["task"])
            scores.setdefault(key, []).append(r["score"])
    gaps = [
        abs(sum(scores[n, mode, f"mean {b}%", t]) / len(scores[n, mode, f"mean {b}%", t])
            - sum(scores[n, mode, f"entropy {b}%", t]) / len(scores[n, mode, f"entropy {b}%", t]))
        for n in (2048, 4096) for mode in ("inside", "after") for b in (10, 20)
        for t in ruler.TASKS
    ]  # fmt: skip
    assert max(gaps) <= 0.05 + 1e-9 and "differ by more than 0.05" in readme
    evicted_after = sorted(v for k, v in after.items() if k in ruler.OUR_METHODS - {"full"})
    for quoted in (
        f"was {inside['mean 10%']} for mean pooling and {inside['entropy 10%']} for entropy at "
        f"10 %, {inside['mean 20%']} and {inside['entropy 20%']} at 20 % (head-independent "
        f"{inside['head_independent 10%']} and {inside['head_independent 20%']}, the full "
        f"cache {inside['full']})",
        f"fell to {evicted_after[0]}-{evicted_after[-1]}",
        f"six tasks at length 2,048, {samples} samples each",
        _quote_4k(text),
        _quote_qwen(text, rows),
        _quote_presses(text, rows),
    ):
        assert quoted in readme, quoted
    # Lessons 6 and 8's rows of the lessons' table in the app's guide.
    guide = " ".join((ROOT / "docs" / "app.md").read_text().split())
    for quoted in (
        f"mean {inside['mean 10%']}, entropy {inside['entropy 10%']} at 10 %",
        f"KVzip at 10 % {shared['kvzip 10%']}, Page-EntroKV {shared['entropy 10%']}, mean "
        f"pooling {shared['mean 10%']}, SnapKV {shared['snapkv 10%']}, KVzip's kept tokens "
        f"touching at least {touched10} % of some (layer, KV head)'s pages; and at 1 % of the "
        f"tokens KVzip {shared['kvzip 1%']}, its tokens touching at least {touched1} %",
        guide_memory(memory_numbers()),
    ):
        assert quoted in guide, quoted


def test_the_memory_figure_averages_every_method_on_the_same_prompts():
    """A prompt one method has not answered is left out of every point."""
    mem = {"pages_16": 2, "cells": 4, "context_pages": 5}

    def row(method, index, score, pages_sum):
        return _row(method, "ruler_vt", index, score, "after") | mem | {"pages_sum": pages_sum}

    rows = [row("entropy reconstruct/global 10%", i, 1.0, 8) for i in (0, 1)]
    rows += [row("kvzip 10%", 0, 0.5, 10), _row("entropy 10%", "ruler_vt", 1, 0.0, "after")]
    svg = ruler.memory_figure(rows)
    assert "the 1 prompts every method answered" in svg  # sample 1: no kvzip answer
    # entropy at 8 of 20 pages, kvzip at 10 of 20, both on sample 0 alone
    assert "entropy reconstruct/global 10%: 1.00 at 40.0%" in svg
    assert "kvzip 10%: 0.50 at 50.0%" in svg
    with pytest.raises(SystemExit, match="record their memory"):
        ruler.memory_figure([_row("entropy 10%", "ruler_vt", 0, 1.0)])


def test_the_memory_figure_and_its_numbers_are_the_committed_answers():
    """docs/ruler_memory.json and .svg are `--figure`'s of docs/ruler.jsonl, and lesson 8
    (`memory_numbers`) reads the comparison there: ours at 10 %, question-agnostic with a
    shared budget, against KVzip at equal memory in each measure."""
    from pagekv.app.lessons import MEMORY_OURS, MEMORY_PRESS, memory_numbers

    rows = [json.loads(x) for x in (ROOT / "docs/ruler.jsonl").read_text().splitlines() if x]
    summary = json.loads(json.dumps(ruler.memory_summary(rows)))  # as JSON holds it
    committed = json.loads((ROOT / "docs" / "ruler_memory.json").read_text())
    assert committed == summary
    svg = (ROOT / "docs" / "ruler_memory.svg").read_text()
    assert svg == ruler.figure_svg(summary["curves"], summary["title"])
    entry = next(e for e in summary["equal_memory"] if e["ours"] == MEMORY_OURS)
    got = entry["presses"][MEMORY_PRESS]
    numbers = memory_numbers(summary)
    assert numbers["mem_prompts_sum"] == got["pages_sum"]["prompts"] > 0
    assert numbers["mem_press_max"] == f"{got['pages_max']['press']:.2f}"
    assert numbers["mem_frac_sum"] == round(100 * entry["memory"]["pages_sum"])
