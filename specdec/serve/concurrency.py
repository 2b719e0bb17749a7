"""How one worker shares its time between the connections and the engine: the engine's own OS thread, and time
limits on blocking reads.

Under gunicorn the worker is gevent's (see worker.py): every connection is a greenlet on one event loop, so a slow
or idle client costs a greenlet, not a thread. Decoding must not run on that loop: `EngineThread` runs every engine
call (loading the pair, each decoding round, ending a generation) on one OS thread of its own, and the calling
greenlet waits for it cooperatively; torch releases the GIL in its kernels, so the loop keeps serving meanwhile.
Without gevent (the Flask test client, a threaded server) the engine thread is an ordinary thread and a caller
blocks on it. Either way the engine's state is only ever touched from that one thread.
"""

import contextlib
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future


def gevent_patched() -> bool:
    """Whether gevent has monkey-patched this process (gunicorn's gevent worker does so before loading the app)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and monkey.is_module_patched("threading")


class EngineThread:
    """One OS thread for every engine call; `call` waits for the result, `submit` does not."""

    def __init__(self, name: str = "specdec-engine"):
        self.name = name
        self._lock = threading.Lock()
        self._pool = None  # gevent: a one-thread gevent ThreadPool; otherwise a queue served by a daemon thread
        self._jobs: queue.SimpleQueue | None = None
        self._ident: int | None = None  # the daemon thread's

    def call(self, fn: Callable, *args):
        """fn(*args) on the engine thread; its result, or its exception raised here."""
        ok, value = self._run(fn, args)
        if not ok:
            raise value
        return value

    def submit(self, fn: Callable, *args) -> None:
        """Start fn(*args) on the engine thread and return at once (fn reports its own outcome)."""
        self._start()
        if self._pool is not None:
            self._pool.spawn(_captured, fn, args)
        else:
            self._jobs.put((fn, args, None))

    def _run(self, fn: Callable, args: tuple) -> tuple[bool, object]:
        self._start()
        if self._pool is not None:  # the greenlet waits on the event loop; the loop runs on
            return self._pool.apply(_captured, (fn, args))  # (from the engine thread itself: at once)
        if threading.get_ident() == self._ident:  # from the engine thread itself (a finalizer closing a stream)
            return _captured(fn, args)
        done: Future = Future()
        self._jobs.put((fn, args, done))
        return done.result()

    def _start(self) -> None:
        # started on first use: after gunicorn's fork and gevent's patching, in the process that uses it
        with self._lock:
            if self._pool is not None or self._jobs is not None:
                return
            if gevent_patched():
                from gevent.threadpool import ThreadPool

                self._pool = ThreadPool(1)
            else:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._serve, name=self.name, daemon=True).start()

    def _serve(self) -> None:
        self._ident = threading.get_ident()
        while True:
            fn, args, done = self._jobs.get()
            result = _captured(fn, args)
            if done is not None:
                done.set_result(result)


def _captured(fn: Callable, args: tuple) -> tuple[bool, object]:
    """(True, result) or (False, exception): an exception crosses back to the caller as a value, so neither the
    thread pool nor the engine thread reports it on its own."""
    try:
        return True, fn(*args)
    except BaseException as error:  # noqa: BLE001 - re-raised in the caller
        return False, error


class TimeLimitExceeded(Exception):
    """A `time_limit` block ran out of time."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeLimitExceeded in the block once `seconds` have passed, even inside a blocked socket read.

    Under gevent the read is interrupted where it waits. A thread cannot be interrupted, so elsewhere (the test
    client, whose body is in memory) the block runs without a limit."""
    if not gevent_patched():
        yield
        return
    import gevent

    timeout = gevent.Timeout(seconds, TimeLimitExceeded(f"over the time limit of {seconds:g} s"))
    with timeout:
        yield
