"""benchmarks/bench_release.py runs end to end on the bundled model and writes every part
of a release that docs/performance.md quotes (the timings are the machine's, not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = (
    "preview_s", "release_s", "first_s", "plan_s", "pair_decode_s", "pair_tokens",
    "views_during_decode_s", "views_during_decode_unmemoised_s", "retention_view_s",
)  # fmt: skip


@pytest.mark.slow
def test_one_release_is_timed_part_by_part(bundled_study, tmp_path):
    out = tmp_path / "release.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_release.py", "--budgets", "20", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["budget_pct"] == 20 and set(PARTS) <= set(row)
    assert row["pair_tokens"] > 0
