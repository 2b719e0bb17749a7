"""The HTTP floor: what a request costs on this machine, over what its work costs, in any service built as ours is
(gunicorn's gevent worker, the work on an OS thread of its own, the client on a new connection), but with no
service in it: `POST /wait {"seconds": s, "size": n}` keeps an OS thread busy for s seconds (a Python loop, as
a small pair's rounds keep the engine thread), then answers n bytes of JSON. Nothing of ours runs but the
hand-off to that thread (specdec.serve.concurrency.EngineThread, the service's own).

`bench.overhead` asks it, beside each in-process run, for a request as long as that run and an answer as long
as the service's: the service's figure against the floor's is what the service itself adds. On these VMs a
client that sleeps 50 ms on a socket takes about 1 ms longer to wake than one that does not (2026-12-06).

    python -m gunicorn -k gevent --bind 127.0.0.1:8000 'bench.floor:create_app()'
"""

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.stress import ROOT, free_port, stop_process

EMPTY_ANSWER = len(b'{"text": ""}')  # the shortest answer, in bytes


def create_app():
    """The floor's WSGI application; its OS thread is started on the first request, in the worker."""
    from specdec.serve.concurrency import EngineThread

    worker = EngineThread("floor")

    def app(environ, start_response):
        if environ["PATH_INFO"] != "/wait":
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", "2")])
            return [b"{}"]
        request = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
        worker.call(busy, float(request["seconds"]))
        body = json.dumps({"text": "x" * (int(request.get("size", 0)) - EMPTY_ANSWER)}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def busy(seconds: float) -> None:
    """Keep the calling thread busy in Python for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class FloorServer:
    """The floor app under gunicorn's gevent worker on 127.0.0.1, one worker."""

    def __init__(self, log_path: Path, env: dict | None = None):
        self.port = free_port()
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   **(env or {})}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "-k", "gevent", "--workers", "1", "--bind",
                 f"127.0.0.1:{self.port}", "bench.floor:create_app()"], cwd=ROOT, env=environ, stdout=log,
                stderr=subprocess.STDOUT)
        self.log_path = Path(log_path)

    def wait_ready(self, timeout: float = 60) -> "FloorServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the floor server exited:\n{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                self._request("GET", "/healthz")
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"the floor server was not ready within {timeout} s")

    def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"{method} {path} answered {response.status}")
        return data

    def wait(self, seconds: float, size: int) -> float:
        """One request whose work takes `seconds`, answered with `size` bytes: its wall time from the client, on a
        new connection (as bench.overhead's requests to the service)."""
        payload = json.dumps({"seconds": seconds, "size": size}).encode()
        started = time.perf_counter()
        answer = self._request("POST", "/wait", payload)
        seconds = time.perf_counter() - started
        if len(answer) != max(size, EMPTY_ANSWER):
            raise RuntimeError(f"the floor answered {len(answer)} bytes, not {size}")
        return seconds

    def stop(self) -> None:
        stop_process(self.process, 30)
