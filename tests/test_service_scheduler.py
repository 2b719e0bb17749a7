"""scheduler.py: one request at a time, first come first served, a bounded queue, a queue timeout."""

import threading
import time

import pytest

from specdec.serve.scheduler import Overloaded, Scheduler


def test_free_engine_is_taken_at_once_and_released_once():
    changes = []
    scheduler = Scheduler(queue_size=2, queue_timeout=1,
                          on_change=lambda waiting, busy: changes.append((waiting, busy)))
    slot = scheduler.acquire()
    assert scheduler.busy and slot.waited < 0.1
    slot.release()
    slot.release()  # idempotent: a second release must not free someone else's turn
    assert not scheduler.busy
    assert changes == [(0, True), (0, False)]


def test_full_queue_is_refused_at_once():
    scheduler = Scheduler(queue_size=0, queue_timeout=5)
    with scheduler.acquire():
        start = time.monotonic()
        with pytest.raises(Overloaded, match="busy"):
            scheduler.acquire()
        assert time.monotonic() - start < 0.5


def test_waiting_longer_than_the_timeout_is_refused():
    scheduler = Scheduler(queue_size=3, queue_timeout=0.2)
    with scheduler.acquire():
        start = time.monotonic()
        with pytest.raises(Overloaded, match="queue timeout"):
            scheduler.acquire()
        assert 0.2 <= time.monotonic() - start < 1.0
        assert scheduler.waiting == 0


def test_waiters_are_served_first_come_first_served_and_one_at_a_time():
    scheduler = Scheduler(queue_size=5, queue_timeout=10)
    order, inside, overlap = [], [0], []
    lock = threading.Lock()

    def request(i):
        with scheduler.acquire():
            with lock:
                inside[0] += 1
                overlap.append(inside[0])
            order.append(i)
            time.sleep(0.01)
            with lock:
                inside[0] -= 1

    holder = scheduler.acquire()
    threads = []
    for i in range(5):
        threads.append(threading.Thread(target=request, args=(i,)))
        threads[-1].start()
        while scheduler.waiting < i + 1:  # queue them in a known order
            time.sleep(0.001)
    with pytest.raises(Overloaded):
        scheduler.acquire()  # the sixth waiter does not fit
    holder.release()
    for thread in threads:
        thread.join(5)
    assert order == [0, 1, 2, 3, 4] and max(overlap) == 1


def test_a_waiter_that_times_out_lets_the_next_one_in():
    scheduler = Scheduler(queue_size=2, queue_timeout=0.3)
    holder = scheduler.acquire()
    results = {}

    def first():
        try:
            scheduler.acquire()
        except Overloaded:
            results["first"] = "timed out"

    def second():
        time.sleep(0.05)
        scheduler.queue_timeout = 5  # the second waiter is patient
        with scheduler.acquire():
            results["second"] = "served"

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the first waiter has given up by now, but the engine is still held
    holder.release()
    for thread in threads:
        thread.join(5)
    assert results == {"first": "timed out", "second": "served"}
