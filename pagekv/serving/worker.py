"""Run the model's work on one thread: the process's main thread, when a server lends it.

A web server calls its handlers on many threads. On the CPU, torch's OpenMP (GNU
libgomp) keeps the worker threads of the *first* thread that computes in parallel
spinning between operations; once other threads have teams of their own, the
spinning appears throttled (libgomp spins briefly when it manages more threads than
there are cores), and a decode step is hundreds of small operations that then pay
the wake-ups. Measured on the project's 2 cores (`python benchmarks/bench_pair_decode.py
--threads`): A and B decoded together on the first preset took 1.03-1.09 s on the
first thread and 1.75-1.83 s on another one (budgets 10 % and 20 %).

So `python app.py` gives its main thread to `MODEL_THREAD.serve_forever()` once the
server runs, and `Study` sends each prefill and decode there with `on_model_thread`
(the calling thread waits for the result; exceptions travel back), and every other
thread that uses torch calls `keep_this_thread_light()` first. Where nothing
serves (tests, the CLI, a notebook, another server), `on_model_thread` simply calls
the function on the caller's thread. Calls made from the model thread itself run at
once (no deadlock).

    from pagekv.serving.worker import MODEL_THREAD, on_model_thread
    result = on_model_thread(runner.evaluate, prefill, config)   # anywhere
    MODEL_THREAD.serve_forever(stop)                               # the main thread
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, TimeoutError

__all__ = ["MODEL_THREAD", "ModelThread", "keep_this_thread_light", "on_model_thread"]


class ModelThread:
    """A queue of calls served by whichever thread runs `serve_forever`."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def serving(self) -> bool:
        return self._thread is not None

    def call(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on the serving thread (waits for it), or here when
        nothing serves or when called from the serving thread."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: Future = Future()
        self._jobs.put((fn, args, kwargs, fut))
        while True:
            try:
                return fut.result(timeout=1.0)
            except TimeoutError:
                # Serving stopped after the job was queued and before it was drained.
                if self._thread is None and fut.cancel():
                    return fn(*args, **kwargs)

    def serve_forever(self, stop: threading.Event | None = None, poll_s: float = 0.2):
        """Serve calls on this thread until `stop` is set (or KeyboardInterrupt)."""
        if self._thread is not None:
            raise RuntimeError("a thread already serves the model")
        self._thread = threading.current_thread()
        try:
            while stop is None or not stop.is_set():
                try:
                    fn, args, kwargs, fut = self._jobs.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to the caller, the loop goes on
                    fut.set_exception(e)
                    if isinstance(e, KeyboardInterrupt):
                        raise
        finally:
            self._thread = None
            self._drain()

    def _drain(self):
        """Calls still queued when serving stops run on their callers' behalf here."""
        while True:
            try:
                fn, args, kwargs, fut = self._jobs.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:
                    fut.set_exception(e)


def keep_this_thread_light() -> None:
    """While a thread serves the model: make torch single-threaded on the calling
    thread (any other thread), so that it never starts an OpenMP team of its own; one
    more team, even an idle one, throttles the model thread's workers (the slowdown
    `python benchmarks/bench_pair_decode.py --threads` shows). torch's thread count is
    per thread, so the model thread keeps all its workers. Nothing changes where no
    thread serves."""
    thread = MODEL_THREAD._thread
    if thread is not None and threading.current_thread() is not thread:
        import torch

        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)


#: The process's model thread (served by `python app.py`'s main thread).
MODEL_THREAD = ModelThread()


def on_model_thread(fn, *args, **kwargs):
    """`MODEL_THREAD.call(fn, *args, **kwargs)`."""
    return MODEL_THREAD.call(fn, *args, **kwargs)
