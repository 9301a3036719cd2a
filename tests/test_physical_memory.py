"""Physical memory of a kept set in a paged cache (`pagekv.maths.paging.pages_touched`,
`physical_tokens`) and the benchmark's comparison at equal physical memory
(`experiments/physical_rows.py`'s `equal_physical_rows`, and `experiments/reconstruct_ab.py`'s
reuse of an earlier run's peer rows)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.physical_rows import (
    add_result,
    equal_physical_rows,
    matched_keys,
    new_row,
    peer_runs,
)
from pagekv.maths.paging import expand_pages, num_pages, pages_touched, physical_tokens
from tests.benchmark_scripts import load


def test_pages_touched_by_hand():
    keep = torch.zeros(2, 3, 37, dtype=torch.bool)
    keep[0, 0, [0, 1, 17, 36]] = True  # pages 0, 1 and the short last page 2
    keep[1, 2] = True
    assert pages_touched(keep, 16).tolist() == [[3, 0, 0], [0, 0, 3]]
    assert physical_tokens(keep, 16) == 6 * 16
    assert physical_tokens(keep, 1) == int(keep.sum()) == 41


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 90),
    page=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
    p=st.floats(0.0, 1.0),
)
def test_pages_touched_bounds_and_whole_pages(n, page, seed, p):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(3, 2, n, generator=gen) < p
    touched = pages_touched(keep, page)
    kept = keep.sum(-1)
    assert torch.equal(pages_touched(keep, 1), kept)
    assert bool((touched <= kept).all()) and bool((touched * page >= kept).all())
    assert bool((touched <= num_pages(n, page)).all())
    # A set of whole pages touches exactly its pages.
    page_keep = torch.rand(3, 2, num_pages(n, page), generator=gen) < p
    assert torch.equal(pages_touched(expand_pages(page_keep, n, page), page), page_keep.sum(-1))


def _script():
    return load("reconstruct_ab")


def test_equal_physical_rows_pick_the_largest_run_that_fits_per_prompt():
    rows = {"ours, 20%": new_row()}
    add_result(rows["ours, 20%"], "p1", True, 100, 320)
    add_result(rows["ours, 20%"], "p2", False, 100, 160)
    runs = {  # budget: {prompt: (right, kept, physical)}
        "kvpress kvzip, 20%": {"p1": (True, 100, 900), "p2": (True, 100, 800)},
        "kvpress kvzip, 10%": {"p1": (True, 50, 480), "p2": (True, 50, 400)},
        "kvpress kvzip, 5%": {"p1": (False, 25, 304), "p2": (True, 25, 208)},
    }
    for key, per in runs.items():
        rows[key] = new_row()
        for label, (right, kept, physical) in per.items():
            add_result(rows[key], label, right, kept, physical)
    out = equal_physical_rows(rows, "ours", [0.2], ["kvzip"])
    row = out["kvpress kvzip at ours's physical memory, 20%"]
    # p1: the 5 % run is the only one within 320; p2: none fits 160, so the smallest.
    assert row["budgets"] == {"p1": "kvpress kvzip, 5%", "p2": "kvpress kvzip, 5%"}
    assert (row["right"], row["prompts"], row["wrong"]) == (1, 2, ["p1"])
    assert row["physical"] == 304 + 208 and row["stored"] == 50 and row["over"] == 1
    rows["kvpress kvzip, 10%"]["per_prompt"]["p1"]["physical"] = 320  # now exactly ours
    row = equal_physical_rows(rows, "ours", [0.2], ["kvzip"])[
        "kvpress kvzip at ours's physical memory, 20%"
    ]
    assert row["budgets"]["p1"] == "kvpress kvzip, 10%" and row["right"] == 2


def test_earlier_peer_rows_are_reused_only_on_the_same_prompts(tmp_path):
    ab = _script()
    kept = {"right": 1, "prompts": 1, "stored": 9, "wrong": []}
    saved = {
        "settings": {"contexts": [1000, 500], "curated": None, "mode": "after",
                     "seed_offset": 5000, "physical_page": 16, "peer": ["kvzip"]},
        "rows": {"ours, 20%": kept, "kvpress kvzip, 20%": kept, "kvpress keydiff, 6%": kept,
                 "kvpress kvzip at ours's physical memory, 20%": kept},
    }  # fmt: skip
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(saved))
    args = ab.argparse.Namespace(contexts={500, 1000}, curated=None, mode="after",
                                 seed_offset=5000, physical_page=16)  # fmt: skip
    rows, names = ab.earlier_peer_rows(str(path), args)
    # The peer's own runs only: ours and the old matching are this run's to make.
    assert sorted(rows) == ["kvpress keydiff, 6%", "kvpress kvzip, 20%"]
    assert names == ["kvzip", "keydiff"]
    for key, value in [("seed_offset", 0), ("physical_page", 8), ("contexts", {500})]:
        other = ab.argparse.Namespace(**(vars(args) | {key: value}))
        with pytest.raises(ValueError, match=key):
            ab.earlier_peer_rows(str(path), other)


def test_run_peer_runs_only_the_batches_an_earlier_run_lacks(monkeypatch):
    from experiments.peer import kvpress_peer as kp

    ab = _script()
    batches = []

    def fake_run(model_dir, reqs, timeout, progress):
        batches.append(sorted({r["budget"] for r in reqs}))
        touched = {"16": [[2, 1]]}  # one layer, two KV heads: 3 pages of 16
        return [{"answer": "x", "attended_tokens": [[5, 4]], "touched_pages": touched}] * len(reqs)

    monkeypatch.setattr(kp, "run_kvpress", fake_run)
    monkeypatch.setattr(kp, "bundled_model_dir", lambda: "model")
    monkeypatch.setattr(ab, "score", lambda answer, task: {"correct": answer == "x"})
    monkeypatch.setattr(ab, "default_max_new_tokens", lambda task: 8)
    earlier = {"kvpress kvzip, 20%": new_row()}
    rows = dict(earlier)
    ab.run_peer(["kvzip"], [(list(range(40)), [3], None)], [0.2, 0.5], rows, fractions=(0.5,),
                skip=earlier)  # fmt: skip
    # 20 % was the earlier run's; 50 %, 10 % and 25 % are run, in that order.
    assert batches == [[0.5], [0.1], [0.25]]
    assert rows["kvpress kvzip, 20%"] is earlier["kvpress kvzip, 20%"]
    swept = rows["kvpress kvzip, 10%"]
    assert (swept["right"], swept["physical"], swept["stored"]) == (1, 48, 9)


def test_peer_runs_are_told_from_ours_and_from_the_matched_rows():
    rows = {k: new_row() for k in [
        "reconstruct/max, global, pages at 8, 20%",  # ours, " at " in its label
        "kvpress kvzip, 20%", "kvpress keydiff, 6%", "kvpress kvzip, 6%",
        "kvpress kvzip at reconstruct/max, global's physical memory, 20%",
    ]}  # fmt: skip
    assert {name: list(runs) for name, runs in peer_runs(rows).items()} == {
        "kvzip": ["kvpress kvzip, 20%", "kvpress kvzip, 6%"],
        "keydiff": ["kvpress keydiff, 6%"],
    }
    assert matched_keys(rows) == {"kvpress kvzip at reconstruct/max, global's physical memory, 20%"}
