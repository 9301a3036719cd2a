"""experiments/ruler_memory.py: a kept set's memory in the three cache layouts, a rival
matched to ours at equal memory, the bootstrap interval and its verdict, on hand-made
rows; and the `gathered` layout against the bytes pagekv's own decode pool allocates for
a press's token-level kept set and for our page plans (the bundled model)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import ruler_memory as rm
from pagekv.maths.paging import pages_touched


def _row(method, index, score, pages, kept=None, n_context=80, task="ruler_vt"):
    """An answer row whose kept set touches `pages` ([L][G] pages of 16) and keeps
    `kept` ([L][G] tokens) in each (layer, KV head)."""
    mem = rm.memory_fields(pages, n_context, kept)
    return {"model": "m", "length": 2048, "task": task, "index": index, "mode": "after",
            "method": method, "score": score, **mem}  # fmt: skip


def test_the_three_layouts_of_one_kept_set():
    """Four (layer, KV head)s of a 40-token context (3 pages): one keeps 17 tokens on 2
    pages, one 40 on 3, one 3 scattered on 3 pages, one 33 on 3."""
    fields = rm.memory_fields(torch.tensor([[2, 3], [3, 3]]), 40, kept=[[17, 40], [3, 33]])
    assert fields == {"pages_sum": 11, "pages_16": 3, "cells": 4, "context_pages": 3,
                      "gathered_pages": 2 + 3 + 1 + 3}  # fmt: skip
    row = {"method": "x", **fields}
    assert rm.memory(row, "gathered") == 9  # ceil(17/16) + ceil(40/16) + ceil(3/16) + ...
    assert rm.memory(row, "in_place") == 11
    assert rm.memory(row, "uniform") == 12  # 3 pages in every one of 4
    assert rm.fraction(row, "gathered") == 9 / 12 and rm.fraction(row, "uniform") == 1.0
    assert rm.memory({"method": "old"}, "in_place") is None  # rows without memory: unknown
    with pytest.raises(ValueError, match="layout"):
        rm.memory(row, "pages_sum")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 70), st.data())
def test_gathered_never_exceeds_in_place_nor_in_place_uniform(L, G, n, data):
    bits = data.draw(st.lists(st.booleans(), min_size=L * G * n, max_size=L * G * n))
    keep = torch.tensor(bits, dtype=torch.bool).view(L, G, n)
    row = {"method": "x", **rm.memory_fields(pages_touched(keep, 16), n, keep.sum(-1))}
    got = [rm.memory(row, lay) for lay in rm.LAYOUTS]
    assert got[0] <= got[1] <= got[2] <= L * G * -(-n // 16)
    # Each (layer, KV head)'s kept tokens packed: the same as keeping its first tokens.
    packed = torch.arange(n).expand(L, G, n) < keep.sum(-1, keepdim=True)
    assert int(pages_touched(packed, 16).sum()) == got[0]


def test_gathered_is_derived_only_where_the_method_fixes_it():
    """`gathered` is derived only where pages of 16 or one count per head fix it."""
    base = {"method": "x", "pages_sum": 30, "pages_16": 9, "cells": 4, "context_pages": 9,
            "kept_tokens": 20, "kept_tokens_max": 20}  # fmt: skip
    assert rm.gathered(base | {"page_size": 16}) == 30
    assert rm.gathered(base | {"chunk_length": 16}) == 30
    assert rm.gathered(base | {"page_size": 4}) is None  # pages of 4: not whole 16s
    assert rm.gathered(base | {"per_head_count": True}) == 4 * 2  # 20 tokens: 2 pages each
    assert rm.gathered(base | {"per_head_count": True, "kept_tokens_max": 31}) is None
    assert rm.gathered(base) is None  # a KVzip row
    assert rm.gathered(base | {"gathered_pages": 7}) == 7  # recorded: as it is


def test_a_rival_is_matched_to_ours_at_the_nearest_memory_within_ten_percent():
    """A rival run matches ours at the nearest memory within 10 % (else the prompt is left out and
    counted); ties keep the most tokens."""
    ours = [_row("ours", 0, 0.5, [[5, 5]], [[80, 80]]), _row("ours", 1, 1.0, [[10, 10]],
                                                             [[160, 160]])]  # fmt: skip
    # Two runs of equal memory, the one keeping fewer tokens first: the other is matched.
    rival = [
        _row("kv 5%", 0, 0.0, [[5, 5]], [[40, 40]]),
        _row("kv 11%", 0, 0.25, [[5, 5]], [[64, 72]]) | {"kept_tokens": 60},
        _row("kv 10%", 0, 0.75, [[5, 5]], [[72, 64]]) | {"kept_tokens": 68},
        _row("kv 20%", 0, 1.0, [[6, 6]], [[96, 96]]),
        _row("kv 10%", 1, 0.0, [[5, 5]], [[72, 72]]),
        _row("kv 30%", 1, 1.0, [[15, 15]], [[240, 240]]),
    ]
    got, left = rm.match(ours + rival, "kv", "ours", "gathered")
    assert left == 1
    assert [(r["index"], r["method"], r["score"], r["ours_score"], r["ratio"]) for r in got] == [
        (0, "kv 10%", 0.75, 0.5, 0.9)
    ]
    c = rm.compare(ours + rival, "kv", "ours", "gathered")
    assert (c["prompts"], c["unmatched"], c["ratio_mean"]) == (1, 1, 0.9)
    assert (c["rival_score"], c["ours_score"], c["diff"]) == (0.75, 0.5, 0.25)
    assert rm.compare(ours, "kv", "ours", "gathered") is None  # the rival never ran
    none = rm.compare([ours[1], *rival[4:]], "kv", "ours", "gathered")
    assert none == {"rival": "kv", "ours": "ours", "layout": "gathered", "leader": "none",
                    "prompts": 0, "unmatched": 1}  # fmt: skip
    assert rm.verdict(none, "kv", "ours") == "no kv run within 10% of ours' memory (1 prompts)"


def test_the_bootstrap_resamples_prompts_within_each_task():
    """Resampling within each task gives the point interval 0.5."""
    pairs = [("a", 1.0)] * 3 + [("b", 0.0)] * 7
    assert rm.bootstrap(pairs) == (0.5, 0.5, 0.5)
    spread = [("a", d) for d in (1.0, 0.0, 0.0, 0.0)] + [("b", d) for d in (0.5, -0.5)]
    mean, lo, hi = rm.bootstrap(spread)
    assert mean == (0.25 + 0.0) / 2 and lo < 0 < hi
    assert rm.bootstrap(spread) == (mean, lo, hi)  # seeded: the same every run


def test_a_lead_needs_an_interval_clear_of_zero():
    """Two tasks of two prompts each; the rival's score minus ours per prompt."""

    def compared(diffs):
        ours = [_row("ours", i, 0.5, [[1]], [[16]], task=t)
                for i, t in enumerate("aabb")]  # fmt: skip
        rival = [_row("kv 1%", i, 0.5 + d, [[1]], [[16]], task=t)
                 for i, (t, d) in enumerate(zip("aabb", diffs, strict=True))]  # fmt: skip
        return rm.compare(ours + rival, "kv", "ours", "gathered")

    ahead = compared([0.5, 0.25, 0.25, 0.5])  # every draw positive
    assert ahead["leader"] == "rival" and 0 < ahead["low"] <= ahead["high"]
    assert rm.verdict(ahead, "kv", "ours") == (
        f"kv leads by 0.38 ({ahead['low']:.2f} to {ahead['high']:.2f})"
    )
    behind = compared([-0.5, -0.25, -0.25, -0.5])
    assert behind["leader"] == "ours"
    assert rm.verdict(behind, "kv", "ours") == (
        f"ours leads by 0.38 ({-behind['high']:.2f} to {-behind['low']:.2f})"
    )
    tie = compared([0.5, -0.5, 0.25, -0.25])  # draws on both sides of 0
    assert tie["leader"] == "tie" and tie["low"] < 0 < tie["high"]
    assert rm.verdict(tie, "kv", "ours").startswith("a tie (kv +0.00, ")


