"""NVIDIA kvpress as a peer, run in its own virtual environment and spoken to in JSON.

kvpress 0.5.5 requires ``transformers>=4.56,<5.3`` and fails on the transformers 5.x that
pagekv uses (``KeyError: 'past_key_values'``), so it cannot be imported here. Instead:

1. :func:`ensure_kvpress_env` creates a virtual environment on demand (``python -m venv``
   then ``pip install -r requirements-kvpress.txt``, torch first so kvpress's torch
   requirement is already met by the pinned CPU-or-local build). A marker file holds the
   hash of the requirements, so a second call returns at once and a changed pin reinstalls.
2. :func:`run_kvpress` writes the requests to a JSON file, runs ``kvpress_worker.py`` with
   that environment's Python, and reads back one JSON response.

Anything that stops the peer (no network for pip, a worker crash, a model that does not
load, garbage output, a timeout) raises :class:`PeerUnavailable` with the reason, which
the replication harness records instead of results. A single request that fails (e.g.
a prompt shorter than SnapKV's window) comes back with its ``error`` set; the others run.

Pinned versions that were installed and run together on CPU (Python 3.11):
torch 2.13.0 (+cpu build), kvpress 0.5.5, transformers 5.2.0, tokenizers 0.22.2 (see
``requirements-kvpress.txt``). transformers 5.2.0 is the newest release kvpress 0.5.5
accepts; it reads the converted bundled model (``pagekv.runtime.models.bundled_cache_dir()``,
saved by transformers 5.24) and its tokenizer unchanged.

Budgets: kvpress's ``compression_ratio`` is the fraction REMOVED; our ``beta`` is the
fraction KEPT. kvpress keeps ``max(1, int(n * (1 - ratio)))`` tokens per layer and KV
head, so ``ratio = 1 - beta`` can keep one token less than our ``floor(beta * n)`` through
float rounding (``beta = 0.1, n = 100``: ``1 - (1 - 0.1) = 0.0999...``, 9 tokens kept).
:func:`ratio_for_budget` returns the ratio that makes kvpress keep exactly our ``k``.
kvpress selects tokens (per KV head), not pages, so it is compared at the same token
budget, not the same page set.

Environment variables:

- ``PAGEKV_KVPRESS_VENV``: where the environment lives (default
  ``<pagekv cache root>/venv-kvpress``, i.e. ``~/.cache/pagekv/venv-kvpress``).
- ``PAGEKV_KVPRESS_PYTHON``: the interpreter that creates it (default: this one).
- ``PAGEKV_KVPRESS_PIP_ARGS``: extra ``pip install`` arguments (e.g. an index URL for
  CPU torch wheels on a machine without a local torch 2.13.0 wheel).

Example::

    from experiments.peer import kvpress_peer as kp
    req = kp.make_request("q1", "snapkv", input_ids=ids, budget=0.2, max_new_tokens=24)
    [res] = kp.run_kvpress(kp.bundled_model_dir(), [req])
    res["answer"], res["kept_tokens"]  # text, per-layer cache length after compression
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from pagekv.integrations.kvpress_press import kvpress_kept

PRESSES = (
    "snapkv", "expected_attention", "knorm", "streaming_llm", "kvzip", "keydiff", "chunkkv",
)  # fmt: skip
"""The kvpress presses the peer runs (``"none"`` is also accepted: no compression)."""
PAGEKV_PRESSES = ("pagekv_entropy", "pagekv_mean")
"""pagekv's own presses run through kvpress (``pagekv.integrations.kvpress_press``:
``PageEntroKVPress`` and ``MeanPoolPagePress``); their results add a ``pagekv`` record
with the pages each (layer, KV head) kept."""
MODES = ("inside", "after")

REQUIREMENTS_FILE = Path(__file__).with_name("requirements-kvpress.txt")
WORKER_FILE = Path(__file__).with_name("kvpress_worker.py")
MARKER_NAME = ".pagekv-requirements.sha256"

# Wall-clock limits (seconds): creating the env downloads ~1 GB where no local wheels exist.
ENV_TIMEOUT = 3600
RUN_TIMEOUT = 1800
_TAIL = 1500  # characters of pip / worker output quoted in error messages


class PeerUnavailable(RuntimeError):
    """The kvpress peer cannot run here; ``str(e)`` says exactly why."""


# ------------------------------------------------------------------ budgets and requests


def budget_tokens(beta: float, n: int) -> int:
    """``k = floor(beta * n)``, as ``EvictionConfig.budget_tokens`` computes it."""
    return int(math.floor(beta * n + 1e-9))


def compression_ratio(beta: float) -> float:
    """kvpress's ratio (fraction removed) for our budget ``beta`` (fraction kept): ``1 - beta``.

    Exact only up to float rounding; use :func:`ratio_for_budget` when ``n`` is known.
    """
    _check_beta(beta)
    return 1.0 - float(beta)


def ratio_for_budget(beta: float, n: int) -> float:
    """The ``compression_ratio`` that makes kvpress keep exactly ``floor(beta * n)`` of ``n``.

    Starts at ``1 - k / n`` and steps by one ulp until :func:`kvpress_kept` gives ``k``
    (a step or two at most), so the peer and our policies get the same token budget.

    >>> kvpress_kept(100, 1 - 0.1), kvpress_kept(100, ratio_for_budget(0.1, 100))
    (9, 10)
    """
    _check_beta(beta)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer; got {n!r}")
    k = budget_tokens(beta, n)
    if k < 1:
        raise ValueError(f"budget {beta} keeps no token of {n}; kvpress keeps at least 1")
    ratio = 1.0 - k / n
    for _ in range(64):
        got = kvpress_kept(n, ratio)
        if got == k:
            return max(ratio, 0.0)
        ratio = math.nextafter(ratio, 0.0 if got < k else 1.0)
    raise ValueError(f"no compression ratio keeps exactly {k} of {n} tokens")  # unreachable


def _check_beta(beta: float) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta <= 1:
        raise ValueError(f"budget beta must be a number in (0, 1]; got {beta!r}")


def _id_list(ids, name: str) -> list[int]:
    if hasattr(ids, "tolist"):  # a tensor or array
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        if len(ids) != 1:
            raise ValueError(f"{name}: one sequence expected, got a batch of {len(ids)}")
        ids = ids[0]
    out = [int(t) for t in ids]
    if not out:
        raise ValueError(f"{name} is empty")
    if min(out) < 0:
        raise ValueError(f"{name} holds a negative token id")
    return out


def make_request(
    id: str | int,
    press: str,
    *,
    input_ids=None,
    context_ids=None,
    question_ids=None,
    budget: float | None = None,
    compression_ratio: float | None = None,
    max_new_tokens: int = 24,
    press_kwargs: dict | None = None,
    page_sizes: Sequence[int] = (16,),
    reuse_scores: bool = False,
) -> dict:
    """One validated worker request.

    Give ``input_ids`` (question-inside mode: the press sees the whole prompt) or
    ``context_ids`` and ``question_ids`` (question-after mode: the press sees the context
    only, as kvpress's pipeline does). Give ``budget`` (fraction kept; converted with
    :func:`ratio_for_budget` on the compressed length) or kvpress's ``compression_ratio``
    (fraction removed), not both. ``press="none"`` runs without compression.
    ``press_kwargs`` go to the press's constructor (e.g. ``{"window_size": 32}`` for
    SnapKV, whose default window of 64 needs prompts longer than 64 tokens; ``{"page_size":
    16}`` for the ``pagekv_*`` presses of :data:`PAGEKV_PRESSES`). ``page_sizes``: the
    pages the result's ``touched_pages`` counts (what a paged cache of each would hold).
    ``reuse_scores`` (KVzip only): a request on the same ids and press_kwargs as the one
    before it applies its ratio to that request's scores instead of scoring again (the
    worker's ``_scored``; tests/test_kvpress_peer.py checks that the kept sets are the
    pipeline's). ``"chunkkv"``'s ``press_kwargs``: ``{"scorer": "keydiff",
    "chunk_length": 16}``.
    """
    if press not in PRESSES and press not in PAGEKV_PRESSES and press != "none":
        raise ValueError(
            f"unknown press {press!r}; expected one of {PRESSES + PAGEKV_PRESSES} or 'none'"
        )
    if (input_ids is None) == (context_ids is None):
        raise ValueError("give input_ids (question inside) or context_ids (question after)")
    req: dict = {"id": id, "press": press}
    if input_ids is not None:
        if question_ids is not None:
            raise ValueError("question_ids go with context_ids, not input_ids")
        req["mode"] = "inside"
        req["input_ids"] = _id_list(input_ids, "input_ids")
        n = len(req["input_ids"])
    else:
        if question_ids is None:
            raise ValueError("context_ids need question_ids")
        req["mode"] = "after"
        req["context_ids"] = _id_list(context_ids, "context_ids")
        req["question_ids"] = _id_list(question_ids, "question_ids")
        n = len(req["context_ids"])
    if press == "none":
        if budget not in (None, 1, 1.0) or compression_ratio not in (None, 0, 0.0):
            raise ValueError("press 'none' takes no budget or compression ratio")
        ratio = 0.0
    elif (budget is None) == (compression_ratio is None):
        raise ValueError("give exactly one of budget (kept) or compression_ratio (removed)")
    elif budget is not None:
        ratio = ratio_for_budget(budget, n)
        req["budget"] = float(budget)
    else:
        ratio = float(compression_ratio)
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"compression_ratio must be in [0, 1); got {compression_ratio}")
    req["compression_ratio"] = ratio
    req["expected_kept"] = kvpress_kept(n, ratio) if ratio > 0 else n
    is_int = isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool)
    if not is_int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    req["max_new_tokens"] = max_new_tokens
    req["page_sizes"] = [int(P) for P in page_sizes]
    if press_kwargs:
        req["press_kwargs"] = dict(press_kwargs)
    if reuse_scores:
        if press != "kvzip":
            raise ValueError(f"reuse_scores is for kvzip (scores without a ratio), not {press!r}")
        req["reuse_scores"] = True
    return req


# ------------------------------------------------------------------ the environment


def kvpress_venv_dir() -> Path:
    """``$PAGEKV_KVPRESS_VENV``, else ``venv-kvpress`` under pagekv's cache root."""
    env = os.environ.get("PAGEKV_KVPRESS_VENV")
    if env:
        return Path(env).expanduser()
    try:
        from pagekv.runtime.models import cache_root

        return cache_root() / "venv-kvpress"
    except ImportError:  # keep the peer usable if the model module cannot import
        return Path.home() / ".cache" / "pagekv" / "venv-kvpress"


