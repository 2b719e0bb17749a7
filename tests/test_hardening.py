"""Hardening, in-process: the bad-request corpus (each answered with its documented 4xx, then a good request is
answered correctly), the per-request time budget, out-of-memory inside generation, no tracebacks or server
paths in answers, /openapi.json, and the security defaults (bind address, trust_remote_code, non-root image)."""

import inspect
import json
import logging
import re
import runpy
import time
from pathlib import Path

import pytest
import torch

import specdec.models.pair
from specdec.serve import create_app
from specdec.serve.config import load_settings
from specdec.serve.protocol import PredictRequest
from tests.support.bad_requests import CORPUS, GOOD, LEAKS, PROMPT, check_error
from tests.support.models import load_saved_pair, make_app

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("clean_env")


class Faults:
    """Switchable faults and a delay inside the target's forward (a hook on this module's own copy)."""

    def __init__(self):
        self.error: type[BaseException] | None = None
        self.delay = 0.0

    def __call__(self, module, args):
        if self.error is not None:
            raise self.error("injected: CUDA out of memory. Tried to allocate 20.00 GiB")
        if self.delay:
            time.sleep(self.delay)


@pytest.fixture(scope="module")
def faults():
    return Faults()


@pytest.fixture(scope="module")
def pair(tiny_pair_dirs, faults):
    draft, target, tokenizer = load_saved_pair(tiny_pair_dirs)
    target.register_forward_pre_hook(faults)
    return draft, target, tokenizer


@pytest.fixture(scope="module")
def good_answer(app):
    return app.test_client().post("/predict", json=GOOD).get_json()["text"]


def assert_serves(client, good_answer):
    """The engine is free and the next good request gets the right answer."""
    assert not client.application.extensions["specdec"].scheduler.busy
    response = client.post("/predict", json=GOOD)
    assert response.status_code == 200 and response.get_json()["text"] == good_answer


# --- the bad-request corpus ------------------------------------------------------------------------------------

def test_the_corpus_covers_at_least_30_kinds():
    assert len({bad.name for bad in CORPUS}) == len(CORPUS) >= 30


@pytest.mark.parametrize("bad", CORPUS, ids=lambda bad: bad.name)
def test_bad_request_gets_its_4xx_and_the_next_request_is_answered(client, good_answer, bad):
    kwargs = {"content_type": bad.content_type} if bad.content_type else {}
    response = client.open(bad.path, method=bad.method, data=bad.body, **kwargs)
    check_error(response.status_code, response.headers["Content-Type"], response.get_data(as_text=True), bad)
    assert response.headers["X-Request-ID"]
    assert_serves(client, good_answer)


def test_a_whitespace_prompt_is_refused_but_surrounding_whitespace_is_kept(client):
    assert client.post("/predict", json={"prompt": "\t \n"}).status_code == 422
    assert client.post("/predict", json={"prompt": "\x1d\x1d"}).status_code == 422  # str.isspace: blank
    assert client.post("/predict", json={"prompt": "  x  ", "max_new_tokens": 2}).status_code == 200


def test_prompt_blankness_is_the_openapi_patterns():
    """The schema's pattern (ECMA-262 regex) and the server's check must agree on every whitespace character,
    or a schema-valid prompt is refused (schemathesis found "\x1d\x1d")."""
    import re as regex

    from specdec.serve.protocol import NOT_BLANK, NOT_BLANK_PATTERN

    ecma_whitespace = "\t\n\x0b\x0c\r \xa0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff" + "".join(
        chr(c) for c in range(0x2000, 0x200b))
    python_whitespace = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())
    for char in ecma_whitespace + python_whitespace:
        assert not NOT_BLANK.search(char), hex(ord(char))
    for char in "a0_\u200b\x00\x7f":
        assert regex.fullmatch(NOT_BLANK_PATTERN, char), hex(ord(char))


@pytest.mark.parametrize("sent, kept", [("abc-123", True), ("x" * 65, False), ("two words", False),
                                        ("<script>", False), ("ümlaut", False)])
def test_only_a_plain_request_id_is_echoed(client, sent, kept):
    returned = client.get("/healthz", headers={"X-Request-ID": sent}).headers["X-Request-ID"]
    assert (returned == sent) == kept and re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", returned)


