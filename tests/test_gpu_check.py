"""The GPU check's CPU dry run: `benchmarks/gpu_check.py --dry-run` works, writes every section and
imports no app code. A `sitecustomize` in every child process blocks gradio, plotly and gguf
(absent on the GPU machine) and records who imports accelerate: only transformers may."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("gradio", "plotly", "gguf")
WATCHED = (*BLOCKED, "accelerate")

SITECUSTOMIZE = '''
"""Written by tests/test_gpu_check.py: block {blocked}, record imports of {watched}."""
import atexit
import importlib.abc
import importlib.machinery
import json
import os
import sys
import traceback

_BLOCKED = {blocked!r}
_WATCHED = {watched!r}
_seen = []


class _Blocked(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(module.__name__ + " is blocked by tests/test_gpu_check.py")


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _WATCHED:
            return None
        stack = traceback.extract_stack()[:-1]
        if any(f.name == "_find_and_load" for f in stack):  # an import, not a probe
            files = [f for f in stack if not f.filename.startswith("<frozen")]
            last = files[-1] if files else None
            _seen.append({{
                "module": name,
                "importer": f"{{last.filename}}:{{last.lineno}}" if last else "?",
                "argv": sys.argv[:4],
            }})
        if name in _BLOCKED:
            return importlib.machinery.ModuleSpec(name, _Blocked())
        return None


sys.meta_path.insert(0, _Guard())


@atexit.register
def _dump():
    if _seen:
        with open(os.environ["PAGEKV_IMPORT_LOG"], "a") as f:
            for entry in _seen:
                f.write(json.dumps(entry) + "\\n")
'''


def test_gpu_check_dry_run(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=BLOCKED, watched=WATCHED))
    log = tmp_path / "imports.jsonl"
    out = tmp_path / "perf_gpu_dry.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env["PAGEKV_IMPORT_LOG"] = str(log)
    # The sitecustomize works: a blocked package does not import under it.
    probe = subprocess.run([sys.executable, "-c", "import plotly"], env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert probe.returncode != 0 and "blocked by tests/test_gpu_check.py" in probe.stderr
    log.unlink(missing_ok=True)

    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert proc.stdout.strip().splitlines()[-1] == "GPU check: PASSED", tail
    report = json.loads(out.read_text())
    assert report["verdict"] == {"passed": True, "failures": []}

    # No process of the check imported a blocked package, and only transformers itself
    # imported accelerate.
    imports = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    blocked = [e for e in imports if e["module"] in BLOCKED]
    assert not blocked, blocked
    accel = [e for e in imports if e["module"] == "accelerate"]
    assert all(f"{os.sep}transformers{os.sep}" in e["importer"] for e in accel), accel
    assert report["imports"]["imported_by_check"] == []

    # Every section, in the dry-run mode, within the deadline, versions recorded.
    for key in ("meta", "runner_tests", "kernel_tests", "end_to_end", "bench_kernels",
                "imports", "elapsed_s", "verdict"):  # fmt: skip
        assert key in report, key
    meta = report["meta"]
    assert meta["mode"] == "dry-run" and meta["triton_interpret"] == "1"
    assert meta["torch"] and meta["triton"] and meta["transformers"] and meta["date_utc"]
    assert report["within_deadline"] and report["elapsed_s"] <= meta["deadline_s"]

    # Stages 1 and 2: the runner tests (first) and the kernel tests ran and passed.
    for key in ("runner_tests", "kernel_tests"):
        tests = report[key]
        assert tests["ok"] and tests["passed"] > 0, (key, tests)
        assert tests["failed"] == tests["errors"] == 0, (key, tests)
    assert "tests/test_decode_masks.py" in report["runner_tests"]["cmd"]
    assert "tests/test_kernels.py" in report["kernel_tests"]["cmd"]

    # Stage 3: every size ran end to end on the Triton backend, with sane figures.
    e2e = report["end_to_end"]
    assert e2e["ok"] and e2e["runner_backend"] == "triton", e2e.get("process")
    assert [r["n"] for r in e2e["runs"]] == e2e["sizes"] and not e2e["skipped"]
    assert e2e["warmup"]["s"] > 0
    # The decode's weight-bandwidth bound: every weight's bytes (float32 here), and no
    # bound claimed without a GPU's bandwidth.
    assert e2e["weight_bytes"] == 4 * e2e["parameters"] and e2e["decode_bound_ms_per_token"] is None
    for run in e2e["runs"]:
        assert "error" not in run, run.get("traceback")
        assert run["backend"] == "triton"
        assert run["prefill_s"] > 0 and run["evict_step_s"] > 0
        assert 0 < run["score_s"] <= run["evict_step_s"], run
        assert 0 < run["evict_frac_of_prefill"] < float("inf")  # interpreted: no bound
        assert run["decode_tok_s_full"] > 0 and run["decode_tok_s_evicted"] > 0
        assert run["entropy"]["decode_forwards"] == e2e["new_tokens"] - 1
        # Budget 0.2 of the prompt, in whole pages: at most a fifth of the full cache.
        assert 0 < run["cache_bytes_after"] <= 0.2 * run["cache_bytes_before"]
        assert run["full"]["cache_bytes_after"] == run["cache_bytes_before"]
        assert run["profile_memo_cleared"], "the repeats would not time the scoring"
        # The step before the size's decodes too (the dry run's two repeats), and the
        # repeats' garbage collections per generation.
        before = run["evict_step_s_before_decode"]
        assert len(before) == 2 and min(before) > 0, before
        unsynced = run["evict_step_s_unsynced"]  # the runner's own timer put back after
        assert len(unsynced) == 2 and min(unsynced) > 0, unsynced
        assert len(run["gc_collections_in_reps"]) == 3, run["gc_collections_in_reps"]
        prof = run["evict_profile"]  # where the step's time goes, for the next lease
        assert prof["wall_ms"] > 0 and 0 < prof["host_ops_ms"] and prof["events"] > 0, prof
        names = {e["name"] for e in prof["top_host"]}
        assert any(name.startswith("aten::") for name in names), names
        py = run["evict_py_profile"]  # the Python around the operations
        assert py["wall_ms"] > 0 and {"pagekv", "kernels", "C"} <= set(py["own_ms_by_area"]), py
        steps = {r["where"] for r in py["top_cumulative"]}
        assert any(w.startswith("pagekv/runtime/runner.py:") and w.endswith(":evict")
                   for w in steps), steps  # fmt: skip
    parity = e2e["runs"][0]["backend_parity"]
    assert parity["tokens_equal"] and parity["kept_pages_equal"] is True, parity

    # Stage 4: the kernel benchmark ran at its size, with parity and timings.
    bench = report["bench_kernels"]
    assert bench["ok"] and not bench["not_reached"], bench.get("output_tail")
    (row,) = bench["summary"]
    assert row["score_triton_ms"] > 0 and row["score_torch_ms"] > 0, row
    assert row["parity"]["kept_pages_equal"] and row["parity"]["compact_equal"], row


def test_a_failing_check_says_so_in_its_last_line_and_exit_status(tmp_path):
    """A deadline too short for any stage: every stage is skipped, which fails the check
    (exit status 1, the last line naming the stages)."""
    out = tmp_path / "short.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--deadline", "12",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert last.startswith("GPU check: FAILED: runner_tests skipped"), last
    assert json.loads(out.read_text())["verdict"]["passed"] is False


def _report(**over) -> dict:
    """A passing GPU report, with `over` replacing whole sections."""
    tests = {"status": "done", "ok": True, "passed": 5, "failed": 0, "errors": 0, "rc": 0}
    report = {
        "runner_tests": dict(tests),
        "kernel_tests": dict(tests),
        "end_to_end": {
            "status": "done", "ok": True, "process": {"rc": 0, "timed_out": False},
            "runs": [{"n": 4096, "evict_frac_of_prefill": 0.02, "score_s": 0.002},
                     {"n": 32768, "evict_frac_of_prefill": 0.025, "score_s": 0.004}],
            "skipped": [], "not_reached": [],
        },
        "bench_kernels": {
            "status": "done", "ok": True, "rc": 0, "timed_out": False, "not_reached": [],
            "summary": [{"n": 4096, "score_triton_ms": 1.5}, {"n": 32768, "score_triton_ms": 3.0}],
        },
        "imports": {"imported_by_check": [], "imported_by_end_to_end": ["accelerate"]},
        "within_deadline": True,
        "elapsed_s": 300.0,
    }  # fmt: skip
    report.update(over)
    return report


def test_the_verdict_names_each_failure():
    """The verdict of hand-made reports: a pass, and each kind of failure named."""
    from types import SimpleNamespace

    from tests.benchmark_scripts import load

    gpu_check = load("gpu_check")
    args = SimpleNamespace(deadline=400.0)
    assert gpu_check.verdict(_report(), "gpu", args) == []
    base = _report()
    failed_tests = dict(base["kernel_tests"], ok=False, failed=2, failed_tests=["t::a[cuda]"])
    assert gpu_check.verdict(_report(kernel_tests=failed_tests), "gpu", args) == [
        "kernel tests: 2 failed, 0 errors (t::a[cuda])"
    ]
    timed = dict(base["runner_tests"], ok=False, timed_out=True, limit_s=100.0)
    assert "stopped at its 100.0 s limit" in gpu_check.verdict(_report(runner_tests=timed),
                                                               "gpu", args)[0]  # fmt: skip
    e2e = dict(base["end_to_end"], runs=[{"n": 4096, "error": "OutOfMemoryError: x"}],
               not_reached=[32768])  # fmt: skip
    assert gpu_check.verdict(_report(end_to_end=e2e), "gpu", args) == [
        "e2e n = 4096: OutOfMemoryError: x",
        "e2e: sizes not reached [32768]",
    ]
    slow = dict(base["end_to_end"], runs=[{"n": 32768, "evict_frac_of_prefill": 0.94,
                                           "score_s": 0.327}])  # fmt: skip
    got = gpu_check.verdict(_report(end_to_end=slow), "gpu", args)
    assert got[0] == "eviction step 94.0% of prefill at n = 32768 (target at most 3%)", got
    assert got[1].startswith("the runner's scoring 327.00 ms is 109.0x the kernel's"), got
    # A dry run judges no GPU target; app packages imported fail it, accelerate does not.
    assert gpu_check.verdict(_report(end_to_end=slow), "dry-run", args) == []
    plotly = {"imported_by_check": ["plotly"], "imported_by_end_to_end": ["accelerate"]}
    assert gpu_check.verdict(_report(imports=plotly), "gpu", args) == ["imported ['plotly']"]
    late = _report(within_deadline=False, elapsed_s=431.0)
    assert gpu_check.verdict(late, "gpu", args) == ["took 431.0 s, over the 400 s deadline"]


def test_the_scoring_roofline_by_hand():
    """`roofline` on a hand-worked case (L=1, H=2, G=1, n=10, d=4, w=2, bf16): 304 bytes, 640 flops,
    compute-bound; the fp32 peak moves the bound."""
    from tests.benchmark_scripts import load

    bench = load("bench_kernels")
    ones = {"tbps": 1.0, "tflops_half": 1.0, "tflops_fp32": 0.1, "texp": 1.0}
    r = bench.roofline(1, 2, 1, 10, 4, 2, 2, False, ms=1.28e-6, peaks=ones)
    assert (r["bytes"], r["flops"], r["exps"]) == (304, 640, 80)
    assert r["bound"] == "compute" and abs(r["frac_of_bound"] - 0.5) < 1e-12
    assert abs(r["bound_ms"]["memory"] - 3.04e-7) < 1e-18
    assert abs(r["flops_per_byte"] - 640 / 304) < 1e-12
    slow_fp32 = bench.roofline(1, 2, 1, 10, 4, 2, 2, True, peaks=ones)
    assert abs(slow_fp32["bound_ms"]["compute"] - 10 * r["bound_ms"]["compute"]) < 1e-18
    exp_bound = bench.roofline(1, 2, 1, 10, 4, 2, 2, False, peaks={**ones, "texp": 0.01})
    assert exp_bound["bound"] == "exp2"


def test_gc_count_sees_the_collections_inside_its_block():
    """`_GcCount` counts the collections inside `with` by generation, and only there."""
    import gc

    from tests.benchmark_scripts import load

    gpu_check = load("gpu_check")
    with gpu_check._GcCount() as seen:
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
    assert seen.by_generation[2] >= 1 and seen.by_generation[0] >= 1, seen.by_generation
    counted = list(seen.by_generation)
    gc.collect()
    assert seen.by_generation == counted


def test_code_area_names_this_repo_and_the_libraries():
    """`_code_area`: this repo's folder, a library's package, `~` built-ins, else `other`."""
    from tests.benchmark_scripts import load

    gpu_check = load("gpu_check")
    area = gpu_check._code_area
    assert area(str(ROOT / "pagekv" / "runtime" / "runner.py")) == "pagekv"
    assert area(str(ROOT / "kernels" / "score.py")) == "kernels"
    assert area("/venv/lib/python3.11/site-packages/triton/runtime/jit.py") == "triton"
    assert area("/venv/lib/python3.11/site-packages/transformers/cache_utils.py") == "transformers"
    assert area("/venv/lib/python3.11/site-packages/torch/nn/functional.py") == "torch"
    assert area("~") == "C"
    assert area("/usr/lib/python3.11/inspect.py") == "other"
    # A virtual environment inside the repo (the README's .venv) is not the repo's code.
    venv = ROOT / ".venv" / "lib" / "python3.11" / "site-packages"
    assert area(str(venv / "triton" / "runtime" / "interpreter.py")) == "triton"
    assert area(str(venv / "numpy" / "core" / "fromnumeric.py")) == "other"


def test_the_peaks_follow_the_gpu():
    """Peaks follow the GPU's name (most specific first, a GH200 is no H200), `--peak-*` flags
    override, an unknown GPU needs every flag."""
    from tests.benchmark_scripts import load

    bench = load("bench_kernels")
    tbps = {
        "NVIDIA H200": 4.8,
        "NVIDIA H100 80GB HBM3": 3.35,
        "NVIDIA H100 PCIe": 2.0,
        "NVIDIA H100 NVL": 3.9,
        "NVIDIA A100-SXM4-80GB": 2.039,
        "NVIDIA A100 80GB PCIe": 1.935,
        "NVIDIA A100-SXM4-40GB": 1.555,
    }
    for name, want in tbps.items():
        peaks, matched = bench.peaks_of(name)
        assert peaks["tbps"] == want and matched in name, (name, peaks, matched)
        assert set(peaks) == set(bench.PEAKS)
    assert bench.peaks_of("NVIDIA H200 NVL")[0]["tflops_half"] == 835.0
    assert bench.peaks_of("NVIDIA GH200 480GB") is None
    assert bench.peaks_of("NVIDIA L4") is None

    none = dict.fromkeys(bench.PEAKS)
    assert bench.choose_peaks(None, none)[0] == bench.PEAKS  # the CPU smoke run's shapes
    peaks, source = bench.choose_peaks("NVIDIA H100 80GB HBM3", {**none, "tbps": 3.0})
    assert peaks == {**bench.peaks_of("NVIDIA H100 80GB HBM3")[0], "tbps": 3.0}
    assert "H100" in source and "tbps" in source, source
    peaks, reason = bench.choose_peaks("NVIDIA L4", {**none, "tbps": 0.3})
    assert peaks is None and "tflops_half" in reason and "tbps" not in reason, reason
    given = {"tbps": 0.3, "tflops_half": 121.0, "tflops_fp32": 30.3, "texp": 1.0}
    assert bench.choose_peaks("NVIDIA L4", given)[0] == given


def test_the_unsynced_step_puts_the_runner_s_timer_back(monkeypatch):
    """`_evict_unsynced` swaps the runner's timer only while its step runs (or raises)."""
    import pytest
    import torch

    import pagekv.runtime.runner as runner_mod
    from pagekv import EvictionConfig
    from tests.benchmark_scripts import load
    from tests.test_runner import prompt, tiny_model

    gpu_check = load("gpu_check")
    timer = runner_mod.synced_now
    runner = runner_mod.Runner(tiny_model("llama", layers=2, seed=0), None, backend="torch")
    pre = runner.prefill(prompt(120, seed=1), window_max=16)
    cfg = EvictionConfig(policy="entropy", budget=0.4, page_size=8, window=16)
    seen = []
    evict = runner.evict
    monkeypatch.setattr(runner, "evict", lambda *a: seen.append(runner_mod.synced_now) or evict(*a))
    assert gpu_check._evict_unsynced(runner, pre, cfg, torch.device("cpu")) > 0
    assert seen and seen[0] is not timer and runner_mod.synced_now is timer

    def fails(*a):
        raise RuntimeError("planted")

    monkeypatch.setattr(runner, "evict", fails)
    with pytest.raises(RuntimeError, match="planted"):
        gpu_check._evict_unsynced(runner, pre, cfg, torch.device("cpu"))
    assert runner_mod.synced_now is timer
