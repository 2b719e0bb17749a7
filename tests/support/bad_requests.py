"""The bad-request corpus: every kind of malformed, mistyped, out-of-range or oversized request the service must
answer with its documented 4xx JSON error (status, `type`, `field`), shared by the Flask test-client test
(test_hardening.py) and the same requests over a real socket to gunicorn (test_hardening_gunicorn.py).

Each entry holds the raw bytes sent, so NaN, Infinity, invalid UTF-8 and 5,000-digit numbers go out exactly.
The limits assumed are config/default.toml's, with the tiny pair's context of 256 tokens.
"""

import json
from dataclasses import dataclass

PROMPT = "Who is the president of the USA"
JSON = "application/json"


@dataclass(frozen=True)
class Bad:
    name: str
    status: int
    type: str
    field: str | None = None
    body: bytes = b""
    content_type: str | None = JSON
    method: str = "POST"
    path: str = "/predict"


def fields(**values) -> bytes:
    """A body with a good prompt and the given fields (json.dumps writes NaN and Infinity as such)."""
    return json.dumps({"prompt": PROMPT, **values}).encode()


def raw(text: str) -> bytes:
    return text.encode()


def invalid(field: str, name: str, body: bytes, type_: str = "invalid_field") -> Bad:
    return Bad(name, 422, type_, field, body)


