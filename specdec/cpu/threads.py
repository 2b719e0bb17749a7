"""OS threads for CPU work at start-up (reading weights, packing int8 layers), real ones even where gevent has
patched `threading`: under gunicorn's gevent worker a `ThreadPoolExecutor` makes greenlets, and blocking calls
(positional reads, fbgemm's packing) then run one after the other instead of side by side."""

import importlib
import sys
from collections.abc import Callable, Iterable


def _original(module: str, name: str):
    """`module.name` as it was before gevent patched it (as it is, where gevent has not)."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched(module):
        return monkey.get_original(module, name)
    return getattr(importlib.import_module(module), name)


class Job:
    """fn(*args) running on an OS thread of its own; `result()` waits for it (blocking the calling thread)."""

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
