"""concurrency.py, threads.py and worker.py without gunicorn: the engine thread (one OS thread for every call,
results and exceptions carried back), OS threads, time limits, and under gevent (in a subprocess, patched as
gunicorn's worker patches): the event loop keeps running while the engine thread computes, an OS thread started
on the engine thread runs beside it, a thread pool left there ends by itself, and a blocked read is interrupted.
Also the worker's open-file budget."""

import json
import os
import resource
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from specdec.serve.concurrency import EngineThread, time_limit
from specdec.serve.worker import RESERVED_DESCRIPTORS, descriptors_for
from specdec.threads import gevent_patched, start_os_thread

_ROOT = Path(__file__).resolve().parents[1]


def test_every_call_runs_on_one_thread_of_its_own():
    engine = EngineThread()
    threads = {engine.call(threading.get_ident) for _ in range(5)}
    assert len(threads) == 1 and threading.get_ident() not in threads
    # callers on several threads at once still meet the one engine thread
    seen = []
    callers = [threading.Thread(target=lambda: seen.append(engine.call(threading.get_ident))) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    assert set(seen) == threads


def test_results_and_exceptions_come_back_to_the_caller():
    engine = EngineThread()
    assert engine.call(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ValueError, match="bad round"):
        engine.call(_raise, ValueError("bad round"))
    with pytest.raises(StopIteration) as stopped:  # a generator's end, carrying its return value
        engine.call(next, _returns(42))
    assert stopped.value.value == 42
    assert engine.call(lambda: "still serving") == "still serving"


def test_a_call_from_the_engine_thread_itself_runs_at_once():
    engine = EngineThread()  # e.g. a generation's close, run by a finalizer while the engine thread works
    assert engine.call(lambda: engine.call(threading.get_ident)) == engine.call(threading.get_ident)


def test_submit_returns_at_once_and_keeps_the_order():
    engine = EngineThread()
    release, order = threading.Event(), []
    engine.submit(lambda: (release.wait(10), order.append("slow")))
    engine.submit(order.append, "next")
    assert order == []  # submit did not wait
    release.set()
    assert engine.call(lambda: list(order)) == ["slow", "next"]


def _rounds(record: list, count: int, seconds: float = 0.0):
    """A stream's stand-in: `count` items made one after another, each noting the thread that made it."""
    try:
        for i in range(count):
            time.sleep(seconds)
            record.append(threading.get_ident())
            yield f"<{i}>"
    finally:
        record.append(("closed on", threading.get_ident()))


def test_ahead_computes_on_the_engine_thread_and_hands_over_everything_in_order():
    engine, made = EngineThread(), []
    engine_thread = engine.call(threading.get_ident)
    batches = list(engine.ahead(_rounds(made, 30)))
    assert "".join(batches) == "".join(f"<{i}>" for i in range(30))
    assert set(made[:-1]) == {engine_thread} and made[-1] == ("closed on", engine_thread)


def test_ahead_joins_what_is_ready_together_and_takes_one_batch_an_interval():
    engine, made = EngineThread(), []
    started = time.monotonic()
    batches = list(engine.ahead(_rounds(made, 20, seconds=0.005), interval=0.04))
    seconds = time.monotonic() - started
    assert "".join(batches) == "".join(f"<{i}>" for i in range(20))
    assert 2 <= len(batches) <= 1 + seconds / 0.04 + 1, (len(batches), seconds)  # not one batch an item
    # without an interval, a consumer that keeps up gets the items one by one as they come
    assert len(list(engine.ahead(_rounds([], 10, seconds=0.02)))) >= 8


def test_ahead_never_waits_for_a_consumer_that_does_not_take_and_reports_the_end_at_once():
    """A consumer that takes one batch and then nothing (a client that stopped reading): the engine thread makes
    every item anyway, and `on_end` runs as soon as they are made, while the consumer still has them to take: the
    engine is then free for others (a stream held it, waiting for room, until the client was dropped)."""
    engine, made, ended = EngineThread(), [], []
    engine_thread = engine.call(threading.get_ident)
    batches = engine.ahead(_rounds(made, 50, seconds=0.002), interval=0.05,
                           on_end=lambda: ended.append(threading.get_ident()))
    first = next(batches)
    deadline = time.monotonic() + 5
    while not ended:  # the consumer takes nothing meanwhile
        assert time.monotonic() < deadline, made
        time.sleep(0.01)
    assert len(made) == 51 and made[-1] == ("closed on", engine_thread)  # all 50 made, then closed
    assert ended == [engine_thread]  # without gevent, on the engine thread (with it: tests below, under gevent)
    assert first + "".join(batches) == "".join(f"<{i}>" for i in range(50))  # and all handed over, in order
    assert ended == [engine_thread]  # once


def test_ahead_stops_the_work_when_the_consumer_closes_it():
    """A client gone: closing the iterator stops the work before the next item, closes the items on the engine
    thread, and returns once it has."""
    engine, made = EngineThread(), []
    batches = engine.ahead(_rounds(made, 1000, seconds=0.002))
    assert next(batches).startswith("<0>")
    batches.close()
    assert made[-1] == ("closed on", engine.call(threading.get_ident))
    assert len(made) < 500, len(made)  # stopped, not run to the end
    assert engine.call(lambda: "still serving") == "still serving"


def test_ahead_converts_the_items_taken_together_on_the_consumers_side():
    engine = EngineThread()
    engine_thread = engine.call(threading.get_ident)
    converted_on, sizes = [], []

    def convert(items: list) -> str:
        converted_on.append(threading.get_ident())
        sizes.append(len(items))
        return "".join(items).upper()

    batches = list(engine.ahead((f"<x{i}>" for i in range(12)), interval=0.05, convert=convert))
    assert "".join(batches) == "".join(f"<X{i}>" for i in range(12))
    assert set(converted_on) == {threading.get_ident()} != {engine_thread}
    assert sum(sizes) == 12 and len(batches) == len(sizes) < 12  # once a batch, not once an item


def test_ahead_raises_an_exception_of_the_items_in_the_consumer():
    def failing():
        yield "<0>"
        raise ValueError("bad round")

    batches, ended = [], []
    with pytest.raises(ValueError, match="bad round"):
        for batch in EngineThread().ahead(failing(), on_end=lambda: ended.append(True)):
            batches.append(batch)
    assert batches == ["<0>"]  # the item before the failure still comes first
    assert ended == [True]


def test_start_os_thread_carries_the_result_or_the_exception():
    assert start_os_thread(lambda: threading.get_ident()).result(10) != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        start_os_thread(lambda: 1 / 0).result(10)


def test_without_gevent_a_time_limit_cannot_interrupt():
    assert not gevent_patched()
    with time_limit(0.01):
        time.sleep(0.05)  # nothing to interrupt a thread with: the block runs to its end


GEVENT_SCRIPT = textwrap.dedent("""
    from gevent import monkey; monkey.patch_all()
    import json, socket, threading, time
    import gevent, torch
    from concurrent.futures import ThreadPoolExecutor
    from specdec.serve.concurrency import EngineThread, TimeLimitExceeded, time_limit
    from specdec.threads import gevent_patched, start_os_thread

    engine = EngineThread()
    gaps = []
    def ticker():
        last = time.perf_counter()
        while True:
            gevent.sleep(0.01)
            now = time.perf_counter(); gaps.append(now - last); last = now
    ticks = gevent.spawn(ticker)
    def compute():
        a = torch.randn(400, 400)
        start = time.perf_counter()
        while time.perf_counter() - start < 1.0:
            a = (a @ a).tanh()
        return threading.get_native_id()
    engine_thread = engine.call(compute)
    def items():  # a stream's rounds, computed on the engine thread while the loop keeps ticking
        for i in range(20):
            a = torch.randn(200, 200)
            end = time.perf_counter() + 0.01
            while time.perf_counter() < end:
                a = (a @ a).tanh()
            yield f"<{i}>"
    ticks_before = len(gaps)
    ahead = "".join(engine.ahead(items(), 0.02))
    ahead_ticks = len(gaps) - ticks_before
    ended = []  # a consumer busy elsewhere (a write to a slow client): on_end runs in a greenlet of this loop
    batches = engine.ahead(items(), 0.02, on_end=lambda: ended.append((threading.get_native_id(),
                                                                        gevent.getcurrent() is not gevent.get_hub())))
    next(batches)
    gevent.sleep(1.0)  # the 20 items take 0.2 s
    ended_while_busy = list(ended)
    rest = "".join(batches)
    taken_with_end = []  # the consumer takes the end with the last batch before its wake-up is delivered
    batches = engine.ahead(iter(["<a>", "<b>"]), 0.0, on_end=lambda: taken_with_end.append(True))
    from gevent.monkey import get_original
    get_original("time", "sleep")(0.1)  # not gevent's: the loop does not run, so the engine thread's wake-up waits
    last = next(batches)  # both items and the end taken at once
    gevent.sleep(0.3)  # busy (a write to a slow client): the end is reported meanwhile
    reported_while_writing = list(taken_with_end)
    assert list(batches) == []
    loaded = threading.Event()
    engine.submit(lambda: (time.sleep(0.2), loaded.set()))  # set from the engine thread, awaited on the loop
    woke = loaded.wait(5)
    ticks.kill()
    def overlapped():  # an OS thread started on the engine thread runs beside it, not after it
        started = {}
        done = start_os_thread(lambda: started.setdefault("at", time.perf_counter()))
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
        done.result()
        return started["at"] < end
    overlaps = engine.call(overlapped)
    def leave_a_pool():  # as transformers' loading does: its threads are greenlets of the engine thread's loop
        pool = ThreadPoolExecutor(2)
        assert sum(f.result() for f in [pool.submit(pow, 2, i) for i in range(4)]) == 15
        pool.shutdown(wait=False)
        return list(pool._threads)
    pool_threads = engine.call(leave_a_pool)
    time.sleep(0.5)  # the engine thread is idle: its loop's turns let them end
    pool_ended = engine.call(lambda: not any(t.is_alive() for t in pool_threads))
    left, right = socket.socketpair()
    start = time.perf_counter()
    try:
        with time_limit(0.3):
            left.recv(1)  # nothing ever arrives
        interrupted = None
    except TimeLimitExceeded:
        interrupted = time.perf_counter() - start
    print(json.dumps({"patched": gevent_patched(), "engine_thread": engine_thread,
                      "loop_thread": threading.get_native_id(), "ticks": len(gaps), "max_gap": max(gaps),
                      "woke": woke, "interrupted_after": interrupted, "overlaps": overlaps,
                      "pool_ended": pool_ended, "ahead": ahead, "ahead_ticks": ahead_ticks,
                      "ended_while_busy": ended_while_busy, "ended": ended, "rest": rest, "last": last,
                      "reported_while_writing": reported_while_writing, "taken_with_end": taken_with_end}))
""")


def test_under_gevent_the_loop_runs_while_the_engine_thread_computes():
    done = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=_ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["patched"] and result["engine_thread"] != result["loop_thread"]
    assert result["ticks"] >= 40 and result["max_gap"] < 0.25, result  # a second of compute: the loop ran on
    assert result["woke"] and result["overlaps"] and result["pool_ended"], result
    # a stream computed ahead on the engine thread arrives whole and in order, and the loop runs meanwhile
    assert result["ahead"] == "".join(f"<{i}>" for i in range(20)) and result["ahead_ticks"] >= 5, result
    # its end reported on the loop's thread, in a greenlet, while the consumer was busy, and once
    assert result["ended_while_busy"] == result["ended"] == [[result["loop_thread"], True]], result
    assert result["rest"].endswith("<19>")
    assert result["last"] == "<a><b>" and result["reported_while_writing"] == result["taken_with_end"] == [True]
    assert result["interrupted_after"] is not None and 0.25 < result["interrupted_after"] < 2, result


def test_the_worker_fits_its_connections_into_the_open_file_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        assert descriptors_for(1024) == 1024  # the soft limit is raised to make room
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1024 + RESERVED_DESCRIPTORS
        if hard != resource.RLIM_INFINITY:  # more than the hard limit allows: fewer connections
            assert descriptors_for(hard + 1000) == hard - RESERVED_DESCRIPTORS
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _raise(error):
    raise error


def _returns(value):
    """A generator that ends at once; its StopIteration carries `value`."""
    yield from ()
    return value



@pytest.mark.parametrize("descriptor", [None, 1100])
def test_client_gone_tells_a_client_that_left_from_one_still_there_at_any_descriptor(monkeypatch, descriptor):
    """How a request that waited in line finds its client gone (service._take_engine). It asked select(), which
    refuses descriptors past 1024, and took that refusal for a gone client: a worker holding its 1,024 connections
    would have answered 499 to clients still there (a review). A pipelined next request is a client still there."""
    import socket

    from specdec.serve import concurrency

    monkeypatch.setattr(concurrency, "gevent_patched", lambda: True)
    if descriptor is not None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard <= descriptor:
            pytest.skip(f"the open-file limit ({hard}) is below descriptor {descriptor}")
        if soft != resource.RLIM_INFINITY and soft <= descriptor:
            resource.setrlimit(resource.RLIMIT_NOFILE, (descriptor + 1, hard))
        original = (soft, hard)

    def server_side(pair_end: socket.socket) -> socket.socket:
        if descriptor is None:
            return pair_end
        os.dup2(pair_end.fileno(), descriptor)
        pair_end.close()
        return socket.socket(fileno=descriptor)

    try:
        server, client = socket.socketpair()
        server = server_side(server)
        assert not concurrency.client_gone(server)  # nothing to read: there, waiting for its answer
        client.sendall(b"GET /next HTTP/1.1\r\n\r\n")
        assert not concurrency.client_gone(server)  # its next request, pipelined
        server.close()
        server, client = socket.socketpair()
        server = server_side(server)
        client.close()
        assert concurrency.client_gone(server)  # the connection's end
        server.close()
    finally:
        if descriptor is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, original)
