"""kvpress's own generic press tests (github.com/NVIDIA/kvpress), applied to pagekv's presses.

tests/kvpress_generic/checks.py runs the checks inside kvpress's venv on tiny random models
(kvpress's tests load a hub model), and also checks the kept count and that the cache holds
exactly the planned pages. Not mirrored: ScorerPress-only wrappers (pagekv's presses select
pages, the case checks the wrappers refuse them); the reconstruct scorer under ComposedPress,
in batches or inside `generate` (it refuses, as kvpress skips KVzipPress); pipeline-only cases
that need a GPU, flash-attention, optimum-quanto or a real model's answer.

Run: ``PAGEKV_TEST_KVPRESS=1 python -m pytest -q tests/test_kvpress_generic.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from experiments.peer import kvpress_peer as kp

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "kvpress_generic" / "checks.py"

pytestmark = [pytest.mark.slow, pytest.mark.kvpress]  # opt-in: tests/conftest.py

VARIANTS = ("entropy-window", "entropy-reconstruct", "meanpool-window", "meanpool-reconstruct")
MODELS = ("llama_mha", "qwen2_gqa")
RATIOS = (0.2, 0.8)
#: kvpress test mirrored -> the script's cases that mirror it.
MIRRORS = {
    # wrapper_press=None, ratios 0.2/0.8; the kept keys are exactly the selected ones.
    "test_presses.py::test_presses_run": [
        f"presses_run[{m}-{v}-{r}]" for m in MODELS for v in VARIANTS for r in RATIOS
    ],
    "test_presses.py::test_presses_run[ComposedPress]": [
        f"presses_run_composed[{v}-{r}]" for v in VARIANTS for r in RATIOS
    ],
    "test_presses.py::test_presses_run[other wrappers refuse]": ["presses_run_other_wrappers"],
    "test_presses.py::test_composed_press": ["composed_press"],
    "test_presses.py::test_presses_run_observed_attention": [
        f"observed_attention[{v}-{r}]" for v in VARIANTS for r in RATIOS
    ],
    "test_presses.py::test_presses_keep_highest_score": [
        "keep_planned[entropy-window]",
        "keep_planned[meanpool-window]",
    ],
    "test_press_call.py::test_context_manager_adds_and_removes_hook": [
        f"context_manager_adds_and_removes_hook[{v}]" for v in VARIANTS
    ],
    "test_press_call.py::test_context_manager_applies_compression": [
        f"context_manager_applies_compression[{v}]" for v in VARIANTS
    ],
    "test_pipeline.py": [f"pipeline[{m}-{v}]" for m in MODELS for v in VARIANTS],
    "test_generate.py::test_generate": [f"generate[{v}]" for v in VARIANTS],
    # Not kvpress's: under BasePress the reconstruct scorer keeps pagekv's own picks.
    "reconstruct scorer matches pagekv": [
        f"reconstruct_matches_pagekv[{m}-{v}]"
        for m in MODELS
        for v in ("entropy-reconstruct", "meanpool-reconstruct")
    ],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case of tests/kvpress_generic/checks.py, run once in kvpress's venv."""
    python = kp.venv_python(kp.ensure_kvpress_env(progress=None))
    out = tmp_path_factory.mktemp("kvpress_generic") / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    proc = subprocess.run(
        [str(python), str(CHECKS), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=ROOT,
    )
    assert out.exists(), (proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(out.read_text())


def _check(results: dict, names: list[str]) -> None:
    """Every named case ran (none silently missing) and passed."""
    missing = [n for n in names if n not in results]
    assert not missing, f"cases that did not run: {missing}"
    failed = {n: results[n]["error"] for n in names if not results[n]["ok"]}
    assert not failed, "\n\n".join(f"{n}:\n{e}" for n, e in failed.items())
    for n in names:
        print(f"\n{n}: {json.dumps(results[n]['facts'], default=str)[:300]}")


@pytest.mark.parametrize("names", list(MIRRORS.values()), ids=list(MIRRORS))
def test_mirrors_kvpress(results, names):
    _check(results, names)


def test_facts_of_two_cases(results):
    """Protected pages only (one warning) at 0.8; KnormPress after PageEntroKVPress."""
    small = results["presses_run[qwen2_gqa-entropy-window-0.8]"]["facts"]
    assert small == {"kept": 48, "k": 25, "warned": 1}
    assert results["composed_press"]["facts"]["128"]["after_knorm"] == 32


def test_every_case_is_asserted(results):
    """No case of the script goes unchecked by a test above."""
    asserted = {n for names in MIRRORS.values() for n in names}
    assert set(results) == asserted and len(results) == 60, sorted(set(results) ^ asserted)
