"""Hardening under a real gunicorn on 127.0.0.1 (the helpers of bench/stress.py, with smaller sizes than
`make stress`): the bad-request corpus over a socket, 16 concurrent clients, faults (disconnect, exception,
out of memory, an error after a stream started) and a short soak (no descriptor or thread growth)."""

import json
import re
import socket
from http import HTTPStatus
from urllib.parse import urlsplit

import pytest
import requests

from bench import stress
from tests.support.bad_requests import CORPUS, GOOD, check_error

pytestmark = pytest.mark.xdist_group("hardening-gunicorn")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_pair_dirs):
    server = stress.start_server(tmp_path_factory.mktemp("hardening"), tiny_pair_dirs, "server", delay=0.002,
                                 queue_size=4, queue_timeout=30, retry_after=1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def good_answer(server):
    return server.post(GOOD).json()["text"]


@pytest.mark.parametrize("bad", CORPUS, ids=lambda bad: bad.name)
def test_bad_request_over_a_socket(server, good_answer, bad):
    headers = {"Content-Type": bad.content_type} if bad.content_type else {}
    response = requests.request(bad.method, server.url + bad.path, data=bad.body, headers=headers, timeout=60)
    check_error(response.status_code, response.headers["Content-Type"], response.text, bad)
    assert server.post(GOOD).json()["text"] == good_answer


CHUNKED = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("head, status, kind", [
    (b"GARBAGE\r\n\r\n", 400, "bad_request"),
    (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400, "bad_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431, "bad_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431,
     "bad_request"),
    # read by the app: a malformed chunk was a 500 with a traceback in the log
    (CHUNKED + b"zz\r\nabc\r\n0\r\n\r\n", 400, "bad_request"),
    (CHUNKED + b"-1\r\nabc\r\n0\r\n\r\n", 400, "bad_request"),
    (CHUNKED + b"2\r\nabcdef\r\n0\r\n\r\n", 400, "bad_request"),
    (CHUNKED.replace(b"chunked", b"xchunked") + b"{}", 501, "bad_request"),  # its phrase too: "Not Implemented"
], ids=["request line", "negative length", "a huge header", "200 headers", "chunk size not hex", "negative chunk",
        "chunk longer than said", "unknown transfer coding"])
def test_what_gunicorn_cannot_parse_is_answered_in_json(server, good_answer, head, status, kind):
    """gunicorn answers a request it cannot parse itself, before the app: in the service's JSON error shape (it
    was gunicorn's HTML page; found by an audit), and the service goes on serving. So does the app a body it
    cannot read (gunicorn then closes the connection: the answer is read here to the connection's end)."""
    with socket.create_connection(urlsplit(server.url)[1].split(":"), timeout=30) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    # the status's own phrase (werkzeug's in capitals)
    assert status_line.split(None, 1)[1].lower() == f"{status} {HTTPStatus(status).phrase}".lower().encode(), answer[:300]
    assert b"content-type: application/json" in headers.lower(), answer[:300]
    assert re.search(rb"\r\nx-request-id: [0-9a-f]{32}(\r\n|$)", b"\r\n" + headers.lower()), headers  # the third audit
    error = json.loads(body)["error"]
    assert error["type"] == kind and error["message"] and error["field"] is None, error
    assert server.post(GOOD).json()["text"] == good_answer


@pytest.mark.parametrize("status, given, reason, kind", [(501, "Bad Request", "Not Implemented", "bad_request"),
                                                         (500, "Internal Server Error", "Internal Server Error",
                                                          "internal_error")])
def test_gunicorns_own_answer_is_typed_by_whose_fault_it_is(status, given, reason, kind):
    """501 is gunicorn's answer to an unsupported transfer coding: the client's, so `bad_request`; gunicorn gives
    it the phrase "Bad Request", and the status line says "Not Implemented" (found by a fuzzing audit)."""
    from specdec.serve.worker import write_json_error

    class Sock:  # what gunicorn.util.write_nonblock uses of a socket
        sent = b""

        def gettimeout(self):
            return 0.0

        def sendall(self, data):
            self.sent += data

    sock = Sock()
    write_json_error(sock, status, given, "")
    head, _, body = sock.sent.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} {reason}".encode()) and json.loads(body)["error"]["type"] == kind


def test_sixteen_concurrent_clients(server):
    load = stress.run_load(server, clients=16, seconds=4, max_new_tokens=16)
    assert load["other_status"] == 0 and load["connection_errors"] == 0, load["samples"]
    assert load["mixed_up"] == 0, load["samples"]
    assert load["ok_200"] > 0 and load["busy_503"] > 0 and load["busy_503_without_retry_after"] == 0, load


@pytest.mark.parametrize("fault", ["disconnect", "hang_up", "unread_stream", "exception", "out_of_memory",
                                   "exception_in_stream"])
def test_fault(server, fault):
    result = {"disconnect": stress.fault_disconnect, "hang_up": stress.fault_hang_up,
              "unread_stream": stress.fault_unread_stream, "exception": stress.fault_exception,
              "out_of_memory": lambda s: stress.fault_exception(s, stress.OOM_MARKER, "fault-oom"),
              "exception_in_stream": stress.fault_exception_in_stream}[fault](server)
    assert result["ok"], (result, server.log()[-3000:])


def test_short_soak_leaks_no_descriptors_or_threads(server):
    soak = stress.run_soak(server, requests_total=150, warmup=50, every=50)
    assert soak["unexpected"] == 0, soak["samples"]
    assert soak["fds_end"] <= soak["fds_warm"] and soak["threads_end"] <= soak["threads_warm"], soak
    assert soak["rss_growth_pct"] < 10, soak["series"]  # `make stress` holds 1,000 requests to < 5 %