# --- the per-request time budget -------------------------------------------------------------------------------

@pytest.fixture
def slow(faults):
    faults.delay = 0.01
    yield
    faults.delay = 0.0


LONG = {"prompt": "a long one", "max_new_tokens": 200, "temperature": 0, "gamma": 2}  # greedy: no EOS before 200


@pytest.fixture(scope="module")
def long_tokens(app):
    """The whole greedy completion of LONG: a request cut short by its budget must be its beginning."""
    body = app.test_client().post("/predict", json={**LONG, "details": True}).get_json()
    assert body["finish_reason"] == "length"
    return body["tokens"]


def test_a_request_over_its_time_budget_ends_with_time_limit(pair, long_tokens, slow):
    app = make_app(pair, request_timeout=0.3)
    client = app.test_client()
    start = time.perf_counter()
    body = client.post("/predict", json={**LONG, "details": True}).get_json()
    took = time.perf_counter() - start
    n = body["usage"]["completion_tokens"]
    assert body["finish_reason"] == "time_limit" and 0 < n < 200
    assert took < 1.5  # the budget, one more round and the answer (all 200 tokens take 2-3 s)
    assert body["stats"]["total_seconds"] >= 0.3
    assert body["tokens"] == long_tokens[:n]  # cut short, not changed
    assert body["text"] == "".join(t["text"] for t in long_tokens[:n])
    assert not app.extensions["specdec"].scheduler.busy


def test_a_stream_over_its_time_budget_ends_with_time_limit(pair, long_tokens, slow):
    app = make_app(pair, request_timeout=0.3)
    client = app.test_client()
    response = client.post("/predict", json={**LONG, "stream": True}, buffered=True)
    events = [json.loads(block.removeprefix("data: "))
              for block in response.get_data(as_text=True).strip().split("\n\n")]
    final = events[-1]
    n = final["usage"]["completion_tokens"]
    assert final["finish_reason"] == "time_limit" and 0 < n < 200
    assert "".join(e["text"] for e in events) == "".join(t["text"] for t in long_tokens[:n])
    assert not app.extensions["specdec"].scheduler.busy


def test_a_v1_requests_choices_share_one_time_budget(pair, slow):
    """n choices decode one after another: each with a budget of its own, n = 16 held the engine 16 times
    request_timeout. All of them now end within one (the later ones decode a round each)."""
    app = make_app(pair, request_timeout=0.3, max_prompts_per_request=16)
    start = time.perf_counter()
    answer = app.test_client().post("/v1/completions", json={
        "model": "target", "prompt": LONG["prompt"], "max_tokens": 200, "temperature": 0, "gamma": 2, "n": 6,
        "ignore_eos": True}).get_json()
    took = time.perf_counter() - start
    assert len(answer["choices"]) == 6 and all(c["finish_reason"] == "length" for c in answer["choices"])
    assert took < 1.5  # one budget and a few rounds (six budgets: 1.8 s at the least)
    assert answer["usage"]["completion_tokens"] < 200
    assert not app.extensions["specdec"].scheduler.busy


def test_a_stream_write_may_not_block_longer_than_the_budget(pair):
    """A client that stops reading a stream would block gunicorn's write, and hold the engine; under gunicorn
    the connection's socket gets the time budget as its timeout for the stream."""

    class Socket:
        timeout = None

        def settimeout(self, seconds):
            self.timeout = seconds

    sock = Socket()
    client = make_app(pair, request_timeout=7).test_client()
    response = client.post("/predict", json={"prompt": PROMPT, "max_new_tokens": 3, "stream": True}, buffered=True,
                           environ_overrides={"gunicorn.socket": sock})
    assert response.status_code == 200 and sock.timeout == 7


# --- out of memory and other failures inside generation --------------------------------------------------------

