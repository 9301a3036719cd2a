"""The GPU check: every GPU figure the project reports, in one command, in one short lease.

On a CUDA machine (an H200 with its own torch, triton and transformers; no model hub, no
gradio, plotly, gguf or accelerate needed)::

    python benchmarks/gpu_check.py --out docs/perf_gpu.json

runs four stages, each in its own subprocess with a time limit, under a global deadline
(`--deadline`, 400 s by default, so the whole check ends within 7 minutes):

1. `runner_tests`, first: the tests of the whole Triton path on the GPU, each on a tiny
   random model (`RUNNER_TESTS`): the runner's Triton path against its torch path with
   the twins made to raise, the eviction step's host waits (counted by
   `torch.cuda.set_sync_debug_mode`), the decode's masks and syncs, the one-launch
   compaction, the reconstruction scorer. Pass/fail counts, overall and for `[cuda]`.
2. `kernel_tests`: the kernel parity tests, `tests/test_kernels.py` and the paged
   decode's `tests/test_paged_decode.py` (their `[cuda]` copies compiled on the GPU),
   less the hypothesis property test (`KERNEL_TESTS_K`).
3. `end_to_end`: a model with Qwen2.5-1.5B-Instruct's configuration and random weights
   (nothing downloaded; bfloat16, SDPA prefill) through
   `pagekv.runtime.runner.Runner(model, None, backend="triton")` at 4k, 16k and 32k random
   prompt tokens: prefill, the eviction step (`policy="entropy"`, budget 0.2, pages of
   16) and 32 decoded tokens, against `policy="full"` and against transformers'
   `generate` on the same prompt. Each plan is decoded twice: the first decode captures
   its bucket's CUDA graph (`decode_tok_s_first_*`), the second replays it. The
   eviction step is timed before the size's decodes (`evict_step_s_before_decode`;
   `evict_step_s_unsynced`: the same with the runner's phase timers not waiting for
   the device, one sync before and one after) and after them (`evict_step_s_reps`,
   with Python's garbage collections during those repeats, `gc_collections_in_reps`),
   and once more under `torch.profiler` (`evict_profile`: the operations' host and
   device time) and once under `cProfile` (`evict_py_profile`: the Python around
   them), since the step is host-bound. A warm-up at the first size (untimed, its time
   recorded) pays the Triton compilation.
4. `bench_kernels`: `benchmarks/bench_kernels.py` at 4k-128k tokens on the pilot model's
   shapes (its defaults), eager twins only (`--bench-compile` adds the torch.compile ones),
   with the time left; sizes that would not fit are skipped, the reason recorded. The
   scoring kernel's bytes and flops give its roofline (`bench_kernels.roofline`).

The last line printed is the verdict, `GPU check: PASSED` or `GPU check: FAILED: <what>`
(also `verdict` in the JSON), and the exit status is 1 when anything failed: a test, a
stage (its return code or its time limit), a size that erred or was not reached, the
deadline, or on a GPU one of the issue's targets (`TARGETS`): the eviction step at most
3 % of prefill at 32k tokens, and the runner's scoring within 2x of `bench_kernels`'
scoring kernel on the same shapes.

Everything goes to ONE JSON file (written after each stage, so a kill keeps what was
measured): `meta` (versions, GPU, date, mode), `runner_tests`, `kernel_tests`,
`end_to_end`, `bench_kernels`, `imports`, `elapsed_s` and `verdict`. Progress lines carry
the elapsed time: `[  42.0s] ...`.

`--dry-run` (chosen automatically without CUDA) is the same four stages as a CPU smoke
test in under 3 minutes: the Triton interpreter (`TRITON_INTERPRET=1`, set before
anything imports `kernels`), a few of the runner and kernel tests (`RUNNER_TESTS_DRY`,
`KERNEL_TESTS_DRY_K`; the CPU suite runs them all), a tiny Qwen2 configuration in
float32 and the small sizes of `PLANS["dry-run"]`. It writes the same JSON structure to a
temporary file (never over docs/perf_gpu.json unless `--out` says so) and ends with the
same verdict line; the GPU targets are not judged (its numbers say nothing about GPU
performance: it proves the script).

Compatibility: it runs with the GPU machine's older stack (transformers 5.17, triton
3.6) as well as ours; the runner passes the cache under whichever name the installed
transformers' `forward` takes (`cache` in 5.24, `past_key_values` in 5.17).
`end_to_end.compat_shims` stays in the JSON, empty unless a future shim is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections import deque
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere

#: The runner-level tests, run first on a GPU (slow-marked ones, which need the bundled
#: model, deselected): the models are tiny, random, on the GPU.
RUNNER_TESTS = (
    "tests/test_triton_path.py",
    "tests/test_host_waits.py",
    "tests/test_decode_masks.py",
    "tests/test_compact_layers.py",
    "tests/test_reconstruct.py::test_the_triton_path_gives_the_torch_scores",
    "tests/test_decode_reads.py",
    "tests/test_capacity.py::test_the_kernel_reads_a_batch_of_rows_of_different_lengths",
)
#: The dry run's share of them (interpreted, all of them take a minute and a half; the
#: CPU test suite runs them anyway): one case of each kind.
RUNNER_TESTS_DRY = (
    "tests/test_decode_masks.py",
    "tests/test_compact_layers.py",
    "tests/test_triton_path.py::test_triton_runner_equals_torch_runner",
    "tests/test_host_waits.py::test_host_waits_do_not_grow_with_the_layers",
)
RUNNER_TESTS_DRY_K = (
    "decode_masks or compact or (entropy and inside) or (entropy-uniform and triton)"
)
#: The kernel parity tests on a GPU: every test but the hypothesis property test, whose
#: random shapes each compile a new launch (the interpreter runs it in the CPU suite).
KERNEL_TESTS_K = "not query_blocks_property"
#: The dry run's share of the kernel tests (the CPU suite runs them all): one test of
#: each kernel against its twin.
KERNEL_TESTS_DRY_K = "score_matches_twin or pool_pages_matches_twin or compact_matches_twin"

#: The issue's targets on a GPU (`target_failures`; not judged in a dry run).
TARGETS = {"evict_frac_of_prefill_max": 0.03, "runner_score_over_bench_max": 2.0}

#: Packages the check must never import (the app's, and the GGUF loader's). Of them,
#: accelerate is imported by transformers itself wherever it is installed (not on the
#: GPU machine), so only the others fail the verdict.
FORBIDDEN = ("gradio", "plotly", "gguf", "accelerate")
APP_ONLY = ("gradio", "plotly", "gguf")

#: Qwen2.5-1.5B-Instruct's configuration (its config.json), weights left random.
QWEN25_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    hidden_act="silu",
    bos_token_id=151643,
    eos_token_id=151645,
)
#: The dry run's stand-in: the same family and GQA ratio class, tiny (no special tokens).
TINY = {k: v for k, v in QWEN25_1_5B.items() if not k.endswith("_token_id")} | dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=256,
    max_position_embeddings=4096,
)

#: Per mode: sizes, decode length, stage limits (s) and the deadline (s).
PLANS = {
    "gpu": dict(
        e2e_sizes=[4096, 16384, 32768],
        new_tokens=32,
        evict_reps=5,
        bench_sizes=[4096, 8192, 16384, 32768, 65536, 131072],
        deadline=400.0,
        # Each stage's own limit, and what is kept back for it while earlier ones run.
        limits={"runner_tests": 100.0, "kernel_tests": 130.0, "e2e": 150.0, "bench": 150.0},
        # (measured on an H200, imports included: runner tests 47 s, kernel tests about
        # 100 s with their compiles, e2e 31 s of which 12 s build the model, bench 30 s)
        reserves={"runner_tests": 0.0, "kernel_tests": 110.0, "e2e": 60.0, "bench": 45.0},
    ),
    "dry-run": dict(
        e2e_sizes=[512, 1024],
        new_tokens=4,
        evict_reps=2,
        bench_sizes=[256],
        deadline=170.0,
        limits={"runner_tests": 60.0, "kernel_tests": 80.0, "e2e": 60.0, "bench": 60.0},
        reserves={"runner_tests": 0.0, "kernel_tests": 20.0, "e2e": 25.0, "bench": 15.0},
    ),
}

#: The stages in order, and the report key of each.
STAGES = {
    "runner_tests": "runner_tests",
    "kernel_tests": "kernel_tests",
    "e2e": "end_to_end",
    "bench": "bench_kernels",
}


# -------------------------------------------------------------------- helpers


class Clock:
    """Elapsed time since the check started, and the progress lines that show it."""

    def __init__(self, deadline: float):
        self.t0 = time.perf_counter()
        self.deadline = deadline

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.deadline - self.elapsed()

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _output(cmd: list[str], timeout: float, need_success: bool = False) -> str | None:
    """What `cmd` prints, stripped; None if it cannot run, prints nothing or fails (if told)."""
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return None if need_success and out.returncode != 0 else (out.stdout.strip() or None)


def environment(mode: str, args) -> dict:
    """Versions, device and date: what the figures were measured on."""
    import torch

    cuda = torch.cuda.is_available()
    meta = {
        "mode": mode,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "deadline_s": args.deadline,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        **{dist: _version(dist) for dist in ("triton", "transformers", "pytest")},
        "git_commit": _output(["git", "rev-parse", "HEAD"], 10, need_success=True),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "cuda_available": cuda,
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        # Driver, clocks and power limit, as nvidia-smi reports them (None without it).
        query = "name,driver_version,clocks.max.sm,clocks.max.memory,power.limit,memory.total"
        meta["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "count": torch.cuda.device_count(),
            "nvidia_smi": _output(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], 15),
        }
    return meta


def _set_mode_env(env, dry: bool) -> None:
    """A dry run: the Triton interpreter, and the CPU even on a GPU machine; else compiled."""
    if dry:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("TRITON_INTERPRET", None)


def run_stage(cmd: list[str], timeout: float, clock: Clock, label: str, dry: bool,
              lines: list[str] | None = None) -> dict:  # fmt: skip
    """Run `cmd` from the repository root in the mode's environment, echo its lines with the
    elapsed time, stop it at `timeout` seconds (its whole process group). Returns rc, wall
    time and the tail; every line is also appended to `lines` when given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    _set_mode_env(env, dry)
    tail: deque[str] = deque(maxlen=60)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)  # fmt: skip

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if lines is not None:
                lines.append(line)
            clock.say(f"  {label} | {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        clock.say(f"{label}: time limit of {timeout:.0f} s reached; stopping it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)  # the stage's own process group (start_new_session)
        rc = proc.wait()
    reader.join(timeout=5)
    return {
        "cmd": " ".join(cmd),
        "rc": rc,
        "timed_out": timed_out,
        "limit_s": round(timeout, 1),
        "wall_s": round(time.perf_counter() - t0, 2),
        "output_tail": list(tail)[-25:],
    }


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


