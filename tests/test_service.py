"""service.py through Flask's test client: every route, every error class, details, stop strings, streaming,
seeds, greedy equality with target-only decoding, queueing, logging and metrics. Tiny models, no network."""

import copy
import io
import json
import logging
import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SpecDecError
from specdec.serve import create_app
from tests.support.models import make_app, wait_until_engine_free
from tests.support.spies import fail_after_first_chunk

PROMPT = "Who is the president of the USA"


pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture
def service(app):
    return app.extensions["specdec"]


def predict(client, headers=None, buffered=False, **body):
    return client.post("/predict", json={"prompt": PROMPT, **body}, headers=headers, buffered=buffered)


def sse_events(response) -> list[dict]:
    text = response.get_data(as_text=True)
    assert text.endswith("\n\n")
    events = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block
        events.append(json.loads(block.removeprefix("data: ")))
    return events


def assert_error(response, status, type_, field=None):
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    error = response.get_json()["error"]
    assert set(error) == {"type", "message", "field"}
    assert error["type"] == type_ and error["field"] == field and error["message"]
    return error


# --- routes ----------------------------------------------------------------------------------------------------

def test_healthz(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.get_json() == {"status": "ok"}


def test_readyz_names_models_and_device(client, tiny_pair_dirs):
    body = client.get("/readyz").get_json()
    assert body["status"] == "ready"
    assert body["models"] == {"draft": "draft", "target": "target"}  # local folders by name: no server paths
    assert body["device"] == "cpu" and body["dtype"] == "float32" and body["context_length"] == 256


def test_readyz_reports_load_seconds_and_resident_memory(pair, caplog):
    def loader(settings):
        time.sleep(0.3)  # a load that takes a known minimum
        return pair

    with caplog.at_level(logging.INFO, logger="specdec"):
        app = create_app({"loader": loader})
        assert app.extensions["specdec"].wait_until_loaded(30)
    body = app.test_client().get("/readyz").get_json()
    assert 0.3 <= body["load_seconds"] < 30
    assert 10 << 20 < body["resident_memory_bytes"] <= body["peak_resident_memory_bytes"]
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("start-up: warmed up (two greedy tokens) in ") for m in messages)
    assert any(m.startswith(f"models ready in {body['load_seconds']:.1f} s, resident memory ") for m in messages)
    metrics = app.test_client().get("/metrics").get_data(as_text=True)
    assert f"specdec_load_seconds {body['load_seconds']}" in metrics


def test_the_service_decodes_with_its_configured_lookup_settings(pair):
    from specdec.params import LookupSettings

    app = create_app({"loader": lambda settings: pair, "lookup_max_ngram": 3, "lookup_max_tokens": 2,
                      "hybrid_min_match": 2, "hybrid_extend": True})
    assert app.extensions["specdec"].wait_until_loaded(30)
    assert app.extensions["specdec"].decoder.lookup == LookupSettings(max_ngram=3, max_tokens=2, hybrid_min_match=2,
                                                                      extend=True)
    answer = app.test_client().post("/predict", json={"prompt": "ab ab ab ab", "drafter": "hybrid",
                                                      "temperature": 0, "max_new_tokens": 6})
    assert answer.status_code == 200 and answer.get_json()["stats"]["drafter"] == "hybrid"


def test_metrics_expose_the_process_resident_memory(client):
    samples = dict(line.rsplit(" ", 1) for line in client.get("/metrics").get_data(as_text=True).splitlines()
                   if line and not line.startswith("#"))
    assert 0.5 * _resident() < float(samples["process_resident_memory_bytes"]) < 2 * _resident()


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_readyz_is_503_until_loaded(pair):
    release = threading.Event()

    def slow_loader(settings):
        release.wait(10)
        return pair

    app = create_app({"loader": slow_loader})
    client = app.test_client()
    assert client.get("/healthz").status_code == 200
    response = client.get("/readyz")
    assert_error(response, 503, "not_ready")
    assert response.headers["Retry-After"] == "5"
    assert_error(predict(client), 503, "not_ready")
    release.set()
    assert app.extensions["specdec"].wait_until_loaded(30)
    assert client.get("/readyz").status_code == 200
    assert predict(client, max_new_tokens=3).status_code == 200


def test_load_failure_is_reported_and_stops_a_worker(pair):
    def broken_loader(settings):
        raise SpecDecError("the target model folder /nowhere has no config.json", field="target_model")

    app = create_app({"loader": broken_loader})
    service = app.extensions["specdec"]
    assert service.wait_until_loaded(30)
    error = assert_error(app.test_client().get("/readyz"), 503, "not_ready")
    assert "model loading failed" in error["message"] and "/nowhere" not in error["message"]  # the log says why
    stopped = []
    service.on_load_failure(stopped.append)  # what gunicorn's post_worker_init registers
    assert stopped == ["the target model folder /nowhere has no config.json"]