def venv_python(venv: str | Path) -> Path:
    return Path(venv) / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def requirements_hash(requirements: str | Path = REQUIREMENTS_FILE) -> str:
    """sha256 of the requirements text and the creating interpreter's version."""
    h = hashlib.sha256(Path(requirements).read_bytes())
    h.update(sys.version.split()[0].encode())
    return h.hexdigest()


def _pinned_torch(requirements: Path) -> str | None:
    """The ``torch==...`` line of the requirements, installed on its own first."""
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.replace(" ", "").lower().startswith("torch=="):
            return line
    return None


def _tail(text: str | bytes | None, limit: int = _TAIL) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = (text or "").strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def _run(cmd: list[str], what: str, timeout: float, env: dict | None = None) -> str:
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except FileNotFoundError as e:
        raise PeerUnavailable(f"{what}: cannot run {cmd[0]}: {e}") from e
    except subprocess.TimeoutExpired as e:
        raise PeerUnavailable(
            f"{what}: timed out after {timeout:.0f} s; output tail: {_tail(e.stdout)}"
        ) from e
    if proc.returncode != 0:
        out = _tail((proc.stdout or "") + "\n" + (proc.stderr or ""))
        raise PeerUnavailable(f"{what} failed (exit {proc.returncode}): {out}")
    return proc.stdout


