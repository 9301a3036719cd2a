"""`pagekv.serving.worker`: calls served by one thread, results and errors handed back."""

from __future__ import annotations

import threading

import pytest

from pagekv.serving.worker import ModelThread


def test_without_a_server_calls_run_here():
    mt = ModelThread()
    assert not mt.serving
    assert mt.call(threading.current_thread) is threading.current_thread()


def test_calls_run_on_the_serving_thread_and_errors_come_back():
    mt = ModelThread()
    stop = threading.Event()
    ran_on, errors = [], []

    def client():
        try:
            while not mt.serving:
                pass
            ran_on.append(mt.call(threading.current_thread))
            ran_on.append(mt.call(lambda: mt.call(threading.current_thread)))  # re-entrant
            with pytest.raises(ValueError, match="boom"):
                mt.call(lambda: (_ for _ in ()).throw(ValueError("boom")))
            ran_on.append(mt.call(lambda x, y=0: x + y, 2, y=3))
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            stop.set()

    server = threading.Thread(target=mt.serve_forever, args=(stop, 0.05), name="model")
    th = threading.Thread(target=client)
    server.start()
    th.start()
    th.join(30)
    server.join(30)
    assert not errors, errors
    assert ran_on == [server, server, 5]
    assert not mt.serving  # serving stopped with `stop`


def test_one_server_at_a_time():
    mt = ModelThread()
    stop = threading.Event()
    server = threading.Thread(target=mt.serve_forever, args=(stop, 0.05))
    server.start()
    while not mt.serving:
        pass
    try:
        with pytest.raises(RuntimeError, match="already serves"):
            mt.serve_forever(stop)
    finally:
        stop.set()
        server.join(30)
