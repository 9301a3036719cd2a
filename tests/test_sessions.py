"""`pagekv.app.sessions.SessionGate`: one turn at a time per session, bounded, and
what it holds for a session dropped when the session ends."""

from __future__ import annotations

import threading

from pagekv.app.sessions import SessionGate


def test_a_sessions_turns_never_overlap_and_other_sessions_do_not_wait():
    """Four turns of session a, one at a time; session b's turn ends while a's first turn
    is still held (it waits for nothing of a's)."""
    gate = SessionGate()
    inside, overlaps = {"a": 0, "b": 0}, []
    a_in, a_release, b_done = threading.Event(), threading.Event(), threading.Event()

    def turn(sid):
        with gate.turn(sid):
            inside[sid] += 1
            overlaps.append(inside[sid])
            if sid == "a":
                a_in.set()
                a_release.wait(10)
            inside[sid] -= 1
        if sid == "b":
            b_done.set()

    threads = [threading.Thread(target=turn, args=("a",)) for _ in range(4)]
    for t in threads:
        t.start()
    assert a_in.wait(5)
    threading.Thread(target=turn, args=("b",)).start()
    assert b_done.wait(5), "session b waited behind session a"
    assert inside["a"] == 1 and not a_release.is_set()  # a's turn was held all along
    a_release.set()
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