@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
def test_out_of_memory_in_forward_is_a_500_and_the_server_keeps_serving(client, faults, good_answer, caplog,
                                                                        error):
    faults.error = error
    try:
        with caplog.at_level(logging.ERROR, logger="specdec.serve"):
            response = client.post("/predict", json={"prompt": PROMPT}, headers={"X-Request-ID": "oom-1"})
    finally:
        faults.error = None
    text = response.get_data(as_text=True)
    assert response.status_code == 500 and response.mimetype == "application/json"
    body = response.get_json()["error"]
    assert body["type"] == "internal_error" and "oom-1" in body["message"] and "out of memory" in body["message"]
    assert not any(leak in text for leak in LEAKS) and "GiB" not in text  # the details are in the log only
    assert any("request_id=oom-1 ran out of memory" in r.getMessage() and r.exc_info for r in caplog.records)
    assert_serves(client, good_answer)  # the same answer as before: nothing of the failed request lingers


def test_out_of_memory_mid_stream_is_an_error_event(client, faults, good_answer):
    faults.error = torch.OutOfMemoryError
    try:
        response = client.post("/predict", json={"prompt": PROMPT, "stream": True}, buffered=True,
                               headers={"X-Request-ID": "oom-2"})
    finally:
        faults.error = None
    assert response.status_code == 200  # the status line went out before the first forward
    last = json.loads(response.get_data(as_text=True).strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["type"] == "internal_error" and "oom-2" in last["error"]["message"]
    assert_serves(client, good_answer)


def test_a_load_failure_is_not_echoed_with_its_paths(pair):
    def broken(settings):
        raise specdec.SpecDecError("the target model folder /srv/secret/models has no config.json")

    app = create_app({"loader": broken})
    assert app.extensions["specdec"].wait_until_loaded(30)
    for path in ("/readyz", "/predict"):
        response = app.test_client().post("/predict", json={"prompt": "x"}) if path == "/predict" \
            else app.test_client().get(path)
        assert response.status_code == 503 and "/srv/secret" not in response.get_data(as_text=True)


def test_readyz_names_local_models_without_their_paths(client, tiny_pair_dirs):
    body = client.get("/readyz").get_json()
    assert body["models"] == {"draft": "draft", "target": "target"}
    assert str(Path(tiny_pair_dirs[0]).parent) not in json.dumps(body)


# --- /openapi.json ---------------------------------------------------------------------------------------------

def test_openapi_describes_every_route_with_the_server_limits(pair):
    app = make_app(pair, max_new_tokens=4, max_new_tokens_limit=8, max_gamma=6)
    document = app.test_client().get("/openapi.json").get_json()
    assert document["openapi"].startswith("3.")
    # Flask's /v1/models/<path:model> is OpenAPI's /v1/models/{model}
    routes = {re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule) for rule in app.url_map.iter_rules()
              if rule.endpoint != "static"}
    assert set(document["paths"]) == routes
    request = document["components"]["schemas"]["PredictRequest"]
    assert set(request["properties"]) == set(PredictRequest.model_fields) and request["required"] == ["prompt"]
    assert request["additionalProperties"] is False
    assert request["properties"]["max_new_tokens"]["maximum"] == 8
    gamma = request["properties"]["gamma"]  # max_gamma 6: no "adaptive", which proposes up to 8
    assert (gamma["type"], gamma["minimum"], gamma["maximum"], gamma["nullable"]) == ("integer", 1, 6, True)
    assert "anyOf" not in gamma and 'not "adaptive" here' in gamma["description"]
    wide = make_app(pair, max_gamma=16).test_client().get("/openapi.json").get_json()
    assert wide["components"]["schemas"]["PredictRequest"]["properties"]["gamma"]["anyOf"] == [
        {"type": "integer", "minimum": 1, "maximum": 16}, {"type": "string", "enum": ["adaptive"]}]
    assert "default 4" in request["properties"]["max_new_tokens"]["description"]
    assert request["properties"]["drafter"]["enum"] == ["model", "lookup", "hybrid", None]  # null: the default
    assert request["properties"]["verification"]["enum"] == ["token", "block", None]
    assert "default model" in request["properties"]["drafter"]["description"]
    token = document["components"]["schemas"]["Token"]["properties"]["source"]["enum"]
    assert "lookup" in token and "draft" in token
    stats = document["components"]["schemas"]["GenerationStats"]["properties"]
    assert {"proposed_by_drafter", "accepted_by_drafter", "round_share_by_drafter"} <= set(stats)
    documented = {int(status) for status in document["paths"]["/predict"]["post"]["responses"]}
    assert {bad.status for bad in CORPUS if bad.path == "/predict" and bad.method == "POST"} <= documented
    # every field /readyz gives is described (prompt_cache_bytes was not; found by an audit)
    app.extensions["specdec"].wait_until_loaded(60)
    ready = document["components"]["schemas"]["Ready"]
    assert set(app.test_client().get("/readyz").get_json()) <= set(ready["properties"])


