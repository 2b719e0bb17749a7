"""The gunicorn worker class of the service (config/gunicorn.conf.py): gunicorn's gevent worker, with

- each connection a greenlet, so clients that send or read slowly, or sit idle, cost a greenlet, not a thread
  (the engine decodes on its own OS thread, see concurrency.py);
- a request's line and headers timed by `header_timeout` (the body by `body_timeout`, in protocol.py);
- enough file descriptors for `worker_connections`, the soft limit raised towards the hard one if need be;
- draining on SIGTERM: the service refuses new requests at once (503 with Retry-After, /readyz 503) but the
  worker keeps accepting and answering until the requests in flight and queued are done, then stops as gunicorn's
  gevent worker does, all within gunicorn's graceful_timeout; while draining, a request's head must come within
  DRAIN_HEADER_TIMEOUT (a connection that waits for one longer is closed, as `header_timeout` closes it), so
  that a client holding an idle kept-alive connection does not keep the worker up for `header_timeout`;
- gunicorn's own error answers (a request line or headers it cannot parse: 400, 414, 431) in the service's JSON
  error shape, not gunicorn's HTML page;
- an answer that says `Connection: close` (one that left the request's body unread: 408, 413) closes the
  connection, which gunicorn would otherwise keep alive (it drops an application's hop-by-hop headers);
- `end_process`, which gunicorn.conf.py's worker_exit hook calls, to leave without interpreter shutdown.

gevent patches the process itself when the worker starts (before the app is loaded), as gunicorn's own gevent
worker does; the master is never patched.
"""

import contextlib
import json
import logging
import os
import resource
import sys
import time
import uuid
import warnings
from http import HTTPStatus

import gevent
from gevent.local import local
from gevent.monkey import MonkeyPatchWarning
from gunicorn import util
from gunicorn.workers.ggevent import GeventWorker

logger = logging.getLogger(__name__)

# descriptors the worker needs besides its connections: listeners, pipes, logs, model files, the engine's
RESERVED_DESCRIPTORS = 128
# while draining, the longest wait for a request's head (seconds), from the drain's start or the wait's if later: a
# new connection sends its request at once and is answered 503, an idle kept-alive one is closed
DRAIN_HEADER_TIMEOUT = 2.0


