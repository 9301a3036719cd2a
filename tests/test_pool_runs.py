"""`experiments/pool_runs.py`: reconstruct_ab runs on disjoint prompt sets pooled into one,
with the rows at equal physical memory matched anew from the pooled runs."""

from __future__ import annotations

import pytest

from experiments.physical_rows import add_result, new_row
from tests.benchmark_scripts import load


def _run(offset: int, results: dict) -> dict:
    """A run at `offset`: {row: {prompt: (right, kept, physical)}}."""
    rows = {}
    for key, per in results.items():
        rows[key] = new_row() | ({"pages": 7} if key.startswith("ours") else {})
        for label, (right, kept, physical) in per.items():
            add_result(rows[key], label, right, kept, physical)
    settings = {"budgets": [0.2], "contexts": [500], "curated": None, "mode": "after",
                "physical_page": 16, "page_size": 16, "window": 8, "seed_offset": offset,
                "settings": ["ours"]}  # fmt: skip
    return {"rows": rows, "settings": settings}


def test_pooled_rows_add_up_and_match_memory_per_prompt():
    pr = load("pool_runs")
    a = _run(5000, {
        "ours, 20%": {"p": (True, 100, 320)},
        "kvpress kvzip, 20%": {"p": (True, 100, 900)},
        "kvpress kvzip, 6%": {"p": (False, 30, 300)},
        "kvpress kvzip, 10%": {"p": (True, 50, 310)},  # only this run swept 10 %
    })  # fmt: skip
    b = _run(6000, {
        "ours, 20%": {"p": (False, 100, 330)},
        "kvpress kvzip, 20%": {"p": (True, 100, 880)},
        "kvpress kvzip, 6%": {"p": (True, 30, 290)},
    })  # fmt: skip
    pooled = pr.pool([a, b])
    rows = pooled["rows"]
    assert "kvpress kvzip, 10%" not in rows  # not in every run: not pooled on fewer prompts
    ours = rows["ours, 20%"]
    assert (ours["right"], ours["prompts"], ours["physical"], ours["pages"]) == (1, 2, 650, 14)
    assert ours["wrong"] == ["seeds+6000: p"]
    matched = rows["kvpress kvzip at ours's physical memory, 20%"]
    # Per prompt the 6 % run (300 <= 320, 290 <= 330); the 10 % run, though it fit run a's
    # prompt, is not among the pooled runs.
    assert matched["budgets"] == {
        "seeds+5000: p": "kvpress kvzip, 6%",
        "seeds+6000: p": "kvpress kvzip, 6%",
    }  # noqa: E501
    assert (matched["right"], matched["physical"], matched.get("over", 0)) == (1, 590, 0)
    assert pooled["settings"]["seed_offsets"] == [5000, 6000]


def test_runs_on_the_same_prompts_or_other_settings_are_not_pooled():
    pr = load("pool_runs")
    a = _run(5000, {"ours, 20%": {"p": (True, 100, 320)}})
    with pytest.raises(ValueError, match="same prompts"):
        pr.pool([a, _run(5000, {"ours, 20%": {"p": (True, 100, 320)}})])
    other = _run(6000, {"ours, 20%": {"p": (True, 100, 320)}})
    other["settings"]["budgets"] = [0.5]
    with pytest.raises(ValueError, match="budgets"):
        pr.pool([a, other])


def test_per_prompt_notes_keep_their_runs_names():
    pr = load("pool_runs")
    a = _run(5000, {"ours, 20%": {"p": (True, 100, 320)}})
    b = _run(6000, {"ours, 20%": {"p": (True, 100, 320)}})
    a["rows"]["ours, 20%"] |= {"page_sizes": {"p": 4}, "shares": {"p": {"16": 0.9, "4": 0.96}}}
    b["rows"]["ours, 20%"] |= {"page_sizes": {"p": 16}, "shares": {"p": {"16": 0.97}}}
    a["rows"]["ours, 20%"]["retention"] = {"p": 0.5}
    row = pr.pool([a, b])["rows"]["ours, 20%"]
    assert row["page_sizes"] == {"seeds+5000: p": 4, "seeds+6000: p": 16}
    assert row["shares"] == {"seeds+5000: p": {"16": 0.9, "4": 0.96}, "seeds+6000: p": {"16": 0.97}}
    assert row["retention"] == {"seeds+5000: p": 0.5}