def test_the_table_prints_each_match_with_its_ratio_interval_and_left_out_prompts():
    ours = [_row("ours", i, s, [[5, 5]], [[80, 80]], task=t)
            for i, (s, t) in enumerate([(0.0, "a"), (1.0, "a"), (0.0, "b")])]  # fmt: skip
    rival = [_row("kv 10%", i, 1.0, [[5, 5]], [[76, 76]], task=t)
             for i, t in enumerate(["a", "a", "b"])]  # fmt: skip
    lines = rm.equal_memory_table(ours + rival, ["ours", "absent"], ["kv"])
    assert lines[0].startswith("| ours | memory (gathered / in place / uniform) | rival |")
    gathered = next(x for x in lines if "| gathered |" in x)
    # ours: task a 0.5, task b 0: 0.25; the rival 1.0: +0.75; 10 of 10 pages: ratio 1
    assert gathered == ("| ours | 100.0% / 100.0% / 100.0% | kv | gathered | 1.00 vs 0.25 | "
                        "+0.75 (+0.50 to +1.00) | 1.00 (1.00-1.00) | 3 |")  # fmt: skip
    assert len(lines) == 2 + 3 + 1 and lines[-1] == ""  # a line per layout, none for absent


def test_the_figure_draws_a_panel_per_layout_and_the_full_cache():
    rows = [_row("ours 10%", 0, 0.5, [[1, 1], [1, 1]]), _row("ours 20%", 0, 1.0, [[2, 2], [2, 2]])]
    rows += [_row("kv 10%", 0, 0.25, [[3, 0], [0, 0]])]
    curves = rm.curves(rows, "uniform")
    assert curves == {
        "kv": [(12 / 20, 0.25, "kv 10%")],  # 3 pages in the fullest of 4 cells of 5 pages
        "ours": [(4 / 20, 0.5, "ours 10%"), (8 / 20, 1.0, "ours 20%")],
    }
    assert rm.curves(rows, "gathered") == {}  # no row recorded its kept tokens
    svg = rm.figure_svg({lay: rm.curves(rows, lay) for lay in rm.LAYOUTS}, "a & b", full=0.75)
    assert svg.startswith("<svg") and "a &amp; b" in svg
    assert svg.count("<polyline") == 4  # two families in two panels, none in gathered
    assert all(f"{lay}: memory" in svg for lay in rm.LAYOUTS)
    assert svg.count("full cache: 0.75") == 3
    # ours 20% in place: 8 of 20 pages, score 1.0 -> x = 48 + 300 + 56 + 0.4 * 300, y = 48
    assert re.search(r'<circle cx="524\.0" cy="48\.0"', svg)


