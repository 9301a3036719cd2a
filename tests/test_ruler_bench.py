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

from pagekv.paths import RULER_MEMORY_PATH, RULER_RESULTS_PATH  # noqa: E402


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


def test_a_press_runs_at_each_budget_and_its_rows_come_in_budget_order():
    ours = [_row("entropy 10%", "ruler_vt", 0, 1.0)]
    press = [_row(f"snapkv {b}%", "ruler_vt", 0, 0.5) for b in (10, 3, 5, 4)]
    text = ruler.table(ours + press)
    runs = [x.split(" |")[0] for x in text.splitlines() if x.startswith("| snapkv ")]
    assert runs[:4] == ["| snapkv 3%", "| snapkv 4%", "| snapkv 5%", "| snapkv 10%"]
    assert ruler.peer_methods(["snapkv"], [0.3, 0.5]) == {
        f"snapkv {b}%": ("snapkv", b / 100) for b in (3, 5, 6, 10, 20)
    }


def test_our_rows_run_in_pages_of_16_4_and_1_and_know_their_gathered_memory():
    """Both poolings at 5/10/20 % in pages of 16, 4 and 1, with `gathered` derived only where whole
    pages or one count per head fix it."""
    names = ruler.agnostic_methods()
    for page in (16, 4, 1):
        for pct in (5, 10, 20):
            for pool in ("mean", "entropy"):
                cfg = names[ruler.agnostic_name(pool, pct / 100, page)]
                assert (cfg.page_size, cfg.budget, cfg.allocation, cfg.scorer) == (
                    page, pct / 100, "global", "reconstruct")  # fmt: skip
    assert ruler.agnostic_name("entropy", 0.1, 16) == "entropy reconstruct/global 10%"
    assert ruler.agnostic_name("mean", 0.2, 4) == "mean reconstruct/global 20% (pages of 4)"
    mem = {"pages_sum": 40, "pages_16": 9, "cells": 8, "context_pages": 9,
           "kept_tokens": 70, "kept_tokens_max": 70}  # fmt: skip
    rows = [_row(m, "ruler_vt", 0, 1.0, "after") | mem for m in (
        "entropy reconstruct/global 10%", "entropy reconstruct/global 10% (pages of 4)",
        "chunkkv 10%", "keydiff 10%", "kvzip 10%", "full")]  # fmt: skip
    got = [ruler.gathered(r) for r in ruler.rows_with_memory(rows)]
    assert got == [40, None, 40, 8 * 5, None, None]


def test_earlier_rows_get_their_memory_written_in_and_a_changed_plan_is_refused(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    rows = [_row("entropy reconstruct/global 10% (pages of 1)", "ruler_vt", i, 1.0, "after")
            | {"pages_sum": 30} for i in (0, 1)]  # fmt: skip
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(ruler.unmeasured_cases(out)) == 2
    key = ("bundled", 2048, "ruler_vt")
    method = rows[0]["method"]
    ruler.backfill_memory(out, {
        (*key, 0, "after", method): {"pages_sum": 30, "gathered_pages": 12},
        (*key, 1, "after", method): {"pages_sum": 31, "gathered_pages": 13},
    })  # fmt: skip
    back = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r.get("gathered_pages") for r in back] == [12, None]  # sample 1: another plan
    assert "the re-made plan touches 31 pages, the row 30" in capsys.readouterr().out
    assert len(ruler.unmeasured_cases(out)) == 1


def test_a_block_with_presses_repeats_every_method_on_the_presses_prompts():
    """Ours over all samples, then every row again on the prompts every press answered."""
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


def _same_prompts(text: str, mode: str) -> tuple[int, int, dict[str, str]]:
    """On the table of the prompts every press answered (2,048 tokens, the bundled
    model): their number, the fewest samples of any cell and each row's `mean`."""
    block = text.split(f"### bundled, 2048 tokens, question {mode}", 1)[1].split("###")[0]
    table = block.split("\nOn the ", 1)[1]
    means = {}
    for cells in (x.split(" | ") for x in table.splitlines()[3:] if x.startswith("| ")):
        means[cells[0].lstrip("| ")] = cells[-2]
    fewest = min(int(c) for c in re.findall(r"\((\d+)\)", table))
    return int(table.split(" ", 1)[0]), fewest, means


