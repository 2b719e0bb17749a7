"""How one worker shares its time between the connections and the engine: the engine's own OS thread, and time
limits on blocking reads.

Under gunicorn the worker is gevent's (see worker.py): every connection is a greenlet on one event loop, so a slow
or idle client costs a greenlet, not a thread. Decoding must not run on that loop: `EngineThread` runs every engine
call (loading the pair, each decoding round, ending a generation) on one OS thread of its own, and the calling
greenlet waits for it cooperatively; torch releases the GIL in its kernels, so the loop keeps serving meanwhile.
Without gevent (the Flask test client, a threaded server) the engine thread is an ordinary thread and a caller
blocks on it. Either way the engine's state is only ever touched from that one thread. A stream runs its rounds
there ahead of the greenlet that sends them (`EngineThread.ahead`), which is woken only when it waits.
"""

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from ..threads import gevent_patched, os_lock, os_thread_id, start_os_thread

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

    def ahead(self, items: Iterator, depth: int, interval: float = 0.0,
              convert: Callable[[list], str] | None = None, most: int | None = None) -> Iterator[str]:
        """The strings of `items` (or, with `convert`, what it makes of the items taken together, computed by the
        caller as it takes them), the items computed on the engine thread ahead of the caller, who gets them in
        order: the engine thread never waits for the caller to send one, unless `depth` are untaken and the caller
        is late (it last took more than two `interval`s ago: a client that reads slowly, or has gone, stops the
        work within `depth` items), or `most` (default `depth`) are untaken. The caller takes at most one batch
        every `interval` seconds, the strings ready then joined into one; it is woken only while it waits for one,
        so the engine thread wakes it once a batch at most, not once a string.

        Closing the returned iterator (the caller stopped: a client gone) stops the work before its next item and
        closes `items` on the engine thread, and returns once it has. An exception in `items` is raised here."""
        outbox = _Outbox(depth, interval, most)
        self.submit(outbox.fill, items)
        return outbox.drain(convert)

    def submit(self, fn: Callable, *args) -> None:
        """Start fn(*args) on the engine thread and return at once (fn reports its own outcome)."""
        self._start()
        self._jobs.put((fn, args, None))

    def _start(self) -> None:
        # started on first use: after gunicorn's fork and gevent's patching, in the process that uses it; once
        # started, no lock (a round's calls come through here, and under gevent the lock is gevent's)
        if self._jobs is not None:
            return
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


