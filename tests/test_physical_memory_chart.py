"""`experiments/physical_memory_chart.py`: which rows become points, and one colour per
setting (KVzip red, each of ours its own)."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load


def _script():
    return load("physical_memory_chart")


def _row(right, prompts, physical):
    return {"right": right, "prompts": prompts, "physical": physical}


ROWS = {
    "ours, 50%": _row(3, 4, 800),
    "ours, 20%": _row(2, 4, 400),
    "ours, sum in a page, 20%": _row(1, 4, 400),
    "kvpress kvzip, 6%": _row(1, 4, 360),
    "kvpress kvzip at ours's physical memory, 20%": _row(1, 4, 360),  # a matching, not a run
    "kvpress keydiff, 20%": {"right": 1, "prompts": 4},  # no physical memory reported
}


def test_points_are_runs_with_physical_memory_sorted_by_memory():
    pts = _script().points(ROWS)
    assert pts == {
        "ours": [(100.0, 0.5, 20.0), (200.0, 0.75, 50.0)],
        "ours, sum in a page": [(100.0, 0.25, 20.0)],
        "kvpress kvzip": [(90.0, 0.25, 6.0)],
    }


def test_each_setting_has_its_own_colour(tmp_path):
    mod = _script()
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": ROWS}))
    fig = mod.chart([path, path], ["a", "b"])
    colours = {t.name: t.marker.color for t in fig.data}
    assert colours["KVzip (kvpress), its budgets"] == "#d62728"
    assert colours["pages of 16: ours"] != colours["pages of 16: ours, sum in a page"]
    assert len(fig.data) == 6 and sum(t.showlegend for t in fig.data) == 3
