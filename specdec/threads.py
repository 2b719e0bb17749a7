"""OS threads that stay OS threads: `start_os_thread` runs a function on a new one and returns its Future, also
in a process that gevent has monkey-patched (the service's gunicorn worker). There `threading.Thread` starts a
greenlet instead, which runs only while the thread that started it waits, so work meant to overlap would not."""

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future


def gevent_patched() -> bool:
    """Whether gevent has monkey-patched this process's threading (gevent itself is not imported here)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and monkey.is_module_patched("threading")


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

    if gevent_patched():
        from gevent.monkey import get_original

        get_original("_thread", "start_new_thread")(run, ())
    else:
        threading.Thread(target=run, name=name, daemon=True).start()
    return future


def os_thread_id() -> int:
    """The calling OS thread's id (under gevent, threading.get_ident names the calling greenlet instead)."""
    if gevent_patched():
        from gevent.monkey import get_original

        return get_original("_thread", "get_ident")()
    return threading.get_ident()
