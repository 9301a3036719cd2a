"""The app under a class: one student alone, N simulated students at once, then one
visitor's varied runs.

    python benchmarks/load_app.py [--students 20] [--lessons 7] [--varied-runs 100]
                                  [--max-seconds 900] [--out docs/perf_load_app.json]

Starts `python app.py` on 127.0.0.1 (a subprocess on a free port, stopped at the end,
also on an error or Ctrl-C), waits until it serves, then:

0. **Alone**: one client runs the first preset (2000 tokens) and for each of
   `--solo-budgets` sends what dragging the budget slider sends (`preview_plans`: plan
   views only) and then what releasing it sends (`/budget`: decodes both sides).
1. **Class**: `--students` threads, each with its own `gradio_client.Client` (its own
   session), started staggered over `--stagger` seconds. Each student runs the first
   `--lessons` lessons in order (`/lesson`) and after each live lesson moves the budget
   twice (`/budget` with the lesson's exact run inputs,
   `pagekv.app.lesson_handlers._lesson_run_args`, and both sides' budgets +5 and +10
   percentage points).
2. **Varied runs**: one client makes `--varied-runs` `/run` calls with different
   budgets, page sizes, policies, seeds, context lengths (500-4000) and question
   positions, then the app's resident memory is read (the issue's bound: 2.5 GB).

Each phase has a deadline (`--max-seconds`, `--varied-max-seconds`): requests not
started by then are skipped and counted, a request still running is abandoned at it
and counted as timed out (not as an error). Kinds of action and what their latency means:

- `lesson first`: the first request for a lesson in the whole class (it computes,
  unless the app computed its live lessons when it started: its default, which this
  script waits for; `--no-warm` starts the app without);
- `lesson repeated`: a lesson another student already asked for (the app's result memo
  should serve it; while the first is still running it waits for that one);
- `budget move`: a `/budget` call (`first`/`repeated` in the same sense, split out too);
- `varied run`: phase 2.

Per kind: count, p50 / p95 / max of the latency a student sees (`total_s`: submit to
final answer, the queue wait included), of the time to the first update (`first_s`:
the plan views), and of the server's share (`service_s`: from the moment the queue
starts processing the request to the final answer, read from the client's status
updates, polled every 50 ms). An error is a status that starts with "**Error:**" or an
exception. The app's memory: its resident set (with any children) sampled every 0.5 s,
and the kernel's high-water mark (VmHWM); after phase 2, the resident set then.

Timings are measurements, never asserted in tests (`tests/test_load_app.py` checks the
script on a tiny run: structure and zero errors).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import app  # noqa: E402  (the lesson list, the output order and the run inputs)
from pagekv.app import handlers, lesson_handlers  # noqa: E402
from pagekv.app.lessons import LESSONS  # noqa: E402
from pagekv.engine.study import MODES  # noqa: E402
from pagekv.runtime.machine import cpu_facts  # noqa: E402  (the CPU beside every timing)

GB = 1e9
POLL_S = 0.05  # how often a student's thread reads its job's status
START_S = 300  # how long the app may take to serve (and, with `warm`, its lessons)
LIVE = [lesson.kind == "live" for lesson in LESSONS]


# ----------------------------------------------------------------- the app process


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of `pid` in bytes from /proc (0, 0 once it has gone)."""
    out = {"VmRSS": 0, "VmHWM": 0}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in out:
                out[key] = int(line.split()[1]) * 1024  # kB
    return out["VmRSS"], out["VmHWM"]


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (psutil if installed, else /proc/*/task/*/children)."""
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        pass
    except Exception:  # the process has gone
        return []
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(x) for x in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


class MemorySampler(threading.Thread):
    """Samples the resident set of a process and its children every `every` seconds.

    `peak_rss` is the largest sampled sum (process + children); `hwm` the process's
    own kernel high-water mark (VmHWM), which no sampling interval can miss.
    """

    def __init__(self, pid: int, every: float = 0.5):
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.every = pid, every
        self.peak_rss = self.hwm = self.last_rss = self.phase_peak = self.children_seen = 0
        self.stopped = threading.Event()

    def sample(self) -> int:
        rss, hwm = _proc_rss(self.pid)
        kids = _children(self.pid)
        self.children_seen = max(self.children_seen, len(kids))
        rss += sum(_proc_rss(k)[0] for k in kids)
        if rss:
            self.last_rss = rss
        self.peak_rss = max(self.peak_rss, rss)
        self.phase_peak = max(self.phase_peak, rss)
        self.hwm = max(self.hwm, hwm)
        return rss

    def mark(self) -> int:
        """Start a new phase: return the phase peak so far and reset it."""
        peak, self.phase_peak = self.phase_peak, 0
        return peak

    def run(self):
        while not self.stopped.wait(self.every):
            self.sample()


def disk_bytes(folder: Path) -> tuple[int, int]:
    """(bytes, files) under `folder`."""
    total = files = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
                files += 1
    return total, files


def _serves(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_app(log_path: Path, tmp: Path, warm: bool = True, dtype: str = "auto"):
    """Start `python app.py` on a free local port; yield `(url, process)`; always stop it
    (SIGTERM to its process group, then SIGKILL after 10 s).

    The app's temporary files (each run's export folder, Gradio's copies of the files
    it serves) go under `tmp` (TMPDIR, GRADIO_TEMP_DIR), so that what a class writes
    to disk can be measured apart from other processes and removed afterwards. With
    `warm` the app computes its live lessons once it serves (its default), and this
    waits for its "lessons ready" line; without, the app starts with `--no-warm`.
    `dtype` is the app's `--dtype` (how answers decode)."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ([] if warm else ["--no-warm"]) + ["--dtype", dtype]
    env = dict(os.environ, TMPDIR=str(tmp), GRADIO_TEMP_DIR=str(tmp / "gradio"))
    log = open(log_path, "w")  # noqa: SIM115  (closed in finally)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}/"
    t0 = time.perf_counter()

    def wait_until(ready, failure: str):
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"the app exited with {proc.returncode}; see {log_path}")
            if time.perf_counter() - t0 > START_S:
                raise RuntimeError(f"{failure} within {START_S} s")
            time.sleep(0.5)

    def lessons_ready() -> bool:
        text = log_path.read_text(errors="replace")
        return "lessons ready" in text or "lessons not warmed" in text

    try:
        wait_until(lambda: _serves(url), "the app did not serve")
        print(f"[{time.perf_counter() - t0:6.1f}s] app serving at {url} (pid {proc.pid})")
        if warm:
            wait_until(lessons_ready, "the lessons were not ready")
            print(f"[{time.perf_counter() - t0:6.1f}s] lessons ready (computed by the app)")
        yield url, proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the group this script started
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


