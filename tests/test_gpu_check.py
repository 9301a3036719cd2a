"""The GPU check's CPU dry run: the script works, writes every section, imports no app code.

`benchmarks/gpu_check.py` is meant to run once on a bare GPU machine that has torch,
triton and transformers but not gradio, plotly, gguf or accelerate. This test runs its
`--dry-run` (Triton interpreter, tiny shapes) in a subprocess whose every Python
process (the check, its pytest, its benchmark and its end-to-end child) first runs a
`sitecustomize` that

- blocks `gradio`, `plotly` and `gguf`: importing them raises ImportError, as it would
  there; and
- records every real import (not an availability probe) of those and of `accelerate`,
  with the file that imported it.

accelerate cannot be blocked the same way here: transformers imports it whenever it is
installed (its own availability check), and it is installed in this venv for the GGUF
loader. So the test checks who imported it: only transformers may, and on the GPU
machine, where it is absent, transformers does not.
"""

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
    report = json.loads(out.read_text())

    # No process of the check imported a blocked package, and only transformers itself
    # imported accelerate.
    imports = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    blocked = [e for e in imports if e["module"] in BLOCKED]
    assert not blocked, blocked
    accel = [e for e in imports if e["module"] == "accelerate"]
    assert all(f"{os.sep}transformers{os.sep}" in e["importer"] for e in accel), accel
    assert report["imports"]["imported_by_check"] == []

    # Every section, in the dry-run mode, within the deadline, versions recorded.
    for key in ("meta", "tests", "end_to_end", "bench_kernels", "imports", "elapsed_s"):
        assert key in report, key
    meta = report["meta"]
    assert meta["mode"] == "dry-run" and meta["triton_interpret"] == "1"
    assert meta["torch"] and meta["triton"] and meta["transformers"] and meta["date_utc"]
    assert report["within_deadline"] and report["elapsed_s"] <= meta["deadline_s"]

    # Stage 1: the kernel tests ran and passed.
    tests = report["tests"]
    assert tests["ok"] and tests["passed"] > 0 and tests["failed"] == tests["errors"] == 0, tests

    # Stage 2: every size ran end to end on the Triton backend, with sane figures.
    e2e = report["end_to_end"]
    assert e2e["ok"] and e2e["runner_backend"] == "triton", e2e.get("process")
    assert [r["n"] for r in e2e["runs"]] == e2e["sizes"] and not e2e["skipped"]
    assert e2e["warmup"]["s"] > 0
    for run in e2e["runs"]:
        assert "error" not in run, run.get("traceback")
        assert run["backend"] == "triton"
        assert run["prefill_s"] > 0 and run["evict_step_s"] > 0
        assert 0 < run["evict_frac_of_prefill"] < float("inf")  # interpreted: no bound
        assert run["decode_tok_s_full"] > 0 and run["decode_tok_s_evicted"] > 0
        assert run["entropy"]["decode_forwards"] == e2e["new_tokens"] - 1
        # Budget 0.2 of the prompt, in whole pages: at most a fifth of the full cache.
        assert 0 < run["cache_bytes_after"] <= 0.2 * run["cache_bytes_before"]
        assert run["full"]["cache_bytes_after"] == run["cache_bytes_before"]
        assert run["profile_memo_cleared"], "the repeats would not time the scoring"
    parity = e2e["runs"][0]["backend_parity"]
    assert parity["tokens_equal"] and parity["kept_pages_equal"] is True, parity

    # Stage 3: the kernel benchmark ran at its size, with parity and timings.
    bench = report["bench_kernels"]
    assert bench["ok"] and not bench["not_reached"], bench.get("output_tail")
    (row,) = bench["summary"]
    assert row["score_triton_ms"] > 0 and row["score_torch_ms"] > 0, row
    assert row["parity"]["kept_pages_equal"] and row["parity"]["compact_equal"], row
