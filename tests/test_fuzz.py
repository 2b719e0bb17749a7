"""Property-based fuzzing of /predict: random bodies (right and wrong types, random keys, any JSON, any bytes)
always get JSON with a documented status and never a 500, and the app still answers afterwards; then
schemathesis against the app's own /openapi.json (valid requests must be answered 200, invalid ones 4xx, and
every answer must match the document)."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specdec.errors import SpecDecError
from specdec.serve import create_app
from specdec.serve.errors import ApiError
from specdec.serve.openai_protocol import TokenizeRequest
from specdec.serve.openapi import FINISH_REASONS
from specdec.serve.structured import ResponseFormat, StructuredOutputs, request_constraint
from tests.support.bad_requests import LEAKS
from tests.support.document import check_against_the_document
from tests.support.models import specdec_env_cleared

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DOCUMENTED = {200, 400, 413, 415, 422}
FIELDS = ("prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "gamma", "method", "stop", "chat",
          "details", "stream")


@pytest.fixture(scope="module")
def app(pair):
    with specdec_env_cleared():
        # short completions keep each accepted request fast; the limits are still checked
        app = create_app({"loader": lambda s: pair, "max_new_tokens": 4, "max_new_tokens_limit": 8})
    assert app.extensions["specdec"].wait_until_loaded(30)
    return app


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


def unleaky(max_size: int):
    """Text that holds none of LEAKS: an answer may echo what the request sent (an unknown field's name, a bad
    value), which must not pass for a leak (a field named ".py" did, once)."""
    return st.text(max_size=max_size).filter(lambda text: not any(leak in text for leak in LEAKS))


any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | unleaky(20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(unleaky(8), children, max_size=4),
    max_leaves=12)

# per field: values the server accepts, and values near or far outside what it accepts
VALID = {
    "prompt": st.text(min_size=1, max_size=40).filter(str.strip),
    "max_new_tokens": st.integers(1, 8),
    "temperature": st.sampled_from([0, 0.5, 1]) | st.floats(1e-5, 100),
    "top_k": st.integers(0, 200),
    "top_p": st.floats(1e-9, 1),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "gamma": st.integers(1, 16),
    "method": st.sampled_from(["google", "deepmind", "target"]),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=16),
    "chat": st.booleans(),
    "details": st.booleans(),
    "stream": st.booleans(),
}
INVALID = {
    "prompt": st.sampled_from(["", " ", "\n\t", "x" * 300]),
    "max_new_tokens": st.integers(max_value=0) | st.integers(min_value=9),
    "temperature": st.floats(max_value=-1e-9) | st.floats(5e-324, 9e-6) | st.sampled_from([math.nan, math.inf]),
    "top_k": st.integers(max_value=-1),
    "top_p": st.floats(max_value=0) | st.floats(min_value=1.0001) | st.just(math.nan),
    "seed": st.integers(min_value=2**64) | st.integers(max_value=-(2**63) - 1),
    "gamma": st.integers(max_value=0) | st.integers(min_value=17),
    "method": unleaky(8).filter(lambda m: m not in ("google", "deepmind", "target")),
    "stop": st.lists(st.text(max_size=300), min_size=17, max_size=20) | st.just([""]) | st.just(["x" * 257]),
    "chat": st.integers(0, 1),
    "details": st.text(max_size=4),
    "stream": st.just("true"),
}


@st.composite
def bodies(draw):
    """A body whose fields are mostly valid: a prompt is there four times in five, and valid 17 times in 20."""
    names = draw(st.lists(st.sampled_from(FIELDS[1:]), unique=True, max_size=6))
    if draw(st.integers(0, 4)) < 4:  # (hypothesis draws small numbers more often than large ones)
        names.insert(0, "prompt")
    body = {}
    for name in names:
        kind = draw(st.integers(0, 9 if name != "prompt" else 19))  # 0-6 (0-16) valid, 7 invalid, 8 null, 9 any
        kind = kind - 10 if kind > 9 else kind
        strategy = VALID[name] if kind <= 6 else INVALID[name] if kind == 7 else st.none() if kind == 8 else any_json
        body[name] = draw(strategy)
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(st.dictionaries(unleaky(10), any_json, max_size=2)))
    return body


def check_answer(response, sent: dict | None) -> None:
    """A documented status, JSON (or a well-formed event stream), never a traceback."""
    text = response.get_data(as_text=True)
    assert response.status_code in DOCUMENTED, text[:500]
    assert not any(leak in text for leak in LEAKS), text[:500]
    if response.status_code != 200:
        error = response.get_json()["error"]
        assert set(error) == {"type", "message", "field"} and error["message"]
        if response.status_code == 422 and sent is not None:
            assert error["field"] in set(sent) | {"prompt"}, (error, sent)
        return
    if response.mimetype == "text/event-stream":
        events = [json.loads(block.removeprefix("data: ")) for block in text.strip().split("\n\n")]
        final = events[-1]
    else:
        assert response.mimetype == "application/json"
        final = response.get_json()
    assert final["finish_reason"] in FINISH_REASONS and 1 <= final["usage"]["completion_tokens"] <= 8


@FUZZ
@given(body=bodies())
def test_random_bodies_get_a_documented_answer(client, body):
    check_answer(client.post("/predict", data=json.dumps(body), content_type="application/json", buffered=True),
                 body)


@FUZZ
@given(body=any_json)
def test_any_json_gets_a_documented_answer(client, body):
    check_answer(client.post("/predict", data=json.dumps(body), content_type="application/json", buffered=True),
                 body if isinstance(body, dict) else None)


@settings(FUZZ, max_examples=100)
@given(data=st.binary(max_size=200), content_type=st.sampled_from(["application/json", "text/plain", None]))
def test_any_bytes_get_a_documented_answer(client, data, content_type):
    kwargs = {"content_type": content_type} if content_type else {}
    check_answer(client.post("/predict", data=data, **kwargs), None)


def test_the_app_still_answers_after_fuzzing(client, app):
    assert not app.extensions["specdec"].scheduler.busy
    body = client.post("/predict", json={"prompt": "Who is", "temperature": 0}).get_json()
    assert body["usage"]["completion_tokens"] == 4 and not math.isnan(body["stats"]["total_seconds"])


# --- schemathesis against /openapi.json ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_against_the_openapi_document(app, mode):
    """Requests generated from the document: valid ones (positive) must get 200, invalid ones (negative) a 4xx;
    every answer must match the document (status, content type, body schema, each streamed event).

    schemathesis's own pytest plugin does not run under pytest 9, so the cases are drawn with hypothesis here.
    """
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    operation = schema["/predict"]["POST"]
    service = app.extensions["specdec"]
    vocab = service.decoder.vocab_size

    def stated(body) -> bool:
        """Whether the body is free of what the document cannot state (each refused with a 4xx naming its field):
        whether its regex, grammar or schema compiles, logit_bias keys as ids of the vocabulary (OpenAPI 3.0 can
        say neither that its keys are digits nor how many tokens there are), and rules across fields: min_tokens
        at most max_new_tokens; response_format and structured_outputs not both; ignore_eos, stop_token_ids,
        min_tokens and stop strings not beside a constraint. Exactly one structured output, response_format's json_schema with its
        type, and the token ids' bound are the document's: a body valid by it that breaks them fails the test."""
        so, rf = body.get("structured_outputs"), body.get("response_format")
        structured = StructuredOutputs.model_validate(so) if so is not None else None
        response_format = ResponseFormat.model_validate(rf) if rf is not None else None
        formats = response_format is not None and response_format.type != "text"
        constrained = structured is not None or formats
        bias, stops = body.get("logit_bias") or {}, body.get("stop_token_ids") or []
        room = body.get("max_new_tokens") or service.settings.max_new_tokens
        least = body.get("min_tokens") or 0
        if not all(key.isascii() and key.isdigit() and int(key) < vocab for key in bias) or least > room:
            return False
        if constrained and (structured is not None and formats or body.get("ignore_eos") or stops or least
                            or body.get("stop")):
            return False
        try:
            service.grammar(request_constraint(response_format, structured))
        except (ApiError, SpecDecError):  # a regex, grammar or schema that does not compile
            return False
        # the tiny tokenizer spells printable ASCII and newlines only: a constraint whose strings need other
        # characters can lead the grammar where no token goes on (a 422 saying so, not a 200)
        constraint = json.dumps([so, rf])
        return constraint.isascii() and "\\u" not in constraint

    assert check_against_the_document(operation, mode, stated, settings(FUZZ, max_examples=100))
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):  # no inputs: one call each
        case = schema[path]["GET"].Case()
        case.validate_response(case.call())


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_against_the_tokenizer_routes(app, path, mode):
    """/tokenize and /detokenize as the document describes them: valid requests get 200 (prompt or messages, the
    fields that go with messages only, the served model, token ids of the vocabulary are the document's), invalid
    ones a 4xx, and every answer matches the document."""
    schemathesis = pytest.importorskip("schemathesis")
    operation = schemathesis.openapi.from_wsgi("/openapi.json", app)[path]["POST"]
    service = app.extensions["specdec"]

    def stated(body) -> bool:
        """Whether a conversation is free of what the document cannot state: a message's text that Unicode cannot
        hold (a lone surrogate) and the chat template's rules (roles it refuses; continue_final_message continues
        an assistant's message)."""
        if body.get("messages") is None:
            return True
        try:
            request = TokenizeRequest.model_validate(body)
        except ValidationError as error:  # a message's own rule; the request's rules are the document's
            return error.errors()[0]["loc"][:1] != ("messages",)
        try:
            service.tokenize(**request.encoding())
        except ApiError as error:
            return error.field not in ("messages", "continue_final_message")
        return True

    assert check_against_the_document(operation, mode, stated, settings(FUZZ, max_examples=50))
