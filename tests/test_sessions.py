"""`pagekv.serving.sessions.SessionGate`: one turn at a time per session, bounded, and
what it holds for a session dropped when the session ends."""

from __future__ import annotations

import threading
import time

from pagekv.serving.sessions import SessionGate


def test_a_sessions_turns_never_overlap_and_other_sessions_do_not_wait():
    gate = SessionGate()
    inside, overlaps = {"a": 0, "b": 0}, []
    b_done = threading.Event()

    def turn(sid, hold_s):
        with gate.turn(sid):
            inside[sid] += 1
            overlaps.append(inside[sid])
            time.sleep(hold_s)
            inside[sid] -= 1
        if sid == "b":
            b_done.set()

    threads = [threading.Thread(target=turn, args=("a", 0.05)) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    threading.Thread(target=turn, args=("b", 0.0)).start()
    assert b_done.wait(5) and time.perf_counter() - t0 < 0.1  # not behind session a
    for t in threads:
        t.join(10)
    assert max(overlaps) == 1 and len(overlaps) == 5
    with gate.turn(None):  # a Python caller (no session): no entry
        pass
    assert len(gate) == 2


def test_ended_sessions_are_dropped_and_the_gate_stays_bounded():
    gate = SessionGate(max_sessions=3)
    for sid in "abcde":
        with gate.turn(sid):
            pass
    assert len(gate) == 3  # the least recently used idle ones went
    gate.end("e")
    gate.end("unknown")
    gate.end(None)
    assert len(gate) == 2


def test_a_busy_session_is_neither_ended_nor_trimmed():
    gate = SessionGate(max_sessions=1)
    entered, release = threading.Event(), threading.Event()

    def busy():
        with gate.turn("busy"):
            entered.set()
            release.wait(10)

    t = threading.Thread(target=busy)
    t.start()
    assert entered.wait(5)
    gate.end("busy")  # the tab closed while its run goes on: the run keeps its entry
    with gate.turn("other"):
        pass
    assert len(gate) == 1  # "other" (idle) was trimmed, "busy" stays
    release.set()
    t.join(10)
    gate.end("busy")
    assert len(gate) == 0
