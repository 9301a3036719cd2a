"""experiments/figures_of_checkout.py's comparison: equal figures and tables pass, a
figure or an answers table that differs fails and is named."""

from __future__ import annotations

import json

from experiments.figures_of_checkout import compare


def _write(path, figures, answers="<table>A</table>", status="**Done:** 1 s"):
    path.write_text(json.dumps({"status": status, "answers": answers, "figures": figures}))
    return str(path)


FIG = {"data": [{"x": [1, 2]}], "layout": {"title": {"text": "Page frame"}}}


def test_equal_runs_compare_equal_whatever_their_seconds(tmp_path, capsys):
    a = _write(tmp_path / "a.json", [FIG, FIG])
    b = _write(tmp_path / "b.json", [FIG, FIG], status="**Done:** 9 s")
    assert compare(a, b) == 0
    assert "2 of 2 figures the same JSON; the answers tables the same" in capsys.readouterr().out


def test_a_figure_or_a_table_that_differs_fails(tmp_path, capsys):
    other = {**FIG, "data": [{"x": [1, 3]}]}
    a = _write(tmp_path / "a.json", [FIG, FIG])
    assert compare(a, _write(tmp_path / "b.json", [FIG, other])) == 1
    assert "DIFF figure 1: Page frame" in capsys.readouterr().out
    assert compare(a, _write(tmp_path / "c.json", [FIG, FIG], answers="<table>B</table>")) == 1
    assert compare(a, _write(tmp_path / "d.json", [FIG])) == 1  # a figure missing