def _pip_env() -> dict:
    env = dict(os.environ)
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    env.pop("PYTHONPATH", None)  # never let pagekv's environment leak into the peer's
    return env


_PROBE = (
    "import json, importlib.metadata as m; import torch, transformers, kvpress; "
    "print(json.dumps({k: m.version(k) for k in ('torch', 'transformers', 'kvpress')}))"
)


def _probe(python: Path, timeout: float = 300) -> dict:
    """Import kvpress in the environment; its package versions, or PeerUnavailable."""
    out = _run([str(python), "-c", _PROBE], "importing kvpress in its environment", timeout)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        raise PeerUnavailable(f"kvpress import probe printed no versions: {_tail(out)}") from e


def env_ready(venv: str | Path | None = None, requirements: str | Path = REQUIREMENTS_FILE):
    """``(True, "")`` when the environment exists with the current requirements' marker,
    else ``(False, why)``. Cheap: reads files only, imports nothing."""
    venv = Path(venv) if venv is not None else kvpress_venv_dir()
    if not venv_python(venv).exists():
        return False, f"no kvpress environment at {venv}"
    marker = venv / MARKER_NAME
    if not marker.exists():
        return False, f"kvpress environment at {venv} is incomplete (no {MARKER_NAME})"
    if marker.read_text().strip() != requirements_hash(requirements):
        return False, f"kvpress environment at {venv} was built from other requirements"
    return True, ""


