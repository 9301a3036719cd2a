"""`experiments/answers_of_checkout.py`: comparing two checkouts' answers token by token,
and the reference file of this code's float32 answers (docs/answers_float32.json) that a
change to the decode is compared against (docs/performance.md, "The same answers")."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.answers_of_checkout import CONFIGS, compare, parting, write

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "answers_float32.json"


def test_the_reference_covers_every_case_with_its_logits(capsys):
    """The reference holds all 208 cases with their top-2 logits per step, self-consistent."""
    got = json.loads(REFERENCE.read_text())
    assert got["decode"] == "lean step, float32 linear weights"
    assert len(got["tokens"]) == 208 and set(got["top2"]) == set(got["tokens"])
    assert {" ".join(case.split()[3:]) for case in got["tokens"]} == set(CONFIGS)
    for case, tokens in got["tokens"].items():
        steps = got["top2"][case]
        assert len(steps) == len(tokens) and all(s[0] >= s[1] for s in steps), case
    assert compare(str(REFERENCE), str(REFERENCE)) == 0
    assert "208 of 208 cases decode the same tokens" in capsys.readouterr().out
    assert "**208 of 208**" in (ROOT / "docs" / "performance.md").read_text()


def test_compare_and_parting_by_hand(tmp_path, capsys):
    """Two hand-made files: the case that differs is reported with both files' logits at
    the step where the answers part; a file agrees with itself; `write` round-trips."""
    c2 = {"tokens": [1, 2], "top2": [[1.0, 0.0], [1.0, 0.5]]}
    a = {"decode": "x", "tokens": {"c1": [5, 6, 7], "c2": c2["tokens"]},
         "top2": {"c1": [[3.0, 1.0], [2.5, 2.5], [4.0, 0.0]], "c2": c2["top2"]}}  # fmt: skip
    b = {"decode": "y", "tokens": {"c1": [5, 8], "c2": c2["tokens"]},
         "top2": {"c1": [[3.0, 1.0], [2.25, 2.0]], "c2": c2["top2"]}}  # fmt: skip
    pa, pb = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    write(a, pa)
    write(b, pb)
    assert json.loads(Path(pa).read_text()) == a
    assert compare(pa, pb) == 1
    out = capsys.readouterr().out
    assert "DIFF c1" in out and "DIFF c2" not in out
    assert "they part at step 1: two largest logits [2.5, 2.5] and [2.25, 2.0]" in out
    assert "1 of 2 cases decode the same tokens" in out
    assert compare(pa, pa) == 0
    assert parting([1, 2], [1, 2]) is None and parting([1, 2, 3], [1, 2]) == 2
