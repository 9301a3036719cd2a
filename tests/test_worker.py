"""`pagekv.engine.worker`: jobs run one at a time on the thread that owns the worker,
identical jobs once, a job's own sub-jobs inline, results and errors handed back."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from pagekv.engine.worker import Job, ModelWorker, WorkerTimeout


@contextlib.contextmanager
def _served(w: ModelWorker):
    """`w` served forever by a thread (yielded) until the block ends."""
    stop = threading.Event()
    server = threading.Thread(target=w.serve_forever, args=(stop, 0.05), name="model")
    server.start()
    try:
        while not w.serving:
            time.sleep(0.001)
        yield server
    finally:
        stop.set()
        server.join(30)


def test_without_a_server_the_caller_runs_its_job():
    w = ModelWorker()
    assert not w.serving and w.owner is None
    assert w.run("k", threading.current_thread) is threading.current_thread()
    assert w.owner is None and w.pending() == 0 and w.jobs_run == 1


def test_jobs_run_on_the_serving_thread_and_errors_come_back():
    w = ModelWorker()
    with _served(w) as server:
        assert w.run("a", threading.current_thread) is server
        # a job that asks for another job runs it inline, on the same thread
        assert w.run("b", lambda: w.run("c", threading.current_thread)) is server
        with pytest.raises(ValueError, match="boom"):
            w.run("d", lambda: (_ for _ in ()).throw(ValueError("boom")))
        assert w.run("e", lambda: 2 + 3) == 5
    assert not w.serving and not server.is_alive()


def test_identical_jobs_run_once_and_every_caller_gets_the_value():
    w = ModelWorker()
    gate, calls, got = threading.Event(), [], []

    def slow():
        gate.wait(10)
        calls.append(1)
        return object()

    threads = [threading.Thread(target=lambda: got.append(w.run("same", slow))) for _ in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while w.pending() != 1 or sum(t.is_alive() for t in threads) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    gate.set()
    for t in threads:
        t.join(10)
    assert calls == [1] and len(got) == 6 and len({id(v) for v in got}) == 1
    assert w.run(None, lambda: 1) == 1 and w.run(None, lambda: 2) == 2  # None: never shared


def test_jobs_never_overlap_across_many_callers():
    w = ModelWorker()
    busy, overlaps, owners = [0], [], set()

    def job():
        busy[0] += 1
        overlaps.append(busy[0])
        owners.add(threading.current_thread().name)
        time.sleep(0.002)
        busy[0] -= 1

    def client(i):
        for j in range(20):
            w.run((i, j), job)

    threads = [threading.Thread(target=client, args=(i,), name=f"c{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert max(overlaps) == 1 and len(overlaps) == 160
    assert len(owners) > 1, "caller-runs: whichever caller found the worker free ran jobs"
    assert w.pending() == 0 and w.owner is None


def test_a_wait_times_out_without_losing_the_job():
    w, gate = ModelWorker(), threading.Event()
    with _served(w):
        job = w.submit("slow", lambda _job: gate.wait(10) and "done")
        assert not w.wait(job, 0.05)
        with pytest.raises(WorkerTimeout):
            w.run("slow", lambda: "not run: shares the job in flight", timeout=0.05)
        gate.set()
        assert w.wait(job, 10) and job.result() == "done"


def test_a_timed_wait_holds_its_timeout_when_nobody_serves():
    """Caller-runs: a timed wait returns at its timeout; a helper runs the job."""
    w = ModelWorker()
    gate, started = threading.Event(), threading.Event()

    def slow(_job):
        started.set()
        return gate.wait(5) and "done"

    job = w.submit("slow", slow)
    with pytest.raises(WorkerTimeout):
        w.run("slow", lambda: "not run: shares the job in flight", timeout=0.1)
    assert started.wait(5) and not job.done.is_set(), "the wait returned before the job ended"
    assert w.owner is not None and w.owner is not threading.current_thread()
    assert not w.wait(job, 0.05)
    gate.set()
    assert w.wait(job) and job.result() == "done"
    for _ in range(5000):  # the helper lets go once the queue is empty
        if w.owner is None:
            break
        time.sleep(0.001)
    ran_on = []
    assert w.run("here", lambda: ran_on.append(threading.current_thread()) or 1) == 1
    assert ran_on == [threading.current_thread()]
    assert w.owner is None and w.pending() == 0


def test_progress_streams_when_nobody_serves():
    """Caller-runs: `progress` yields a job's reports while it runs."""
    w = ModelWorker()
    seen_while_running = []

    def counting(job):
        for i in range(1, 4):
            job.report(i)
            time.sleep(0.05)
        return "done"

    job = w.submit("count", counting)
    for value in w.progress(job, 0.01):
        seen_while_running.append((value, job.done.is_set()))
    assert job.result() == "done"
    assert seen_while_running and not any(done for _, done in seen_while_running)


def test_progress_at_poll_0_waits_between_checks_and_does_not_spin(monkeypatch):
    """Each progress check waits at least `MIN_POLL_S`, so a poll of 0 s does not spin."""
    from pagekv.engine import worker as worker_mod

    w = ModelWorker()
    timeouts = []
    wait = w.wait
    monkeypatch.setattr(
        w, "wait", lambda job, timeout=None: timeouts.append(timeout) or wait(job, timeout)
    )
    job = w.submit("sleepy", lambda job: time.sleep(0.1) or "done")
    list(w.progress(job, 0.0))
    assert job.result() == "done"
    assert timeouts and min(timeouts) >= worker_mod.MIN_POLL_S > 0
    assert len(timeouts) <= 0.1 / worker_mod.MIN_POLL_S + 5  # waits, not a spin


def test_a_job_reports_progress_that_waiters_can_read():
    w = ModelWorker()

    def steps(job: Job):
        for i in range(3):
            job.report(i)
        return "end"

    job = w.submit("p", steps)
    assert w.wait(job) and job.result() == "end"
    assert (job.progress, job.version) == (2, 3)
    done = Job.finished(7)
    assert w.wait(done, 0) and done.result() == 7


def test_a_job_waiting_for_itself_is_an_error_not_a_hang():
    w = ModelWorker()

    def recurse():
        return w.run("me", lambda: None)

    with pytest.raises(RuntimeError, match="waits for itself"):
        w.run("me", recurse)


def test_one_server_at_a_time():
    w = ModelWorker()
    with _served(w), pytest.raises(RuntimeError, match="already serves"):
        w.serve_forever(threading.Event())


def test_an_interrupt_in_a_job_reaches_its_waiters_and_stops_the_thread_running_it():
    w = ModelWorker()

    def interrupted():
        raise KeyboardInterrupt

    job = w.submit("ctrl-c", lambda _job: interrupted())
    with pytest.raises(KeyboardInterrupt):
        w.wait(job)  # caller-runs: the interrupt stops this thread's turn
    assert job.done.is_set() and isinstance(job.error, KeyboardInterrupt)
    assert w.owner is None and w.pending() == 0  # the worker is free for the next job
    assert w.run("next", lambda: "ok") == "ok"