# ----------------------------------------------------------------- one request


def _lesson_outputs_status(out) -> tuple[str | None, str | None]:
    """(status, observation) from a `/lesson` result (the tabs output is not returned:
    LESSON_CONTROLS, the lesson text, RUN_VIEWS minus `last`, MECH_VIEWS)."""
    views = [v for v in app.RUN_VIEWS if v != "last"]
    base = len(app.LESSON_CONTROLS) + 1
    if not isinstance(out, (list, tuple)) or len(out) != base + len(views) + len(app.MECH_VIEWS):
        raise RuntimeError(f"/lesson returned {type(out).__name__} of unexpected length")
    picked = (out[base + views.index(k)] for k in ("status", "observation"))
    return tuple(x if isinstance(x, str) else None for x in picked)


def _observation_outcome(text: str | None) -> str:
    if not text:
        return "none"
    if text.startswith("**Error:**"):
        return "error"
    return next((k for k in ("does not hold", "holds", "not checked") if k in text), "other")


def timed_call(client, deadline: float, api_name: str, *args, **kwargs) -> dict:
    """Submit one request and wait for its final output; times in seconds."""
    from gradio_client.utils import Status

    busy = (Status.PROCESSING, Status.ITERATING, Status.PROGRESS)
    rec: dict = {"api": api_name}
    t0 = time.perf_counter()
    try:
        job = client.submit(*args, api_name=api_name, **kwargs)
        first = started = None
        while not job.done():
            now = time.perf_counter()
            if now > deadline:
                job.cancel()
                rec["timed_out"] = True  # abandoned by us, not failed by the app
                return rec
            if started is None and job.status().code in busy:
                started = now
            if first is None and job.outputs():
                first = now
                started = started or now
            time.sleep(POLL_S)
        rec["output"] = job.result()
        end = time.perf_counter()
        started = started or end
        rec.update(total_s=end - t0, first_s=(first or end) - t0, service_s=end - started)
    except Exception as e:  # a failed request is an error of the app, counted
        rec.update(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        rec["total_s"] = time.perf_counter() - t0
    return rec


# ----------------------------------------------------------------- phase 0: alone


def _check_run_status(rec: dict, out):
    """A `/run` or `/budget` answer's status into `rec`; none, or "**Error:**", is an error."""
    status = out[0] if isinstance(out, (list, tuple)) and out else None
    rec["status"] = (status or "")[:200]
    if not status or status.startswith("**Error:**"):
        rec["error"] = (status or "no status")[:300]


def solo(url: str, budgets: tuple, deadline: float) -> list[dict]:
    """Phase 0, one student alone (the module's docstring), at `budgets`. Kinds: `solo first
    run`, `solo preview`, `solo budget release` (its `first_s` is when the plan views
    arrive; `total_s` both answers)."""
    from gradio_client import Client

    client = Client(url, verbose=False)
    run = handlers._preset_run_args(app.PRESETS[0]).as_dict()
    records = []

    def add(rec, kind, pct=None):
        out = rec.pop("output", None)
        if kind != "solo preview" and out is not None:
            _check_run_status(rec, out)
        if kind == "solo preview" and out is not None and not any(out):
            rec["error"] = "the preview returned nothing"
        rec.update(kind=kind, first=True, budget_pct=pct)
        records.append(rec)

    add(timed_call(client, deadline, "/run", **run), "solo first run")
    for pct in budgets:
        kw = dict(run, budget_pct=pct, budget_b=pct)
        t0 = time.perf_counter()
        try:  # a plain call: a preview is one short update
            out = client.predict(*[kw[k] for k in app.RUN_DEFAULTS], api_name="/preview_plans")
            rec = {"total_s": time.perf_counter() - t0, "output": out}
            rec["first_s"] = rec["service_s"] = rec["total_s"]
        except Exception as e:
            rec = {"error": f"{type(e).__name__}: {e}"[:300], "total_s": time.perf_counter() - t0}
        add(rec, "solo preview", pct)
        add(timed_call(client, deadline, "/budget", **kw), "solo budget release", pct)
    with contextlib.suppress(Exception):
        client.close()
    return records


# ----------------------------------------------------------------- phase 1: a class


class Class:
    """Shared bookkeeping of the students: which lessons and budget moves were asked
    for already (that decides `first` or `repeated`), the records, the skipped."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.lock = threading.Lock()
        self.asked: set = set()
        self.records: list[dict] = []
        self.skipped = 0

    def first_time(self, key) -> bool:
        with self.lock:
            new = key not in self.asked
            self.asked.add(key)
            return new

    def add(self, rec: dict):
        with self.lock:
            self.records.append(rec)


def student(i: int, url: str, cls: Class, n_lessons: int, start_at: float, moves: tuple):
    from gradio_client import Client

    time.sleep(max(0.0, start_at - time.perf_counter()))
    planned = sum(1 + (len(moves) if LIVE[k] else 0) for k in range(n_lessons))
    done = 0
    try:
        client = Client(url, verbose=False)
    except Exception as e:
        cls.add({"kind": "connect", "student": i, "error": f"{type(e).__name__}: {e}"})
        with cls.lock:
            cls.skipped += planned
        return
    for k in range(n_lessons):
        title, lesson = app.LESSON_TITLES[k], LESSONS[k]
        actions = [("lesson", title, None)]
        if LIVE[k]:
            run = lesson_handlers._lesson_run_args(lesson, title, "bundled").as_dict()
            for d in moves:
                kw = dict(run, budget_pct=run["budget_pct"] + d, budget_b=run["budget_b"] + d)
                actions.append(("budget move", (title, d), kw))
        for kind, key, kw in actions:
            if time.perf_counter() > cls.deadline:
                with cls.lock:
                    cls.skipped += planned - done
                return
            first = cls.first_time((kind, key))
            if kind == "lesson":
                rec = timed_call(client, cls.deadline, "/lesson", title)
                label = "lesson first" if first else "lesson repeated"
            else:
                rec = timed_call(client, cls.deadline, "/budget", **kw)
                label = "budget move"
            rec.update(kind=label, first=first, student=i, lesson=title, at=time.perf_counter())
            out = rec.pop("output", None)
            if out is not None:
                try:
                    if kind == "lesson":
                        status, obs = _lesson_outputs_status(out)
                        rec["observation"] = _observation_outcome(obs)
                    else:
                        status = out[0] if isinstance(out, (list, tuple)) else None
                    rec["status"] = (status or "")[:200]
                    if status and status.startswith("**Error:**"):
                        rec["error"] = status[:300]
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"
            cls.add(rec)
            done += 1
    with contextlib.suppress(Exception):
        client.close()


# ----------------------------------------------------------------- phase 2: varied runs


CONTEXTS = (500, 1000, 1500, 2000, 3000, 4000)


def varied_settings(n: int, seed: int = 0, contexts=CONTEXTS) -> list[dict]:
    """`n` run inputs that differ in budget, page size, policies, seed, context length
    (500-4000) and question position (both sides' own settings half the time). Budgets
    are drawn above what the protected pages need (sink page + window pages, about
    (2 P + window) tokens), so every run is valid input."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        context = rng.choice(contexts)
        side = {}
        for suffix in ("", "_b"):
            page = rng.choice(app.PAGE_SIZES)
            window = rng.choice([8, 16, 32, 64])
            floor = 100 * (2 * page + window) / (0.9 * context) + 2
            side |= {
                f"budget{suffix or '_pct'}": round(rng.uniform(max(floor, 5), 60) * 2) / 2,
                f"page_size{suffix}": page,
                f"n_sink{suffix}": rng.choice([0, 2, 4, 8]),
                f"window{suffix}": window,
                f"tau{suffix}": rng.choice([0.5, 1.0, 2.0]),
                f"mode{suffix}": rng.choice(MODES),
            }
        link = rng.random() < 0.5
        out.append(
            dict(
                app.RUN_DEFAULTS,
                task="needle",
                context=context,
                depth=rng.choice([0.1, 0.3, 0.5, 0.7, 0.9]),
                seed=rng.randrange(5),
                needles=rng.choice([1, 1, 2]),
                policy_a=rng.choice(app.POLICY_CHOICES),
                policy_b=rng.choice(app.POLICY_CHOICES),
                link_b=link,
                **side,
            )
        )
    return out


def varied_runs(url: str, n: int, deadline: float, contexts=CONTEXTS) -> tuple[list[dict], int]:
    from gradio_client import Client

    client = Client(url, verbose=False)
    records, skipped = [], 0
    for j, kw in enumerate(varied_settings(n, contexts=contexts)):
        if time.perf_counter() > deadline:
            skipped = n - j
            break
        rec = timed_call(client, deadline, "/run", **kw)
        out = rec.pop("output", None)
        if out is not None:
            _check_run_status(rec, out)
        rec.update(kind="varied run", first=True, settings={
            k: kw[k] for k in ("context", "seed", "mode", "policy_a", "policy_b", "budget_pct",
                               "page_size", "link_b", "budget_b", "page_size_b", "mode_b")
        })  # fmt: skip
        records.append(rec)
        flag = "ERROR " + rec["error"][:80] if "error" in rec else ""
        flag = "abandoned at the deadline" if rec.get("timed_out") else flag
        print(f"  varied run {j + 1:3d}/{n}: {rec.get('total_s', 0):6.2f} s {flag}")
    with contextlib.suppress(Exception):
        client.close()
    return records, skipped


# ----------------------------------------------------------------- summary


def quantile(xs, q):
    """The `q`-quantile of `xs`, Nones left out (None if nothing is left); linear
    interpolation, as numpy's default."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    i = (len(xs) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _stats(xs: list[float]) -> dict:
    out = {"p50": quantile(xs, 0.5), "p95": quantile(xs, 0.95), "max": max(xs, default=None)}
    return {k: None if x is None else round(x, 3) for k, x in out.items()}


def summarize(records: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for rec in records:
        groups.setdefault(rec["kind"], []).append(rec)
        if rec["kind"] == "budget move":
            split = f"budget move ({'first' if rec['first'] else 'repeated'})"
            groups.setdefault(split, []).append(rec)
    out = {}
    for kind, recs in groups.items():
        ok = [r for r in recs if "service_s" in r]
        out[kind] = {
            "count": len(recs),
            "errors": sum("error" in r for r in recs),
            "timed_out": sum(bool(r.get("timed_out")) for r in recs),
            **{f: _stats([r[f] for r in ok]) for f in ("total_s", "first_s", "service_s")},
        }
        obs = [r["observation"] for r in recs if "observation" in r]
        if obs:
            out[kind]["observations"] = {k: obs.count(k) for k in sorted(set(obs))}
    return out


def print_table(title: str, summary: dict):
    print(f"\n{title}")
    print(
        f"  {'kind':26s} {'count':>5s} {'err':>4s}  {'p50 s':>7s} {'p95 s':>7s} {'max s':>7s}"
        f"  {'svc p50':>7s} {'svc p95':>7s}  {'1st p95':>7s}"
    )
    f = lambda x: "      -" if x is None else f"{x:7.2f}"  # noqa: E731
    for kind, s in summary.items():
        t, v = s["total_s"], s["service_s"]
        print(
            f"  {kind:26s} {s['count']:5d} {s['errors']:4d}  {f(t['p50'])} {f(t['p95'])} "
            f"{f(t['max'])}  {f(v['p50'])} {f(v['p95'])}  {f(s['first_s']['p95'])}"
        )


def machine_state() -> dict:
    """The machine the class ran on: its CPU (`pagekv.runtime.machine.cpu_facts`: model, the flags
    that decide which dtypes run fast, cores, load average), platform and Python."""
    cpu = cpu_facts()
    return {
        "cpus": cpu["cores"],
        "cpu_model": cpu["model"],
        "cpu_flags": cpu["flags"],
        "loadavg_1_5_15": cpu["loadavg_1_5_15"],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# ----------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--students", type=int, default=20)
    ap.add_argument("--lessons", type=int, default=len(LESSONS), help="the first N lessons")
    ap.add_argument("--moves", default="5,10", help="budget moves after a live lesson (+pp)")
    ap.add_argument("--stagger", type=float, default=5.0, help="students start over this")
    ap.add_argument(
        "--solo-budgets",
        default="12,15,18,22,25,30,35,40",
        help="phase 0: budgets (%%) one student alone drags to and releases ('' skips it)",
    )
    ap.add_argument("--varied-runs", type=int, default=100)
    ap.add_argument("--max-seconds", type=float, default=900, help="deadline of the class")
    ap.add_argument("--varied-max-seconds", type=float, default=900, help="of phase 2")
    ap.add_argument(
        "--contexts",
        default=",".join(map(str, CONTEXTS)),
        help="context lengths the varied runs draw from (tokens)",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "perf_load_app.json"))
    ap.add_argument("--app-log", default=None, help="keep the app's log here")
    ap.add_argument(
        "--no-warm",
        action="store_true",
        help="start the app with --no-warm: the class's first request of each lesson computes",
    )
    ap.add_argument("--keep-tmp", action="store_true", help="keep the app's temporary files")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="the app's --dtype: how answers decode (default auto)",
    )
    args = ap.parse_args(argv)
    if not 1 <= args.lessons <= len(LESSONS):
        ap.error(f"--lessons must be 1 to {len(LESSONS)}")
    moves = tuple(float(x) for x in args.moves.split(",") if x.strip())
    contexts = tuple(int(x) for x in args.contexts.split(",") if x.strip())

    # SIGTERM ends like Ctrl-C: the finally blocks stop the app.
    signal.signal(signal.SIGTERM, _interrupt)
    t_start = time.perf_counter()
    log_path = Path(args.app_log or tempfile.mkstemp(prefix="load_app_", suffix=".log")[1])
    result: dict = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "settings": vars(args) | {"moves": list(moves)},
        "machine_before": machine_state(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    app_tmp = Path(tempfile.mkdtemp(prefix="load_app_tmp_"))
    try:
        _measure(args, moves, contexts, result, log_path, app_tmp)
    finally:
        if not args.keep_tmp:
            shutil.rmtree(app_tmp, ignore_errors=True)
    result["errors"] = sum(result[phase]["errors"] for phase in ("solo", "class", "varied"))
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    result["machine_after"] = machine_state()
    result["app_log"] = str(log_path)
    m, disk = result["memory"], result["disk"]
    print(
        f"\nerrors {result['errors']}; app memory: peak resident {m['peak_rss_gb']:.2f} GB "
        f"(VmHWM {m['vm_hwm_gb']:.2f} GB), after the varied runs "
        f"{result['varied']['rss_after_gb']:.2f} GB; temporary files written "
        f"{disk['gb']:.2f} GB in {disk['files']} files; wall {result['wall_s']:.0f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if result["errors"] == 0 else 1


def _measure(args, moves, contexts, result: dict, log_path: Path, app_tmp: Path):
    """The three phases against one app process; fills `result`."""
    solo_budgets = tuple(float(x) for x in args.solo_budgets.split(",") if x.strip())
    with running_app(log_path, app_tmp, warm=not args.no_warm, dtype=args.dtype) as (url, proc):
        result["app_pid"] = proc.pid
        sampler = MemorySampler(proc.pid)
        sampler.start()
        result["memory_idle_gb"] = round(sampler.sample() / GB, 3)

        # Phase 0: one student alone (the app idle).
        t00 = time.perf_counter()
        recs0 = solo(url, solo_budgets, t00 + args.max_seconds) if solo_budgets else []
        result["solo"] = _phase(recs0, t00)
        print_table("Alone: the first preset (2000 tokens), budget dragged and released",
                    result["solo"]["by_kind"])  # fmt: skip

        # Phase 1: the class.
        t0 = time.perf_counter()
        cls = Class(deadline=t0 + args.max_seconds)
        threads = [
            threading.Thread(
                target=student,
                args=(i, url, cls, args.lessons, t0 + args.stagger * i / args.students, moves),
                name=f"student-{i}",
                daemon=True,
            )
            for i in range(args.students)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        result["class"] = _phase(cls.records, t0, sampler, skipped=cls.skipped)
        print_table(
            f"Class: {args.students} students x {args.lessons} lessons "
            f"({result['class']['wall_s']:.0f} s, {cls.skipped} skipped)",
            result["class"]["by_kind"],
        )

        # Phase 2: one visitor's varied runs.
        t1 = time.perf_counter()
        recs, skipped = (
            varied_runs(url, args.varied_runs, t1 + args.varied_max_seconds, contexts)
            if args.varied_runs
            else ([], 0)
        )
        result["varied"] = _phase(recs, t1, sampler, "runs", skipped=skipped)
        print_table(f"Varied runs: {len(recs)} ({skipped} skipped)", result["varied"]["by_kind"])
        sampler.stopped.set()
        result["memory"] = {
            "peak_rss_gb": round(sampler.peak_rss / GB, 3),
            "vm_hwm_gb": round(sampler.hwm / GB, 3),
            "children": sampler.children_seen,
            "sampler": "psutil" if importlib.util.find_spec("psutil") else "/proc",
            "every_s": sampler.every,
        }
    size, files = disk_bytes(app_tmp)
    result["disk"] = {
        "gb": round(size / GB, 3),
        "files": files,
        "what": "the app's temporary files (export folders, Gradio's served copies), "
        "removed after the run unless --keep-tmp",
    }


def _phase(records, t0, sampler=None, count="requests", **extra) -> dict:
    """A phase's part of the JSON: its wall time, requests, errors, summary by kind and
    (with `sampler`, sampled now) the app's memory peak during it and after it."""
    out = {"wall_s": round(time.perf_counter() - t0, 1), count: len(records),
           "errors": sum("error" in r for r in records), **extra,
           "by_kind": summarize(records)}  # fmt: skip
    if sampler is not None:
        sampler.sample()
        out |= {"peak_rss_gb": round(sampler.mark() / GB, 3),
                "rss_after_gb": round(sampler.last_rss / GB, 3)}  # fmt: skip
    return out | {"error_samples": [r["error"] for r in records if "error" in r][:10]}


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
