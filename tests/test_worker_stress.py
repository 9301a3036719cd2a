"""The model worker's invariant under concurrent calls (docs/design.md, "One model worker"): 8
threads of mixed calls on a small random GQA decoder under the bundled tokenizer all return in
time with the serial result; a planted lock-order inversion is caught (control)."""

from __future__ import annotations

import threading

import pytest
import torch

from pagekv import EvictionConfig, PromptSpec, Study
from pagekv.engine.comparison import Decoding, Side, compare, preview_comparison
from pagekv.engine.worker import ModelWorker
from pagekv.runtime import models
from pagekv.runtime.models import LoadedModel

from .stress import serial, stress

pytestmark = pytest.mark.slow

SPECS = [
    PromptSpec(task="needle", context=160, depth=0.5, seed=1),
    PromptSpec(task="needle", context=200, depth=0.3, seed=2, mode="after"),
    PromptSpec(task="needle", context=240, depth=0.7, seed=3),
]
BASE = EvictionConfig(budget=0.4, page_size=8, window=16)
CONFIGS = [
    BASE.replace(policy="mean"),
    BASE.replace(policy="entropy"),
    BASE.replace(policy="head_independent"),
    BASE.replace(policy="entropy", budget=0.6),
]
NEW = 4  # answer tokens per run


def _tiny_study(tokenizer, worker: ModelWorker, n_heads: int = 8, family: str = "llama") -> Study:
    """A random 2-layer decoder of `family` ("llama" or "qwen2"): `n_heads` query heads of
    8 dims over 2 KV heads, named "tiny-<family>"."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]  # fmt: skip
    cfg = config_cls(
        vocab_size=len(tokenizer), hidden_size=8 * n_heads, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=n_heads, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=1024, initializer_range=0.15, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    loaded = LoadedModel(
        model=model, tokenizer=tokenizer, name=f"tiny-{family}", device="cpu",
        dtype=torch.float32, n_layers=2, n_heads=n_heads, n_kv_heads=2, head_dim=8,
        max_context=1024, load_s=0.0,
    )  # fmt: skip
    return Study(loaded, backend="torch", worker=worker)


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return models.load_model("bundled").tokenizer
    except models.ModelLoadError as e:
        pytest.skip(f"bundled model unavailable: {e}")


def _sig(rec) -> tuple:
    return tuple(rec.tokens), tuple(rec.plan.keep.flatten().tolist())


def _calls() -> dict:
    """key -> study -> signature. Keys name the kind first."""
    calls = {}
    for i, spec in enumerate(SPECS):
        for j, cfg in enumerate(CONFIGS):
            calls[("run", i, j)] = lambda s, spec=spec, cfg=cfg: _sig(
                s.run(s.prepare(spec), cfg, NEW)
            )
        for j, k in ((0, 1), (1, 3), (2, 1)):
            a, b = CONFIGS[j], CONFIGS[k]
            calls[("run_pair", i, j, k)] = lambda s, spec=spec, a=a, b=b: tuple(
                map(_sig, s.run_pair(s.prepare(spec), a, b, NEW))
            )
            calls[("preview", i, j, k)] = lambda s, spec=spec, a=a, b=b: _preview(s, spec, a, b)
            calls[("budget", i, j, k)] = lambda s, spec=spec, a=a, b=b: _budget(s, spec, a, b)
        calls[("lesson", i)] = lambda s, spec=spec: _lesson(s, spec)
    return calls


def _preview(study, spec, a, b):
    """What a dragged slider does: plan both sides on the cached prefill (the prefill is
    made first here, so the preview always has one to plan on)."""
    study.prepare(spec)
    comp = preview_comparison(study, spec, Side(a, spec.mode), Side(b, spec.mode), cached_only=True)
    return tuple(tuple(comp.plan_of(k).keep.flatten().tolist()) for k in ("full", "A", "B"))


def _budget(study, spec, a, b):
    """What a released slider does: plan, then decode full, A and B, streaming."""
    comp = preview_comparison(study, spec, Side(a, spec.mode), Side(b, spec.mode))
    for _ in Decoding(study, comp, NEW).stream(poll_s=0.01):
        pass
    return tuple(_sig(comp.records[k]) for k in ("full", "A", "B"))


def _lesson(study, spec):
    """A lesson's run: A and B with their own question positions (two prefills)."""
    a = Side(CONFIGS[0], "inside")
    comp = compare(study, spec, a, a.replace(policy="entropy", mode="after"), max_new_tokens=NEW)
    return tuple(_sig(comp.records[k]) for k in ("full", "A", "B"))


