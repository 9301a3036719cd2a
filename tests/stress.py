"""A stress harness for the model worker: many threads, a random mix of calls, a timeout per call,
each result compared with the serial one for its key (`report.hung`, `.errors` and `.mismatches`
are empty when the worker is sound)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Report:
    calls: int = 0
    hung: list = field(default_factory=list)  # (key, seconds in flight)
    errors: list = field(default_factory=list)  # (key, repr of the exception)
    mismatches: list = field(default_factory=list)  # key
    kinds: dict = field(default_factory=dict)  # kind -> calls made
    threads: list = field(default_factory=list, repr=False)

    def settle(self, timeout_s: float) -> bool:
        """Wait for the client threads to end; whether they all did."""
        for t in self.threads:
            t.join(timeout_s)
        return not any(t.is_alive() for t in self.threads)

    @property
    def sound(self) -> bool:
        return self.calls > 0 and not (self.hung or self.errors or self.mismatches)


def serial(study, calls: dict) -> dict:
    """Each key's signature, computed one call at a time on this thread."""
    return {key: fn(study) for key, fn in calls.items()}


def stress(
    study,
    calls: dict,
    expected: dict,
    threads: int = 8,
    duration_s: float = 15.0,
    call_timeout_s: float = 60.0,
    seed: int = 0,
    tolerated=(),
    calls_per_thread: int | None = None,
) -> Report:
    """Random calls from `threads` threads for `duration_s` (or `calls_per_thread` each); a call
    past `call_timeout_s` is hung; `tolerated` exceptions count as calls."""
    report = Report()
    lock = threading.Lock()  # the harness's own bookkeeping, never held across a call
    in_flight: dict[int, tuple] = {}
    keys = list(calls)
    stop_at = time.monotonic() + duration_s

    def more(made: int) -> bool:
        if calls_per_thread is not None:
            return made < calls_per_thread
        return time.monotonic() < stop_at

    def client(i: int):
        rng = random.Random(seed * 1000 + i)
        made = 0
        while more(made):
            made += 1
            key = rng.choice(keys)
            with lock:
                in_flight[i] = (key, time.monotonic())
            try:
                got = calls[key](study)
            except tolerated:
                got = expected[key]
            except Exception as e:
                with lock:
                    report.errors.append((key, repr(e)))
                got = expected[key]
            with lock:
                del in_flight[i]
                report.calls += 1
                report.kinds[key[0]] = report.kinds.get(key[0], 0) + 1
                if got != expected[key]:
                    report.mismatches.append(key)

    workers = [
        threading.Thread(target=client, args=(i,), daemon=True, name=f"stress-{i}")
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    deadline = stop_at + call_timeout_s
    if calls_per_thread is not None:  # each call gets its timeout, one after the other
        deadline = time.monotonic() + calls_per_thread * call_timeout_s
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    now = time.monotonic()
    with lock:
        report.hung = [(key, round(now - t0, 1)) for key, t0 in in_flight.values()]
    report.threads = workers
    return report
