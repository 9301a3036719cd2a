"""The before/after answer files of issue 40 and what docs/performance.md says of them."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.answers_of_checkout import compare

ROOT = Path(__file__).resolve().parents[1]


def test_the_quoted_count_is_the_files(capsys):
    before = str(ROOT / "docs/answers_before_issue40.json")
    after = str(ROOT / "docs/answers_after_issue40.json")
    assert compare(before, after) == 1  # one case differs
    out = capsys.readouterr().out
    same, total = map(int, re.search(r"(\d+) of (\d+) cases decode the same", out).groups())
    assert out.count("DIFF ") == total - same == 1
    doc = (ROOT / "docs/performance.md").read_text()
    assert f"**{same} of {total} cases decode the same tokens**" in doc
    assert "entropy 20% layer" in out and "inside" in out
    assert compare(before, before) == 0  # and a file agrees with itself