@pytest.fixture(scope="module")
def expected(tokenizer):
    """Every key's result, computed serially on a study of its own."""
    return serial(_tiny_study(tokenizer, ModelWorker()), _calls())


def test_concurrent_calls_never_hang_and_equal_the_serial_results(tokenizer, expected):
    worker = ModelWorker()
    study = _tiny_study(tokenizer, worker)
    report = stress(study, _calls(), expected, threads=8, calls_per_thread=6, call_timeout_s=60)
    assert report.sound, report
    assert set(report.kinds) == {"run", "run_pair", "preview", "budget", "lesson"}, report.kinds
    assert report.calls == 8 * 6, report.calls  # every call returned (none hung)
    assert worker.pending() == 0  # nothing left queued


def test_a_served_app_worker_also_holds(tokenizer, expected):
    """The same stress while one thread serves the worker forever (as `python app.py`'s
    main thread does), so no caller runs jobs itself."""
    worker = ModelWorker()
    stop = threading.Event()
    server = threading.Thread(target=worker.serve_forever, args=(stop, 0.05), daemon=True)
    server.start()
    try:
        study = _tiny_study(tokenizer, worker)
        report = stress(study, _calls(), expected, threads=8, calls_per_thread=4, call_timeout_s=60)
    finally:
        stop.set()
        server.join(30)
    assert report.sound, report
    assert worker.jobs_run > 0 and not server.is_alive()


def test_the_stress_catches_a_planted_lock_order_inversion(tokenizer, expected, monkeypatch):
    """Negative control: a caller holding a lock a job needs is reported, hung or failed."""
    worker = ModelWorker()
    study = _tiny_study(tokenizer, worker)
    planted = threading.Lock()
    real_run, real_job = Study.run, Study._run_job

    def run_holding_a_lock(self, *args, **kwargs):
        with planted:  # held while waiting for the job: the inversion
            return real_run(self, *args, **kwargs)

    def job_taking_the_lock(self, *args, **kwargs):
        if not planted.acquire(timeout=4.0):  # give up, so the threads end after the test
            raise TimeoutError("the job waited for a lock its caller holds")
        try:
            return real_job(self, *args, **kwargs)
        finally:
            planted.release()

    monkeypatch.setattr(Study, "run", run_holding_a_lock)
    monkeypatch.setattr(Study, "_run_job", job_taking_the_lock)
    report = stress(study, _calls(), expected, threads=8, duration_s=4, call_timeout_s=3)
    assert report.settle(120), "the planted jobs give up on the lock: every thread ends"
    assert not report.sound
    assert report.hung or any("lock its caller holds" in e for _, e in report.errors), report


def test_the_apps_run_path_holds_its_session_turn_across_worker_waits(tokenizer, monkeypatch):
    """`run_comparison` holds its session turn across worker waits without a hang."""
    from types import SimpleNamespace

    from pagekv.app import handlers
    from pagekv.app.model_registry import ModelRegistry
    from pagekv.engine.worker import WORKER

    settings = [
        dict(policy_a=policy, budget_pct=pct)
        for policy in ("mean", "head_independent")
        for pct in (40.0, 60.0)
    ]

    def call(i: int, session: str):
        run = dict(model="tiny-llama", context=300, **settings[i])
        *_, last = handlers.run_comparison(**run, request=SimpleNamespace(session_hash=session))
        status = last[handlers.RUN_VIEWS.index("status")]
        assert status.startswith("**Done:**"), status
        comp = last[handlers.RUN_VIEWS.index("last")]
        return tuple(tuple(comp.records[k].tokens) for k in ("full", "A", "B"))

    def fresh_model():  # a registry whose one model is a new tiny study (empty memos,
        # finished runs' views included)
        monkeypatch.setattr(handlers, "MODELS", ModelRegistry(
            default="bundled", factory=lambda name: _tiny_study(tokenizer, WORKER),
            known={"tiny-llama"},
        ))  # fmt: skip

    sessions = ("stress-s1", "stress-s2")
    calls = {
        ("session", i, s): (lambda _study, i=i, s=s: call(i, s))
        for i in range(len(settings))
        for s in sessions
    }
    try:
        fresh_model()
        expected = {key: fn(None) for key, fn in calls.items()}  # one at a time
        fresh_model()  # so that the stress computes (prefill, plans, decoding) again
        report = stress(None, calls, expected, threads=8, calls_per_thread=3, call_timeout_s=60)
    finally:
        for s in sessions:
            handlers.SESSIONS.end(s)
    assert report.sound, report
    assert report.calls == 8 * 3