def test_gathered_is_what_the_decode_pool_allocates(bundled_study):
    """`gathered` pages are what the decode pool allocates, scattered or paged."""
    from pagekv import EvictionConfig
    from pagekv.runtime.paged_cache import PagedCache

    runner = bundled_study.runner
    ids = bundled_study.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)
    pre = runner.prefill(ids[:333], window_max=8)
    keys = [lay.keys for lay in pre.cache.layers]
    values = [lay.values for lay in pre.cache.layers]
    L, G, n, d = len(keys), keys[0].shape[1], pre.n, keys[0].shape[-1]
    page_bytes = 2 * 16 * d * keys[0].element_size()  # keys and values
    # A press's kept set: every 7th token from a per-(layer, KV head) offset, a different
    # count in each.
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(1, n // 7, (L, G), generator=g)
    keep = torch.zeros(L, G, n, dtype=torch.bool)
    for layer in range(L):
        for group in range(G):
            keep[layer, group, torch.arange(layer % 7, n, 7)[: counts[layer, group]]] = True
    fields = rm.memory_fields(pages_touched(keep, 16), n, keep.sum(-1))
    kept = [torch.sort(torch.topk(keep[i].to(torch.int8), int(counts[i].max()), -1,
                                  sorted=False).indices, -1).values for i in range(L)]  # fmt: skip
    counts_host = [[[int(c) for c in counts[i]]] for i in range(L)]
    pool = PagedCache.gathered(keys, values, kept, counts_host, 0, 16)
    assert pool.nbytes == fields["gathered_pages"] * page_bytes
    assert fields["pages_sum"] > fields["gathered_pages"]  # in place it costs more
    for cfg in (
        EvictionConfig(policy="entropy", budget=0.2, page_size=16, window=8, allocation="global"),
        EvictionConfig(policy="mean", budget=0.15, page_size=16, window=8),
        EvictionConfig(policy="entropy", budget=0.2, page_size=1, window=8, allocation="global"),
        EvictionConfig(policy="full", window=8),
    ):
        planned = runner.plan(pre, cfg)
        fields = rm.plan_memory(planned)
        ev = runner.evict(pre, cfg, planned)
        pool = runner.decode_cache([ev], pre, 0)  # the decode's pool, no room to grow
        if cfg.page_size == 16:
            assert pool.nbytes == fields["gathered_pages"] * page_bytes, cfg
            assert fields["gathered_pages"] == fields["pages_sum"], cfg
        else:  # pages of 1: the pool's blocks are single tokens; gathered rounds to 16
            tokens = int(planned.keep.sum())
            assert pool.nbytes == tokens * page_bytes // 16
            assert fields["gathered_pages"] == sum(
                -(-int(k) // 16) for k in planned.keep.sum(-1).flatten()
            )
        assert fields["context_pages"] == 21 and fields["cells"] == pre.n_layers * pre.n_groups
    assert fields["gathered_pages"] == fields["pages_sum"] == 21 * fields["cells"]  # full


def test_the_docstring_examples_hold():
    import doctest

    got = doctest.testmod(rm)
    assert got.attempted > 0 and got.failed == 0