def ensure_kvpress_env(
    progress: Callable[[str], object] | None = print,
    venv: str | Path | None = None,
    requirements: str | Path = REQUIREMENTS_FILE,
    timeout: float = ENV_TIMEOUT,
) -> Path:
    """Create (once: step 1 of the module docstring) the kvpress virtual environment; returns
    its folder. An existing venv is reused and upgraded in place, and the marker written
    once kvpress imports; a lock file serialises concurrent callers. Raises
    :class:`PeerUnavailable` with pip's own words when an install fails (e.g. no network
    and no local wheels)."""
    say = progress or (lambda _msg: None)
    venv = Path(venv) if venv is not None else kvpress_venv_dir()
    requirements = Path(requirements)
    if not requirements.exists():
        raise PeerUnavailable(f"kvpress requirements file missing: {requirements}")
    ok, _ = env_ready(venv, requirements)
    if ok:
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with _lock(venv.parent / f".{venv.name}.lock"):
        ok, why = env_ready(venv, requirements)  # another process may have finished it
        if ok:
            return venv
        t0 = time.monotonic()
        say(f"kvpress peer: {why}; creating it (one-time, downloads up to ~1 GB)")
        python = venv_python(venv)
        creator = os.environ.get("PAGEKV_KVPRESS_PYTHON") or sys.executable
        env = _pip_env()
        if not python.exists():
            _run([creator, "-m", "venv", str(venv)], f"creating a venv at {venv}", 600, env)
        (venv / MARKER_NAME).unlink(missing_ok=True)
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        pip += shlex.split(os.environ.get("PAGEKV_KVPRESS_PIP_ARGS", ""))
        torch_pin = _pinned_torch(requirements)
        if torch_pin:
            say(f"kvpress peer: pip install {torch_pin}")
            _run(pip + [torch_pin], f"pip install {torch_pin} into {venv}", timeout, env)
        say(f"kvpress peer: pip install -r {requirements.name}")
        _run(pip + ["-r", str(requirements)], f"pip install -r {requirements}", timeout, env)
        found = _probe(python)
        (venv / MARKER_NAME).write_text(requirements_hash(requirements) + "\n")
        say(
            f"kvpress peer: ready in {time.monotonic() - t0:.0f} s at {venv} "
            + " ".join(f"{k} {v}" for k, v in found.items())
        )
    return venv


@contextmanager
def _lock(path: Path):
    """An exclusive advisory file lock (no-op where fcntl is missing)."""
    with open(path, "a+") as f:  # closing the file releases the lock
        with suppress(ImportError):
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def kvpress_available(
    create: bool = False, progress: Callable[[str], object] | None = None
) -> tuple[bool, str]:
    """Whether the kvpress peer can run, and why not.

    With ``create=False`` (default) nothing is installed: the environment must already
    exist and import kvpress. With ``create=True`` it is created when missing.
    """
    try:
        if create:
            venv = ensure_kvpress_env(progress=progress)
        else:
            venv = kvpress_venv_dir()
            ok, why = env_ready(venv)
            if not ok:
                return False, why + " (call ensure_kvpress_env() to create it)"
        if not WORKER_FILE.exists():
            return False, f"kvpress worker script missing: {WORKER_FILE}"
        found = _probe(venv_python(venv))
    except PeerUnavailable as e:
        return False, str(e)
    return True, " ".join(f"{k} {v}" for k, v in found.items())


