"""gunicorn settings for the specdec service (`python serving.py`, `make serve`, the Docker image).

One worker: both models are resident in it, and they load there, after fork (CUDA cannot be re-initialised in
a forked child, so nothing here or in the master touches the GPU). The worker is gevent's (specdec/serve/worker.py):
each connection is a greenlet, so slow and idle clients cost little, while the engine decodes on its own OS
thread; the service's scheduler lets one request decode and bounds the queue behind it. Bind address, port and
limits come from the specdec settings (config/default.toml < $SPECDEC_CONFIG < SPECDEC_* variables); gunicorn's
own options may still be overridden on its command line or in GUNICORN_CMD_ARGS.
"""

import os
import sys

from specdec.serve.config import ConfigError, load_settings  # the project is installed (editable: make, the image)

try:
    _settings = load_settings()
except ConfigError as _error:
    sys.exit(f"specdec: {_error}")  # one clear message, no traceback, exit status 1

# The factory from the installed package: gunicorn runs in the directory it was started from (relative paths in
# settings are read from there), where a serving.py of its own must not stand in for ours. The same factory as
# serving.py's create_app, which `gunicorn serving:create_app()` names from the repository (the Docker image).
wsgi_app = "specdec.serve:create_app()"
bind = [f"[{_settings.host}]:{_settings.port}" if ":" in _settings.host else f"{_settings.host}:{_settings.port}"]
workers = 1
worker_class = "specdec.serve.worker.Worker"
# Connections open at once (each a greenlet). The worker raises its open-file limit to fit them, or holds fewer.
worker_connections = 1024
# The event loop heartbeats while the engine thread decodes, so this bounds a hung worker, not a generation.
timeout = 120
# On SIGTERM the worker drains: new requests get 503, those in flight and queued finish, for up to this long
# (a request waits at most queue_timeout for its turn, then decodes for at most request_timeout).
graceful_timeout = int(_settings.queue_timeout + _settings.request_timeout) + 10
# Keep-alive on. The worker times each wait for a request's head, on a new or a kept-alive connection, with the
# header_timeout setting instead of this.
keepalive = max(1, round(_settings.header_timeout))
control_socket_disable = True  # one fixed worker: nothing to manage at runtime, and no socket under $HOME

# Logs go to stdout. The service writes one line per request itself, so gunicorn's access log stays quiet.
accesslog = None
loglevel = _settings.log_level
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stdout": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}},
    "root": {"level": _settings.log_level.upper(), "handlers": ["stdout"]},
    "loggers": {
        "gunicorn.error": {"level": _settings.log_level.upper(), "handlers": ["stdout"], "propagate": False},
        "gunicorn.access": {"level": "WARNING", "handlers": ["stdout"], "propagate": False},
    },
}


def post_worker_init(worker):
    """If the models fail to load, stop the worker with gunicorn's "app failed to load" status, which stops
    the master too: a server that can never become ready should not keep running."""
    service = worker.service  # specdec.serve.worker.Worker: the app's Service

    def stop(message):
        worker.log.error("stopping: the models could not be loaded (%s)", message)
        os._exit(4)  # gunicorn.arbiter.Arbiter.APP_LOAD_ERROR

    service.on_load_failure(stop)


def worker_exit(server, worker):
    """The worker's last step, whichever way it leaves: end its process at once (see worker.end_process). The
    master calls this hook too, for a worker that vanished; there it does nothing."""
    if worker.pid == os.getpid():
        from specdec.serve.worker import end_process

        end_process()
