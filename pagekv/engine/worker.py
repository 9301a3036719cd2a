"""One model worker: every computation on a model runs as a job, one at a time, on
one thread; identical jobs run once (single flight).

The invariant (docs/design.md, "One model worker"): **no thread ever waits for a job
while holding anything that job needs.** The code guarantees it by construction:

1. Only the thread that owns the worker runs jobs, one after the other. A job that
   asks for more work (a run that needs a prefill) runs it inline, at once, on the
   same thread: a job never waits for another job.
2. A waiter waits on its job's event and on the worker's condition, which it releases
   while waiting; the worker's own lock is held for queue and dictionary operations
   only, never while a job runs.
3. Jobs take no lock that a caller holds while waiting: the memos' locks guard a few
   dictionary operations and are never held across a call out (`pagekv.engine.memo`),
   and nothing in `pagekv` holds a lock while it calls `run` or `wait`.

So every queued job eventually runs, and every waiter eventually returns.

Who owns the worker (docs/design.md, "One model worker", says why): the thread in
`serve_forever` (the app's main thread); elsewhere, a caller that finds the worker free
and waits without a timeout owns it while it waits and runs the queued jobs in order,
its own among them (caller-runs). A caller that waits with a timeout never runs a job
itself (a job cannot be stopped midway, so its timeout could not hold): if nobody owns
the worker it starts a helper thread that owns it until the queue is empty.

    from pagekv.engine.worker import WORKER
    out = WORKER.run(("prefill", spec), lambda: runner.prefill(ids))   # anywhere
    job = WORKER.submit(("pair", key), decode_pair)                    # do not wait yet
    while not WORKER.wait(job, 0.25): show(job.progress)               # stream
    WORKER.serve_forever(stop)                                         # the main thread
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["WORKER", "Job", "ModelWorker", "WorkerTimeout", "keep_this_thread_light"]


class WorkerTimeout(TimeoutError):
    """A wait for a job ran out of time (the job itself goes on)."""


class Job:
    """One piece of work on the worker: its key, its outcome and its progress.

    `progress` is the latest value the job reported (`report`), for streaming: several
    waiters may read it; it is replaced, never queued. `version` counts reports.
    """

    __slots__ = (
        "key", "fn", "done", "value", "error", "started", "progress", "version", "owner"
    )  # fmt: skip

    def __init__(self, key: Hashable, fn: Callable[[Job], Any] | None, owner: Hashable = None):
        self.key = key
        self.fn = fn
        self.owner = owner  # whose job it is (a model's Study): the worker takes turns
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = False
        self.progress: Any = None
        self.version = 0

    @classmethod
    def finished(cls, value: Any, key: Hashable = None) -> Job:
        """A job that is already done with `value` (a memo hit in a job's clothes)."""
        job = cls(key, None)
        job.value = value
        job.done.set()
        return job

    def report(self, value: Any) -> None:
        """Called by the job's function: the latest partial result."""
        self.progress = value
        self.version += 1

    def result(self) -> Any:
        """The job's value, or its exception raised here (the job must be done)."""
        if not self.done.is_set():
            raise RuntimeError(f"job {self.key!r} is not done")
        if self.error is not None:
            raise self.error
        return self.value

    def _run(self) -> None:
        self.started = True
        try:
            self.value = self.fn(self)
        except BaseException as e:  # handed to every waiter
            self.error = e
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise  # and the thread running it stops too (Ctrl-C stops the app)
        finally:
            self.fn = None  # what the function held is released with it
            self.done.set()


#: The shortest wait between two checks of a job's progress (`ModelWorker.progress`).
MIN_POLL_S = 0.01


class ModelWorker:
    """A queue of jobs run one at a time by the thread that owns the worker.

    `submit(key, fn)` queues `fn(job)` unless a job of the same key is queued or running
    (then that job is returned: single flight); `wait(job, timeout)` waits for it, owning
    the worker meanwhile if nobody does; `run(key, fn)` is both. `key=None` never
    shares. A job's function receives its `Job` (to `report` progress).

    Turns: a job may name its `owner` (a `Study` names itself, a model load its model).
    The next job is the oldest queued job of another owner than the job that ran last,
    else the oldest: each owner's jobs run in the order they came, and a job of one model
    waits for at most one job of each other model (a run on a slow model never holds up
    the runs on another for more than the one job it is in).
    """

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[Job] = deque()
        self._jobs: dict[Hashable, Job] = {}  # key -> job queued or running
        self._owner: threading.Thread | None = None
        self._forever = False
        self._last: Hashable = None  # the owner of the job that ran last
        self.jobs_run = 0

    # ------------------------------------------------------------------ state

    @property
    def serving(self) -> bool:
        """Whether a thread serves forever (`serve_forever`)."""
        return self._forever

    @property
    def owner(self) -> threading.Thread | None:
        """The thread that runs jobs now (None: nobody)."""
        return self._owner

    def on_worker(self) -> bool:
        """Whether the calling thread is the one running jobs now."""
        return self._owner is threading.current_thread()

    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cv:
            return len(self._jobs)

    # ------------------------------------------------------------------ calls

    def submit(self, key: Hashable, fn: Callable[[Job], Any], owner: Hashable = None) -> Job:
        """Queue `fn(job)` under `key` and return its job, or the job already queued or
        running under `key`. From a job on the worker, the new job runs at once, inline
        (a job never waits for another): the returned job is then done."""
        if self.on_worker():
            return self._inline(key, fn)
        with self._cv:
            if key is not None and key in self._jobs:
                return self._jobs[key]
            job = Job(key, fn, owner)
            if key is not None:
                self._jobs[key] = job
            self._queue.append(job)
            self._cv.notify_all()
            return job

    def wait(self, job: Job, timeout: float | None = None) -> bool:
        """Wait until `job` is done (True) or `timeout` seconds pass (False). Holds
        nothing while it waits. If no thread owns the worker: without a timeout this one
        does until `job` is done, running the queued jobs in order (caller-runs); with
        one, a helper thread does (`_help`), so that the timeout holds."""
        if self.on_worker():  # a job waiting for a job: run what is queued, inline
            self._serve(until=job)
            return True
        if timeout is not None:
            return self._wait_until(job, time.monotonic() + timeout)
        me = threading.current_thread()
        while not job.done.is_set():
            with self._cv:
                while not job.done.is_set() and self._owner is not None:
                    self._cv.wait()
                if job.done.is_set():
                    return True
                self._owner = me  # nobody runs jobs: this thread does, until job is done
            try:
                self._serve(until=job)
            finally:
                with self._cv:
                    self._owner = None
                    self._cv.notify_all()
        return True

    def progress(self, job: Job, poll_s: float):
        """Wait for `job`, yielding its `progress` each time it changed, checked every
        `poll_s` seconds (at least `MIN_POLL_S`). Holds nothing between checks (`wait`): a
        check every 0 s would spin and hold the interpreter's lock, which the thread
        running the job needs after each of its torch operations."""
        seen = 0
        poll_s = max(float(poll_s), MIN_POLL_S)
        while not self.wait(job, poll_s):
            if job.version != seen and job.progress is not None:
                seen = job.version
                yield job.progress

    def run(
        self,
        key: Hashable,
        fn: Callable[[], Any],
        timeout: float | None = None,
        owner: Hashable = None,
    ) -> Any:
        """`fn()` as a job under `key` (shared with an identical job in flight): its
        value, or its exception raised here. WorkerTimeout after `timeout` seconds."""
        job = self.submit(key, lambda _job: fn(), owner)
        if not self.wait(job, timeout):
            raise WorkerTimeout(f"no result for {key!r} within {timeout} s")
        return job.result()

    def serve_forever(self, stop: threading.Event | None = None, poll_s: float = 0.2) -> None:
        """Own the worker on this thread and run jobs until `stop` is set."""
        me = threading.current_thread()
        with self._cv:
            if self._forever:
                raise RuntimeError("a thread already serves the model worker")
            while self._owner is not None:  # a caller-run owner finishes its turn first
                self._cv.wait()
            self._owner, self._forever = me, True
        try:
            while stop is None or not stop.is_set():
                job = self._next(poll_s)
                if job is not None:
                    self._execute(job)
        finally:
            with self._cv:
                self._owner, self._forever = None, False
                self._cv.notify_all()  # waiters left: they run their jobs themselves

    # ------------------------------------------------------------------ internals

    def _wait_until(self, job: Job, deadline: float) -> bool:
        """A timed wait: never runs a job on this thread; starts the helper when nobody
        owns the worker."""
        with self._cv:
            while not job.done.is_set():
                if self._owner is None:
                    self._owner = helper = threading.Thread(
                        target=self._help, name="pagekv-worker-helper", daemon=True
                    )
                    helper.start()
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def _help(self) -> None:
        """The helper thread: owns the worker (set by `_wait_until`) and runs the queued
        jobs in turn until none is left, then lets go."""
        try:
            while True:
                with self._cv:
                    job = self._pop_locked()
                    if job is None:
                        return
                self._execute(job)
        finally:
            with self._cv:
                if self._owner is threading.current_thread():
                    self._owner = None
                self._cv.notify_all()

    def _next(self, poll_s: float) -> Job | None:
        with self._cv:
            if not self._queue:
                self._cv.wait(poll_s)
            return self._pop_locked()

    def _pop_locked(self) -> Job | None:
        """The next job to run (the class docstring's turns), taken off the queue."""
        if not self._queue:
            return None
        job = next((j for j in self._queue if j.owner != self._last), self._queue[0])
        self._queue.remove(job)
        self._last = job.owner
        return job

    def _serve(self, until: Job) -> None:
        """Run queued jobs in order until `until` is done (the caller owns the worker)."""
        while not until.done.is_set():
            with self._cv:
                job = self._pop_locked()
            if job is None:  # cannot happen: an unfinished job is queued or running here
                raise RuntimeError(f"job {until.key!r} is neither queued nor done")
            self._execute(job)

    def _execute(self, job: Job) -> None:
        try:
            job._run()
        finally:
            with self._cv:
                if job.key is not None and self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                self.jobs_run += 1
                self._cv.notify_all()

    def _inline(self, key: Hashable, fn: Callable[[Job], Any]) -> Job:
        """A job submitted by a job: run now on this thread (a queued twin runs now)."""
        with self._cv:
            job = self._jobs.get(key) if key is not None else None
            if job is not None and job.started:
                raise RuntimeError(f"job {key!r} waits for itself")
            if job is not None:
                self._queue.remove(job)  # run the queued twin now; its waiters share it
            else:
                job = Job(key, fn)
                if key is not None:
                    self._jobs[key] = job
        self._execute(job)
        return job


def keep_this_thread_light() -> None:
    """While a thread serves the worker forever: make torch single-threaded on the
    calling thread (any other thread), so that it never starts an OpenMP team of its
    own; one more team, even an idle one, throttles the worker thread's OpenMP workers
    (`python benchmarks/bench_pair_decode.py --threads` shows it). torch's thread count
    is per thread, so the worker keeps all its workers. Nothing changes otherwise."""
    if WORKER.serving and not WORKER.on_worker():
        import torch

        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)


#: The process's model worker: one for every model the process holds.
WORKER = ModelWorker()