# ------------------------------------------------------------------ running


def bundled_model_dir(model: str = "bundled") -> Path:
    """The converted (``save_pretrained``) copy of a bundled model, built if needed;
    the folder kvpress loads, since it cannot read GGUF."""
    from pagekv.runtime.models import build_bundled_cache, bundled_cache_dir, cache_problem

    if cache_problem(model=model) is not None:
        build_bundled_cache(model=model)
    return bundled_cache_dir(model)


def run_kvpress(
    model_dir: str | Path,
    requests: Sequence[dict],
    timeout: float = RUN_TIMEOUT,
    *,
    python: str | Path | None = None,
    worker: str | Path | None = None,
    threads: int | None = None,
    progress: Callable[[str], object] | None = print,
) -> list[dict]:
    """Run ``requests`` (see :func:`make_request`) through kvpress; one result per request.

    Each result holds ``id, press, mode, compression_ratio, answer, tokens, kept_tokens``
    (cache length per layer after compression), ``prompt_tokens, stop_reason,
    prefill_seconds, seconds`` and ``error`` (``None``, or why this request failed), plus
    ``expected_kept`` and ``budget`` echoed from the request and the peer's versions.
    ``python`` (default: the kvpress environment's, created on demand) and ``worker``
    are for tests. Raises :class:`PeerUnavailable` when the peer as a whole cannot run.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise PeerUnavailable(f"model folder for kvpress not found: {model_dir}")
    worker = Path(worker) if worker is not None else WORKER_FILE
    if not worker.exists():
        raise PeerUnavailable(f"kvpress worker script missing: {worker}")
    requests = [dict(r) for r in requests]
    if not requests:
        return []
    if python is None:
        python = venv_python(ensure_kvpress_env(progress=progress))
    payload = {"model_dir": str(model_dir), "requests": requests}
    if threads:
        payload["threads"] = int(threads)
    env = _pip_env()
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="pagekv-kvpress-") as tmp:
        src, dst = Path(tmp) / "request.json", Path(tmp) / "response.json"
        src.write_text(json.dumps(payload))
        cmd = [str(python), str(worker), "--input", str(src), "--output", str(dst)]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
            )
        except FileNotFoundError as e:
            raise PeerUnavailable(f"cannot run the kvpress worker with {python}: {e}") from e
        except subprocess.TimeoutExpired as e:
            raise PeerUnavailable(
                f"kvpress worker timed out after {timeout:.0f} s; stderr tail: {_tail(e.stderr)}"
            ) from e
        text = dst.read_text() if dst.exists() else ""
    try:
        response = json.loads(text)
    except ValueError:
        response = None
    if not isinstance(response, dict):
        raise PeerUnavailable(
            f"kvpress worker wrote no valid JSON (exit {proc.returncode}); "
            f"output: {_tail(text, 200)!r}; stderr tail: {_tail(proc.stderr)}"
        )
    if not response.get("ok"):
        raise PeerUnavailable(
            f"kvpress worker failed: {response.get('error') or 'no reason given'} "
            f"(exit {proc.returncode})"
        )
    results = response.get("results")
    if not isinstance(results, list) or len(results) != len(requests):
        got = len(results) if isinstance(results, list) else type(results).__name__
        raise PeerUnavailable(f"kvpress worker returned {got} results for {len(requests)}")
    versions = response.get("versions", {})
    for req, res in zip(requests, results, strict=True):
        res.setdefault("expected_kept", req.get("expected_kept"))
        if "budget" in req:
            res.setdefault("budget", req["budget"])
        res["peer"] = "kvpress"
        res["versions"] = versions
        res["load_seconds"] = response.get("load_seconds")
    return results
