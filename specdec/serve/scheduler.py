"""One request at a time through the engine (batch size 1), with a bounded first-come-first-served wait queue.

A request either gets the engine at once, waits in line (at most `queue_size` others may wait, each at most
`queue_timeout` seconds), or is turned away with Overloaded, which the service answers 503 with Retry-After.
"""

import threading
import time
from collections import deque
from collections.abc import Callable


class Overloaded(Exception):
    """The queue is full, or a request waited longer than the queue timeout."""


class Slot:
    """The right to use the engine. `release` is idempotent, so every exit path may call it."""

    def __init__(self, scheduler: "Scheduler", waited: float, queued: bool = False):
        self._scheduler = scheduler
        self._released = False
        self._lock = threading.Lock()
        self.waited = waited  # seconds spent in the queue
        self.queued = queued  # it waited in line (its client may have left meanwhile)

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._scheduler._release()

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


class Scheduler:
    """The engine lock and its wait queue. `on_change(waiting, busy)` reports each change (for the gauges)."""

    def __init__(self, queue_size: int, queue_timeout: float, on_change: Callable[[int, bool], None] | None = None):
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self._on_change = on_change or (lambda waiting, busy: None)
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: deque[object] = deque()  # tickets, first come first served

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def acquire(self) -> Slot:
        """Wait for the engine; raise Overloaded when the queue is full or the wait exceeds queue_timeout."""
        start = time.monotonic()
        with self._cond:
            if not self._busy and not self._waiting:
                return self._take(start)
            if len(self._waiting) >= self.queue_size:
                raise Overloaded(f"the server is busy: {len(self._waiting)} requests are already waiting")
            ticket = object()
            self._waiting.append(ticket)
            self._changed()
            deadline = start + self.queue_timeout
            try:
                while self._busy or self._waiting[0] is not ticket:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise Overloaded(f"the server is busy: no turn within the queue timeout of "
                                         f"{self.queue_timeout:g} s")
                    self._cond.wait(remaining)
                return self._take(start, queued=True)
            finally:
                self._waiting.remove(ticket)
                self._changed()
                self._cond.notify_all()  # a waiter that gave up at the head lets the next one in

    def _take(self, start: float, queued: bool = False) -> Slot:
        self._busy = True
        self._changed()
        return Slot(self, time.monotonic() - start, queued)

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._changed()
            self._cond.notify_all()

    def _changed(self) -> None:
        self._on_change(len(self._waiting), self._busy)