def test_predict_returns_completion_usage_and_stats(client):
    response = predict(client, max_new_tokens=20, seed=1)
    assert response.status_code == 200
    body = response.get_json()
    assert set(body) == {"text", "finish_reason", "usage", "stats"}
    assert isinstance(body["text"], str) and body["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == len(PROMPT)  # the character tokenizer adds no specials
    assert 1 <= body["usage"]["completion_tokens"] <= 20
    assert body["usage"]["total_tokens"] == len(PROMPT) + body["usage"]["completion_tokens"]
    stats = body["stats"]
    for key in ("acceptance_rate", "accepted", "proposed", "tokens_per_target_forward", "total_seconds",
                "tokens_per_second", "draft_seconds", "target_seconds", "queue_seconds"):
        assert key in stats
    assert stats["method"] == "google" and stats["gamma"] == 4 and stats["seed"] == 1
    assert 0 <= stats["accepted"] <= stats["proposed"]
    assert response.headers["X-Request-ID"]


def test_predict_ignore_eos_decodes_to_max_new_tokens(client, pair):
    """ignore_eos: the EOS a greedy answer stops at is kept, to max_new_tokens ("length"); a non-boolean is a 422
    naming the field, and so is ignore_eos with a constraint."""
    body = {"prompt": "abc", "max_new_tokens": 40, "temperature": 0, "method": "target", "details": True,
            "cache_prompt": False}
    plain = client.post("/predict", json=body).get_json()
    forced = client.post("/predict", json={**body, "ignore_eos": True}).get_json()
    assert forced["usage"]["completion_tokens"] == 40 and forced["finish_reason"] == "length"
    ids = [t["id"] for t in forced["tokens"]]
    assert ids[:len(plain["tokens"])] == [t["id"] for t in plain["tokens"]]
    bad = client.post("/predict", json={**body, "ignore_eos": "yes"})
    assert bad.status_code == 422 and bad.get_json()["error"]["field"] == "ignore_eos"
    constrained = client.post("/predict", json={**body, "ignore_eos": True,
                                                "response_format": {"type": "json_object"}})
    assert 400 <= constrained.status_code < 500 and constrained.get_json()["error"]["field"] == "ignore_eos"


def test_request_id_is_echoed(client):
    response = client.get("/healthz", headers={"X-Request-ID": "abc-123"})
    assert response.headers["X-Request-ID"] == "abc-123"


def test_metrics_counters_move(client):
    def sample(name, labels=""):
        for line in client.get("/metrics").get_data(as_text=True).splitlines():
            if line.startswith(name + labels + " "):
                return float(line.split()[-1])
        return 0.0

    response = client.get("/metrics")
    assert response.status_code == 200 and response.mimetype == "text/plain"
    before = {name: sample(name) for name in ("specdec_generated_tokens_total", "specdec_draft_tokens_proposed_total",
                                              "specdec_draft_tokens_accepted_total")}
    requests_before = sample("specdec_requests_total", '{endpoint="/predict",status="200"}')
    stats = predict(client, max_new_tokens=12, method="google", gamma=3).get_json()["stats"]
    assert sample("specdec_requests_total", '{endpoint="/predict",status="200"}') == requests_before + 1
    assert sample("specdec_generated_tokens_total") == before["specdec_generated_tokens_total"] + stats["new_tokens"]
    assert sample("specdec_draft_tokens_proposed_total") == (before["specdec_draft_tokens_proposed_total"]
                                                             + stats["proposed"])
    assert sample("specdec_draft_tokens_accepted_total") == (before["specdec_draft_tokens_accepted_total"]
                                                             + stats["accepted"])
    assert sample("specdec_request_duration_seconds_count", '{endpoint="/predict"}') >= 1
    assert sample("specdec_queue_depth") == 0 and sample("specdec_ready") == 1


def test_one_log_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="specdec.serve"):
        predict(client, max_new_tokens=5, headers={"X-Request-ID": "log-test-1"})
    lines = [r.getMessage() for r in caplog.records if "request_id=log-test-1" in r.getMessage()]
    assert len(lines) == 1
    for part in ("POST /predict", "status=200", f"prompt_tokens={len(PROMPT)}", "completion_tokens=",
                 "method=google", "acceptance_rate=", "seconds="):
        assert part in lines[0]


# --- errors: one test per kind of bad input --------------------------------------------------------------------

def test_unknown_route_is_json_404(client):
    assert_error(client.get("/nope"), 404, "not_found")