class Worker(GeventWorker):
    """gunicorn's gevent worker with the service's header timeout, open-file budget and draining."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.service = None  # the app's Service, once the app is loaded
        self.header_timeout = float(self.cfg.keepalive or 10)
        self._connection = local()  # per connection's greenlet: the request being answered (`request`)
        self._waiting = {}  # a connection's greenlet: the gevent.Timeout of its wait for a request's head
        self._timers = []  # the hub's timers that end those waits while draining (held until the worker ends)

    def init_process(self):
        self.worker_connections = descriptors_for(self.worker_connections)
        ready_cpu_kernel()  # before gevent patches subprocess
        util.write_error = write_json_error  # in this worker process: what gunicorn's handle_error writes with
        from .loader import ModelHost

        ModelHost.freezes_heap = True  # this process serves one app until it exits (loader.freeze_heap)
        super().init_process()  # patches, loads the app (the models start loading on the engine thread), runs

    def patch(self):
        with warnings.catch_warnings():
            # The master imported the app's stack (transformers, and ssl with it) before forking this worker, so
            # gevent warns that ssl was imported first; HTTPS from the engine thread (a hub download) works.
            warnings.filterwarnings("ignore", "Monkey-patching ssl after ssl", MonkeyPatchWarning)
            # gevent's scan of the loaded modules touches torch.distributed's deprecated alias
            warnings.filterwarnings("ignore", ".*reduce_op", FutureWarning)
            super().patch()

    def load_wsgi(self):
        super().load_wsgi()
        self.service = self.wsgi.extensions["specdec"]
        self.header_timeout = self.service.settings.header_timeout
        self.wsgi = self._closing(self.wsgi)

    def handle_request(self, listener_name, req, sock, addr):
        self._connection.request = req
        return super().handle_request(listener_name, req, sock, addr)

    def _closing(self, app):
        """`app`, whose answers saying `Connection: close` make gunicorn close the connection after them."""
        def closing_app(environ, start_response):
            def start(status, headers, exc_info=None):
                req = getattr(self._connection, "request", None)  # None on a path past handle_request (HTTP/2)
                if req is not None and any(name.lower() == "connection" and value.lower() == "close"
                                           for name, value in headers):
                    req.must_close = True  # gunicorn's own mark (its Response reads it)
                return start_response(status, headers, exc_info)
            return app(environ, start)
        return closing_app

    def timeout_ctx(self):
        # gunicorn times each wait for a request's head with this: a new connection's, or a kept-alive one's next
        return self._head_wait()

    @contextlib.contextmanager
    def _head_wait(self):
        """A wait for a request's head, `header_timeout` long (DRAIN_HEADER_TIMEOUT while draining): its end ends
        the wait quietly, and gunicorn closes the connection. Listed in `_waiting` while it lasts."""
        draining = self.service is not None and self.service.draining
        with gevent.Timeout(min(self.header_timeout, DRAIN_HEADER_TIMEOUT) if draining else self.header_timeout,
                            False) as timeout:
            greenlet = gevent.getcurrent()
            self._waiting[greenlet] = timeout
            try:
                yield
            finally:
                self._waiting.pop(greenlet, None)

    def _shorten_waits(self) -> None:
        """Draining: the waits for a request's head under way end within DRAIN_HEADER_TIMEOUT (each by its own
        timeout, thrown as gevent throws it when it runs out)."""
        for greenlet, timeout in list(self._waiting.items()):
            if timeout.seconds > DRAIN_HEADER_TIMEOUT:
                timeout.cancel()
                timer = gevent.get_hub().loop.timer(DRAIN_HEADER_TIMEOUT)
                self._timers.append(timer)
                timer.start(self._end_wait, greenlet, timeout)

    def _end_wait(self, greenlet, timeout) -> None:
        """In the hub: end `greenlet`'s wait for a request's head if it is still the same wait."""
        if self._waiting.get(greenlet) is timeout:
            greenlet.throw(timeout)

    def handle_exit(self, sig, frame):
        """SIGTERM from the master: drain, then stop."""
        if self.service is None:  # the app is not loaded yet: nothing to drain
            super().handle_exit(sig, frame)
            return
        if self.service.draining:  # already on its way out
            return
        self.service.drain()
        gevent.spawn(self._stop_when_idle)  # not in the signal handler itself (as gunicorn's gevent worker does)

    def _stop_when_idle(self):
        scheduler = self.service.scheduler
        logger.info("draining: new requests are answered 503; waiting for %d in flight and %d queued",
                    int(scheduler.busy), scheduler.waiting)
        started = time.monotonic()
        deadline = started + self.cfg.graceful_timeout
        self._shorten_waits()
        while not self.service.idle and time.monotonic() < deadline:
            gevent.sleep(0.05)
        logger.info("drained in %.1f s%s", time.monotonic() - started,
                    "" if self.service.idle else " (graceful_timeout reached, requests still running)")
        self.alive = False  # gunicorn's gevent worker closes its listeners and lets the open connections end


def write_json_error(sock, status: int, reason: str, message: str) -> None:
    """gunicorn's answer to a request it could not parse (its line, its headers, a chunk), as
    `gunicorn.util.write_error` writes it, with the service's error body in place of an HTML page: its type
    `bad_request` (`internal_error` for a 500; a 501 is an unsupported transfer coding, the client's), gunicorn's
    message, no field; and, as every answer, an X-Request-ID (a new one: the request's own could not be read). The
    reason phrase is the status's own: gunicorn gives its 501 "Bad Request" (found by a fuzzing audit)."""
    body = json.dumps({"error": {"type": "internal_error" if status == 500 else "bad_request",
                                 "message": message or reason, "field": None}}).encode()
    with contextlib.suppress(ValueError):  # a status http.HTTPStatus lacks keeps gunicorn's phrase
        reason = HTTPStatus(status).phrase
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"X-Request-ID: {uuid.uuid4().hex}\r\nContent-Length: {len(body)}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin-1") + body)


def end_process() -> None:
    """End the worker process now, with the exit status it is leaving with (gunicorn's worker_exit hook, the last
    step of every way out of a worker), after flushing the logs.

    Interpreter shutdown would join every thread, and a thread that a library started on the engine thread (a
    thread pool of transformers' loading) is, under gevent, a greenlet of the engine thread's own event loop,
    which the exiting main thread cannot wake: the worker would hang until the master's graceful_timeout. The
    worker has nothing left to save, so it exits as multiprocessing's forked children do."""
    error = sys.exc_info()[1]
    code = error.code if isinstance(error, SystemExit) else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def ready_cpu_kernel() -> bool:
    """Load (building it the first time on this machine) the few-rows CPU kernel before gevent patches the
    process. torch's extension builder runs ninja through `subprocess`, which gevent's patched one refuses on the
    engine thread ("child watchers are only available on the default loop"), and loading would then fall back to
    oneDNN-packed linears: slower verification, and twice the target's weights while packing. The kernel's op
    stays registered for the loading that follows. Skipped where the pair goes to CUDA; returns whether it is
    ready."""
    from ..errors import SpecDecError
    from ..models.sources import resolve_device
    from .config import ConfigError, load_settings

    try:
        if resolve_device(load_settings().device).type != "cpu":
            return False
    except (ConfigError, SpecDecError):
        return False  # loading says what is wrong
    from ..cpu.linear import few_rows_kernel

    return few_rows_kernel()


def descriptors_for(connections: int) -> int:
    """How many connections the worker can hold open: `connections` when the descriptor limit allows, after
    raising the soft limit towards the hard one if it must; fewer (with a warning) when the hard limit is lower."""
    wanted = connections + RESERVED_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return connections
    fewer = max(1, soft - RESERVED_DESCRIPTORS)
    logger.warning("the open-file limit is %d (hard %d): the worker holds at most %d connections, not %d "
                   "(raise `ulimit -n` to %d or more)", soft, hard, fewer, connections, wanted)
    return fewer