def _fmt(x, unit="", scale=1.0, digits=1) -> str:
    return "n/a" if x is None else f"{x * scale:.{digits}f}{unit}"


# -------------------------------------------------- stages 1 and 2: the tests


def _tally(outcomes) -> dict:
    """Counts of `(test name, outcome, is a [cuda] copy)`, overall and for the copies."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    cuda = dict(counts)
    failed_names = []
    for name, outcome, is_cuda in outcomes:
        counts[outcome] += 1
        if is_cuda:
            cuda[outcome] += 1
        if outcome in ("failed", "errors"):
            failed_names.append(name)
    return {**counts, "cuda": cuda, "failed_tests": failed_names[:50]}


def junit_counts(xml_path: Path) -> dict:
    """Outcome counts from pytest's junit XML, overall and for the `[cuda]` copies."""
    outcomes = []
    word = {"failure": "failed", "error": "errors", "skipped": "skipped"}  # first found wins
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = next((w for tag, w in word.items() if tag in tags), "passed")
        name = case.get("name", "")
        is_cuda = "[cuda" in name or "-cuda" in name or "cuda]" in name
        outcomes.append((f"{case.get('classname')}::{name}", outcome, is_cuda))
    return _tally(outcomes)


def verbose_counts(lines: list[str]) -> dict:
    """The same counts from `pytest -v` lines (`path::test[id] PASSED  [ 5%]`)."""
    word = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}
    found = [re.match(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)\b", line) for line in lines]
    return _tally((m.group(1), word[m.group(2)], "[cuda" in m.group(1)) for m in found if m)


def stage_tests(args, clock: Clock, dry: bool, limit: float, stage: str) -> dict:
    """A test stage (`runner_tests` or `kernel_tests`): pytest, and its counts."""
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        # -v: one line per test, so a stage stopped at its limit still has its counts.
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
               f"--junitxml={xml_path}"]  # fmt: skip
        if stage == "runner_tests":
            cmd += [*(RUNNER_TESTS_DRY if dry else RUNNER_TESTS), "-m", "not slow"]
            k = RUNNER_TESTS_DRY_K if dry else None
        else:
            cmd += ["tests/test_kernels.py", "tests/test_paged_decode.py"]
            k = args.tests_k or (KERNEL_TESTS_DRY_K if dry else KERNEL_TESTS_K)
        cmd += ["-k", k] if k else []
        lines: list[str] = []
        out = run_stage(cmd, limit, clock, stage, dry, lines)
        try:
            out.update(junit_counts(xml_path))
            out["counts_from"] = "junit xml"
        except (OSError, ET.ParseError) as e:
            out.update(verbose_counts(lines))
            out["counts_from"] = f"pytest -v lines (no junit xml: {type(e).__name__})"
    summary = [ln for ln in out["output_tail"] if re.search(r"\d+ (passed|failed|error)", ln)]
    out["summary"] = summary[-1] if summary else None
    passed = out["failed"] == out["errors"] == 0 and out["passed"] > 0
    out["ok"] = out["rc"] == 0 and not out["timed_out"] and passed
    return out