@pytest.mark.parametrize("method, path", [("GET", "/predict"), ("POST", "/healthz"), ("DELETE", "/metrics")])
def test_wrong_method_is_json_405(client, method, path):
    response = client.open(path, method=method)
    assert_error(response, 405, "method_not_allowed")
    assert "Allow" in response.headers


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1"])
def test_wrong_content_type_is_415(client, content_type):
    kwargs = {"content_type": content_type} if content_type else {}
    assert_error(client.post("/predict", data=json.dumps({"prompt": PROMPT}), **kwargs), 415,
                 "unsupported_media_type")


def test_json_with_charset_is_accepted(client):
    response = client.post("/predict", data=json.dumps({"prompt": PROMPT, "max_new_tokens": 2}),
                           content_type="application/json; charset=utf-8")
    assert response.status_code == 200


@pytest.mark.parametrize("data", [b"{", b'{"prompt": "x",}', b"", b"\xff\xfe{}", b"[1, 2]", b'"a prompt"', b"null"])
def test_malformed_json_or_non_object_is_400(client, data):
    assert_error(client.post("/predict", data=data, content_type="application/json"), 400, "invalid_json")


def test_body_over_the_limit_is_413(client):
    body = json.dumps({"prompt": "a" * (1 << 20)})
    assert len(body) > 1 << 20
    assert_error(client.post("/predict", data=body, content_type="application/json"), 413, "body_too_large")


def test_chunked_body_over_the_limit_is_413(client):
    body = json.dumps({"prompt": "a" * (1 << 20)}).encode()
    response = client.post("/predict", input_stream=io.BytesIO(body), content_type="application/json")
    assert_error(response, 413, "body_too_large")
    small = json.dumps({"prompt": PROMPT, "max_new_tokens": 2}).encode()
    assert client.post("/predict", input_stream=io.BytesIO(small), content_type="application/json").status_code == 200


