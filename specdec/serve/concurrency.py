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

    def ahead(self, items: Iterator, interval: float = 0.0, convert: Callable[[list], str] | None = None,
              on_end: Callable[[], None] | None = None, then: Callable[[], None] | None = None) -> "Batches":
        """The strings of `items` (or, with `convert`, what it makes of the items taken together, computed by the
        caller as it takes them), the items computed on the engine thread ahead of the caller, who gets them in
        order: the engine thread never waits for the caller, who takes at most one batch every `interval`
        seconds, the strings ready then joined into one; it is woken only while it waits for one, so the engine
        thread wakes it once a batch at most, not once a string. A caller slower than the items (a client that
        reads slowly) leaves them to pile up: the work ends as fast as it can, and the engine is free for others.

        `on_end()` runs on the caller's side as soon as the items have ended on the engine thread (under gevent,
        in a greenlet of the caller's loop), though the caller may still be busy with earlier ones (writing them
        to a slow client). `then()` runs on the caller's side once it has taken the last string. The work starts at
        once, whether or not the caller has begun to take. Closing the returned iterator (the caller stopped: a
        client gone), begun or not, stops the work before its next item and closes `items` on the engine thread,
        and returns once it has. An exception in `items` is raised here."""
        outbox = _Outbox(interval, on_end)
        self.submit(outbox.fill, items)
        return Batches(outbox, convert, then)

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


class Batches:
    """EngineThread.ahead's strings, as the caller takes them: an iterator whose `close` stops the work whether or
    not it was begun (a generator closed before its first item runs no clean-up of its own)."""

    def __init__(self, outbox: "_Outbox", convert: Callable[[list], str] | None, then: Callable[[], None] | None):
        self._outbox, self._then = outbox, then
        self._drain = outbox.drain(convert)
        self._begun = False

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> str:
        self._begun = True
        try:
            return next(self._drain)
        except StopIteration:
            if self._then is not None:
                then, self._then = self._then, None
                then()
            raise

    def close(self) -> None:
        self._drain.close()  # a drain begun stops the work itself, on its way out
        if not self._begun:
            self._outbox.stop()


class _Outbox:
    """Strings passed from the engine thread (`fill`) to one caller (`drain`): a deque, and a wake-up for the
    caller (gevent's async watcher under gevent, else an event), sent while it waits and at the end."""

    def __init__(self, interval: float = 0.0, on_end: Callable[[], None] | None = None):
        self.interval = interval
        self._items: deque = deque()  # strings, then an _End
        self._waiting = False  # the caller waits: the next item wakes it
        self._on_end = on_end  # run on the caller's side once, when the work has ended (`_report_end`)
        self._ended = False  # the engine thread has put the _End
        self.cancelled = False  # set by the caller: the engine thread stops before its next item
        if gevent_patched():
            import gevent
            from gevent.event import Event

            self._ready = Event()
            self._watcher = gevent.get_hub().loop.async_()
            self._watcher.start(self._woken)
            self._wake = self._watcher.send
            self._spawn = gevent.spawn
        else:
            self._ready, self._watcher, self._spawn = threading.Event(), None, None
            self._wake = self._ready.set

    def _woken(self) -> None:
        """Under gevent, on the caller's loop: the caller may go on; at the end, `on_end` (in a greenlet: it
        may wait, the loop may not), whatever the caller is doing then (writing to a slow client, say)."""
        self._ready.set()
        if self._ended:
            self._report_end(self._spawn)

    def _report_end(self, run: Callable) -> None:
        """`run(on_end)` if it has not run yet (the caller may have taken the end before its wake-up came)."""
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            run(on_end)

    def fill(self, items: Iterator[str]) -> None:
        """On the engine thread: compute the items one after another, end with the marker."""
        ending = _End()
        try:
            while not self.cancelled:
                try:
                    item = next(items)
                except StopIteration:
                    break
                self._put(item)
            if hasattr(items, "close"):
                items.close()  # a generator stopped early runs its own clean-up here, on the engine thread
        except BaseException as error:  # noqa: BLE001 - raised in the caller
            ending = _End(error)
        self._ended = True  # before the _End: a caller that takes it finds the work ended
        self._put(ending)
        if self._watcher is None:  # threads: the callback is the engine thread's
            self._report_end(lambda on_end: on_end())

    def _put(self, item) -> None:
        self._items.append(item)
        if self._waiting or isinstance(item, _End):  # after the append: a caller not past it yet is woken
            self._wake()

    def _pause(self, seconds: float) -> None:
        """On the caller's side: wait out the interval, unless the end comes first (the last events go at once)."""
        self._ready.clear()
        if not (self._items and isinstance(self._items[-1], _End)):
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
        ready together), one batch at most every `interval` seconds."""
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
                    sent = time.monotonic()
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
            if ending is None:  # the caller stopped early
                self.stop()
            else:
                self._stop_waking()

    def stop(self) -> None:
        """On the caller's side, which takes no more: stop the engine thread's work, and wait until it has."""
        self.cancelled = True
        while True:
            while self._items and not isinstance(self._items[0], _End):
                self._items.popleft()
            if self._items:
                break
            self._await(IDLE_TURN_SECONDS)
        self._stop_waking()

    def _stop_waking(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()  # a wake-up not yet delivered is dropped: the end is reported here then
            self._report_end(lambda on_end: on_end())


class _End:
    """The last item of an _Outbox: the work ended, by itself or with `error`."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def _event_loop_turn() -> Callable[[], None] | None:
    """Under gevent: a function that lets the calling thread's own event loop run its ready greenlets once."""
    if not gevent_patched():
        return None
    import gevent

    return lambda: gevent.sleep(0)


def off_loop(fn: Callable[[], object]):
    """fn() on a thread of gevent's pool under gevent, the calling greenlet waiting for it cooperatively (the loop
    runs meanwhile: the Rust tokenizer lets go of the GIL, Python gives it up every switch interval); elsewhere fn()
    here. Its result, or its exception raised here."""
    if not gevent_patched():
        return fn()
    import gevent

    ok, value = gevent.get_hub().threadpool.apply(_captured, (fn, ()))
    if not ok:
        raise value
    return value


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
    import gevent
    from gevent.socket import wait_read

    def watch() -> None:
        try:
            wait_read(sock.fileno())
        except OSError:  # the socket closed under us
            on_gone()
            return
        if _hung_up(sock):
            on_gone()

    watcher = gevent.spawn(watch)
    try:
        yield
    finally:
        watcher.kill()


def client_gone(sock) -> bool:
    """Whether the client at `sock`, whose request was read whole, has hung up by now (see watch_disconnect); False
    without gevent or a socket (the test client)."""
    if sock is None or not gevent_patched():
        return False
    import select

    from gevent.monkey import get_original

    try:  # the OS's own poll, at once: no limit on descriptor numbers (select's is 1024), nothing waited for
        poll = get_original("select", "poll")()
        poll.register(sock.fileno(), select.POLLIN)
        readable = bool(poll.poll(0))
    except (OSError, ValueError):  # the socket closed under us
        return True
    return readable and _hung_up(sock)


def _hung_up(sock) -> bool:
    """For a readable socket whose request was read whole: whether what is there is the connection's end (or a
    reset), not the client's next request on a kept-alive connection. A client that half-closes counts as gone.
    Where it cannot be told (a TLS socket takes no MSG_PEEK), the client is taken to be there."""
    import socket

    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ValueError:
        return False
    except OSError:
        return True


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