# -------------------------------------------------------- stage 3: end to end


def build_model(config: dict, dtype, device):
    """A Qwen2 causal LM with random weights from `config` (nothing downloaded)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**config)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: seconds, not a minute, at 1.5B
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def _sync(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _clear_profile_memo(pre) -> bool:
    """Forget the prefill's memoised scoring (`Prefill._scores`), so that the next
    eviction scores again. False when the prefill has no such memo (then the repeats
    time the eviction step without its scoring, and the JSON says so)."""
    memo = getattr(pre, "_scores", None)
    if isinstance(memo, dict):
        memo.clear()
    return isinstance(memo, dict)


def _evict_alone(runner, pre, cfg) -> float:
    """One eviction step, scoring from scratch, with no decode: its seconds as the runner
    times them (scoring, planning, and the gather into the decode cache)."""
    _clear_profile_memo(pre)
    ev = runner.evict(pre, cfg)
    runner._gather(pre, [ev], 0)  # adds the gather's seconds to `evict_s`
    return _step_seconds({"score_s": ev.score_s, "evict_s": ev.evict_s})[0]


def _evict_unsynced(runner, pre, cfg, device) -> float:
    """One eviction step's wall time (scoring from scratch) with the runner's phase
    timers made not to wait for the device: one sync before, one after. On a GPU each
    timer (`synced_now`: scoring, planning, the gather) synchronises, so the host cannot
    queue a phase's launches while the device still runs the one before; the
    difference from the timed step is what those waits cost."""
    import pagekv.runtime.runner as runner_mod

    _clear_profile_memo(pre)
    t0 = _sync(device)
    with mock.patch.object(runner_mod, "synced_now", lambda _device: time.perf_counter()):
        runner.decode_cache([runner.evict(pre, cfg)], pre, 0)
    return _sync(device) - t0


class _GcCount:
    """Python's garbage collections, per generation, while the `with` block runs."""

    def __enter__(self):
        self.by_generation = [0, 0, 0]
        gc.callbacks.append(self._seen)
        return self

    def _seen(self, phase, info):
        if phase == "start":
            self.by_generation[info["generation"]] += 1

    def __exit__(self, *exc):
        gc.callbacks.remove(self._seen)
        return False


def _step_seconds(timings: dict) -> tuple[float, list[str]]:
    """The eviction step: every timed part except the prefill and the decode."""
    other = ("prefill_s", "decode_s")
    keys = [k for k, v in timings.items() if k.endswith("_s") and k not in other and v is not None]
    return float(sum(float(timings[k]) for k in keys)), keys


def _flat_ints(x) -> list[int]:
    """The integers of a nested list (`[L][G]` per-group counts), however deep."""
    if isinstance(x, (list, tuple)):
        return [i for item in x for i in _flat_ints(item)]
    return [] if x is None else [int(x)]


def _result_summary(res) -> dict:
    """The JSON-ready fields of a RunResult that the check reports (no [L][G] lists)."""
    d = res.to_dict()
    left_out = ("answer", "kept_tokens", "union_tokens", "needle_retention",
                "needle_retention_union", "plan", "logits")  # fmt: skip
    out = {k: v for k, v in d.items() if k not in left_out}
    flat = _flat_ints(d.get("kept_tokens"))
    if flat:
        out["kept_tokens_per_layer_group"] = {"min": min(flat), "max": max(flat)}
    decode_s = float(d.get("timings", {}).get("decode_s", 0.0))
    # The first answer token is the prefill's argmax: len(tokens) - 1 decode forwards.
    out["decode_forwards"] = forwards = max(len(d.get("tokens") or []) - 1, 0)
    out["decode_tok_s"] = forwards / decode_s if decode_s > 0 and forwards else None
    out["evict_step_s"], out["evict_step_parts"] = _step_seconds(d.get("timings", {}))
    return out


