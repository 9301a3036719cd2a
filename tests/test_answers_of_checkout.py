"""The before/after answer files of issue 40 and what docs/performance.md says of them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from experiments.answers_of_checkout import compare, parting, write

ROOT = Path(__file__).resolve().parents[1]
#: `--dtype` -> (before, after): ce39643 and the decode engine, decoded on one machine.
PAIRS = {
    dtype: (f"docs/answers_before_issue40{tail}.json", f"docs/answers_after_issue40{tail}.json")
    for dtype, tail in (("float32", "_float32"), ("auto", ""))
}
DOC = " ".join((ROOT / "docs/performance.md").read_text().split())  # lines joined


def _compared(capsys, dtype: str) -> tuple[int, str, int, int, dict, dict]:
    before, after = (str(ROOT / p) for p in PAIRS[dtype])
    code = compare(before, after)
    out = capsys.readouterr().out
    same, total = map(int, re.search(r"(\d+) of (\d+) cases decode the same", out).groups())
    files = [json.loads(Path(p).read_text()) for p in (before, after)]
    return code, out, same, total, *files


def _float16_step(x: float) -> float:
    """The spacing of float16 numbers at `x` (1/64 between 16 and 32)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 10)


def test_float32_weights_decode_the_same_tokens_before_and_after(capsys):
    code, out, same, total, a, b = _compared(capsys, "float32")
    assert code == 0 and "DIFF" not in out and same == total == 208
    # Before: transformers' own forward; after: the lean step over the paged cache.
    assert a["decode"] == "transformers forward, float32", a["decode"]
    assert b["decode"] == "lean step, float32 linear weights", b["decode"]
    assert f"| **{same} of {total}** |" in DOC


def test_float16_weights_part_only_at_a_float16_tie(capsys):
    """The one case that differs under float16 weights parts where both checkouts' two
    largest logits are within one float16 step, after them an exact tie won by the
    lower token id; the document quotes the count, the case and the logits."""
    code, out, same, total, a, b = _compared(capsys, "auto")
    assert code == 1 and out.count("DIFF ") == total - same == 1 and total == 208
    assert a["decode"] == b["decode"] == "lean step, float16 linear weights"
    (case,) = [c for c in a["tokens"] if a["tokens"][c] != b["tokens"].get(c)]
    at = parting(a["tokens"][case], b["tokens"][case])
    top_a, top_b = a["top2"][case][at], b["top2"][case][at]
    for top in (top_a, top_b):
        assert 0 <= top[0] - top[1] <= _float16_step(top[0]), top
    assert top_b[0] == top_b[1] and b["tokens"][case][at] < a["tokens"][case][at]
    assert f"| **{same} of {total}** |" in DOC
    name, mode = case.split()[1:3]
    assert f"`{name}`, question {mode}" in DOC and f"at step {at}" in DOC
    assert f"{top_a[0]} and {top_a[1]} before" in DOC and f"{top_b[0]} twice after" in DOC


@pytest.mark.parametrize("dtype", sorted(PAIRS))
def test_the_files_cover_every_case_with_its_logits(dtype):
    """Each file holds the 208 cases, and each answer's two largest logits per step
    (one step per token), in order."""
    for path in PAIRS[dtype]:
        got = json.loads((ROOT / path).read_text())
        assert len(got["tokens"]) == 208 and set(got["top2"]) == set(got["tokens"])
        for case, tokens in got["tokens"].items():
            steps = got["top2"][case]
            assert len(steps) == len(tokens) and all(s[0] >= s[1] for s in steps), case


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