class _Outbox:
    """Strings passed from the engine thread (`fill`) to one caller (`drain`): a deque; a wake-up for the caller
    while it waits (gevent's async watcher under gevent, else an event); and a native lock that the engine thread
    waits on while it has no room (`_room`)."""

    def __init__(self, depth: int, interval: float = 0.0, most: int | None = None):
        self.depth, self.interval = depth, interval
        self.most = max(depth, most or depth)
        self._items: deque = deque()  # strings, then an _End
        self._space = os_lock()  # released by the caller when it takes: the engine thread may go on
        self._taken_at = time.monotonic()  # when the caller last took (or the outbox was made)
        self._full = False  # the engine thread waits for room: the caller takes at once, not after its interval
        self._waiting = False  # the caller waits: the next item wakes it
        self.cancelled = False  # set by the caller: the engine thread stops before its next item
        if gevent_patched():
            import gevent
            from gevent.event import Event

            self._ready = Event()
            self._watcher = gevent.get_hub().loop.async_()
            self._watcher.start(self._ready.set)
            self._wake = self._watcher.send
        else:
            self._ready, self._watcher = threading.Event(), None
            self._wake = self._ready.set

    def _room(self) -> bool:
        """Whether the engine thread may make another item: fewer than `depth` untaken, or fewer than `most` while
        the caller keeps its interval (rounds faster than `depth` an interval then go out an interval at a time,
        not `depth` at a time: bench/README.md, "Rounds bound by overhead"). Keeping it is taking again within two
        intervals: one the caller waits out after it sends, one for its wake-up and its work, so that a caller on
        time never finds the engine thread waiting for it."""
        untaken = len(self._items)
        return untaken < self.depth or (untaken < self.most
                                        and time.monotonic() - self._taken_at <= 2 * self.interval)

    def fill(self, items: Iterator[str]) -> None:
        """On the engine thread: compute the items while there is room (`_room`), end with the marker."""
        ending = _End()
        try:
            while not self.cancelled:
                try:
                    item = next(items)
                except StopIteration:
                    break
                self._put(item)
                while not self._room() and not self.cancelled:
                    self._space.acquire(blocking=False)  # cleared, then taken again when the caller takes
                    if not self._room() and not self.cancelled:
                        # no room: the caller takes now, not at the end of its interval (else rounds faster than
                        # `most` an interval would wait for it: 16 rounds each 5 ms caps a stream at 3,200/s)
                        self._full = True
                        self._wake()
                        self._space.acquire(timeout=IDLE_TURN_SECONDS)
                        self._full = False
            if hasattr(items, "close"):
                items.close()  # a generator stopped early runs its own clean-up here, on the engine thread
        except BaseException as error:  # noqa: BLE001 - raised in the caller
            ending = _End(error)
        self._put(ending)

    def _put(self, item) -> None:
        self._items.append(item)
        if self._waiting or isinstance(item, _End):  # after the append: a caller not past it yet is woken
            self._wake()

    def _pause(self, seconds: float) -> None:
        """On the caller's side: wait out the interval, unless the end comes first (the last events go at once)
        or the engine thread has filled the outbox (and waits for room)."""
        self._ready.clear()
        if not (self._items and isinstance(self._items[-1], _End)) and not self._full:
            self._ready.wait(seconds)

    def _await(self, timeout: float | None = None) -> None:
        """On the caller's side: wait until an item is there (or the timeout)."""
        self._ready.clear()
        self._waiting = True  # before looking: an item put after this wakes the caller
        try:
            if not self._items:
                self._ready.wait(timeout)
        finally:
            self._waiting = False

    def drain(self, convert: Callable[[list], str] | None = None) -> Iterator[str]:
        """On the caller's side: the strings as they come (those ready together joined, or `convert` of the items
        ready together), one batch at most every `interval` seconds. The engine thread may go on once the items
        are taken, before they are converted."""
        interval, ending = self.interval, None
        try:
            while True:
                taken = []
                while self._items and ending is None:
                    item = self._items.popleft()
                    if isinstance(item, _End):
                        ending = item
                    else:
                        taken.append(item)
                if taken:
                    self._taken_at = sent = time.monotonic()
                    self._full = False
                    _release(self._space)
                    if joined := ("".join(taken) if convert is None else convert(taken)):
                        yield joined
                    if ending is None and (pause := sent + interval - time.monotonic()) > 0:
                        self._pause(pause)
                if ending is not None:
                    if ending.error is not None:
                        raise ending.error
                    return
                self._await()
        finally:
            if ending is None:  # the caller stopped early: stop the engine thread's work, and wait until it has
                self.cancelled = True
                _release(self._space)
                while True:
                    while self._items and not isinstance(self._items[0], _End):
                        self._items.popleft()
                    if self._items:
                        break
                    self._await(IDLE_TURN_SECONDS)
            if self._watcher is not None:
                self._watcher.stop()


class _End:
    """The last item of an _Outbox: the work ended, by itself or with `error`."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def _release(lock) -> None:
    try:
        lock.release()
    except RuntimeError:  # not held: the engine thread is not waiting
        pass


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


@contextlib.contextmanager
def watch_disconnect(sock, on_gone: Callable[[], None]):
    """While the block runs (a JSON answer being decoded), call `on_gone` once if the client at `sock` hangs up.

    A streamed answer finds out when a write fails; a JSON answer writes nothing until the end, so under gevent a
    greenlet waits for the client's socket to turn readable: the request was read whole, so what is there is the
    end of the connection (or a reset), or the client's next request on a kept-alive connection, which stops the
    watch. As uvicorn (vLLM's server) does, a client that half-closes its side counts as gone. Without gevent or a
    socket (the test client) the block runs unwatched."""
    if sock is None or not gevent_patched():
        yield
        return
    import socket

    import gevent
    from gevent.socket import wait_read

    def watch() -> None:
        try:
            wait_read(sock.fileno())
            gone = sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:  # a reset, or the socket closed under us
            gone = True
        if gone:
            on_gone()

    watcher = gevent.spawn(watch)
    try:
        yield
    finally:
        watcher.kill()


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
