"""The service under a real gunicorn (`python serving.py`) on 127.0.0.1 with the saved tiny pair: the README's
curl request, SSE read by a real client, 8 concurrent clients against a queue of 2, metrics, client disconnect,
SIGTERM during a request and draining after it, API keys, and start-up refusing a bad configuration."""

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from bench.stress import DELAY_ENV, LOAD_BUSY_ENV, ROOT, Server

pytestmark = pytest.mark.xdist_group("gunicorn")

PROMPT = "Who is the president of the USA"


def start(tmp_path_factory, tiny_pair_dirs, name, **settings) -> Server:
    """The tiny pair with the target slowed by 5 ms per forward, so a request is reliably still decoding when a
    test overloads the server, disconnects or sends SIGTERM."""
    draft_dir, target_dir = tiny_pair_dirs
    server = Server(tmp_path_factory.mktemp(name) / "server.log", env={DELAY_ENV: "0.005"}, draft_model=draft_dir,
                    target_model=target_dir, device="cpu", loader="bench.stress:faulty_pair", **settings)
    server.wait_ready(timeout=90)
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_pair_dirs):
    server = start(tmp_path_factory, tiny_pair_dirs, "server", queue_size=2, queue_timeout=30)
    yield server
    server.stop()


def post(server, body, **kwargs):
    return requests.post(server.url + "/predict", json=body, timeout=60, **kwargs)


def test_health_and_readiness(server, tiny_pair_dirs):
    assert requests.get(server.url + "/healthz", timeout=5).json() == {"status": "ok"}
    ready = requests.get(server.url + "/readyz", timeout=5).json()
    assert ready["models"] == {"draft": "draft", "target": "target"} and ready["device"] == "cpu"