# --- security defaults -----------------------------------------------------------------------------------------

def test_the_server_binds_localhost_unless_configured(monkeypatch):
    assert load_settings(environ={}).host == "127.0.0.1"
    conf = runpy.run_path(str(ROOT / "config" / "gunicorn.conf.py"))
    assert conf["bind"] == ["127.0.0.1:5000"]
    monkeypatch.setenv("SPECDEC_HOST", "0.0.0.0")
    assert runpy.run_path(str(ROOT / "config" / "gunicorn.conf.py"))["bind"] == ["0.0.0.0:5000"]


def test_trust_remote_code_is_off_by_default(monkeypatch, pair):
    assert inspect.signature(specdec.models.pair.load_pair).parameters["trust_remote_code"].default is False
    calls = []

    def recording_load_pair(**kwargs):
        calls.append(kwargs)
        return pair

    monkeypatch.setattr(specdec.models.pair, "load_pair", recording_load_pair)
    app = create_app()  # the service's own loader, not an injected one
    assert app.extensions["specdec"].wait_until_loaded(30)
    assert len(calls) == 1 and not calls[0].get("trust_remote_code", False)


def test_limits_bound_what_one_request_may_ask_for():
    settings = load_settings(environ={})
    assert settings.max_body_bytes <= 1 << 20 and settings.max_new_tokens_limit <= 4096
    assert settings.max_prompt_tokens <= 32768 and 0 < settings.request_timeout <= 600
    assert settings.queue_size <= 64 and settings.queue_timeout <= 600
    fields = PredictRequest.model_fields
    assert fields["stop"].metadata and PredictRequest.model_config["extra"] == "forbid"
    # gunicorn lets in-flight and queued requests finish on SIGTERM within their budgets
    conf = runpy.run_path(str(ROOT / "config" / "gunicorn.conf.py"))
    assert conf["graceful_timeout"] >= settings.queue_timeout + settings.request_timeout


def test_the_container_runs_as_a_non_root_user():
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    users = [line.split(None, 1)[1] for line in lines if line.startswith("USER ")]
    cmd = max(i for i, line in enumerate(lines) if line.startswith("CMD "))
    last_user = max(i for i, line in enumerate(lines) if line.startswith("USER "))
    assert users and last_user < cmd
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) >= 1000)


def test_a_prompt_too_long_by_its_characters_alone_is_refused_before_it_is_tokenized(pair):
    """Tokenizing a megabyte of text held the event loop for seconds (every stream and /healthz with it), only to
    refuse the prompt: a text with more characters than max_prompt_tokens tokens can spell is refused unread."""
    app = make_app(pair, max_prompt_tokens=50)
    client, service = app.test_client(), app.extensions["specdec"]
    service.wait_until_loaded(60)
    longest = service.models.longest_token
    assert longest >= max(len(t) for t in service.tokenizer.convert_ids_to_tokens(list(range(len(service.tokenizer)))))
    tokenized = []
    tokenize = service.tokenize
    service.tokenize = lambda *args, **kwargs: tokenized.append(1) or tokenize(*args, **kwargs)
    over = "a" * (50 * longest + 1)
    for path, body in (("/predict", {"prompt": over}),
                       ("/v1/completions", {"model": "target", "prompt": over}),
                       ("/v1/chat/completions", {"model": "target",
                                                 "messages": [{"role": "user", "content": over[:-60]},
                                                              {"role": "user", "content": "b" * 60}]})):
        answer = client.post(path, json=body)
        assert answer.status_code in (400, 422), answer.get_json()
        assert "characters" in answer.get_data(as_text=True)
    assert not tokenized
    answer = client.post("/predict", json={"prompt": over[:-1]})  # within the bound: tokenized, then refused
    assert answer.status_code == 422 and "tokens; the limit is 50" in answer.get_json()["error"]["message"]
    assert tokenized