def _least_touched(rows: list[dict]) -> int:
    """The least share (%, floored) of a prompt's 16-token pages that a run's kept tokens
    touch in their fullest (layer, KV head), over `rows`."""
    return int(min(100 * r["pages_16"] / -(-r["prompt_tokens"] // 16) for r in rows))


def _quote_presses(text: str, rows: list[dict]) -> str:
    """What docs/research.md says of kvpress's presses on RULER."""
    n, fewest, after = _same_prompts(text, "after")
    _, _, inside = _same_prompts(text, "inside")
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
        f"{inside['entropy 10%']}, SnapKV {inside['snapkv 10%']}). The tokens it keeps are "
        f"scattered: at 10 and 20 %, in some (layer, KV head) they touch at least {touched} % "
        "of the prompt's 16-token pages, so a paged cache that frees pages in place holds "
        "nearly the whole prompt for them, while a cache that gathers what it keeps, as "
        f"pagekv's decode pool does, holds their tokens alone. At 1 % it scored "
        f"{after['kvzip 1%']} with the question after and {inside['kvzip 1%']} with it inside."
    )


def guide_memory(m: dict) -> str:
    """Lesson 8's row of docs/app.md on RULER at equal memory."""
    return (
        f"and on RULER ({m['mem_model']}, question after) KVzip against Page-EntroKV "
        "scored by the reconstruction pass at equal memory: gathered (this app's decode "
        f"pool), {m['mem_gathered']}; in place, {m['mem_in_place']}; uniform, "
        f"{m['mem_uniform']}"
    )


def guide_pages(m: dict) -> str:
    """Lesson 2's row of docs/app.md on RULER's pages against tokens."""
    return (
        f"on RULER ({m['pg_model']}) at equal memory, pages of 16 against pages of 1: "
        f"gathered, {m['pg_gathered']}; in place, {m['pg_in_place']}"
    )


def test_the_quoted_ruler_figures_are_the_committed_answers():
    """docs/ruler.md is the command's table of its answers (`RULER_RESULTS_PATH`), and
    lesson 6 and the researcher's page (docs/research.md) quote that table."""
    from pagekv.app.lessons import memory_numbers, pages_numbers, ruler_numbers

    path = RULER_RESULTS_PATH
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    text = ruler.table(rows)
    assert (ROOT / "docs" / "ruler.md").read_text() == text + "\n"
    inside, after = _means(text, "inside"), _means(text, "after")
    samples = min(_counts(text, "inside") + _counts(text, "after"))
    n, _, shared = _same_prompts(text, "after")
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
        guide_memory(memory_numbers()),
        guide_pages(pages_numbers()),
    ):
        assert quoted in guide, quoted


def test_the_memory_figure_averages_every_method_on_the_same_prompts():
    """A prompt one method lacks is left out of every point; full is the square at 100 %."""
    mem = {"pages_16": 2, "cells": 4, "context_pages": 5}

    def row(method, index, score, pages_sum, gathered=None):
        got = mem | {"pages_sum": pages_sum, "gathered_pages": gathered}
        return _row(method, "ruler_vt", index, score, "after") | got

    rows = [row("entropy reconstruct/global 10%", i, 1.0, 8) for i in (0, 1)]
    rows += [row("kvzip 10%", 0, 0.5, 10, gathered=6), row("full", 0, 0.75, 20, 20)]
    rows += [_row("entropy 10%", "ruler_vt", 1, 0.0, "after"), row("full", 1, 0.25, 20, 20)]
    svg = ruler.memory_figure(rows)
    assert "the 1 prompts every method answered" in svg  # sample 1: no kvzip answer
    # entropy at 8 of 20 pages, kvzip at 10 of 20 in place and 6 gathered, on sample 0
    assert "entropy reconstruct/global 10%: 1.00 at 40.0%" in svg
    assert "kvzip 10%: 0.50 at 50.0%" in svg and "kvzip 10%: 0.50 at 30.0%" in svg
    assert svg.count("full cache: 0.75") == 3
    with pytest.raises(SystemExit, match="record their memory"):
        ruler.memory_figure([_row("entropy 10%", "ruler_vt", 0, 1.0)])


def test_the_memory_figure_and_its_numbers_are_the_committed_answers():
    """`RULER_MEMORY_PATH` and docs/ruler_memory.svg are `--figure`'s of the answers, and lessons 2
    and 8 (`pages_numbers`, `memory_numbers`) read the comparisons there."""
    from pagekv.app.lessons import MEMORY_OURS, memory_numbers, pages_numbers, said

    rows = [json.loads(x) for x in RULER_RESULTS_PATH.read_text().splitlines() if x]
    summary = json.loads(json.dumps(ruler.memory_summary(rows)))  # as JSON holds it
    committed = json.loads(RULER_MEMORY_PATH.read_text())
    assert committed == summary
    svg = (ROOT / "docs" / "ruler_memory.svg").read_text()
    assert svg == ruler.figure_svg(summary["curves"], summary["title"], summary["full"])
    leads = {(c["layout"], c["budget"], c["rival"]): c for c in summary["leads"]}
    for pct in (10, 20):
        c = leads[("gathered", pct, "kvzip")]
        assert c["ours"] == MEMORY_OURS.format(pct=pct)
        assert said(c, "KVzip") in memory_numbers(summary)["mem_gathered"]
        tokens = leads[("in_place", pct, "entropy reconstruct/global (pages of 1)")]
        assert said(tokens, "pages of 1", "pages of 16") in pages_numbers(summary)["pg_in_place"]
    table = memory_numbers(summary)["mem_table"].strip().splitlines()
    assert len(table) == 2 + 3 * 3  # every layout, every rival