def test_the_readme_curl_request(server):
    command = ["-X", "POST", "-H", "Content-Type: application/json", "-d",
               '{"prompt": "Who is the president of the USA"}', server.url + "/predict"]
    if shutil.which("curl"):
        done = subprocess.run(["curl", "-s", *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
    else:  # the same request, byte for byte, without curl
        body = requests.post(command[-1], data=command[5], headers={"Content-Type": "application/json"},
                             timeout=60).json()
    assert isinstance(body["text"], str) and body["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == len(PROMPT) and 1 <= body["usage"]["completion_tokens"] <= 64
    assert 0 <= body["stats"]["acceptance_rate"] <= 1


def test_errors_are_json_under_gunicorn(server):
    response = requests.post(server.url + "/predict", data="prompt=hi", timeout=10,
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 415 and response.json()["error"]["type"] == "unsupported_media_type"
    response = requests.get(server.url + "/predict", timeout=10)
    assert response.status_code == 405 and response.headers["Content-Type"] == "application/json"
    response = post(server, {"prompt": "a" * (1 << 20)})
    assert response.status_code == 413 and response.json()["error"]["type"] == "body_too_large"
    chunked = (b'{"prompt": "' if i == 0 else b"a" * 65536 for i in range(20))  # no Content-Length
    response = requests.post(server.url + "/predict", data=chunked, timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "1048576" in response.json()["error"]["message"]


def test_sse_stream_read_by_a_real_client(server):
    body = {"prompt": PROMPT, "max_new_tokens": 40, "seed": 5, "details": True, "cache_prompt": False}  # to the bit
    events = []
    with post(server, {**body, "stream": True}, stream=True) as response:
        assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        for line in response.iter_lines(decode_unicode=True):
            if line:
                assert line.startswith("data: ")
                events.append(json.loads(line.removeprefix("data: ")))
    final = events[-1]
    assert len(events) - 1 == final["stats"]["rounds"] >= 2
    plain = post(server, body).json()
    assert "".join(e["text"] for e in events) == plain["text"]
    assert [t for e in events[:-1] for t in e["tokens"]] == plain["tokens"]
    assert final["usage"] == plain["usage"] and final["finish_reason"] == plain["finish_reason"]


def test_eight_concurrent_clients_with_a_queue_of_two(server):
    prompts = [f"client {i}: " + "ab" * i for i in range(8)]  # distinct lengths identify the prompt
    barrier = threading.Barrier(8)
    results = [None] * 8

    def client(i):
        barrier.wait()
        try:
            # cache_prompt false: answers compared to the bit (the prompt cache reuses keys of other widths)
            response = post(server, {"prompt": prompts[i], "seed": i, "max_new_tokens": 120, "cache_prompt": False},
                            headers={"X-Request-ID": f"concurrent-{i}"})
            results[i] = (response.status_code, response.headers, response.json())
        except Exception as error:  # noqa: BLE001 - a lost request must fail the test, not the thread
            results[i] = error

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(isinstance(r, tuple) for r in results), results
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    for i, (status, headers, body) in enumerate(results):
        assert headers["X-Request-ID"] == f"concurrent-{i}"
        if status == 503:
            assert body["error"]["type"] == "overloaded" and int(headers["Retry-After"]) >= 1
        else:  # the answer belongs to this client's prompt: the same as asking alone
            assert body["usage"]["prompt_tokens"] == len(prompts[i])
            alone = post(server, {"prompt": prompts[i], "seed": i, "max_new_tokens": 120, "cache_prompt": False}).json()
            assert body["text"] == alone["text"] and body["usage"] == alone["usage"]
    log = server.log()
    for i in range(8):  # answered exactly once
        assert len(re.findall(rf"request_id=concurrent-{i} POST /predict status={statuses[i]} ", log)) == 1


def test_metrics_counters_move(server):
    served = '{endpoint="/predict",status="200"}'
    before = {name: server.metric(name) for name in ("specdec_generated_tokens_total",
                                                     "specdec_draft_tokens_proposed_total",
                                                     "specdec_draft_tokens_accepted_total")}
    requests_before = server.metric("specdec_requests_total", served)
    stats = post(server, {"prompt": PROMPT, "max_new_tokens": 30}).json()["stats"]
    assert server.metric("specdec_requests_total", served) == requests_before + 1
    # a random seed may hit EOS before 30 tokens: the counter moves by what was generated
    assert 0 < stats["new_tokens"] <= 30
    assert server.metric("specdec_generated_tokens_total") == (before["specdec_generated_tokens_total"]
                                                               + stats["new_tokens"])
    assert server.metric("specdec_draft_tokens_proposed_total") == (before["specdec_draft_tokens_proposed_total"]
                                                                    + stats["proposed"])
    assert server.metric("specdec_draft_tokens_accepted_total") == (before["specdec_draft_tokens_accepted_total"]
                                                                    + stats["accepted"])
    assert server.metric("specdec_request_duration_seconds_count", '{endpoint="/predict"}') >= 1
    assert server.metric("specdec_queue_depth") == 0 and server.metric("specdec_ready") == 1


def test_a_client_that_disconnects_stops_the_generation(server):
    served = '{endpoint="/predict",status="200"}'
    requests_before = server.metric("specdec_requests_total", served)
    generated_before = server.metric("specdec_generated_tokens_total")
    # greedy: this prompt decodes all 200 tokens (a random seed may hit EOS before the disconnect is noticed)
    response = post(server, {"prompt": PROMPT, "max_new_tokens": 200, "temperature": 0, "stream": True}, stream=True,
                    headers={"X-Request-ID": "disconnects-1"})
    lines = response.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")
    response.close()  # drops the connection mid-stream
    deadline = time.monotonic() + 20
    while server.metric("specdec_requests_total", served) == requests_before:  # recorded when the server notices
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert server.metric("specdec_generated_tokens_total") - generated_before < 200
    assert re.search(r"request_id=disconnects-1 .*finish_reason=cancelled", server.log())
    assert post(server, {"prompt": PROMPT, "max_new_tokens": 5}).status_code == 200  # the engine is free again


def _send_raw(server, path: str, body: dict, request_id: str) -> socket.socket:
    """A connection with one JSON POST sent on it, its answer not read."""
    data = json.dumps(body).encode()
    connection = socket.create_connection((server.url.split("//")[1].split(":")[0], int(server.url.rsplit(":", 1)[1])))
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"X-Request-ID: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


@pytest.mark.parametrize("path, body", [
    ("/predict", {"prompt": PROMPT, "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "target", "messages": [{"role": "user", "content": PROMPT}], "n": 2,
                              "max_tokens": 200, "temperature": 0, "ignore_eos": True}),
])
def test_a_client_that_hangs_up_on_a_json_answer_stops_its_generation(server, path, body):
    """A JSON answer writes nothing until the end, so no failed write tells the server the client has gone: it
    watches the socket (concurrency.watch_disconnect). Without it, each of an SDK's timed-out retries decoded to
    the end while every other client waited. 200 tokens take over a second here (5 ms a target forward)."""
    generated_before = server.metric("specdec_generated_tokens_total")
    request_id = f"hangs-up-{path.strip('/').replace('/', '-')}"
    connection = _send_raw(server, path, body, request_id)
    time.sleep(0.3)  # decoding
    connection.close()
    deadline = time.monotonic() + 20
    while not re.search(rf"request_id={request_id} ", server.log()):  # the log line: when the request ends
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert re.search(rf"request_id={request_id} .*finish_reason=cancelled", server.log()), server.log()
    assert server.metric("specdec_generated_tokens_total") - generated_before < 200  # of 200 (400 with n=2)
    assert post(server, {"prompt": PROMPT, "max_new_tokens": 5}).status_code == 200  # the engine is free again


@pytest.mark.parametrize("path, body", [
    ("/predict", {"prompt": PROMPT, "max_new_tokens": 50, "stream": True}),
    ("/v1/completions", {"model": "target", "prompt": [PROMPT, PROMPT], "max_tokens": 50}),  # one turn, two prompts
])
def test_a_client_that_leaves_while_its_request_waits_in_line_is_not_decoded_for(server, path, body):
    """A request whose client hung up while it waited for the engine took its turn anyway: a prefill and a round
    before the hang-up was noticed (an audit; seconds of prefill on a large pair, for each of a timed-out client's
    retries). Now it is dropped when its turn comes: 499 client_gone, logged as cancelled, no token decoded."""
    request_id = f"left-in-line-{path.strip('/').replace('/', '-')}"
    first = _send_raw(server, "/predict", {"prompt": PROMPT, "max_new_tokens": 200, "temperature": 0,
                                           "ignore_eos": True}, f"{request_id}-first")
    time.sleep(0.3)  # the first decodes (200 tokens take over a second here)
    generated_before = server.metric("specdec_generated_tokens_total")
    _send_raw(server, path, body, request_id).close()  # queued, then gone
    with first:
        first.settimeout(30)
        while first.recv(65536) and not re.search(rf"request_id={request_id}-first ", server.log()):
            pass
    deadline = time.monotonic() + 20
    while not re.search(rf"request_id={request_id} ", server.log()):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    line = re.search(rf"request_id={request_id} .*", server.log()).group()
    assert "status=499" in line and "completion_tokens=-" in line and "finish_reason=cancelled" in line, line
    assert "error=client_gone" in line, line
    assert server.metric("specdec_generated_tokens_total") - generated_before <= 200  # the first's alone
    assert post(server, {"prompt": PROMPT, "max_new_tokens": 5}).status_code == 200


def test_a_client_that_leaves_a_stream_of_several_choices_stops_them_all(server):
    """Under gevent each choice of an n > 1 stream is decoded as soon as the one before it is (in a greenlet woken
    by the engine thread): a client gone stops the choice being decoded and starts no other."""
    generated_before = server.metric("specdec_generated_tokens_total")
    response = requests.post(server.url + "/v1/completions", stream=True, timeout=60,
                             headers={"X-Request-ID": "leaves-choices"},
                             json={"model": "target", "prompt": PROMPT, "max_tokens": 200, "n": 3, "temperature": 0,
                                   "ignore_eos": True, "stream": True})
    lines = response.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")
    response.close()
    deadline = time.monotonic() + 20
    while not re.search(r"request_id=leaves-choices ", server.log()):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert server.metric("specdec_generated_tokens_total") - generated_before < 200  # of 600
    assert post(server, {"prompt": PROMPT, "max_new_tokens": 5}).status_code == 200  # the engine is free again
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 20, "n": 3, "seed": 1, "ignore_eos": True}
    whole = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()
    streamed = requests.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
    texts = {}
    for block in streamed.strip().split("\n\n")[:-1]:
        for choice in json.loads(block.removeprefix("data: "))["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}  # decoded ahead under gevent, in order


def test_a_kept_alive_clients_next_request_is_not_a_hang_up(server):
    """Two requests pipelined on one connection: the second, waiting in the socket while the first decodes, is
    not taken for the client leaving; both are answered whole."""
    body = {"prompt": PROMPT, "max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    connection = _send_raw(server, "/predict", body, "pipelined-1")
    data = json.dumps(body).encode()
    connection.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    reader = connection.makefile("rb")
    try:
        for _ in range(2):
            assert reader.readline().startswith(b"HTTP/1.1 200")
            length = None
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            answer = json.loads(reader.read(length))
            assert answer["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 60
    finally:
        reader.close()
        connection.close()
    assert not re.search(r"request_id=pipelined-1 .*finish_reason=cancelled", server.log())


def test_sigterm_lets_the_in_flight_request_finish(tmp_path_factory, tiny_pair_dirs):
    server = start(tmp_path_factory, tiny_pair_dirs, "sigterm")
    try:
        events = []
        with post(server, {"prompt": PROMPT, "max_new_tokens": 150, "gamma": 2, "stream": True},
                  stream=True) as response:
            for line in response.iter_lines(decode_unicode=True):
                if not line:
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 1:
                    server.process.send_signal(signal.SIGTERM)
        final = events[-1]
        assert final["finish_reason"] in ("length", "stop") and final["stats"]["rounds"] == len(events) - 1
        assert len(events) > 3  # decoding went on after the signal
        if final["finish_reason"] == "length":
            assert final["usage"]["completion_tokens"] == 150
        assert server.process.wait(30) == 0
        log = server.log()
        assert log.index("Handling signal: term") < log.index("POST /predict status=200")  # it was in flight
    finally:
        server.stop()


def test_sigterm_drains_new_requests_503_while_in_flight_and_queued_ones_finish(tmp_path_factory, tiny_pair_dirs):
    server = start(tmp_path_factory, tiny_pair_dirs, "drain", queue_size=2, retry_after=3)
    try:
        queued = {}

        def wait_in_line():
            response = post(server, {"prompt": "queued", "max_new_tokens": 10}, headers={"X-Request-ID": "queued-1"})
            queued.update(status=response.status_code, body=response.json())

        waiter = threading.Thread(target=wait_in_line)
        events, during = [], {}
        # greedy: this prompt decodes all 200 tokens, for a few seconds at 5 ms per target forward
        with post(server, {"prompt": PROMPT, "max_new_tokens": 200, "gamma": 2, "temperature": 0, "stream": True},
                  stream=True, headers={"X-Request-ID": "in-flight-1"}) as response:
            for line in response.iter_lines(decode_unicode=True):
                if not line:
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 1:
                    waiter.start()
                    deadline = time.monotonic() + 20
                    while server.metric("specdec_queue_depth") < 1:
                        assert time.monotonic() < deadline, server.log()
                        time.sleep(0.01)
                    server.process.send_signal(signal.SIGTERM)  # to the master, which passes it to the worker
                    # new connections, after the signal: still accepted, and told to go elsewhere
                    signalled = time.monotonic()
                    while (readyz := requests.get(server.url + "/readyz", timeout=5)).status_code == 200:
                        assert time.monotonic() - signalled < 1, "/readyz still 200 a second after SIGTERM"
                    during["readyz"] = readyz
                    during["predict"] = post(server, {"prompt": PROMPT}, headers={"X-Request-ID": "after-term-1"})
                    during["healthz"] = requests.get(server.url + "/healthz", timeout=5)
                    during["seconds"] = time.monotonic() - signalled
        waiter.join(60)
        for name in ("readyz", "predict"):
            answer = during[name]
            assert answer.status_code == 503 and answer.json()["error"]["type"] == "shutting_down", answer.text
            assert answer.headers["Retry-After"] == "3"
        assert during["healthz"].status_code == 200 and during["seconds"] < 2
        final = events[-1]
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 200  # whole
        assert queued["status"] == 200 and queued["body"]["usage"]["completion_tokens"] >= 1  # served in turn
        assert server.process.wait(60) == 0
        log = server.log()
        order = [log.index(marker) for marker in (
            "Handling signal: term", "draining: new requests are answered 503; waiting for 1 in flight and 1 queued",
            "request_id=after-term-1 POST /predict status=503", "request_id=in-flight-1 POST /predict status=200",
            "request_id=queued-1 POST /predict status=200", "drained in")]
        assert order == sorted(order), log[-3000:]
    finally:
        server.stop()


def test_sigterm_closes_idle_kept_alive_connections_instead_of_waiting_for_them(tmp_path_factory, tiny_pair_dirs):
    """The fifth audit: a client holding a kept-alive connection idle kept a draining worker up for header_timeout
    (20 s with 20, 31 s with 30). Draining, a request's head must come within DRAIN_HEADER_TIMEOUT: idle
    connections are closed quietly (no error in the log: a review found the first version's shutdown logging a
    traceback for each), and a request whose head completes in time is answered 503."""
    import http.client

    from specdec.serve.worker import DRAIN_HEADER_TIMEOUT

    server = start(tmp_path_factory, tiny_pair_dirs, "idle-drain", header_timeout=60)
    try:
        idle = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=30) for _ in range(3)]
        for connection in idle:
            connection.request("GET", "/healthz")
            response = connection.getresponse()
            assert response.status == 200 and response.read() and not response.will_close  # kept alive
        never = socket.create_connection(("127.0.0.1", server.port))  # connected, never a request
        partial = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        partial.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n")  # its head's end comes after the signal
        time.sleep(0.2)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        while "draining: new requests" not in server.log():  # the worker has it (its waits are shortened now)
            assert time.monotonic() - signalled < 20, server.log()[-3000:]
            time.sleep(0.02)
        time.sleep(DRAIN_HEADER_TIMEOUT / 4)
        partial.sendall(b"\r\n")
        assert partial.recv(4096).startswith(b"HTTP/1.1 503"), server.log()[-3000:]
        assert server.process.wait(20) == 0, server.log()[-3000:]
        assert time.monotonic() - signalled < DRAIN_HEADER_TIMEOUT + 5, server.log()[-3000:]  # not header_timeout
        assert never.recv(1) == b""  # closed by the server, no answer
        log = server.log()
        assert "Traceback" not in log and "Socket error" not in log, log[-3000:]
        for sock in (never, partial, *idle):
            sock.close()
    finally:
        server.stop()


def test_sigterm_while_the_models_load_or_right_after_stops_at_once(tmp_path, tiny_pair_dirs):
    """Threads that loading starts (transformers' thread pool) must not keep the worker from exiting."""
    draft_dir, target_dir = tiny_pair_dirs
    loading = Server(tmp_path / "loading.log", env={LOAD_BUSY_ENV: "60"}, draft_model=draft_dir,
                     target_model=target_dir, device="cpu", loader="bench.stress:busy_loading_pair")
    try:
        deadline = time.monotonic() + 90
        while "loading: computing for 60 s first" not in loading.log():
            assert time.monotonic() < deadline and loading.process.poll() is None, loading.log()[-3000:]
            time.sleep(0.1)
        loading.process.send_signal(signal.SIGTERM)
        assert loading.process.wait(20) == 0, loading.log()[-3000:]
    finally:
        loading.stop()
    # no request and no delay per forward: the production default, right after loading
    ready = Server(tmp_path / "ready.log", env={DELAY_ENV: "0"}, draft_model=draft_dir, target_model=target_dir,
                   device="cpu", loader="bench.stress:faulty_pair").wait_ready(timeout=90)
    try:
        ready.process.send_signal(signal.SIGTERM)
        assert ready.process.wait(20) == 0, ready.log()[-3000:]
    finally:
        ready.stop()


def test_api_keys_under_gunicorn_and_never_in_the_log(tmp_path_factory, tiny_pair_dirs):
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    key = "sk-live-5b0c1d8e7f6a4932"
    keys_file.write_text(f"# rotated monthly\n{key}\n")
    server = start(tmp_path_factory, tiny_pair_dirs, "keys", api_keys_file=keys_file)
    try:
        missing = post(server, {"prompt": PROMPT})
        assert missing.status_code == 401 and missing.headers["WWW-Authenticate"].startswith("Bearer")
        assert missing.json()["error"]["type"] == "unauthorized"
        wrong = post(server, {"prompt": PROMPT}, headers={"Authorization": f"Bearer {key[:-1]}x"})
        assert wrong.status_code == 401 and 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
        good = post(server, {"prompt": PROMPT, "max_new_tokens": 5}, headers={"Authorization": f"Bearer {key}"})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
        assert requests.get(server.url + "/metrics", timeout=5).status_code == 401
        log = server.log()
        assert "status=401" in log and "status=200" in log
        assert key not in log and key[:-1] not in log and "sk-live" not in log
    finally:
        server.stop()


def test_a_missing_keys_file_stops_start_up_with_one_message(tmp_path):
    server = Server(tmp_path / "no-keys.log", api_keys_file=tmp_path / "missing-keys")
    assert server.process.wait(60) != 0
    log = server.log()
    assert (f"specdec: invalid configuration: api_keys_file = '{tmp_path / 'missing-keys'}' "
            f"(from SPECDEC_API_KEYS_FILE): the API keys file {tmp_path / 'missing-keys'} does not exist") in log
    assert "Traceback" not in log


def test_invalid_configuration_stops_start_up_with_one_message(tmp_path):
    server = Server(tmp_path / "bad-config.log", queue_timeout="soon")
    assert server.process.wait(60) != 0
    log = server.log()
    assert "specdec: invalid configuration: queue_timeout = 'soon' (from SPECDEC_QUEUE_TIMEOUT)" in log
    assert "Traceback" not in log


def test_relative_paths_in_settings_are_read_from_where_the_service_was_started(tmp_path, tiny_pair_dirs):
    """The master checked the settings in the directory the service was started from, the worker used them in the
    repository's (gunicorn's --chdir): a relative SPECDEC_CONFIG was silently another file, and relative model
    folders and keys files failed in the worker (the third audit). Both now read them from where it started."""
    for name, source in zip(("draft", "target"), tiny_pair_dirs):
        shutil.copytree(source, tmp_path / "pair" / name)
    (tmp_path / "my.toml").write_text('method = "target"\nmax_new_tokens = 7\n')
    (tmp_path / "keys.txt").write_text("sk-relative-key\n")
    # a project's own serving.py where the service is started must not stand in for ours (a review): gunicorn
    # takes the factory from the installed package
    (tmp_path / "serving.py").write_text("raise SystemExit('a decoy serving.py was imported')\n")
    server = Server(tmp_path / "server.log", cwd=tmp_path, config="my.toml", draft_model="pair/draft",
                    target_model="pair/target", api_keys_file="keys.txt", device="cpu")
    try:
        server.wait_ready(timeout=90)
        assert requests.post(server.url + "/predict", json={"prompt": PROMPT}, timeout=60).status_code == 401
        answer = requests.post(server.url + "/predict", json={"prompt": PROMPT, "ignore_eos": True}, timeout=60,
                               headers={"Authorization": "Bearer sk-relative-key"}).json()
        assert (answer["stats"]["method"], answer["usage"]["completion_tokens"]) == ("target", 7)
    finally:
        server.stop()


def test_a_model_that_cannot_load_stops_the_server(tmp_path, tiny_pair_dirs):
    server = Server(tmp_path / "bad-model.log", draft_model=tiny_pair_dirs[0], target_model=tmp_path / "missing",
                    device="cpu")
    try:
        assert server.process.wait(90) == 4  # gunicorn: "App failed to load."
    finally:
        server.stop()
    assert "model loading failed: the target model" in server.log()


def test_the_worker_freezes_the_loaded_heap_before_it_serves(server):
    """A collection of the oldest generation walked the whole heap (the models, torch's modules: some 600,000
    objects with the tiny pair) and stopped the worker for about 0.3 s, engine thread and connections alike; the
    worker freezes what loading left (gc.freeze, as vLLM does) before the pair is served, so that one walks only
    what came after. Not in a test's own process (loader.ModelHost.freezes_heap)."""
    from specdec.serve.loader import ModelHost

    found = re.search(r"start-up: froze the loaded heap \(gc.freeze\) in [\d.]+ s \((\d+) objects; a full collection "
                      r"took ([\d.]+) ms before, ([\d.]+) ms after\)", server.log())
    assert found, server.log()[-3000:]
    frozen, before, after = int(found[1]), float(found[2]), float(found[3])
    assert frozen > 10_000 and after < before / 10
    assert server.log().index("froze the loaded heap") < server.log().index("models ready in")
    assert not ModelHost.freezes_heap  # this process (the test's) makes many apps: nothing is frozen here


def test_the_compiled_path_under_gunicorn(tmp_path, tiny_pair_dirs):
    """Compiling runs the C++ compiler from the engine thread, under gevent: both models compile before /readyz
    says 200, and greedy speculative answers equal target-only ones, JSON and SSE."""
    draft_dir, target_dir = tiny_pair_dirs
    server = Server(tmp_path / "server.log", draft_model=draft_dir, target_model=target_dir, device="cpu",
                    compile="true", draft_quantization="none")
    try:
        server.wait_ready(timeout=600)
        compiled = re.findall(r"start-up: compiled the (draft|target)'s forwards .*\(static cache of", server.log())
        assert sorted(compiled) == ["draft", "target"], server.log()[-3000:]
        body = {"prompt": PROMPT, "max_new_tokens": 32, "temperature": 0}
        target_only = post(server, {**body, "method": "target"}).json()["text"]
        assert post(server, {**body, "method": "google", "drafter": "hybrid"}).json()["text"] == target_only
        streamed = post(server, {**body, "method": "google", "stream": True}, stream=True)
        events = [json.loads(line.removeprefix(b"data: ")) for line in streamed.iter_lines() if line]
        assert "".join(event["text"] for event in events) == target_only
    finally:
        server.stop()


def test_the_servers_help_says_what_it_starts_and_where_its_settings_come_from():
    """`specdec-serve --help` printed gunicorn's help alone, its config default the wrong file (an audit)."""
    result = subprocess.run([sys.executable, str(ROOT / "serving.py"), "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: specdec-serve") and "SPECDEC_CONFIG" in result.stdout
    assert "config/gunicorn.conf.py" in result.stdout and "usage: gunicorn" in result.stdout  # its options after