@pytest.mark.parametrize("body, field", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ["a"]}, "prompt"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 1025}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 8.0}, "max_new_tokens"),
    ({"max_new_tokens": "8"}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"seed": "7"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": False}, "seed"),
    ({"gamma": 0}, "gamma"),
    ({"gamma": 17}, "gamma"),
    ({"gamma": "fast"}, "gamma"),
    ({"method": "draft"}, "method"),
    ({"method": "medusa"}, "method"),
    ({"drafter": "ngram"}, "drafter"),
    ({"drafter": 1}, "drafter"),
    ({"verification": "tree"}, "verification"),
    ({"draft_confidence_threshold": 1.5}, "draft_confidence_threshold"),
    ({"draft_confidence_threshold": -0.1}, "draft_confidence_threshold"),
    ({"draft_confidence_threshold": "0.5"}, "draft_confidence_threshold"),
    ({"stop": "\n"}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"chat": "yes"}, "chat"),
    ({"details": 1}, "details"),
    ({"stream": "true"}, "stream"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ({"logit_bias": {"100": 1}}, "logit_bias"),  # the tiny vocabulary has 100 tokens
    ({"logit_bias": [5]}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),  # the tiny vocabulary has 100 tokens
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens"),
    ({"min_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}, "min_tokens"),
])
def test_invalid_field_is_422_naming_it(client, body, field):
    body = {"prompt": PROMPT, **body} if "prompt" not in body and body else body
    assert_error(client.post("/predict", json=body), 422, "invalid_field", field)


def test_null_means_the_configured_default(client):
    response = predict(client, max_new_tokens=None, temperature=None, gamma=None, method=None, seed=None, stop=None)
    assert response.status_code == 200
    stats = response.get_json()["stats"]
    assert stats["gamma"] == 4 and stats["method"] == "google"
    assert (stats["drafter"], stats["verification"]) == ("model", "token")
    assert response.get_json()["usage"]["completion_tokens"] <= 64


def test_prompt_over_the_token_limit_is_422(pair):
    client = make_app(pair, max_prompt_tokens=10).test_client()
    assert predict(client, prompt="a" * 10, max_new_tokens=2).status_code == 200
    assert_error(predict(client, prompt="a" * 11), 422, "prompt_too_long", "prompt")


def test_prompt_over_the_context_minus_max_new_tokens_is_422(client):
    assert predict(client, prompt="a" * 156, max_new_tokens=100).status_code == 200  # exactly 256
    error = assert_error(predict(client, prompt="a" * 157, max_new_tokens=100), 422, "prompt_too_long", "prompt")
    assert "256" in error["message"]


def test_chat_without_a_template_is_422(pair):
    draft, target, tokenizer = pair
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    client = make_app((draft, target, plain)).test_client()
    assert_error(predict(client, chat=True), 422, "invalid_field", "chat")


def test_queue_full_is_503_with_retry_after(pair):
    app = make_app(pair, queue_size=0)
    slot = app.extensions["specdec"].scheduler.acquire()  # another request is decoding
    try:
        response = predict(app.test_client())
    finally:
        slot.release()
    assert_error(response, 503, "overloaded")
    assert response.headers["Retry-After"] == "5"
    assert predict(app.test_client(), max_new_tokens=2).status_code == 200


def test_queue_timeout_is_503_with_retry_after(pair):
    app = make_app(pair, queue_size=1, queue_timeout=0.2)
    slot = app.extensions["specdec"].scheduler.acquire()
    try:
        response = predict(app.test_client())
    finally:
        slot.release()
    error = assert_error(response, 503, "overloaded")
    assert "queue timeout" in error["message"] and response.headers["Retry-After"] == "5"


def test_draining_refuses_new_requests_and_serves_those_in_flight(pair):
    app = make_app(pair, queue_size=1, retry_after=7)
    service, client = app.extensions["specdec"], app.test_client()
    slot = service.scheduler.acquire()  # a request is decoding
    queued = {}
    waiter = threading.Thread(target=lambda: queued.update(response=predict(app.test_client(), max_new_tokens=3)))
    waiter.start()
    while service.scheduler.waiting < 1:  # and one waits in the queue
        waiter.join(0.01)
    service.drain()
    assert not service.idle
    for response in (client.get("/readyz"), predict(client)):
        error = assert_error(response, 503, "shutting_down")
        assert "shutting down" in error["message"] and response.headers["Retry-After"] == "7"
    assert client.get("/healthz").status_code == 200  # alive, just not taking work
    assert "specdec_ready 0.0" in client.get("/metrics").get_data(as_text=True)
    slot.release()
    waiter.join(30)
    assert queued["response"].status_code == 200  # the queued request was served
    assert service.idle


def test_a_request_that_came_in_before_the_drain_is_served(pair):
    from specdec.serve.service import RequestRecord

    app = make_app(pair)
    service = app.extensions["specdec"]
    before = RequestRecord("before-the-drain")
    service.drain()
    prompt = service.encode("Who is")
    # seeded: a sampled <eos> would end it before its 3 tokens (seen once unseeded)
    generation = service.generation(prompt, service.settings.sampling.replace(max_new_tokens=3, seed=1), before)
    generation.run()
    generation.close()
    assert len(generation.completion.tokens) == 3 and service.idle
    with pytest.raises(Exception, match="shutting down"):
        service.generation(prompt, service.settings.sampling, RequestRecord("after-the-drain"))


def test_unexpected_failure_is_500_and_the_server_keeps_serving(app, client, service, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(service.decoder, "stream", broken)
    with caplog.at_level(logging.ERROR, logger="specdec.serve"):
        response = predict(client)
    error = assert_error(response, 500, "internal_error")
    request_id = response.headers["X-Request-ID"]
    assert request_id in error["message"] and "Traceback" not in response.get_data(as_text=True)
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)
    monkeypatch.undo()
    assert not service.scheduler.busy
    assert predict(client, max_new_tokens=3).status_code == 200


def test_failure_mid_stream_is_an_error_event(client, service, monkeypatch):
    fail_after_first_chunk(monkeypatch, service.decoder)
    response = predict(client, stream=True, buffered=True)
    events = sse_events(response)
    assert events[-1]["error"]["type"] == "internal_error" and "finish_reason" not in events[-1]
    assert not service.scheduler.busy


# --- decoding over HTTP ----------------------------------------------------------------------------------------

def test_details_list_every_token(client):
    body = predict(client, max_new_tokens=25, details=True, seed=3).get_json()
    tokens = body["tokens"]
    assert len(tokens) == body["usage"]["completion_tokens"]
    assert "".join(t["text"] for t in tokens) == body["text"]
    assert all(set(t) == {"id", "text", "source"} and isinstance(t["id"], int) for t in tokens)
    assert {t["source"] for t in tokens} <= {"draft", "resampled", "bonus"}
    target_only = predict(client, max_new_tokens=5, details=True, method="target").get_json()
    assert {t["source"] for t in target_only["tokens"]} == {"target"}


@pytest.mark.parametrize("kwargs", [{"temperature": 0.9, "seed": 11}, {"temperature": 0, "method": "target"}])
def test_a_json_answer_without_stop_strings_equals_one_detokenized_round_by_round(client, kwargs):
    """Without stop strings a JSON answer's rounds are detokenized once decoding has ended (Generation.run);
    with a stop string that never matches, round by round; streamed, round by round as well. All three give the
    same text, tokens and log-probabilities."""
    body = {"max_new_tokens": 40, "details": True, "logprobs": 2, "cache_prompt": False, **kwargs}
    deferred = predict(client, **body).get_json()
    per_round = predict(client, stop=["\x00never"], **body).get_json()
    events = sse_events(predict(client, stream=True, buffered=True, **body))
    assert deferred["usage"]["completion_tokens"] > 10
    for key in ("text", "tokens", "logprobs", "finish_reason", "usage"):
        assert deferred[key] == per_round[key], key
    assert "".join(e["text"] for e in events) == deferred["text"]
    assert [entry for e in events for entry in e["logprobs"]] == deferred["logprobs"]
    # a stream without stop strings is detokenized and rendered by the greenlet as it takes each round; with one,
    # on the engine thread as each is decoded: the same events
    per_round_events = sse_events(predict(client, stream=True, buffered=True, stop=["\x00never"], **body))
    assert len(events) == len(per_round_events) > 3
    for event, other in zip(events, per_round_events):
        event["stats"] = other["stats"] = None  # the timings differ
        assert event == other


@pytest.mark.parametrize("kwargs", [{"method": "target"}, {"gamma": 3}])
def test_a_text_only_stream_renders_the_rounds_it_takes_together_as_each_round_alone(client, kwargs):
    """Without details or logprobs a stream's greenlet feeds the rounds it takes together and renders each from
    its text (Generation.rounds' render_texts); with a stop string that never matches each round is rendered
    alone on the engine thread, and with details on the greenlet round by round: the same events, one a round."""
    body = {"max_new_tokens": 40, "seed": 4, "temperature": 0.9, "cache_prompt": False, **kwargs}
    together = sse_events(predict(client, stream=True, buffered=True, **body))
    alone = sse_events(predict(client, stream=True, buffered=True, stop=["\x00never"], **body))
    detailed = sse_events(predict(client, stream=True, buffered=True, details=True, **body))
    assert len(together) == len(alone) == len(detailed) == together[-1]["stats"]["rounds"] + 1 > 5
    for event, other, more in zip(together, alone, detailed):
        event["stats"] = other["stats"] = more["stats"] = None  # the timings differ
        assert event == other == {key: value for key, value in more.items() if key != "tokens"}
    assert "".join(e["text"] for e in together) == predict(client, **body).get_json()["text"]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_a_text_event_is_the_event_rendered(text):
    """/predict's text-only events come from a template (generation.text_template): the same bytes as rendering
    the event, for any text (quotes, backslashes, control characters, non-ASCII, the placeholder itself)."""
    from specdec.serve.generation import TEXT_PLACEHOLDER, _text_event, sse, text_template

    assert _text_event(text) == sse({"text": text})
    assert _text_event(TEXT_PLACEHOLDER + text) == sse({"text": TEXT_PLACEHOLDER + text})
    assert text_template(lambda t: sse({"a": [t], "b": 1}))(text) == sse({"a": [text], "b": 1})


def reference(client, **kwargs):
    """A greedy completion long enough to pick stop strings from."""
    body = predict(client, temperature=0, max_new_tokens=60, details=True, **kwargs).get_json()
    assert len(body["text"]) >= 30, body
    return body


def test_stop_string_cuts_the_text(client):
    full = reference(client)["text"]
    stop = full[20:23]
    expected = full[:full.find(stop)]
    body = predict(client, temperature=0, max_new_tokens=60, stop=["never-there", stop], details=True).get_json()
    assert body["text"] == expected and body["finish_reason"] == "stop"
    joined = "".join(t["text"] for t in body["tokens"])
    assert joined.startswith(expected + stop[0]) and len(joined) < len(full)  # decoding stopped early
    assert body["usage"]["completion_tokens"] == len(body["tokens"])
    assert body["stats"]["new_tokens"] >= len(body["tokens"])


def test_stop_string_in_a_stream_is_never_sent(client):
    full = reference(client)["text"]
    stop = full[20:24]
    expected = full[:full.find(stop)]
    events = sse_events(predict(client, temperature=0, max_new_tokens=60, stop=[stop], stream=True, buffered=True))
    sent = "".join(e["text"] for e in events)
    assert sent == expected and events[-1]["finish_reason"] == "stop"


def test_seed_reproducibility(client):
    first = predict(client, temperature=1.0, top_p=1.0, seed=1234, details=True).get_json()
    again = predict(client, temperature=1.0, top_p=1.0, seed=1234, details=True).get_json()
    assert first["tokens"] == again["tokens"] and first["text"] == again["text"]
    others = [predict(client, temperature=1.0, top_p=1.0, seed=s).get_json()["text"] for s in (1, 2, 3)]
    assert any(text != first["text"] for text in others)


@pytest.mark.parametrize("method, gamma", [("google", 1), ("google", 4), ("google", None), ("deepmind", 3),
                                           ("google", "adaptive"), ("deepmind", "adaptive")])
def test_greedy_equals_target_only_greedy(client, method, gamma):
    target_only = predict(client, temperature=0, max_new_tokens=50, method="target").get_json()
    speculative = predict(client, temperature=0, max_new_tokens=50, method=method, gamma=gamma).get_json()
    assert speculative["text"] == target_only["text"]
    assert speculative["usage"] == target_only["usage"]
    # null is the server's default (4 here); "adaptive" asks for adaptive gamma whatever the default (an audit)
    assert speculative["stats"]["gamma"] == {None: 4, "adaptive": None}.get(gamma, gamma)


def test_adaptive_gamma_is_refused_where_max_gamma_is_below_what_it_proposes(pair):
    """Adaptive gamma proposes up to 8 tokens a round: a request asking for it went past a max_gamma of 2 (a
    review); refused there, as a default in the settings is."""
    from specdec.serve.config import ConfigError, load_settings

    error = make_app(pair, max_gamma=2, gamma=2).test_client().post(
        "/predict", json={"prompt": "abc", "gamma": "adaptive"}).get_json()["error"]
    assert error["field"] == "gamma" and "max_gamma of 2" in error["message"]
    with pytest.raises(ConfigError, match="past max_gamma"):
        load_settings({"gamma": "adaptive", "max_gamma": 4}, environ={})


@pytest.mark.parametrize("body, field, words", [
    ({"max-tokens": 5}, "max-tokens", "unknown field 'max-tokens'"),  # a review: the cleanup dropped its name
    ({"logit_bias": {"-1": 5}}, "logit_bias", "logit_bias[-1]"),
    ({"logit_bias": {"a-b": 5}}, "logit_bias", "logit_bias[a-b]"),  # an audit: a key like a mark was dropped
    # an audit: a nested unknown key was blamed on its parent, as if structured outputs were unknown
    ({"structured_outputs": {"regex": "a+", "regexx": "b"}}, "structured_outputs",
     "unknown field 'structured_outputs.regexx'"),
    ({"gamma": "fast"}, "gamma", 'gamma: must be an integer of at least 1, or "adaptive"'),
])
def test_an_error_names_the_place_in_the_body_without_pydantics_marks(client, body, field, words):
    error = predict(client, **body).get_json()["error"]
    assert error["field"] == field and words in error["message"], error


@pytest.mark.parametrize("gamma", ["fast", "Adaptive", 0, 17])
def test_a_gamma_neither_a_draft_length_nor_adaptive_is_refused_naming_it(client, gamma):
    error = predict(client, gamma=gamma).get_json()["error"]
    assert error["field"] == "gamma" and "[" not in error["message"], error  # no pydantic union tag in it
    assert ("adaptive" in error["message"]) == isinstance(gamma, str)


def test_a_logit_bias_bans_and_favours_tokens_and_speculation_keeps_target_only_greedy(client):
    """logit_bias: -100 on the token target-only greedy gives most keeps it out, and greedy speculative decoding
    with the bias gives target-only's text with the same bias (streamed too)."""
    plain = predict(client, temperature=0, max_new_tokens=30, method="target", details=True).get_json()
    ids = [token["id"] for token in plain["tokens"]]
    banned = max(set(ids), key=ids.count)
    bias = {str(banned): -100}
    target_only = predict(client, temperature=0, max_new_tokens=30, method="target", details=True,
                          logit_bias=bias).get_json()
    assert banned not in [token["id"] for token in target_only["tokens"]] and target_only["text"] != plain["text"]
    for method, gamma in (("google", 4), ("deepmind", None)):
        body = predict(client, temperature=0, max_new_tokens=30, method=method, gamma=gamma, logit_bias=bias)
        assert body.get_json()["text"] == target_only["text"]
    streamed = sse_events(predict(client, temperature=0, max_new_tokens=30, stream=True, logit_bias=bias))
    assert "".join(event.get("text", "") for event in streamed) == target_only["text"]
    favoured = predict(client, temperature=0.8, seed=3, max_new_tokens=20, details=True,
                       logit_bias={str(banned): 100}).get_json()
    assert all(token["id"] == banned for token in favoured["tokens"])


def test_stop_token_ids_end_the_text_at_the_first_one(client):
    """stop_token_ids (vLLM's): the completion ends with the first of them (its text kept), finish_reason stop,
    streamed too; combined with a constraint it is a 422 naming the field."""
    plain = predict(client, temperature=0, max_new_tokens=30, details=True).get_json()
    ids = [token["id"] for token in plain["tokens"]]
    stop = ids[len(ids) // 2]
    cut = ids.index(stop) + 1
    body = predict(client, temperature=0, max_new_tokens=30, details=True, stop_token_ids=[stop]).get_json()
    assert [token["id"] for token in body["tokens"]] == ids[:cut] and body["finish_reason"] == "stop"
    assert body["text"] == "".join(token["text"] for token in plain["tokens"][:cut])
    streamed = sse_events(predict(client, temperature=0, max_new_tokens=30, stream=True, stop_token_ids=[stop]))
    assert "".join(event.get("text", "") for event in streamed) == body["text"]
    assert streamed[-1]["finish_reason"] == "stop"
    refused = predict(client, stop_token_ids=[stop], structured_outputs={"choice": ["yes", "no"]})
    assert refused.status_code == 422 and refused.get_json()["error"]["field"] == "stop_token_ids"


def test_min_tokens_holds_back_the_ending_tokens_and_stop_strings_until_then(client):
    """min_tokens (vLLM's): a stop token the greedy completion starts with cannot end it before min_tokens tokens,
    nor a stop string its first token completes; JSON and SSE alike."""
    plain = predict(client, temperature=0, max_new_tokens=30, details=True).get_json()
    first = plain["tokens"][0]
    ended = predict(client, temperature=0, max_new_tokens=30, stop_token_ids=[first["id"]]).get_json()
    assert ended["usage"]["completion_tokens"] == 1 and ended["finish_reason"] == "stop"
    body = predict(client, temperature=0, max_new_tokens=30, details=True, stop_token_ids=[first["id"]],
                   min_tokens=5).get_json()
    ids = [token["id"] for token in body["tokens"]]
    assert len(ids) >= 5 and first["id"] not in ids[:5]
    assert body["finish_reason"] == ("stop" if first["id"] in ids else "length")
    streamed = sse_events(predict(client, temperature=0, max_new_tokens=30, stream=True,
                                  stop_token_ids=[first["id"]], min_tokens=5))
    assert "".join(event.get("text", "") for event in streamed) == body["text"]
    assert predict(client, temperature=0, max_new_tokens=30, stop=[first["text"]]).get_json()["text"] == ""
    late = predict(client, temperature=0, max_new_tokens=30, stop=[first["text"]], min_tokens=2).get_json()
    assert late["text"].startswith(plain["text"][:1]) and late["usage"]["completion_tokens"] >= 2


def test_penalties_cut_repeats_and_speculation_keeps_target_only_greedy(client):
    """presence, frequency and repetition penalties: the greedy text repeats its commonest token less, and greedy
    speculative decoding under them gives target-only's text under them (every drafter, both rules, streamed too)."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.2}
    plain = predict(client, temperature=0, max_new_tokens=30, method="target", details=True).get_json()
    target_only = predict(client, temperature=0, max_new_tokens=30, method="target", details=True,
                          **penalties).get_json()
    most = max((token["id"] for token in plain["tokens"]), key=[token["id"] for token in plain["tokens"]].count)
    assert target_only["text"] != plain["text"]
    assert sum(token["id"] == most for token in target_only["tokens"]) < sum(
        token["id"] == most for token in plain["tokens"])
    for method, gamma, drafter, verification in (("google", 4, "model", "token"), ("deepmind", None, "hybrid", "block"),
                                                 ("google", 3, "lookup", "token")):
        body = predict(client, temperature=0, max_new_tokens=30, method=method, gamma=gamma, drafter=drafter,
                       verification=verification, **penalties)
        assert body.get_json()["text"] == target_only["text"], (method, drafter, verification)
    streamed = sse_events(predict(client, temperature=0, max_new_tokens=30, stream=True, **penalties))
    assert "".join(event.get("text", "") for event in streamed) == target_only["text"]


@pytest.mark.parametrize("drafter, verification", [("lookup", "token"), ("hybrid", "block"), ("model", "block")])
def test_drafter_and_verification_fields(client, drafter, verification):
    prompt = "abcabcabcabcabcabc"
    target_only = predict(client, prompt=prompt, temperature=0, max_new_tokens=30, method="target").get_json()
    body = predict(client, prompt=prompt, temperature=0, max_new_tokens=30, drafter=drafter,
                   verification=verification, details=True).get_json()
    assert body["text"] == target_only["text"]
    stats = body["stats"]
    assert (stats["drafter"], stats["verification"]) == (drafter, verification)
    assert sum(stats["round_share_by_drafter"].values()) == pytest.approx(1.0)
    sources = {t["source"] for t in body["tokens"]}
    assert sources <= {"draft", "lookup", "resampled", "bonus"}
    if drafter != "model":
        assert stats["proposed_by_drafter"]["lookup"] > 0


def test_draft_confidence_threshold_field(client):
    """At 1 the draft model ends every run after its first token (any probability is below 1): one model proposal
    per round at most, and greedy output still target-only's; left out, the configured 0 drafts gamma tokens."""
    target_only = predict(client, temperature=0, max_new_tokens=30, method="target").get_json()
    body = predict(client, temperature=0, max_new_tokens=30, gamma=4, draft_confidence_threshold=1).get_json()
    assert body["text"] == target_only["text"]
    stats = body["stats"]
    assert stats["draft_confidence_threshold"] == 1.0
    assert stats["proposed"] <= stats["rounds"] and stats["draft_forwards"] <= stats["rounds"]
    default = predict(client, temperature=0, max_new_tokens=30, gamma=4).get_json()["stats"]
    assert default["draft_confidence_threshold"] == 0.0 and default["proposed"] > default["rounds"]


def test_chat_applies_the_template(client):
    plain = predict(client, max_new_tokens=2).get_json()
    chat = predict(client, max_new_tokens=2, chat=True).get_json()
    # "<bos>user: " + prompt + "\n" + "<bos>assistant: " with <bos> as one token
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("user: \nassistant: ") + 2


def test_stream_sends_one_event_per_round_then_a_summary(client):
    response = predict(client, stream=True, seed=9, max_new_tokens=40, details=True, buffered=True)
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    events = sse_events(response)
    final = events[-1]
    assert set(final) == {"text", "finish_reason", "usage", "stats"}
    assert len(events) - 1 == final["stats"]["rounds"]  # speculation commits several tokens per event
    assert any(len(e["tokens"]) > 1 for e in events[:-1])
    plain = predict(client, seed=9, max_new_tokens=40).get_json()
    assert "".join(e["text"] for e in events) == plain["text"]
    assert final["usage"] == plain["usage"] and final["finish_reason"] == plain["finish_reason"]


@pytest.mark.parametrize("path, body", [
    ("/predict", {"prompt": PROMPT}),  # rendered by the sender
    ("/predict", {"prompt": PROMPT, "stop": ["never in this text \u2603"]}),  # rendered on the engine thread
    ("/v1/completions", {"model": "target", "prompt": PROMPT, "logprobs": 2}),
])
def test_a_stream_frees_the_engine_once_decoded_though_its_client_has_read_nothing(client, service, path, body):
    """A client that stops reading a stream: its rounds are all decoded and the engine freed for the next
    request while the events wait for it (one such client held the engine until it was dropped, 300 s later,
    and every other request waited or got 503)."""
    tokens = "max_new_tokens" if path == "/predict" else "max_tokens"
    response = client.post(path, json={**body, tokens: 60, "seed": 1, "ignore_eos": True, "stream": True})
    events = iter(response.response)
    first = next(events)
    wait_until_engine_free(service)  # the client reads nothing meanwhile
    assert predict(client, max_new_tokens=3).status_code == 200  # served while the stream is unread
    rest = (first + b"".join(events)).decode()
    response.close()
    blocks = [block.removeprefix("data: ") for block in rest.strip().split("\n\n")]
    if path == "/predict":
        final = json.loads(blocks[-1])
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 60
    else:
        assert blocks[-1] == "[DONE]" and json.loads(blocks[-2])["choices"][0]["finish_reason"] == "length"


def test_closing_a_stream_stops_generation(client, service, caplog):
    def generated():
        for line in client.get("/metrics").get_data(as_text=True).splitlines():
            if line.startswith("specdec_generated_tokens_total "):
                return float(line.split()[-1])

    before = generated()
    with caplog.at_level(logging.INFO, logger="specdec.serve"):
        # seeded: a sampled <eos> in the first round would end the request before the close (seen once unseeded)
        response = predict(client, stream=True, max_new_tokens=200, gamma=2, seed=1,
                           headers={"X-Request-ID": "gone-1"})
        first = next(iter(response.response))
        assert first.startswith(b"data: ") and service.scheduler.busy
        response.close()  # what the server does when a write to a departed client fails
    assert not service.scheduler.busy
    assert generated() - before < 100  # the rounds decoded before the close, not 200 tokens
    assert any("request_id=gone-1" in r.getMessage() and "finish_reason=cancelled" in r.getMessage()
               for r in caplog.records)
    assert predict(client, max_new_tokens=3).status_code == 200



def test_a_stream_closed_after_the_next_request_does_not_set_the_prompt_cache_gauges_back(client, service):
    """A stream frees the engine once decoded, and the next request may run before its client has read it: the
    gauges are set when its caches go to the prompt cache, not when the stream is closed (which set them back to
    what the cache held before the next request)."""
    def entries() -> float:
        for line in client.get("/metrics").get_data(as_text=True).splitlines():
            if line.startswith("specdec_prompt_cache_entries "):
                return float(line.split()[-1])

    response = predict(client, prompt="a first prompt, streamed", stream=True, max_new_tokens=30, seed=1,
                       ignore_eos=True)
    events = iter(response.response)
    next(events)
    wait_until_engine_free(service)  # the client reads nothing meanwhile
    assert predict(client, prompt="another prompt entirely, answered whole", max_new_tokens=3).status_code == 200
    after_the_next = entries()
    b"".join(events)
    response.close()
    assert entries() == after_the_next
