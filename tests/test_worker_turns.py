"""The worker takes turns between owners (pagekv/engine/worker.py, "Turns"): a job waits for at most
one job of each other model, each owner's jobs keep their order, and a run on a cold model or
prompt says so before the long step."""

from __future__ import annotations

import threading

import pytest

from pagekv import PromptSpec
from pagekv.app import handlers
from pagekv.app.model_registry import ModelRegistry
from pagekv.engine.comparison import Side, compare
from pagekv.engine.worker import WORKER, ModelWorker

from .test_worker_stress import _tiny_study, tokenizer  # noqa: F401 (a fixture)


def _queued(worker: ModelWorker, order: list, name: str, owner) -> object:
    return worker.submit(name, lambda _job: order.append(name), owner=owner)


def test_another_owner_goes_next_and_each_owner_keeps_its_order():
    """Hand-worked: X queues three jobs, then Y one. Waiting for Y's job runs X1 (the
    oldest), then Y1 (X ran last), not X2 and X3 first as a plain queue would."""
    worker, order = ModelWorker(), []
    jobs = [_queued(worker, order, f"X{i}", "x") for i in (1, 2, 3)]
    y1 = _queued(worker, order, "Y1", "y")
    assert worker.wait(y1)  # untimed: this thread runs the jobs, up to this one
    assert order == ["X1", "Y1"]
    assert worker.wait(jobs[-1])
    assert order == ["X1", "Y1", "X2", "X3"]


def test_one_owner_alone_is_a_plain_queue():
    worker, order = ModelWorker(), []
    jobs = [_queued(worker, order, f"A{i}", "a") for i in range(5)]
    assert worker.wait(jobs[-1])
    assert order == ["A0", "A1", "A2", "A3", "A4"]
    order.clear()  # no owner is an owner too (None): it takes its turn like the others
    jobs = [_queued(worker, order, name, owner) for name, owner in (("n1", None), ("n2", None))]
    jobs.append(_queued(worker, order, "A5", "a"))
    assert worker.wait(jobs[-1])
    assert order == ["n1", "A5"]


def test_three_owners_take_turns_oldest_first():
    worker, order = ModelWorker(), []
    for name, owner in (("A1", "a"), ("A2", "a"), ("B1", "b"), ("C1", "c"), ("A3", "a")):
        last = _queued(worker, order, name, owner)
    assert worker.wait(last)
    assert order == ["A1", "B1", "A2", "C1", "A3"]


@pytest.mark.slow
def test_a_slow_models_run_holds_up_another_for_one_job_at_a_time(tokenizer):  # noqa: F811
    """With both owners queued the worker alternates (never one owner twice in a row), and both runs
    answer as alone; a FIFO worker fails."""
    worker, stop = ModelWorker(), threading.Event()
    server = threading.Thread(target=worker.serve_forever, args=(stop,), daemon=True)
    server.start()
    try:
        x, y = _tiny_study(tokenizer, worker), _tiny_study(tokenizer, worker)
        order: list = []
        choices: list = []  # per job run: (its owner, the last owner, the owners queued)
        pop = worker._pop_locked

        def recording_pop():  # under the worker's lock
            waiting, last = {j.owner for j in worker._queue}, worker._last
            job = pop()
            if job is not None:
                order.append(job.owner)
                choices.append((job.owner, last, waiting))
            return job

        worker._pop_locked = recording_pop
        started, y_queued = threading.Event(), threading.Event()
        submit = worker.submit

        def watched_submit(key, fn, owner=None):
            job = submit(key, fn, owner)
            if owner == y._tag:
                y_queued.set()
            return job

        worker.submit = watched_submit
        prefill = x.runner.prefill

        def slow_prefill(*a, **k):
            # X's prefill goes on until Y's run has queued its first job (no sleep
            # standing in for it): Y starts while X's prefill runs.
            started.set()
            assert y_queued.wait(30)
            return prefill(*a, **k)

        x.runner.prefill = slow_prefill
        a, b = Side.of("mean", budget=0.4), Side.of("entropy", budget=0.4)
        spec = PromptSpec(task="needle", context=200, depth=0.5, seed=4)
        out = {}
        tx = threading.Thread(target=lambda: out.update(x=compare(x, spec, a, b, 4)))
        tx.start()
        assert started.wait(30)
        order.append("Y starts")
        out["y"] = compare(y, spec.replace(seed=5), a, b, 4)
        tx.join(60)
    finally:
        stop.set()
        server.join(10)
    assert not tx.is_alive() and {"x", "y"} <= set(out)
    assert y_queued.is_set()
    i = order.index("Y starts")
    ys = [j for j, owner in enumerate(order) if owner == y._tag and j > i]
    assert len(ys) >= 3  # prefill, plans, decoding: several jobs
    # The turns: an owner never runs two jobs in a row while the other has one queued.
    contested = [(o, last) for o, last, waiting in choices if len(waiting) > 1]
    print(f"\n{len(contested)} of {len(choices)} jobs chosen between both owners")
    assert contested and all(o != last for o, last in contested), choices
    for key in ("full", "A", "B"):  # what each run gives alone, on a worker of its own
        alone = compare(_tiny_study(tokenizer, ModelWorker()), spec.replace(seed=5), a, b, 4)
        assert out["y"].records[key].tokens == alone.records[key].tokens


@pytest.mark.slow
def test_a_run_on_a_model_not_loaded_says_so_first(tokenizer, monkeypatch):  # noqa: F811
    registry = ModelRegistry(
        default="bundled",
        factory=lambda name: _tiny_study(tokenizer, WORKER),
        known={"tiny-other"},
    )
    monkeypatch.setattr(handlers, "MODELS", registry)  # a new study: empty memos
    run = dict(model="tiny-other", context=300, budget_pct=40.0)
    status = [s[handlers.RUN_VIEWS.index("status")] for s in handlers.run_comparison(**run)]
    assert status[0].startswith("**Note:** Loading the model tiny-other (once)"), status
    assert status[1].startswith("**Note:** Prefilling the prompt on tiny-llama"), status
    assert status[-1].startswith("**Done:**"), status[-1]
    again = [s[handlers.RUN_VIEWS.index("status")] for s in handlers.run_comparison(**run)]
    assert len(again) == 1 and "Loading" not in again[0] and "Prefilling" not in again[0]
