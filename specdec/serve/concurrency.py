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
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..threads import gevent_patched, os_thread_id, start_os_thread

# While idle, the engine thread gives its own gevent loop a turn this often (see EngineThread._serve).
IDLE_TURN_SECONDS = 0.05


class EngineThread:
    """One OS thread for every engine call; `call` waits for the result, `submit` does not."""

    def __init__(self, name: str = "specdec-engine"):
        self.name = name
        self._lock = threading.Lock()
        self._jobs = None  # a queue that blocks the OS thread (gevent's queues do not work across threads)
        self._ident: int | None = None  # the engine thread's OS-level id

    def call(self, fn: Callable, *args):
        """fn(*args) on the engine thread; its result, or its exception raised here."""
        self._start()
        if os_thread_id() == self._ident:  # from the engine thread itself (a finalizer closing a stream)
            ok, value = _captured(fn, args)
        elif gevent_patched():
            ok, value = self._call_from_greenlet(fn, args)
        else:
            done: Future = Future()
            self._jobs.put((fn, args, done.set_result))
            ok, value = done.result()
        if not ok:
            raise value
        return value

    def _call_from_greenlet(self, fn: Callable, args: tuple) -> tuple[bool, object]:
        """The calling greenlet waits while its event loop runs on; the engine thread wakes it through the loop's
        async watcher, the one thread-safe way into a gevent loop (as gevent's own thread pool does): a round trip
        of tens of microseconds, where waiting on a Future under gevent took hundreds (bench/README.md, "Rounds
        bound by overhead")."""
        import gevent
        from gevent.event import AsyncResult

        hub = gevent.get_hub()
        watcher, result, box = hub.loop.async_(), AsyncResult(), []
        watcher.start(lambda: result.set(box[0]))

        def deliver(outcome) -> None:  # on the engine thread
            box.append(outcome)
            watcher.send()

        try:
            self._jobs.put((fn, args, deliver))
            return result.get()
        finally:
            watcher.stop()

    def submit(self, fn: Callable, *args) -> None:
        """Start fn(*args) on the engine thread and return at once (fn reports its own outcome)."""
        self._start()
        self._jobs.put((fn, args, None))

    def _start(self) -> None:
        # started on first use: after gunicorn's fork and gevent's patching, in the process that uses it
        with self._lock:
            if self._jobs is not None:
                return
            if gevent_patched():
                from gevent.monkey import get_original

                self._jobs = get_original("queue", "SimpleQueue")()
            else:
                self._jobs = queue.SimpleQueue()
            start_os_thread(self._serve, name=self.name)

    def _serve(self) -> None:
        """The engine thread: run the jobs in order.

        Under gevent, a thread that a job starts here with threading.Thread (a library's thread pool) is a
        greenlet of this thread's own event loop, which runs only while this thread waits in gevent. So while idle
        it gives that loop a turn every IDLE_TURN_SECONDS, and such threads finish their work and end."""
        self._ident = os_thread_id()
        turn = _event_loop_turn()
        while True:
            try:
                fn, args, done = self._jobs.get(timeout=IDLE_TURN_SECONDS if turn else None)
            except queue.Empty:
                turn()
                continue
            outcome = _captured(fn, args)
            if done is not None:
                done(outcome)


def _event_loop_turn() -> Callable[[], None] | None:
    """Under gevent: a function that lets the calling thread's own event loop run its ready greenlets once."""
    if not gevent_patched():
        return None
    import gevent

    return lambda: gevent.sleep(0)


def _captured(fn: Callable, args: tuple) -> tuple[bool, object]:
    """(True, result) or (False, exception): an exception crosses back to the caller as a value, so the engine
    thread never reports it on its own."""
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
