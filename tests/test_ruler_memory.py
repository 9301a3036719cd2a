"""experiments/ruler_memory.py: the two measures of physical memory, the press matched to
ours at equal memory, on hand-made rows, and our rows' `pages_sum` against the bytes
the decode's paged pool allocates (the bundled model)."""

from __future__ import annotations

import re

import pytest
import torch

from experiments import ruler_memory as rm


def _row(method, index, score, pages, n_context=80, task="ruler_vt"):
    """An answer row whose kept set touches `pages` ([L][G] pages of 16)."""
    return {"model": "m", "length": 2048, "task": task, "index": index, "mode": "after",
            "method": method, "score": score, **rm.memory_fields(pages, n_context)}  # fmt: skip


def test_the_two_measures_of_one_kept_set():
    fields = rm.memory_fields(torch.tensor([[2, 3], [1, 3]]), 40)
    assert fields == {"pages_sum": 9, "pages_16": 3, "cells": 4, "context_pages": 3}
    row = {"method": "x", **fields}
    assert rm.memory(row, "pages_sum") == 9
    assert rm.memory(row, "pages_max") == 12  # 3 pages in every one of 4 (layer, KV head)s
    assert rm.fraction(row, "pages_sum") == 9 / 12 and rm.fraction(row, "pages_max") == 1.0
    assert rm.memory({"method": "old"}, "pages_sum") is None  # rows from before: unknown
    with pytest.raises(ValueError, match="measure"):
        rm.memory(row, "pages")


def test_a_press_is_matched_to_ours_in_each_measure_on_each_prompt():
    """Ours spreads its pages unevenly (sum 6, max 4 -> 16); the press's runs hold
    (sum, max-loaded): 5% (4, 1 -> 4), 10% (7, 2 -> 8), 20% (12, 3 -> 12). At our
    pages_sum the press gets its 5% run (4 <= 6 < 7); at our pages_max its 20% (12 <= 16).
    On prompt 1 ours holds 2 pages, less than any press run: its smallest stands in, over."""
    ours = [_row("ours", 0, 0.5, [[4, 0], [1, 1]]), _row("ours", 1, 1.0, [[1, 0], [0, 1]])]
    press = [
        _row("kv 5%", 0, 0.0, [[1, 1], [1, 1]]),
        _row("kv 10%", 0, 0.25, [[2, 2], [2, 1]]),
        _row("kv 20%", 0, 1.0, [[3, 3], [3, 3]]),
        _row("kv 5%", 1, 0.75, [[1, 1], [1, 1]]),
        _row("kv 10%", 1, 0.0, [[2, 2], [2, 1]]),
    ]
    rows = ours + press
    at_sum = rm.match(rows, "kv", "ours", lambda r: rm.memory(r, "pages_sum"))
    at_max = rm.match(rows, "kv", "ours", lambda r: rm.memory(r, "pages_max"))
    assert [(r["index"], r["score"], r["over"], r["ours_score"]) for r in at_sum] == [
        (0, 0.0, False, 0.5),
        (1, 0.75, True, 1.0),
    ]
    assert [(r["index"], r["score"], r["over"]) for r in at_max] == [
        (0, 1.0, False),
        (1, 0.75, False),  # 5% holds 4 in the max measure, as ours does
    ]
    assert {r["method"] for r in at_sum} == {"kv at ours's memory"}
    # Runs of equal memory: the one keeping the most tokens (a budget fills the fullest
    # (layer, KV head) at every size, as KVzip's do), whatever their order.
    tied = [_row("kv 2%", 0, 0.1, [[2, 0], [0, 0]]) | {"kept_tokens": 2},
            _row("kv 20%", 0, 0.9, [[2, 2], [2, 2]]) | {"kept_tokens": 20},
            _row("kv 1%", 0, 0.0, [[2, 0], [0, 0]]) | {"kept_tokens": 1}]  # fmt: skip
    picked = rm.match([ours[0], *tied], "kv", "ours", lambda r: rm.memory(r, "pages_max"))
    assert [r["score"] for r in picked] == [0.9]  # all hold 8 in the max measure
    # The table: press vs ours on the same prompts (means of the task means), and ours's
    # memory as fractions of the full cache (4 cells x 5 pages = 20): sum 6/20 and 2/20,
    # max 16/20 and 4/20.
    lines = rm.equal_memory_table(rows, ["ours", "absent"], ["kv"])
    assert lines[0] == "| ours | score | memory (sum / max) | kv at pages_sum | kv at pages_max |"
    assert lines[2] == (
        "| ours | 0.75 | 20.0% / 50.0% | 0.38 vs 0.75 (2, 1 over) | 0.88 vs 0.75 (2) |"
    )
    assert len(lines) == 4 and lines[3] == ""  # no row for a method without answers


def test_the_figure_draws_a_line_per_method_and_a_panel_per_measure():
    rows = [_row("ours 10%", 0, 0.5, [[1, 1], [1, 1]]), _row("ours 20%", 0, 1.0, [[2, 2], [2, 2]])]
    rows += [_row("kv 10%", 0, 0.25, [[3, 0], [0, 0]])]
    curves = rm.curves(rows, "pages_max")
    assert curves == {
        "kv": [(12 / 20, 0.25, "kv 10%")],  # 3 pages in the fullest of 4 cells of 5 pages
        "ours": [(4 / 20, 0.5, "ours 10%"), (8 / 20, 1.0, "ours 20%")],
    }
    svg = rm.figure_svg({m: rm.curves(rows, m) for m in rm.MEASURES}, "a & b")
    assert svg.startswith("<svg") and "a &amp; b" in svg
    assert svg.count("<polyline") == 4  # two families, two panels
    assert all(m in svg for m in rm.MEASURES)
    # ours 20% at pages_sum: 8 of 20 pages, score 1.0 -> x = 48 + 0.4 * 330, y = 48
    assert re.search(r'<circle cx="180\.0" cy="48\.0"', svg)


def test_pages_sum_is_what_the_decode_pool_allocates_for_the_context(bundled_study):
    """For our rows (pages of 16, one budget shared by every (layer, KV head)), pages_sum
    times a page's bytes is the decode's paged pool for the context alone."""
    from pagekv import EvictionConfig

    runner = bundled_study.runner
    ids = bundled_study.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)
    assert len(ids) > 333
    pre = runner.prefill(ids[:333], window_max=8)
    for cfg in (
        EvictionConfig(policy="entropy", budget=0.2, page_size=16, window=8, allocation="global"),
        EvictionConfig(policy="mean", budget=0.15, page_size=16, window=8),
        EvictionConfig(policy="full", window=8),
    ):
        planned = runner.plan(pre, cfg)
        fields = rm.plan_memory(planned)
        ev = runner.evict(pre, cfg, planned)
        pool = runner.decode_cache([ev], pre, 0)  # the decode's pool, no room to grow
        k = pre.cache.layers[0].keys
        page_bytes = 2 * 16 * k.shape[-1] * k.element_size()  # keys and values
        assert pool.nbytes == fields["pages_sum"] * page_bytes, cfg
        if cfg.allocation == "global":  # uneven: the two measures differ
            assert fields["pages_16"] * fields["cells"] > fields["pages_sum"]
        assert fields["context_pages"] == 21 and fields["cells"] == pre.n_layers * pre.n_groups
    assert fields["pages_sum"] == 21 * fields["cells"]  # full: every page everywhere