CORPUS = [
    # content type
    Bad("no content type", 415, "unsupported_media_type", body=fields(), content_type=None),
    Bad("text/plain", 415, "unsupported_media_type", body=fields(), content_type="text/plain"),
    Bad("form-urlencoded", 415, "unsupported_media_type", body=b"prompt=hello",
        content_type="application/x-www-form-urlencoded"),
    Bad("multipart", 415, "unsupported_media_type", body=b"--x--\r\n", content_type="multipart/form-data; boundary=x"),
    Bad("json in latin-1", 415, "unsupported_media_type", body=fields(),
        content_type="application/json; charset=latin-1"),
    # not JSON, or not a JSON object
    Bad("empty body", 400, "invalid_json"),
    Bad("truncated JSON", 400, "invalid_json", body=b'{"prompt": "Who is'),
    Bad("trailing comma", 400, "invalid_json", body=b'{"prompt": "x",}'),
    Bad("single quotes", 400, "invalid_json", body=b"{'prompt': 'x'}"),
    Bad("two JSON documents", 400, "invalid_json", body=fields() + fields()),
    Bad("JSON array", 400, "invalid_json", body=b'[{"prompt": "x"}]'),
    Bad("JSON string", 400, "invalid_json", body=b'"Who is the president"'),
    Bad("JSON number", 400, "invalid_json", body=b"42"),
    Bad("JSON null", 400, "invalid_json", body=b"null"),
    Bad("invalid UTF-8", 400, "invalid_json", body=b'{"prompt": "caf\xe9"}'),
    Bad("UTF-16 with BOM", 400, "invalid_json", body='{"prompt": "x"}'.encode("utf-16")),
    Bad("UTF-8 BOM", 400, "invalid_json", body=b"\xef\xbb\xbf" + fields()),
    Bad("nested 100,000 deep", 400, "invalid_json", body=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    # prompt
    invalid("prompt", "missing prompt", b"{}"),
    invalid("prompt", "prompt null", raw('{"prompt": null}')),
    invalid("prompt", "prompt a number", raw('{"prompt": 42}')),
    invalid("prompt", "prompt a boolean", raw('{"prompt": true}')),
    invalid("prompt", "prompt a list", raw('{"prompt": ["Who", "is"]}')),
    invalid("prompt", "prompt an object", raw('{"prompt": {"text": "Who is"}}')),
    invalid("prompt", "prompt empty", raw('{"prompt": ""}')),
    invalid("prompt", "prompt whitespace only", raw('{"prompt": " \\n\\t \\u3000"}')),
    invalid("prompt", "prompt of separators Python calls whitespace", raw('{"prompt": "\\u001d\\u001c\\u0085"}')),
    invalid("prompt", "prompt of separators JSON Schema calls whitespace", raw('{"prompt": "\\ufeff\\u2029"}')),
    invalid("prompt", "prompt with a lone surrogate", raw('{"prompt": "Who \\ud800 is"}')),
    invalid("prompt", "prompt over max_prompt_tokens", fields(prompt="a" * 5000), "prompt_too_long"),
    invalid("prompt", "prompt plus max_new_tokens over the context", fields(prompt="a" * 200, max_new_tokens=100),
            "prompt_too_long"),
    # max_new_tokens
    invalid("max_new_tokens", "max_new_tokens zero", fields(max_new_tokens=0)),
    invalid("max_new_tokens", "max_new_tokens negative", fields(max_new_tokens=-5)),
    invalid("max_new_tokens", "max_new_tokens over the limit", fields(max_new_tokens=1025)),
    invalid("max_new_tokens", "max_new_tokens 10**30", fields(max_new_tokens=10**30)),
    invalid("max_new_tokens", "max_new_tokens of 5,000 digits",
            raw('{"prompt": "x", "max_new_tokens": ' + "9" * 5000 + "}")),
    invalid("max_new_tokens", "max_new_tokens a string", fields(max_new_tokens="8")),
    invalid("max_new_tokens", "max_new_tokens a float", fields(max_new_tokens=8.5)),
    invalid("max_new_tokens", "max_new_tokens a boolean", fields(max_new_tokens=True)),
    invalid("max_new_tokens", "max_new_tokens NaN", fields(max_new_tokens=float("nan"))),
    # temperature, top_k, top_p
    invalid("temperature", "temperature NaN", fields(temperature=float("nan"))),
    invalid("temperature", "temperature Infinity", fields(temperature=float("inf"))),
    invalid("temperature", "temperature -Infinity", fields(temperature=float("-inf"))),
    invalid("temperature", "temperature 1e999", raw('{"prompt": "x", "temperature": 1e999}')),
    invalid("temperature", "temperature negative", fields(temperature=-0.5)),
    invalid("temperature", "temperature 1e-300 (overflows the logits)", fields(temperature=1e-300)),
    invalid("temperature", "temperature a string", fields(temperature="hot")),
    invalid("top_k", "top_k negative", fields(top_k=-1)),
    invalid("top_k", "top_k a float", fields(top_k=1.5)),
    invalid("top_p", "top_p zero", fields(top_p=0)),
    invalid("top_p", "top_p over one", fields(top_p=1.5)),
    invalid("top_p", "top_p NaN", fields(top_p=float("nan"))),
    # seed, gamma, method
    invalid("seed", "seed 2**64", fields(seed=2**64)),
    invalid("seed", "seed below -2**63", fields(seed=-(2**63) - 1)),
    invalid("seed", "seed a float", fields(seed=1.5)),
    invalid("seed", "seed a string", fields(seed="42")),
    invalid("gamma", "gamma zero", fields(gamma=0)),
    invalid("gamma", "gamma over max_gamma", fields(gamma=17)),
    invalid("gamma", "gamma huge", fields(gamma=2**70)),
    invalid("gamma", "gamma a word other than 'adaptive'", fields(gamma="auto")),
    invalid("method", "method unknown", fields(method="medusa")),
    invalid("method", "method a list", fields(method=["google"])),
    # stop
    invalid("stop", "stop a string", fields(stop="\n")),
    invalid("stop", "stop with 1,000 entries", fields(stop=[f"s{i}" for i in range(1000)])),
    invalid("stop", "stop entry of 10,000 characters", fields(stop=["x" * 10_000])),
    invalid("stop", "stop with an empty string", fields(stop=[""])),
    invalid("stop", "stop with a nested list", fields(stop=[["a"]])),
    invalid("stop", "stop with an object", fields(stop=[{"text": "a"}])),
    invalid("stop", "stop with a number", fields(stop=["ok", 3])),
    # booleans, unknown fields
    invalid("chat", "chat a string", fields(chat="yes")),
    invalid("details", "details a number", fields(details=1)),
    invalid("stream", "stream a string", fields(stream="true")),
    invalid("max_tokens", "unknown field", fields(max_tokens=5)),
    invalid("options", "unknown field holding an object", fields(options={"temperature": 0})),
    # size
    Bad("10 MB body", 413, "body_too_large", body=fields(prompt="a" * (10 << 20))),
    # methods and paths
    Bad("GET /predict", 405, "method_not_allowed", method="GET", content_type=None),
    Bad("PUT /predict", 405, "method_not_allowed", body=fields(), method="PUT"),
    Bad("DELETE /predict", 405, "method_not_allowed", method="DELETE", content_type=None),
    Bad("PATCH /predict", 405, "method_not_allowed", body=fields(), method="PATCH"),
    Bad("POST /healthz", 405, "method_not_allowed", body=fields(), path="/healthz"),
    Bad("POST /readyz", 405, "method_not_allowed", body=fields(), path="/readyz"),
    Bad("POST /metrics", 405, "method_not_allowed", body=fields(), path="/metrics"),
    Bad("unknown path", 404, "not_found", body=fields(), path="/generate"),
    Bad("trailing slash", 404, "not_found", body=fields(), path="/predict/"),
    Bad("path traversal", 404, "not_found", method="GET", content_type=None, path="/static/../../etc/passwd"),
]

GOOD = {"prompt": PROMPT, "max_new_tokens": 12, "temperature": 0}  # greedy: the answer is known in advance
LEAKS = ("Traceback", 'File "', ".py", "site-packages")  # what an answer must never contain


def check_error(status: int, content_type: str, text: str, bad: Bad) -> None:
    """The documented error answer: status, JSON `{"error": {type, message, field}}`, no traceback or path."""
    assert status == bad.status, text[:500]
    assert content_type.split(";")[0].strip() == "application/json", content_type
    error = json.loads(text)["error"]
    assert set(error) == {"type", "message", "field"}, error
    assert error["type"] == bad.type and error["field"] == bad.field and error["message"], error
    assert not any(leak in text for leak in LEAKS), text[:500]
