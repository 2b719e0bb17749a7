"""`make stress` (`python -m bench.stress`): load, faults, slow and idle clients, and a soak against the service
under gunicorn on 127.0.0.1 with a tiny random pair. Prints a Markdown table of the figures and writes them as
JSON.

Nothing downloads: the pair is saved with the tests' tiny-model helper (tests/support/models.py) into a temporary
folder. `faulty_pair` is the loader the server runs with: the pair, plus faults a prompt can ask for (an
exception or an out-of-memory error inside the target's forward) and an optional delay per target forward.
The functional versions of these checks, smaller, are in tests/test_hardening_gunicorn.py and
tests/test_slow_clients_gunicorn.py.
"""

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
RAISE_MARKER = "<<raise>>"  # a prompt containing this makes the target's forward raise RuntimeError
OOM_MARKER = "<<oom>>"  # ... or torch.OutOfMemoryError
DELAY_ENV = "STRESS_FORWARD_DELAY"  # seconds slept per target forward
LOAD_BUSY_ENV = "STRESS_LOAD_BUSY"  # seconds busy_loading_pair computes before loading
PREDICT = '{endpoint="/predict",status="200"}'


# --- the server under test -------------------------------------------------------------------------------------

def faulty_pair(settings):
    """A loader (SPECDEC_LOADER=bench.stress:faulty_pair): the service's own loading, with faults triggered by
    prompt markers."""
    import torch

    from specdec.serve.loader import load_configured_pair

    draft, target, tokenizer = load_configured_pair(settings)
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    faults = [(tokenizer.encode(RAISE_MARKER, add_special_tokens=False), lambda: RuntimeError("injected fault")),
              (tokenizer.encode(OOM_MARKER, add_special_tokens=False),
               lambda: torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 20.00 GiB"))]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[-1] > 1:
            seq = ids[0].tolist()
            for marker, fault in faults:
                if any(seq[i:i + len(marker)] == marker for i in range(len(seq) - len(marker) + 1)):
                    raise fault()
        if delay:
            time.sleep(delay)

    target.register_forward_pre_hook(hook, with_kwargs=True)
    return draft, target, tokenizer


def busy_loading_pair(settings):
    """A loader (SPECDEC_LOADER=bench.stress:busy_loading_pair) that first does what transformers' loading does,
    leaving a thread pool behind to end by itself, then computes for $STRESS_LOAD_BUSY seconds without yielding,
    then loads like faulty_pair: SIGTERM while the models load must still stop the worker at once."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    pool = ThreadPoolExecutor(max_workers=2)
    pool.submit(sum, range(10)).result()
    pool.shutdown(wait=False)
    seconds = float(os.environ.get(LOAD_BUSY_ENV, "0") or 0)
    logging.getLogger(__name__).info("loading: computing for %g s first", seconds)
    end, a = time.monotonic() + seconds, torch.randn(128, 128)
    while time.monotonic() < end:
        a = (a @ a).tanh()
    return faulty_pair(settings)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen, grace: float) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds; its exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


class Server:
    """`python serving.py` (gunicorn) on 127.0.0.1 with only the SPECDEC_* settings given here."""

    def __init__(self, log_path: Path, env: dict | None = None, cwd: Path = ROOT, **settings):
        """Started in `cwd` (where a relative path in a setting is read from)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
        environ.update({f"SPECDEC_{k.upper()}": str(v) for k, v in settings.items()})
        paths = [str(ROOT), *filter(None, [environ.get("PYTHONPATH")])]
        environ.update({"SPECDEC_HOST": "127.0.0.1", "SPECDEC_PORT": str(self.port),
                        "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                        "PYTHONUNBUFFERED": "1", **(env or {})})
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([sys.executable, str(ROOT / "serving.py")], cwd=cwd, env=environ,
                                            stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                if requests.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return self
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy importing
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready within {timeout} s:\n{self.log()[-3000:]}")

    def stop(self) -> int:
        return stop_process(self.process, 60)

    def worker_pid(self) -> int:
        """The gunicorn worker (the master's one child): where the models, the threads and the sockets live."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if len(children) != 1:
            raise RuntimeError(f"expected one gunicorn worker, found {children}")
        return int(children[0])

    def worker_usage(self) -> dict:
        """The worker's resident memory (KiB), open file descriptors and threads, from /proc."""
        pid = self.worker_pid()
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return {"rss_kib": int(status["VmRSS"].split()[0]), "threads": int(status["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}

    def metric(self, name: str, labels: str = "") -> float:
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + labels + " "):
                return float(line.split()[-1])
        return 0.0

    def post(self, body: dict, session=None, **kwargs) -> requests.Response:
        return (session or requests).post(self.url + "/predict", json=body, timeout=120, **kwargs)


def start_server(folder: Path, pair: tuple[str, str], name: str, delay: float = 0.0, **settings) -> Server:
    draft_dir, target_dir = pair
    settings = {"draft_model": draft_dir, "target_model": target_dir, "device": "cpu",
                "loader": "bench.stress:faulty_pair", **settings}
    return Server(folder / f"{name}.log", env={DELAY_ENV: str(delay)}, **settings).wait_ready()


def save_pair(folder: Path) -> tuple[str, str]:
    """The tests' tiny pair (a random 2-layer Llama target, a perturbed draft, a character tokenizer)."""
    from tests.support.models import save_tiny_pair

    return save_tiny_pair(folder)


# --- load ------------------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_load(server: Server, clients: int = 16, seconds: float = 20.0, max_new_tokens: int = 32) -> dict:
    """`clients` threads post for `seconds`, each its own prompt and seed; a 503 waits its Retry-After.

    Every 200 must equal the answer to the same request sent alone (no mixed-up answers) and echo the
    request's X-Request-ID; every 503 must carry Retry-After; any other status is counted as a failure.
    """
    prompts = [f"client {i:02d} asks: " + "xy" * i for i in range(clients)]  # distinct texts and lengths

    def body(i):  # cache_prompt false: with the prompt cache a seeded draw is the same only to a rounding-level tie
        return {"prompt": prompts[i], "seed": 1000 + i, "temperature": 0.8, "max_new_tokens": max_new_tokens,
                "cache_prompt": False}

    reference = [server.post(body(i)).json()["text"] for i in range(clients)]
    lock = threading.Lock()
    counts = {"ok_200": 0, "busy_503": 0, "busy_503_without_retry_after": 0, "other_status": 0,
              "connection_errors": 0, "mixed_up": 0}
    latencies_200: list[float] = []
    latencies_503: list[float] = []
    samples: list[str] = []
    barrier = threading.Barrier(clients)
    end = [0.0]

    def client(i):
        session = requests.Session()
        barrier.wait()
        n = 0
        while time.monotonic() < end[0]:
            n += 1
            request_id = f"load-{i}-{n}"
            start = time.perf_counter()
            try:
                response = server.post(body(i), session=session, headers={"X-Request-ID": request_id})
            except requests.RequestException as error:
                with lock:
                    counts["connection_errors"] += 1
                    samples.append(f"{request_id}: {error!r}")
                session = requests.Session()
                continue
            latency = time.perf_counter() - start
            wait = 0.0
            with lock:
                if response.status_code == 200:
                    counts["ok_200"] += 1
                    latencies_200.append(latency)
                    answer = response.json()
                    if (answer["text"] != reference[i] or answer["usage"]["prompt_tokens"] != len(prompts[i])
                            or response.headers.get("X-Request-ID") != request_id):
                        counts["mixed_up"] += 1
                        samples.append(f"{request_id}: mixed up: {answer['text']!r} != {reference[i]!r}")
                elif response.status_code == 503:
                    counts["busy_503"] += 1
                    latencies_503.append(latency)
                    retry_after = response.headers.get("Retry-After", "")
                    if retry_after.isdigit() and int(retry_after) >= 1:
                        wait = float(retry_after)
                    else:
                        counts["busy_503_without_retry_after"] += 1
                else:
                    counts["other_status"] += 1
                    samples.append(f"{request_id}: {response.status_code} {response.text[:200]}")
            time.sleep(wait)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    start = time.monotonic()
    end[0] = start + seconds
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 300)
    elapsed = time.monotonic() - start
    ms = lambda value: None if value is None else round(value * 1000, 1)  # noqa: E731
    return {"clients": clients, "seconds": round(elapsed, 1), "max_new_tokens": max_new_tokens,
            "requests": sum(counts[k] for k in ("ok_200", "busy_503", "other_status", "connection_errors")),
            **counts, "served_per_second": round(counts["ok_200"] / elapsed, 2),
            "p50_ms": ms(percentile(latencies_200, 50)), "p95_ms": ms(percentile(latencies_200, 95)),
            "p50_503_ms": ms(percentile(latencies_503, 50)), "samples": samples[:10]}


# --- slow and idle clients -------------------------------------------------------------------------------------

# A request head that never ends: one byte of it per second per connection (a header too long to finish in time).
SLOW_HEAD = (b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Slow: "
             + b"a" * 8000)
KEEP_ALIVE_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
GOOD = {"prompt": "a good request", "max_new_tokens": 16, "temperature": 0}


class Clients:
    """`count` connections that one thread holds open against the server, each doing what `kind` says; a
    connection the server closes is opened again at once, so the count stays up.

    - "slow_headers": sends a request head one byte a second, never finishing it;
    - "idle": half send one keep-alive request and read its answer, then stay idle; half never send anything;
    - "slow_readers": send a streamed /predict with a small receive buffer, read the status line, and then the
      answer one byte a second (a 503 is closed and sent again).
    """

    def __init__(self, server: Server, count: int, kind: str, stream_body: dict | None = None):
        self.server, self.count, self.kind = server, count, kind
        body = json.dumps(stream_body or {"prompt": "a slow reader", "max_new_tokens": 4, "stream": True,
                                          "details": True, "temperature": 0}).encode()
        self.predict = (b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.figures = {"opened": 0, "closed_by_server": 0, "connect_errors": 0, "streams_started": 0,
                        "busy_503": 0, "bytes_read": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"clients-{kind}", daemon=True)
        self._conns: list[dict | None] = [None] * count

    def start(self) -> "Clients":
        self._thread.start()
        return self

    def wait_until_open(self, timeout: float) -> bool:
        """Whether all `count` connections are open (slow readers: each with its answer started) by `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.established() >= self.count:
                return True
            time.sleep(0.1)
        return False

    def established(self) -> int:
        return sum(1 for conn in list(self._conns) if conn is not None and conn["state"] in ("open", "reading"))

    def stop(self) -> dict:
        """Close every connection; the figures."""
        self._stop.set()
        self._thread.join(30)
        for conn in self._conns:
            if conn is not None:
                conn["sock"].close()
        return dict(self.figures, connections=self.count, kind=self.kind)

    def _open(self, i: int) -> None:
        sock = socket.socket()
        if self.kind == "slow_readers":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", self.server.port))
        except OSError:
            sock.close()
            self.figures["connect_errors"] += 1
            self._conns[i] = None
            return
        self.figures["opened"] += 1
        conn = {"sock": sock, "state": "open", "sent": 0, "head": b"", "due": time.monotonic() + 1}
        if self.kind == "idle" and i % 2 == 0 or self.kind == "slow_readers":
            try:
                sock.sendall(KEEP_ALIVE_REQUEST if self.kind == "idle" else self.predict)
            except OSError:
                sock.close()
                self.figures["closed_by_server"] += 1
                self._conns[i] = None
                return
            conn["state"] = "answering" if self.kind == "slow_readers" else "open"
        sock.setblocking(False)
        self._conns[i] = conn

    def _tick(self, i: int, now: float) -> None:
        conn = self._conns[i]
        if conn is None:
            return self._open(i)
        sock = conn["sock"]
        due = now >= conn["due"]  # one byte a second, sent or read
        if due:
            conn["due"] = now + 1
        try:
            if self.kind == "slow_headers":
                if due and conn["sent"] < len(SLOW_HEAD):
                    sock.send(SLOW_HEAD[conn["sent"]:conn["sent"] + 1])
                    conn["sent"] += 1
                data = sock.recv(65536)  # anything at all (an error answer, or the end) means the server gave up
            elif self.kind == "idle":
                data = sock.recv(65536)  # the keep-alive answer, then nothing until the server closes
                if data:
                    self.figures["bytes_read"] += len(data)
                    return
            elif conn["state"] == "answering":  # a slow reader waits for its status line, read at once
                data = sock.recv(12 - len(conn["head"]))
                conn["head"] += data
                if data and len(conn["head"]) < 12:
                    return
                if data and conn["head"].startswith(b"HTTP/1.1 503"):
                    self.figures["busy_503"] += 1
                    sock.close()
                    self._conns[i] = None
                    return
                if data:
                    self.figures["streams_started"] += 1
                    conn["state"] = "reading"
                    return
            else:
                if not due:
                    return
                data = sock.recv(1)
                if data:
                    self.figures["bytes_read"] += 1
                    return
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self.figures["closed_by_server"] += 1
        sock.close()
        self._open(i)

    def _run(self) -> None:
        for i in range(self.count):
            self._open(i)
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for i in range(self.count):
                self._tick(i, now)


def probe(server: Server, seconds: float, good: dict = GOOD) -> dict:
    """For `seconds`: a good /predict at a time, each on a new connection, and meanwhile /healthz every 0.2 s.

    Each good request's latency beyond its own decoding (the engine's total_seconds) and each /healthz latency;
    a request that fails or times out counts against the server."""
    end = time.monotonic() + seconds
    health: list[float] = []
    extra: list[float] = []
    failures: list[str] = []

    def healthz():
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                status = requests.get(server.url + "/healthz", timeout=5).status_code
            except requests.RequestException as error:
                status = repr(error)
            health.append(time.perf_counter() - start)
            if status != 200:
                failures.append(f"/healthz: {status}")
            time.sleep(0.2)

    checker = threading.Thread(target=healthz, daemon=True)
    checker.start()
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            response = requests.post(server.url + "/predict", json=good, timeout=15)
        except requests.RequestException as error:
            failures.append(f"/predict: {error!r}")
            extra.append(time.perf_counter() - start)
            continue
        took = time.perf_counter() - start
        if response.status_code != 200:
            failures.append(f"/predict: {response.status_code} {response.text[:200]}")
            extra.append(took)
            continue
        extra.append(took - response.json()["stats"]["total_seconds"])
        time.sleep(0.2)
    checker.join(10)
    return {"good_requests": len(extra), "good_extra_max_s": round(max(extra), 3) if extra else None,
            "healthz_requests": len(health), "healthz_max_s": round(max(health), 3) if health else None,
            "failures": len(failures), "samples": failures[:5]}


def run_slow_clients(server: Server, kind: str, count: int, seconds: float = 10.0, setup_timeout: float = 60.0,
                     **options) -> dict:
    """`count` clients of `kind` (see Clients) against the server, and meanwhile `probe` for `seconds`."""
    clients = Clients(server, count, kind, **options).start()
    try:
        started = time.monotonic()
        opened = clients.wait_until_open(setup_timeout)
        setup = time.monotonic() - started
        figures = probe(server, seconds)
        held = clients.established()
    finally:
        totals = clients.stop()
    figures.update(totals, all_open=opened, setup_seconds=round(setup, 1), open_at_end=held)
    figures["ok"] = (opened and figures["failures"] == 0 and figures["good_extra_max_s"] is not None
                     and figures["good_extra_max_s"] <= 2.0 and figures["healthz_max_s"] <= 1.0)
    return figures


# --- faults ----------------------------------------------------------------------------------------------------

def _engine_free_and_serving(server: Server) -> bool:
    response = server.post({"prompt": "after the fault", "max_new_tokens": 4, "temperature": 0})
    return response.status_code == 200 and server.metric("specdec_engine_busy") == 0


def _clean_error(response: requests.Response, request_id: str) -> bool:
    """A 500 JSON error naming the request id, with no traceback or server path in it."""
    text = response.text
    try:
        error = response.json()["error"]
    except (ValueError, KeyError):
        return False
    return (response.status_code == 500 and error["type"] == "internal_error" and request_id in error["message"]
            and response.headers.get("X-Request-ID") == request_id
            and not any(leak in text for leak in ("Traceback", 'File "', ".py", str(ROOT))))


def fault_disconnect(server: Server, max_new_tokens: int = 200) -> dict:
    """A streaming client that disconnects after the first event: decoding stops and the engine is freed."""
    served = server.metric("specdec_requests_total", PREDICT)
    generated = server.metric("specdec_generated_tokens_total")
    # greedy: the tiny pair decodes all 200 tokens of this prompt (a random seed may hit EOS first)
    response = server.post({"prompt": "a client that leaves", "max_new_tokens": max_new_tokens, "stream": True,
                            "gamma": 2, "temperature": 0}, stream=True, headers={"X-Request-ID": "fault-disconnect"})
    if response.status_code != 200:
        return {"ok": False, "generated_tokens": 0, "of": max_new_tokens, "released_after_ms": None,
                "error": response.text[:300]}
    first = next(line for line in response.iter_lines() if line)
    left = time.perf_counter()
    response.close()
    deadline = time.monotonic() + 30
    while server.metric("specdec_requests_total", PREDICT) == served and time.monotonic() < deadline:
        time.sleep(0.02)
    released = time.perf_counter() - left
    tokens = server.metric("specdec_generated_tokens_total") - generated
    cancelled = any("request_id=fault-disconnect " in line and "finish_reason=cancelled" in line
                    for line in server.log().splitlines())
    ok = first.startswith(b"data: ") and tokens < max_new_tokens and cancelled and _engine_free_and_serving(server)
    return {"ok": ok, "generated_tokens": int(tokens), "of": max_new_tokens,
            "released_after_ms": round(released * 1000)}


def fault_exception(server: Server, marker: str = RAISE_MARKER, request_id: str = "fault-exception") -> dict:
    """An exception inside generation: 500 JSON with the request id, the server keeps serving."""
    response = server.post({"prompt": f"please {marker} now", "max_new_tokens": 8},
                           headers={"X-Request-ID": request_id})
    logged = any(f"request_id={request_id}" in line and "status=500" in line for line in server.log().splitlines())
    ok = _clean_error(response, request_id) and logged and _engine_free_and_serving(server)
    if marker == OOM_MARKER:
        ok = ok and "out of memory" in response.json()["error"]["message"]
    return {"ok": ok, "status": response.status_code, "message": response.json().get("error", {}).get("message")}


def fault_exception_in_stream(server: Server) -> dict:
    """An exception once a stream has started: the status line is sent, so it arrives as a last error event."""
    response = server.post({"prompt": f"please {RAISE_MARKER} now", "stream": True},
                           headers={"X-Request-ID": "fault-stream"})
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines() if line]
    ok = (response.status_code == 200 and events and events[-1].get("error", {}).get("type") == "internal_error"
          and "fault-stream" in events[-1]["error"]["message"] and _engine_free_and_serving(server))
    return {"ok": bool(ok), "events": len(events)}


def _raw_post(server: Server, path: str, body: dict, request_id: str, receive_buffer: int | None = None) -> socket.socket:
    """A connection with one JSON POST sent on it, its answer not read (a receive buffer this small, if given)."""
    data = json.dumps(body).encode()
    connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    connection.connect(("127.0.0.1", server.port))
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-ID: "
                       f"{request_id}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


def fault_hang_up(server: Server, max_new_tokens: int = 200) -> dict:
    """A client that hangs up before its JSON answer (an SDK's timeout): decoding stops within a round or so."""
    generated = server.metric("specdec_generated_tokens_total")
    connection = _raw_post(server, "/predict", {"prompt": "a client that hangs up", "max_new_tokens": max_new_tokens,
                                                "gamma": 2, "temperature": 0, "ignore_eos": True}, "fault-hang-up")
    time.sleep(0.2)
    left = time.perf_counter()
    connection.close()
    deadline = time.monotonic() + 30
    while "request_id=fault-hang-up " not in server.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    released = time.perf_counter() - left
    tokens = server.metric("specdec_generated_tokens_total") - generated
    cancelled = any("request_id=fault-hang-up " in line and "finish_reason=cancelled" in line
                    for line in server.log().splitlines())
    ok = tokens < max_new_tokens and cancelled and _engine_free_and_serving(server)
    return {"ok": ok, "generated_tokens": int(tokens), "of": max_new_tokens, "released_after_ms": round(released * 1000)}


def fault_unread_stream(server: Server, choices: int = 4, max_tokens: int = 120) -> dict:
    """A client that never reads a large stream (several choices with logprobs, a 2 KB receive buffer): the engine
    is free once the choices are decoded, and another request is answered meanwhile."""
    connection = _raw_post(server, "/v1/completions", {
        "model": "target", "prompt": "a client that never reads", "max_tokens": max_tokens, "n": choices,
        "logprobs": 20, "ignore_eos": True, "temperature": 0, "stream": True}, "fault-unread", receive_buffer=2048)
    try:
        started = time.perf_counter()
        time.sleep(0.2)
        deadline = time.monotonic() + 60
        while server.metric("specdec_engine_busy") != 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        freed = time.perf_counter() - started
        asked = time.perf_counter()
        other = server.post({"prompt": "another client", "max_new_tokens": 4, "temperature": 0})
        answered = time.perf_counter() - asked
        unfinished = "request_id=fault-unread " not in server.log()  # its events are still unsent
    finally:
        connection.close()
    ok = other.status_code == 200 and freed < 60 and answered < 10
    return {"ok": ok, "engine_free_after_ms": round(freed * 1000), "other_answered_ms": round(answered * 1000),
            "unread_still_open": unfinished, "tokens": choices * max_tokens}


def run_faults(server: Server) -> dict:
    return {"disconnect": fault_disconnect(server), "hang_up": fault_hang_up(server),
            "unread_stream": fault_unread_stream(server), "exception": fault_exception(server),
            "out_of_memory": fault_exception(server, OOM_MARKER, "fault-oom"),
            "exception_in_stream": fault_exception_in_stream(server)}


def fault_time_limit(server: Server, request_timeout: float, max_new_tokens: int = 200) -> dict:
    """A request that would decode for longer than request_timeout ends at the budget with "time_limit"."""
    start = time.perf_counter()
    answer = server.post({"prompt": "a long one", "max_new_tokens": max_new_tokens, "gamma": 2,
                          "temperature": 0}).json()  # greedy: no end-of-sequence token before 200
    took = time.perf_counter() - start
    ok = (answer.get("finish_reason") == "time_limit" and answer["usage"]["completion_tokens"] < max_new_tokens
          and took < request_timeout + 2 and _engine_free_and_serving(server))
    return {"ok": ok, "seconds": round(took, 2), "budget_seconds": request_timeout,
            "completion_tokens": answer.get("usage", {}).get("completion_tokens")}


def fault_sigterm(server: Server, max_new_tokens: int = 30) -> dict:
    """SIGTERM while a request decodes: the request finishes whole, then the worker and gunicorn exit 0.

    The request must take well under the server's request_timeout, or it would end with "time_limit".
    """
    events = []
    signalled = None
    with server.post({"prompt": "finish me", "max_new_tokens": max_new_tokens, "gamma": 2, "stream": True,
                      "temperature": 0},
                     stream=True, headers={"X-Request-ID": "fault-sigterm"}) as response:
        for line in response.iter_lines(decode_unicode=True):
            if line:
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 1:
                    server.process.send_signal(signal.SIGTERM)
                    signalled = time.perf_counter()
    finished = time.perf_counter() - signalled
    try:
        code = server.process.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    final = events[-1] if events else {}
    log = server.log()
    served = log.find("request_id=fault-sigterm POST /predict status=200")
    in_flight = 0 <= log.find("Handling signal: term") < served
    ok = (final.get("finish_reason") == "length" and final["usage"]["completion_tokens"] == max_new_tokens
          and len(events) > 2 and in_flight and code == 0)
    return {"ok": ok, "finished_after_signal_ms": round(finished * 1000), "events": len(events), "exit_code": code,
            "finish_reason": final.get("finish_reason"), "signal_before_answer": in_flight}


# --- soak ------------------------------------------------------------------------------------------------------

SOAK_MIX = [  # (request body, expected status): plain, streamed, with details and stop strings, and bad ones
    ({"prompt": "soak plain", "max_new_tokens": 16}, 200),
    ({"prompt": "soak stream", "max_new_tokens": 16, "stream": True}, 200),
    ({"prompt": "soak details", "max_new_tokens": 16, "details": True, "stop": ["e", "\n"]}, 200),
    ({"prompt": "soak plain", "max_new_tokens": 16, "method": "target"}, 200),
    ({"prompt": "   "}, 422),
    ({"prompt": "soak", "max_new_tokens": 0}, 422),
    ({"prompt": "soak plain", "max_new_tokens": 16, "gamma": None, "temperature": 0}, 200),
    ({"prompt": "soak chat", "max_new_tokens": 16, "chat": True}, 200),
    ({"prompt": "soak plain", "max_new_tokens": 16, "seed": 7}, 200),
    ({"prompt": "soak stream", "max_new_tokens": 16, "stream": True, "details": True}, 200),
]


def run_soak(server: Server, requests_total: int = 1000, warmup: int = 100, every: int = 100) -> dict:
    """Sequential requests of mixed kinds; the worker's memory, descriptors and threads after warm-up and at the end."""
    session = requests.Session()
    unexpected: list[str] = []
    series = []
    warm = None
    start = time.monotonic()
    for n in range(1, requests_total + 1):
        body, status = SOAK_MIX[n % len(SOAK_MIX)]
        response = server.post(body, session=session)
        response.content  # noqa: B018 - read the whole answer (a stream to its end)
        if response.status_code != status:
            unexpected.append(f"#{n} {body}: {response.status_code} {response.text[:200]}")
        if n == warmup:
            warm = server.worker_usage()
        if n % every == 0:
            series.append({"requests": n, **server.worker_usage()})
    elapsed = time.monotonic() - start
    end = server.worker_usage()
    warm = warm or series[0]
    return {"requests": requests_total, "warmup": warmup, "seconds": round(elapsed, 1), "unexpected": len(unexpected),
            "rss_warm_mib": round(warm["rss_kib"] / 1024, 1), "rss_end_mib": round(end["rss_kib"] / 1024, 1),
            "rss_growth_pct": round(100 * (end["rss_kib"] - warm["rss_kib"]) / warm["rss_kib"], 2),
            "fds_warm": warm["fds"], "fds_end": end["fds"], "threads_warm": warm["threads"],
            "threads_end": end["threads"], "series": series, "samples": unexpected[:10]}


# --- the report ------------------------------------------------------------------------------------------------

def checks(figures: dict) -> list[tuple[str, str, str, bool]]:
    """(what, measured, required, ok) rows of the table."""
    rows = []
    load = figures.get("load")
    if load:
        rows += [
            (f"load: {load['clients']} clients for {load['seconds']} s, requests", str(load["requests"]), "", True),
            ("load: 200 answers", f"{load['ok_200']} ({load['served_per_second']}/s)", "> 0", load["ok_200"] > 0),
            ("load: 503 answers (queue full)", str(load["busy_503"]), "each with Retry-After",
             load["busy_503_without_retry_after"] == 0),
            ("load: other statuses and connection errors", str(load["other_status"] + load["connection_errors"]),
             "0", load["other_status"] + load["connection_errors"] == 0),
            ("load: mixed-up answers", str(load["mixed_up"]), "0", load["mixed_up"] == 0),
            ("load: latency of 200s, p50 / p95", f"{load['p50_ms']} / {load['p95_ms']} ms", "", True),
        ]
    faults = figures.get("faults", {})
    if "disconnect" in faults:
        f = faults["disconnect"]
        rows.append(("fault: client disconnects mid-stream",
                     f"stopped after {f['generated_tokens']} of {f['of']} tokens, engine free after "
                     f"{f['released_after_ms']} ms", "stops, lock released, next served", f["ok"]))
    if "hang_up" in faults:
        f = faults["hang_up"]
        rows.append(("fault: client hangs up before its JSON answer",
                     f"stopped after {f['generated_tokens']} of {f['of']} tokens, logged {f['released_after_ms']} ms "
                     "after", "stops, lock released, next served", f["ok"]))
    if "unread_stream" in faults:
        f = faults["unread_stream"]
        rows.append(("fault: client never reads a stream of " + str(f["tokens"]) + " tokens with logprobs",
                     f"engine free after {f['engine_free_after_ms']} ms, another request answered in "
                     f"{f['other_answered_ms']} ms" + (" while the stream was unread" if f["unread_still_open"]
                                                       else ""), "engine freed once decoded, others served",
                     f["ok"]))
    for key, what in (("exception", "exception inside generation"), ("out_of_memory", "out of memory in forward"),
                      ("exception_in_stream", "exception after a stream started")):
        if key in faults:
            f = faults[key]
            measured = f"status {f['status']}" if "status" in f else f"error event after {f['events'] - 1} events"
            rows.append((f"fault: {what}", measured, "500 JSON with request id, next served", f["ok"]))
    if "time_limit" in faults:
        f = faults["time_limit"]
        rows.append(("fault: request over its time budget",
                     f"ended after {f['seconds']} s (budget {f['budget_seconds']} s), {f['completion_tokens']} tokens",
                     'finish_reason "time_limit"', f["ok"]))
    if "sigterm" in faults:
        f = faults["sigterm"]
        rows.append(("fault: SIGTERM during a request",
                     f"request finished {f['finished_after_signal_ms']} ms after the signal, exit {f['exit_code']}",
                     "request completes, then exit 0", f["ok"]))
    for kind, what in (("slow_headers", "connections trickling request heads, a byte a second"),
                       ("idle", "idle connections (half kept alive after a request, half silent)"),
                       ("slow_readers", "clients reading a stream a byte a second")):
        f = figures.get("slow_clients", {}).get(kind)
        if f:
            rows.append((f"slow clients: {f['connections']} {what}",
                         f"good requests {f['good_extra_max_s']} s beyond decoding (max of {f['good_requests']}), "
                         f"/healthz {f['healthz_max_s']} s (max of {f['healthz_requests']}), {f['failures']} failed; "
                         f"{f['open_at_end']} held open, {f['closed_by_server']} dropped by the server",
                         "<= 2 s, <= 1 s, 0 failed, all held", f["ok"]))
    soak = figures.get("soak")
    if soak:
        rows += [
            (f"soak: {soak['requests']} sequential requests", f"{soak['seconds']} s, {soak['unexpected']} unexpected",
             "0 unexpected", soak["unexpected"] == 0),
            (f"soak: worker RSS after {soak['warmup']} -> at the end",
             f"{soak['rss_warm_mib']} -> {soak['rss_end_mib']} MiB ({soak['rss_growth_pct']:+.2f} %)", "< +5 %",
             soak["rss_growth_pct"] < 5),
            ("soak: open file descriptors", f"{soak['fds_warm']} -> {soak['fds_end']}", "no growth",
             soak["fds_end"] <= soak["fds_warm"]),
            ("soak: threads", f"{soak['threads_warm']} -> {soak['threads_end']}", "no growth",
             soak["threads_end"] <= soak["threads_warm"]),
        ]
    return rows


def table(rows) -> str:
    lines = ["| check | measured | required | ok |", "|---|---|---|---|"]
    lines += [f"| {what} | {measured} | {required} | {'yes' if ok else '**NO**'} |"
              for what, measured, required, ok in rows]
    return "\n".join(lines)


# the main server's limits (the time budget and SIGTERM run on a second server)
LIMITS = {"queue_size": 4, "queue_timeout": 30, "retry_after": 1, "header_timeout": 10.0, "body_timeout": 30.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the load phase")
    parser.add_argument("--soak", type=int, default=1000, help="sequential requests of the soak (0: none)")
    parser.add_argument("--delay", type=float, default=0.002, help="seconds slept per target forward")
    parser.add_argument("--slow-headers", type=int, default=256, help="connections trickling request heads (0: none)")
    parser.add_argument("--idle", type=int, default=256, help="idle connections (0: none)")
    parser.add_argument("--slow-readers", type=int, default=64, help="clients reading a stream a byte a second")
    parser.add_argument("--slow-seconds", type=float, default=10.0, help="probing time under each kind")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stress.json")
    args = parser.parse_args(argv)

    started = time.time()
    figures: dict = {"command": " ".join(["python -m bench.stress", *(argv if argv is not None else sys.argv[1:])]),
                     "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                     "settings": {**LIMITS, "forward_delay_s": args.delay}, "faults": {}}
    with tempfile.TemporaryDirectory(prefix="specdec-stress-") as tmp:
        folder = Path(tmp)
        pair = save_pair(folder / "pair")
        server = start_server(folder, pair, "main", delay=args.delay, log_level="info", **LIMITS)
        try:
            print(f"load: {args.clients} clients for {args.seconds:g} s ...", file=sys.stderr)
            figures["load"] = run_load(server, args.clients, args.seconds)
            print("faults ...", file=sys.stderr)
            figures["faults"].update(run_faults(server))
            figures["slow_clients"] = {}
            for kind, count in (("slow_headers", args.slow_headers), ("idle", args.idle),
                                ("slow_readers", args.slow_readers)):
                if count:
                    print(f"slow clients: {count} {kind} for {args.slow_seconds:g} s ...", file=sys.stderr)
                    figures["slow_clients"][kind] = run_slow_clients(server, kind, count, args.slow_seconds)
            if args.soak:
                print(f"soak: {args.soak} requests ...", file=sys.stderr)
                figures["soak"] = run_soak(server, args.soak, warmup=min(100, args.soak // 5))
        finally:
            server.stop()
        print("time budget and SIGTERM ...", file=sys.stderr)
        budget = 1.5
        server = start_server(folder, pair, "sigterm", delay=0.02, request_timeout=budget)
        try:
            figures["faults"]["time_limit"] = fault_time_limit(server, budget)
            figures["faults"]["sigterm"] = fault_sigterm(server)
        finally:
            server.stop()
    figures["total_seconds"] = round(time.time() - started, 1)
    rows = checks(figures)
    figures["ok"] = all(ok for *_, ok in rows)
    print(table(rows))
    print(f"\n{'all checks passed' if figures['ok'] else 'SOME CHECKS FAILED'} in {figures['total_seconds']} s; "
          f"figures in {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