def _profile_step(runner, pre, cfg, device) -> dict:
    """One eviction step (scoring from scratch) under `torch.profiler`: where its time
    goes. The wall time; the host time of the operations and runtime calls it records
    (on a GPU `cudaLaunchKernel`, `cudaMalloc`, `cudaStreamSynchronize`, ...; the Python
    between them is the rest of the wall time); their device time; and the events with
    the most host time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _clear_profile_memo(pre)
    with profile(activities=acts) as prof:
        t0 = _sync(device)
        runner.evaluate(pre, cfg, max_new_tokens=0, stop_at_eos=False)
        wall = _sync(device) - t0
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))

    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "wall_ms": 1e3 * wall,
        "host_ops_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "device_ms": sum(device_us(e) for e in events) / 1e3,
        "events": sum(e.count for e in events),
        "top_host": [
            {
                "name": e.key,
                "count": e.count,
                "self_host_us": round(e.self_cpu_time_total, 1),
                "self_device_us": round(device_us(e), 1),
            }
            for e in top
        ],
        "note": "under the profiler: its own overhead inflates the wall time",
    }


def _code_area(filename: str) -> str:
    """Which code a profiled function is in: this repo's `pagekv` or `kernels`, a
    library (`triton`, `transformers`, `torch`), `C` (built-ins: torch's operations
    as called from Python, `len`, ...) or `other`."""
    if filename == "~":
        return "C"
    for area in ("triton", "transformers", "torch"):  # also a virtual env inside the repo
        if f"-packages/{area}/" in filename:
            return area
    path = Path(filename)
    if ROOT in path.parents and "site-packages" not in path.parts:
        return path.relative_to(ROOT).parts[0]
    return "other"


def _py_profile_step(runner, pre, cfg, device, top: int = 20) -> dict:
    """One eviction step (scoring from scratch) under `cProfile`: the Python side of the
    host time, which `torch.profiler` leaves out. Its own time per code area
    (`own_ms_by_area`); the functions with the most own time (`top_own`: torch's
    operations show as `C` built-ins, Triton's launch path under `triton`); and this
    repo's functions with the most time including their callees (`top_cumulative`)."""
    import cProfile
    import pstats

    _clear_profile_memo(pre)
    prof = cProfile.Profile()
    t0 = _sync(device)
    prof.enable()
    runner.evaluate(pre, cfg, max_new_tokens=0, stop_at_eos=False)
    prof.disable()
    wall = _sync(device) - t0
    rows = []
    for (filename, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        area = _code_area(filename)
        if area in ("pagekv", "kernels"):
            filename = str(Path(filename).relative_to(ROOT))
        where = name if area == "C" else f"{filename}:{line}:{name}"
        rows.append({"where": where, "area": area, "calls": calls,
                     "own_ms": round(1e3 * own, 3), "cum_ms": round(1e3 * cum, 3)})  # fmt: skip
    by_area: dict = {}
    for r in rows:
        by_area[r["area"]] = round(by_area.get(r["area"], 0.0) + r["own_ms"], 3)
    ours = [r for r in rows if r["area"] in ("pagekv", "kernels")]
    return {
        "wall_ms": 1e3 * wall,
        "own_ms_by_area": dict(sorted(by_area.items(), key=lambda kv: -kv[1])),
        "top_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
        "top_cumulative": sorted(ours, key=lambda r: -r["cum_ms"])[:top],
        "note": "under cProfile: its own overhead (per Python call) inflates the times",
    }


def _generate_tok_s(model, ids, new: int, device) -> float | None:
    """transformers' `generate`, greedy, `new` tokens exactly: decode tokens per second,
    from two runs (`new` tokens, and 1: the same prefill) so the prefill cancels."""
    import torch

    x = torch.tensor([ids], device=device)
    seconds = []
    with torch.inference_mode():
        for n in (1, new):
            t0 = _sync(device)
            model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            seconds.append(_sync(device) - t0)
    dt = seconds[1] - seconds[0]
    return (new - 1) / dt if dt > 0 and new > 1 else None


def _backend_parity(model, ids, cfg, triton_res, new_tokens) -> dict:
    """The same prompt through the torch twins: same kept pages, same answer tokens?"""
    from pagekv.runtime.runner import Runner

    runner = Runner(model, None, backend="torch")
    pre = runner.prefill(ids, window_max=cfg.window)
    res = runner.evaluate(pre, cfg, max_new_tokens=new_tokens, stop_at_eos=False)
    out = {"torch_backend": res.backend, "tokens_equal": res.tokens == triton_res.tokens}
    try:
        a, b = triton_res.plan.page_keep.cpu(), res.plan.page_keep.cpu()
        out["kept_pages_equal"] = bool(a.shape == b.shape and bool((a == b).all()))
        out["kept_pages_differ_frac"] = float((a != b).float().mean()) if a.shape == b.shape else 1
    except AttributeError as e:
        out["kept_pages_equal"] = f"not compared: {e}"
    out["note"] = "random weights: near-uniform attention, so near-ties may break differently"
    return out


def stage_e2e(args) -> int:
    """The end-to-end stage, run in its own process (`--stage e2e`)."""
    import torch

    dry = args.mode == "dry-run"
    plan = PLANS[args.mode]
    stop_at = time.time() + args.stage_limit  # this stage's own deadline
    t0 = time.perf_counter()

    def say(msg):
        print(f"e2e {time.perf_counter() - t0:6.1f}s: {msg}", flush=True)

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    config = TINY if dry else QWEN25_1_5B
    report: dict = {
        "model": "tiny Qwen2 (dry run)" if dry else "Qwen2.5-1.5B-Instruct configuration",
        "weights": "random (torch.manual_seed(0)), nothing downloaded",
        "config": config,
        "dtype": str(dtype).replace("torch.", ""),
        "attn_implementation": "sdpa",
        "device": str(device),
        "runner_backend_requested": "triton",
        "eviction": {"policy": "entropy", "budget": 0.2, "page_size": 16},
        "new_tokens": plan["new_tokens"] if args.new_tokens is None else args.new_tokens,
        "sizes": args.e2e_sizes,
        "timer": "time.perf_counter after torch.cuda.synchronize (runner timings)",
        "runs": [],
        "skipped": [],
    }

    save = functools.partial(write_json, Path(args.part_out), report)

    from pagekv import EvictionConfig
    from pagekv.runtime.runner import Runner

    t = time.perf_counter()
    model = build_model(config, dtype, device)
    report["build_s"] = time.perf_counter() - t
    report["parameters"] = sum(p.numel() for p in model.parameters())
    # A batch-1 decode step reads every weight once: at the GPU's bandwidth that bounds
    # the tokens per second (its published figure, bench_kernels.GPU_PEAKS; none on the
    # CPU or on a GPU not listed there).
    report["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    report["decode_bound_ms_per_token"] = None
    if device.type == "cuda":
        from bench_kernels import peaks_of  # benchmarks/ is this script's own folder

        found = peaks_of(torch.cuda.get_device_name(device))
        report["decode_bound_bandwidth"] = found and {"tbps": found[0]["tbps"], "gpu": found[1]}
        if found:
            report["decode_bound_ms_per_token"] = (
                1e3 * report["weight_bytes"] / (found[0]["tbps"] * 1e12)
            )
    report["compat_shims"] = []  # the runner itself handles transformers 5.17 and 5.24
    say(f"model built in {report['build_s']:.1f} s ({report['parameters'] / 1e6:.1f} M "
        f"parameters, {report['dtype']}); shims: {report['compat_shims'] or 'none'}")  # fmt: skip
    runner = Runner(model, None, backend="triton")
    report["runner_backend"] = runner.backend
    save()

    cfg_e = EvictionConfig(policy="entropy", budget=0.2, page_size=16)
    cfg_f = EvictionConfig(policy="full", budget=0.2, page_size=16)
    new = report["new_tokens"]
    gen = torch.Generator().manual_seed(1)

    def ids_of(n):
        return torch.randint(0, config["vocab_size"], (n,), generator=gen).tolist()

    def evaluate(pre, cfg, tokens=new):
        return runner.evaluate(pre, cfg, max_new_tokens=tokens, stop_at_eos=False)

    # Warm-up (untimed in the figures): compiles the Triton kernels and the SDPA path.
    n0 = args.e2e_sizes[0]
    t = _sync(device)
    pre = runner.prefill(ids_of(n0), window_max=cfg_e.window)
    evaluate(pre, cfg_e, 2)
    evaluate(pre, cfg_f, 2)
    what = "prefill + entropy and full evaluations, 2 tokens each"
    report["warmup"] = {"n": n0, "s": _sync(device) - t, "what": what}
    del pre
    say(f"warm-up at n = {n0}: {report['warmup']['s']:.1f} s (includes Triton compilation)")
    save()

    last = None  # (n, seconds) of the previous size
    for n in args.e2e_sizes:
        left = stop_at - time.time()
        # A size's seconds are mostly its decoded tokens (as many at every size: 32 at
        # ~15 tok/s on an H200 against 0.04-0.36 s of prefill), so they grow slowly.
        need = 1.5 * last[1] * (n / last[0]) ** 0.5 if last else 0.0
        if left < 5 or need > left:
            reason = f"time: {left:.0f} s left in the stage, about {need:.0f} s needed"
            report["skipped"].append({"n": n, "reason": reason})
            say(f"n = {n}: skipped ({reason})")
            save()
            continue
        t_size = time.perf_counter()
        run: dict = {"n": n}
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            ids = ids_of(n)
            # Prefill twice: the first call at a new length pays one-off setup.
            pre = runner.prefill(ids, window_max=cfg_e.window)
            run["prefill_s_first"] = float(pre.timings["prefill_s"])
            del pre
            pre = runner.prefill(ids, window_max=cfg_e.window)
            run["prefill_s"] = prefill_s = float(pre.timings["prefill_s"])
            run["prefill_tok_s"] = n / prefill_s
            # The step before this size's decodes (the repeats below come after them: the
            # H200 runs of 2026-12-04 saw the step slow down after graphed decodes). At
            # the first size the warm-up has decoded already, at that size.
            run["evict_step_s_before_decode"] = [
                _evict_alone(runner, pre, cfg_e) for _ in range(min(3, args.evict_reps))
            ]
            # The same step with no wait at the phase boundaries (the runner's timers).
            run["evict_step_s_unsynced"] = [
                _evict_unsynced(runner, pre, cfg_e, device) for _ in range(min(3, args.evict_reps))
            ]
            # Each decode twice: the first captures its bucket's CUDA graph (reported as
            # decode_tok_s_first_*), the second replays it from its first one-token step.
            firsts = [_result_summary(evaluate(pre, cfg))["decode_tok_s"] for cfg in (cfg_e, cfg_f)]
            res_e, res_f = evaluate(pre, cfg_e), evaluate(pre, cfg_f)
            run["entropy"], run["full"] = _result_summary(res_e), _result_summary(res_f)
            run["decode_tok_s_first_evicted"], run["decode_tok_s_first_full"] = firsts
            # The eviction step again, scoring from scratch each time (memo cleared).
            reps, score_reps, cleared = [], [], True
            with _GcCount() as collections:  # Python's pauses, if any, during the repeats
                for _ in range(args.evict_reps):
                    cleared = _clear_profile_memo(pre) and cleared
                    r = evaluate(pre, cfg_e, 0)
                    reps.append(_step_seconds(r.timings)[0])
                    score_reps.append(float(r.timings.get("score_s") or 0.0))
            run["evict_step_s_reps"] = reps
            run["gc_collections_in_reps"] = collections.by_generation
            run["score_s_reps"] = score_reps
            run["profile_memo_cleared"] = cleared
            step = statistics.median(reps) if reps else run["entropy"]["evict_step_s"]
            run["evict_step_s"] = step
            run["evict_step_s_first"] = run["entropy"]["evict_step_s"]
            run["evict_frac_of_prefill"] = step / prefill_s
            run["score_s"] = statistics.median(score_reps) if score_reps else None
            run["evict_profile"] = _profile_step(runner, pre, cfg_e, device)
            run["evict_py_profile"] = _py_profile_step(runner, pre, cfg_e, device)
            run["score_frac_of_prefill"] = (run["score_s"] or 0.0) / prefill_s
            run["decode_tok_s_full"] = run["full"]["decode_tok_s"]
            run["decode_tok_s_evicted"] = run["entropy"]["decode_tok_s"]
            # transformers' own `generate` on the same prompt: the baseline the decode
            # is measured against (issue 40: at least 5x, evicted at least as fast as full).
            run["generate_tok_s"] = _generate_tok_s(model, ids, new, device)
            for key in ("full", "evicted"):
                ours, base = run[f"decode_tok_s_{key}"], run["generate_tok_s"]
                run[f"decode_over_generate_{key}"] = ours / base if ours and base else None
            run["cache_bytes_before"] = res_e.cache_bytes_before
            run["cache_bytes_after"] = res_e.cache_bytes_after
            run["cache_ratio"] = res_e.cache_bytes_after / res_e.cache_bytes_before
            # The decode's own cache: the decode step's paged pool, in bytes.
            run["cache_bytes_decode"] = res_e.cache_bytes_decode
            run["decode_path"] = res_e.backends.get("decode")
            run["backend"] = res_e.backend
            run["backends"] = {k: v for k, v in run["entropy"].items() if "backend" in k}
            if device.type == "cuda":
                run["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if n == args.e2e_sizes[0]:
                run["backend_parity"] = _backend_parity(model, ids, cfg_e, res_e, new)
            del pre, res_e, res_f
        except Exception as e:  # one size failing (say, out of memory) keeps the others
            run["error"] = f"{type(e).__name__}: {e}"[:800]
            run["traceback"] = traceback.format_exc().splitlines()[-12:]
            print("\n".join(run["traceback"]), flush=True)
            pre = res_e = res_f = None  # noqa: F841 (free the tensors before the next size)
        gc.collect()
        run["wall_s"] = time.perf_counter() - t_size
        last = (n, run["wall_s"])
        report["runs"].append(run)
        save()
        if "error" in run:
            say(f"n = {n}: FAILED {run['error']}")
            continue
        prof = run["evict_profile"]
        before = statistics.median(run["evict_step_s_before_decode"])
        unsynced = statistics.median(run["evict_step_s_unsynced"])
        say(
            f"n = {n}: the step before this size's decodes {1e3 * before:.2f} ms (with no "
            f"wait at its phase boundaries {1e3 * unsynced:.2f} ms), after them "
            f"{1e3 * run['evict_step_s']:.2f} ms (median); garbage collections during the "
            f"repeats, per generation: {run['gc_collections_in_reps']}"
        )
        say(f"n = {n}: the step under the profiler: {prof['wall_ms']:.2f} ms wall, "
            f"{prof['host_ops_ms']:.2f} ms host in {prof['events']} events, "
            f"{prof['device_ms']:.2f} ms device; most host time: "
            + ", ".join(f"{e['name']} x{e['count']} {e['self_host_us'] / 1e3:.2f} ms"
                        for e in prof["top_host"][:5]))  # fmt: skip
        py = run["evict_py_profile"]
        say(f"n = {n}: the step under cProfile: {py['wall_ms']:.2f} ms wall; own time by "
            "area: " + ", ".join(f"{a} {ms:.2f} ms" for a, ms in py["own_ms_by_area"].items())
            + "; most time in this repo's functions: "
            + ", ".join(f"{r['where'].rsplit(':', 1)[-1]} {r['cum_ms']:.2f} ms"
                        for r in py["top_cumulative"][:5]))  # fmt: skip
        dec_f, dec_e = run["decode_tok_s_full"], run["decode_tok_s_evicted"]
        bound = report["decode_bound_ms_per_token"]
        by_weights = f" (the weights bound it at {bound:.2f} ms/token)" if bound else ""
        say(
            f"n = {n}: prefill {run['prefill_s']:.3f} s | eviction step "
            f"{1e3 * run['evict_step_s']:.2f} ms = {100 * run['evict_frac_of_prefill']:.2f}% "
            f"of prefill (scoring {1e3 * (run['score_s'] or 0):.2f} ms) | decode "
            f"{_fmt(dec_f)} tok/s full, {_fmt(dec_e)} tok/s evicted (first decodes, which "
            f"capture the graph on CUDA: {_fmt(run['decode_tok_s_first_full'])}, "
            f"{_fmt(run['decode_tok_s_first_evicted'])}), "
            f"generate {_fmt(run['generate_tok_s'])} tok/s, "
            f"{1e3 / dec_e:.1f} ms/token{by_weights} | "
            f"cache {run['cache_bytes_before'] / 2**20:.1f} -> "
            f"{run['cache_bytes_after'] / 2**20:.1f} MiB | backend {run['backend']} | "
            f"decode: {run['decode_path']}"
        )
    report["forbidden_imported"] = [m for m in FORBIDDEN if m in sys.modules]
    save()
    return 0


def stage_e2e_run(args, clock: Clock, dry: bool, mode: str, limit: float) -> dict:
    """Run the end-to-end stage in a child process and read back what it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "e2e.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", "e2e", "--mode", mode,
               "--part-out", str(part), "--stage-limit", f"{max(limit - 10.0, 5.0):.0f}",
               "--evict-reps", str(args.evict_reps),
               "--e2e-sizes", *map(str, args.e2e_sizes)]  # fmt: skip
        if args.new_tokens is not None:
            cmd += ["--new-tokens", str(args.new_tokens)]
        if dry:
            cmd.append("--dry-run")
        run = run_stage(cmd, limit, clock, "e2e", dry)
        try:
            out = json.loads(part.read_text())
        except (OSError, ValueError) as e:
            out = {"result_error": f"{type(e).__name__}: {e}"}
    out["process"] = run
    done = {r.get("n") for r in out.get("runs", [])} | {s["n"] for s in out.get("skipped", [])}
    out["not_reached"] = [n for n in args.e2e_sizes if n not in done]
    erred = any("error" in r for r in out.get("runs", []))
    out["ok"] = run["rc"] == 0 and not run["timed_out"] and not erred
    return out


# ---------------------------------------------- stage 4: the kernel benchmark


def bench_summary(bench: dict) -> list[dict]:
    """Per size: the scoring kernel against its eager twin, and the whole eviction step."""
    rows = []
    for r in bench.get("results", []):
        t = r.get("times", {})

        def ms(name, t=t):
            return t.get(name, {}).get("ms")

        row = {"n": r.get("n")} | {key: r[key] for key in ("error", "skipped") if key in r}
        s_tr, s_to = ms("score/triton"), ms("score/torch")
        row["score_triton_ms"], row["score_torch_ms"] = s_tr, s_to
        row["score_speedup"] = s_to / s_tr if s_tr and s_to else None
        row["score_frac_of_peak"] = t.get("score/triton", {}).get("frac_of_peak")
        rf = t.get("score/triton", {}).get("roofline") or {}
        row["score_bound"] = rf.get("bound")
        row["score_frac_of_bound"] = rf.get("frac_of_bound")
        row["eviction_step_triton_ms"] = ms("eviction_step/triton")
        row["eviction_step_torch_ms"] = ms("eviction_step/torch")
        row["parity"] = r.get("parity")
        # Long query sets (bench_kernels --long-windows): kernel and twin per window.
        for name, entry in sorted(t.items()):
            if name.startswith(("score_w", "max_w")) and "ms" in entry:
                row[name.replace("/", "_") + "_ms"] = entry["ms"]
                if name.endswith("/triton"):
                    row[name.replace("/", "_") + "_tflops"] = entry.get("TFLOP/s")
        if r.get("long_parity"):
            row["long_parity"] = r["long_parity"]
        rows.append(row)
    return rows


def _bench_line(row: dict) -> str:
    if "error" in row or "skipped" in row:
        return str(row.get("error") or f"skipped: {row.get('skipped')}")

    ms = functools.partial(_fmt, unit=" ms", digits=3)
    long = [
        f"; {key[: -len('_triton_ms')]} triton {ms(row[key])} vs torch "
        f"{ms(row.get(key.replace('_triton_', '_torch_')))}"
        for key in row
        if key.startswith(("score_w", "max_w")) and key.endswith("_triton_ms")
    ]
    return (
        f"score triton {ms(row['score_triton_ms'])} vs torch "
        f"{ms(row['score_torch_ms'])} ({_fmt(row['score_speedup'], 'x')}, "
        f"{_fmt(row['score_frac_of_peak'], '% of peak', 100)}, "
        f"{_fmt(row.get('score_frac_of_bound'), '%', 100)} of its {row.get('score_bound')} "
        f"bound); eviction step triton {ms(row['eviction_step_triton_ms'])}" + "".join(long)
    )


def stage_bench(args, clock: Clock, dry: bool, limit: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "bench.json"
        cmd = [sys.executable, "benchmarks/bench_kernels.py", "--out", str(out_path),
               "--sizes", *map(str, args.bench_sizes),
               "--time-budget", f"{max(limit - 25.0, 1.0):.0f}"]  # fmt: skip
        if not args.bench_compile:
            cmd.append("--no-compile")
        if not dry:
            cmd.append("--rng-device")
        out = run_stage(cmd, limit, clock, "bench", dry)
        try:
            out["result"] = json.loads(out_path.read_text())
        except (OSError, ValueError) as e:
            out["result"] = None
            out["result_error"] = f"{type(e).__name__}: {e}"
    done = {r.get("n") for r in (out["result"] or {}).get("results", [])}
    out["not_reached"] = [n for n in args.bench_sizes if n not in done]
    out["summary"] = bench_summary(out["result"] or {})
    out["ok"] = out["rc"] == 0 and not out["timed_out"]
    return out


# ---------------------------------------------------------------- the verdict


def _test_failures(label: str, out: dict) -> list[str]:
    if out.get("ok"):
        return []
    if "error" in out:
        return [f"{label}: {out['error']}"]
    what = f"{out.get('failed', 0)} failed, {out.get('errors', 0)} errors"
    if out.get("timed_out"):
        what += f", stopped at its {out.get('limit_s')} s limit"
    elif out.get("rc") not in (0, None):
        what += f", exit status {out.get('rc')}"
    if not out.get("passed"):
        what += ", none passed"
    names = out.get("failed_tests") or []
    return [f"{label}: {what}" + (f" ({', '.join(names[:3])})" if names else "")]


def verdict(report: dict, mode: str, args) -> list[str]:
    """What failed, one phrase each (empty: the check passed). Stages the command did
    not ask for are not failures; stages skipped for the deadline are."""
    failures: list[str] = []
    for stage, key in STAGES.items():
        out = report.get(key, {})
        if out.get("status") == "skipped":
            failures.append(f"{stage} skipped ({out.get('reason')})")
            continue
        if out.get("status") != "done":
            continue
        if stage.endswith("_tests"):
            failures += _test_failures(stage.replace("_", " "), out)
            continue
        if "error" in out and "runs" not in out and "result" not in out:
            failures.append(f"{stage}: {out['error']}")
            continue
        proc = out.get("process", out)
        if proc.get("timed_out"):
            failures.append(f"{stage}: stopped at its {proc.get('limit_s')} s limit")
        elif proc.get("rc") not in (0, None):
            failures.append(f"{stage}: exit status {proc.get('rc')}")
        if out.get("result_error"):
            failures.append(f"{stage}: {out['result_error']}")
        rows = out.get("runs", []) if stage == "e2e" else out.get("summary", [])
        failures += [f"{stage} n = {r.get('n')}: {r['error']}" for r in rows if "error" in r]
        if out.get("not_reached"):
            failures.append(f"{stage}: sizes not reached {out['not_reached']}")
        if stage == "e2e" and out.get("skipped"):
            failures.append(f"e2e: sizes skipped {[x['n'] for x in out['skipped']]}")
    if not report.get("within_deadline", True):
        failures.append(
            f"took {report.get('elapsed_s')} s, over the {args.deadline:.0f} s deadline"
        )
    imported = report.get("imports", {})
    bad = (imported.get("imported_by_check") or []) + (imported.get("imported_by_end_to_end") or [])
    bad = [m for m in bad if m in APP_ONLY]  # transformers imports accelerate where present
    if bad:
        failures.append(f"imported {sorted(set(bad))}")
    if mode == "gpu":
        failures += target_failures(report)
    return failures


def target_failures(report: dict) -> list[str]:
    """The issue's `TARGETS` that a GPU run missed: the eviction step's share of prefill at
    the largest size run; the runner's scoring against `bench_kernels`' at the same n."""
    out = []
    runs = [r for r in report.get("end_to_end", {}).get("runs", []) if "error" not in r]
    if runs:
        last = max(runs, key=lambda r: r["n"])
        frac = last.get("evict_frac_of_prefill")
        if frac is not None and frac > TARGETS["evict_frac_of_prefill_max"]:
            out.append(
                f"eviction step {100 * frac:.1f}% of prefill at n = {last['n']} "
                f"(target at most {100 * TARGETS['evict_frac_of_prefill_max']:.0f}%)"
            )
    bench = {r.get("n"): r for r in report.get("bench_kernels", {}).get("summary", [])}
    for run in runs:
        row = bench.get(run["n"])
        if not row or not row.get("score_triton_ms") or run.get("score_s") is None:
            continue
        ratio = 1e3 * run["score_s"] / row["score_triton_ms"]
        run_ratio = report["end_to_end"].setdefault("runner_score_over_bench", {})
        run_ratio[str(run["n"])] = round(ratio, 2)
        if ratio > TARGETS["runner_score_over_bench_max"]:
            out.append(
                f"the runner's scoring {1e3 * run['score_s']:.2f} ms is {ratio:.1f}x the kernel's "
                f"{row['score_triton_ms']:.2f} ms at n = {run['n']} (target at most "
                f"{TARGETS['runner_score_over_bench_max']:.0f}x)"
            )
    return out


# ----------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON file (default: docs/perf_gpu.json on a GPU, a temporary "
                    "file in a dry run)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true",
                    help="the CPU smoke version (automatic without CUDA)")  # fmt: skip
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole check (default 400 on a GPU, 170 dry)")  # fmt: skip
    stages = list(STAGES)
    ap.add_argument("--stages", nargs="+", default=stages, choices=stages,
                    help="the stages to run, in order")  # fmt: skip
    ap.add_argument("--e2e-sizes", type=int, nargs="+", default=None, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=None, help="decoded tokens per run")
    ap.add_argument("--evict-reps", type=int, default=None,
                    help="repeats of the eviction step per size (median reported)")  # fmt: skip
    ap.add_argument("--bench-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--bench-compile", action="store_true",
                    help="also time the torch.compile twins (slow to compile)")  # fmt: skip
    ap.add_argument("--tests-k", default=None, help="pytest -k expression for the kernel tests")
    # Internal: the end-to-end stage runs in a child process of this script.
    ap.add_argument("--stage", choices=["e2e"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=list(PLANS), help=argparse.SUPPRESS)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    ap.add_argument("--stage-limit", type=float, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def prepare_environment(argv: list[str]) -> None:
    """This process's environment, set before anything imports torch or pagekv: the
    Triton interpreter is chosen when a kernel is defined (when `kernels.*` is first
    imported), so a dry run sets it here, from a plain look at argv (argparse is set not
    to abbreviate); a GPU run unsets it. Offline, no analytics. Called by `main` (not at
    import: a test that loads this module keeps its own environment)."""
    _set_mode_env(os.environ, "--dry-run" in argv)
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("GRADIO_ANALYTICS_ENABLED", "False"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(key, value)


def main(argv=None) -> int:
    prepare_environment(sys.argv[1:] if argv is None else list(argv))
    args = parse_args(argv)
    if args.stage == "e2e":
        return stage_e2e(args)

    import torch

    mode = "dry-run" if args.dry_run or not torch.cuda.is_available() else "gpu"
    dry = mode == "dry-run"
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # nothing has imported `kernels` yet
    plan = PLANS[mode]
    args.deadline = args.deadline or plan["deadline"]
    args.e2e_sizes = args.e2e_sizes or plan["e2e_sizes"]
    args.bench_sizes = args.bench_sizes or plan["bench_sizes"]
    args.evict_reps = plan["evict_reps"] if args.evict_reps is None else args.evict_reps
    dry_out = Path(tempfile.gettempdir()) / "pagekv_gpu_check_dry_run.json"
    args.out = args.out or (dry_out if dry else ROOT / "docs" / "perf_gpu.json")
    clock = Clock(args.deadline)
    if dry and not args.dry_run:
        clock.say("no CUDA device: running the CPU dry run (these numbers are not GPU figures)")
    report: dict = {"meta": environment(mode, args)}
    meta = report["meta"]
    clock.say(
        f"gpu_check ({mode}): torch {meta['torch']}, triton {meta['triton']}, transformers "
        f"{meta['transformers']}, {meta.get('gpu', {}).get('name', 'no GPU')}; deadline "
        f"{args.deadline:.0f} s; writing {args.out}"
    )
    report.update({key: {"status": "not run"} for key in STAGES.values()})
    write_json(args.out, report)

    order = [s for s in STAGES if s in args.stages]
    for i, stage in enumerate(order):
        reserve = sum(plan["reserves"][later] for later in order[i + 1 :])
        limit = min(clock.left() - reserve - 5.0, plan["limits"][stage])
        key = STAGES[stage]
        if limit < 10:
            report[key] = {"status": "skipped", "reason": f"deadline: {clock.left():.0f} s left"}
            clock.say(f"{stage}: skipped, {clock.left():.0f} s left")
            write_json(args.out, report)
            continue
        clock.say(f"stage {stage}: limit {limit:.0f} s")
        try:
            if stage.endswith("_tests"):
                out = stage_tests(args, clock, dry, limit, stage)
                clock.say(
                    f"{stage}: {out.get('passed')} passed, {out.get('failed')} failed, "
                    f"{out.get('errors')} errors, {out.get('skipped')} skipped "
                    f"([cuda]: {out.get('cuda')}) in {out['wall_s']:.0f} s"
                )
            elif stage == "e2e":
                out = stage_e2e_run(args, clock, dry, mode, limit)
            else:
                out = stage_bench(args, clock, dry, limit)
                for row in out["summary"]:
                    clock.say(f"bench n = {row['n']}: " + _bench_line(row))
        except Exception as e:  # the check itself failing is a failure, said, not a crash
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:800],
                   "traceback": traceback.format_exc().splitlines()[-12:]}  # fmt: skip
            clock.say(f"{stage}: the stage itself failed: {out['error']}")
        out["status"] = "done"
        report[key] = out
        report["elapsed_s"] = round(clock.elapsed(), 1)
        write_json(args.out, report)

    report["imports"] = {
        "forbidden": list(FORBIDDEN),
        "imported_by_check": [m for m in FORBIDDEN if m in sys.modules],
        "imported_by_end_to_end": report["end_to_end"].get("forbidden_imported"),
        "note": "transformers imports accelerate itself wherever it is installed; "
        "tests/test_gpu_check.py checks that nothing else does",
    }
    report["elapsed_s"] = round(clock.elapsed(), 1)
    report["within_deadline"] = report["elapsed_s"] <= args.deadline
    failures = verdict(report, mode, args)
    report["verdict"] = {"passed": not failures, "failures": failures}
    write_json(args.out, report)
    clock.say(f"done in {report['elapsed_s']:.0f} s; wrote {args.out}")
    print("GPU check: PASSED" if not failures else "GPU check: FAILED: " + "; ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
