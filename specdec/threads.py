"""OS threads that stay OS threads, also in a process that gevent has monkey-patched (the service's gunicorn
worker). There `threading.Thread` and `ThreadPoolExecutor` start greenlets instead, which run only while the
thread that started them waits: reads of weights, fbgemm's packing and the engine's loop would not overlap.

- `start_os_thread`: fn on a new OS thread; its `Future` (the engine thread of the service).
- `Job`: fn on a new OS thread; `result()` blocks the calling OS thread until it is done (start-up work).
- `thread_map`: a list comprehension computed by a few OS threads, in order (reading and packing weights).
- `unpatched`: the standard library's own process functions for a while (torch.compile running the compiler)."""

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future


def gevent_patched(module: str = "threading") -> bool:
    """Whether gevent has monkey-patched `module` in this process (gevent itself is not imported here)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and monkey.is_module_patched(module)


def _original(module: str, name: str):
    """`module.name` as it was before gevent patched it (as it is, where gevent has not)."""
    if gevent_patched(module):
        return sys.modules["gevent.monkey"].get_original(module, name)
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def unpatched(*modules: str):
    """The standard library's own functions in `modules` (e.g. "os", "subprocess") for the duration, where gevent
    has patched them. gevent's subprocess and os.waitpid need the main thread's event loop ("child watchers are
    only available on the default loop"), and torch.compile runs the C++ compiler from the engine thread. The
    swap is process-wide: nothing else in the worker starts processes meanwhile."""
    monkey = sys.modules.get("gevent.monkey")
    saved = getattr(monkey, "saved", {}) if monkey is not None else {}
    swapped = []
    try:
        for module_name in modules:
            module = sys.modules.get(module_name)
            for name, original in saved.get(module_name, {}).items():
                if module is not None and hasattr(module, name):
                    swapped.append((module, name, getattr(module, name)))
                    setattr(module, name, original)
        yield
    finally:
        for module, name, value in reversed(swapped):
            setattr(module, name, value)


def start_os_thread(fn: Callable, *args, name: str | None = None) -> Future:
    """fn(*args) on a new OS thread (a daemon: nothing waits for it at exit); the Future of its result."""
    future: Future = Future()

    def run():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - the Future carries it to whoever waits
            future.set_exception(error)

    if gevent_patched("threading"):
        _original("_thread", "start_new_thread")(run, ())
    else:
        threading.Thread(target=run, name=name, daemon=True).start()
    return future


def os_lock():
    """A native lock: acquiring it blocks the calling OS thread, whatever gevent has patched."""
    return _original("_thread", "allocate_lock")()


def os_thread_id() -> int:
    """The calling OS thread's id (under gevent, threading.get_ident names the calling greenlet instead; gevent
    leaves get_native_id alone, and it is a tenth of the cost of looking up the original get_ident)."""
    return threading.get_native_id()


class Job:
    """fn(*args) running on an OS thread of its own; `result()` waits for it, blocking the calling OS thread (a
    native lock: no event loop is involved, so it works from any thread, patched or not)."""

    def __init__(self, fn: Callable, *args):
        self._done = _original("_thread", "allocate_lock")()
        self._done.acquire()
        self._outcome: tuple[bool, object] = (False, RuntimeError("not finished"))

        def run():
            try:
                self._outcome = (True, fn(*args))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                self._outcome = (False, error)
            finally:
                self._done.release()

        _original("_thread", "start_new_thread")(run, ())

    def result(self):
        with self._done:
            pass
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def thread_map(fn: Callable, items: Iterable, threads: int) -> list:
    """[fn(item) for item in items], computed by up to `threads` OS threads taking items in order; the first
    exception is raised once every thread has stopped (the others stop at their next item)."""
    items = list(items)
    results: list = [None] * len(items)
    lock = _original("_thread", "allocate_lock")()
    state = {"next": 0, "error": None}

    def work():
        while True:
            with lock:
                index = state["next"]
                if index >= len(items) or state["error"] is not None:
                    return
                state["next"] += 1
            try:
                results[index] = fn(items[index])
            except BaseException as error:  # noqa: BLE001 - raised by thread_map
                with lock:
                    state["error"] = state["error"] or error
                return

    workers = [Job(work) for _ in range(max(1, min(threads, len(items))))]
    for worker in workers:
        worker.result()
    if state["error"] is not None:
        raise state["error"]
    return results
