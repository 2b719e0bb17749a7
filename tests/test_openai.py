"""The OpenAI-compatible /v1 routes through Flask's test client: answer and chunk shapes, streaming order,
refusals naming their field, OpenAI-shaped errors (and /predict's unchanged), overload, the context limit, the
shared log line and metrics, an error after a stream started, and /openapi.json. The official client against a
live gunicorn is in test_openai_gunicorn.py."""

import json
import logging
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specdec.errors import SpecDecError
from specdec.serve.errors import ApiError
from specdec.serve.openai_protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
    TokenizeRequest,
)
from specdec.serve.protocol import PredictRequest
from tests.support.models import SPECIALS, make_app, wait_until_engine_free
from tests.support.spies import fail_after_first_chunk

pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.xdist_group("openai")]

PROMPT = "Who is the president of the USA"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


@pytest.fixture
def service(app):
    return app.extensions["specdec"]


def complete(client, headers=None, **body):
    return client.post("/v1/completions", json={"model": "target", "prompt": PROMPT, **body}, headers=headers,
                       buffered=True)


def chat(client, headers=None, **body):
    return client.post("/v1/chat/completions", json={"model": "target", "messages": MESSAGES, **body},
                       headers=headers, buffered=True)


def chunks(response) -> list[dict]:
    """The JSON chunks of an OpenAI stream, checking it ends with [DONE]."""
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    blocks = response.get_data(as_text=True).strip("\n").split("\n\n")
    assert all(block.startswith("data: ") and "\n" not in block for block in blocks)
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-1]]


def assert_openai_error(response, status, code, param=None):
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["code"] == code and error["param"] == param and error["message"]
    return error


def metric(client, name, labels=""):
    for line in client.get("/metrics").get_data(as_text=True).splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


# --- answers ---------------------------------------------------------------------------------------------------

def test_models_lists_the_target_with_the_draft_in_its_metadata(client):
    body = client.get("/v1/models").get_json()
    ModelList.model_validate(body)
    assert body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert model["id"] == "target" and model["object"] == "model" and model["max_model_len"] == 256
    assert model["metadata"]["draft"] == "draft" and model["metadata"]["target"] == "target"
    assert model["metadata"]["drafter"] == "model" and model["metadata"]["verification"] == "token"
    assert model["metadata"]["draft_confidence_threshold"] == 0.0


def test_completion_answer(client):
    response = complete(client, max_tokens=20, seed=3, gamma=3)
    body = response.get_json()
    Completion.model_validate(body)
    assert body["object"] == "text_completion" and body["model"] == "target"
    assert body["id"] == "cmpl-" + response.headers["X-Request-ID"] and body["system_fingerprint"].startswith("fp_")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(PROMPT) and 1 <= usage["completion_tokens"] <= 20
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    stats = choice["speculative_decoding_stats"]
    assert stats["method"] == "google" and stats["gamma"] == 3 and stats["seed"] == 3
    assert stats["drafter"] == "model" and stats["verification"] == "token"  # the configured defaults
    assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    assert len(stats["num_accepted_tokens_per_pos"]) == 3  # every position proposed, zeros included
    assert stats["draft_acceptance_rate"] == pytest.approx(stats["num_accepted_tokens"] / stats["num_draft_tokens"])
    assert 1 <= stats["mean_acceptance_length"] <= 4


def test_the_fingerprint_is_the_served_pairs_and_settings_not_the_starts(service):
    """Found by an audit: system_fingerprint hashed the load's seconds and memory, so every restart (and every
    replica) looked like another backend to a client that pairs it with `seed`. It is now the same for the same
    pair and settings, and another for a setting that changes the model or the decoding defaults."""
    from specdec.serve.openai_protocol import fingerprint

    info, settings = dict(service.models.info), service.settings
    assert {"load_seconds", "resident_memory_bytes"} <= set(info)
    restarted = info | {"load_seconds": info["load_seconds"] + 1.5, "resident_memory_bytes": 1,
                        "peak_resident_memory_bytes": 2}
    assert fingerprint(restarted, settings) == fingerprint(info, settings)
    same = settings.model_copy(update={"port": settings.port + 1, "log_level": "debug", "queue_size": 9})
    assert fingerprint(info, same) == fingerprint(info, settings)
    for changed in ({"quantize": "int4"}, {"weights": "float"}, {"temperature": 0.3}, {"gamma": 2},
                    {"draft_model": "another/draft"}, {"lookup_max_ngram": 2}):
        assert fingerprint(info, settings.model_copy(update=changed)) != fingerprint(info, settings), changed
    assert fingerprint(info | {"models": {"target": "another", "draft": "pair"}}, settings) != fingerprint(info, settings)


def test_chat_answer_goes_through_the_chat_template(client, service):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
             MESSAGES[1]]
    body = chat(client, messages=parts, max_completion_tokens=8, temperature=0).get_json()
    ChatCompletion.model_validate(body)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    expected = service.encode(messages=[{"role": "system", "content": "Be\nbrief."},
                                        {"role": "user", "content": PROMPT}])
    assert body["usage"]["prompt_tokens"] == len(expected)
    assert body["usage"]["completion_tokens"] <= 8 and choice["speculative_decoding_stats"]["method"] == "google"


def test_chat_continues_the_assistants_message_it_was_given(client, service):
    """continue_final_message (vLLM's): the answer continues the last message, the prompt being the conversation
    with that message left open, as /tokenize shows it; greedy, it equals a completion of those very tokens."""
    begun = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    body = chat(client, messages=begun, continue_final_message=True, max_completion_tokens=8, temperature=0)
    assert body.status_code == 200, body.get_data(as_text=True)
    answer = body.get_json()
    prompt = client.post("/tokenize", json={"messages": begun, "continue_final_message": True}).get_json()["tokens"]
    assert service.tokenizer.decode(prompt).endswith("<bos>assistant: The answer is")
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    plain = complete(client, prompt=prompt, max_tokens=8, temperature=0).get_json()["choices"][0]
    assert answer["choices"][0]["message"]["content"] == plain["text"]
    opened = chat(client, messages=begun, max_completion_tokens=8, temperature=0).get_json()  # a new turn instead
    assert opened["usage"]["prompt_tokens"] > len(prompt)
    not_assistants = chat(client, continue_final_message=True, max_completion_tokens=8)
    assert not_assistants.status_code == 400
    assert not_assistants.get_json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("method, gamma", [("google", 4), ("deepmind", 2), ("google", None), ("google", "adaptive")])
def test_greedy_equals_target_only_greedy(client, method, gamma):
    target_only = client.post("/predict", json={"prompt": PROMPT, "temperature": 0, "max_new_tokens": 40,
                                                "method": "target"}).get_json()
    body = complete(client, temperature=0, max_tokens=40, method=method, gamma=gamma).get_json()
    assert body["choices"][0]["text"] == target_only["text"]
    assert body["usage"]["completion_tokens"] == target_only["usage"]["completion_tokens"]


@pytest.mark.parametrize("drafter", ["model", "lookup", "hybrid"])
@pytest.mark.parametrize("verification", ["token", "block"])
def test_every_drafter_and_rule_is_served_and_greedy_equals_target_only(client, drafter, verification):
    prompt = "one two three one two three one two"  # repeated n-grams, so that lookup has matches to propose
    target_only = client.post("/predict", json={"prompt": prompt, "temperature": 0, "max_new_tokens": 30,
                                                "method": "target"}).get_json()
    body = complete(client, prompt=prompt, temperature=0, max_tokens=30, drafter=drafter,
                    verification=verification).get_json()
    assert body["choices"][0]["text"] == target_only["text"]
    stats = body["choices"][0]["speculative_decoding_stats"]
    assert stats["drafter"] == drafter and stats["verification"] == verification
    answer = chat(client, temperature=0, max_tokens=8, drafter=drafter, verification=verification).get_json()
    assert answer["choices"][0]["speculative_decoding_stats"]["drafter"] == drafter
    stopped = complete(client, prompt=prompt, temperature=0, max_tokens=30, drafter=drafter,
                       verification=verification, draft_confidence_threshold=1).get_json()
    assert stopped["choices"][0]["text"] == target_only["text"]
    stopped_stats = stopped["choices"][0]["speculative_decoding_stats"]
    assert stopped_stats["draft_confidence_threshold"] == (None if drafter == "lookup" else 1.0)
    assert stats["draft_confidence_threshold"] == (None if drafter == "lookup" else 0.0)


def test_max_tokens_left_out_fits_the_context(client):
    body = complete(client, prompt="a" * 250).get_json()  # the default of 64 would not fit a context of 256
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 256
    assert body["usage"]["completion_tokens"] >= 1


def test_a_suffix_no_limit_could_hold_is_refused_before_it_is_tokenized(client, service, monkeypatch):
    """Found by an audit of costly valid requests: a fill-in-the-middle request's megabyte of suffix was tokenized
    before it was refused, though a text prompt that long is refused at once (more characters than the limit's
    tokens can spell). The suffix and the prompt now count; nothing is tokenized."""
    from specdec.serve import service as service_module

    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(service_module, "encode_infill", never)
    longest = service.models.longest_token * service.settings.max_prompt_tokens
    for prompt, suffix in (("def f(", "x" * (longest + 1)), ("y" * longest, "}")):
        error = assert_openai_error(complete(client, prompt=prompt, suffix=suffix), 400, "context_length_exceeded",
                                    "prompt")
        assert "characters" in error["message"]


def test_an_answer_made_off_the_event_loop_is_jsonifys_bytes(client, app):
    """An answer with logprobs is made off the event loop (Service.respond's `large`): the very bytes Flask's
    jsonify makes of the same answer, with several choices, logprobs and echo, and /predict's."""
    from flask import jsonify

    answers = [complete(client, prompt=["ab", "cd"], n=2, max_tokens=6, seed=2, logprobs=2, echo=True),
               chat(client, n=3, max_tokens=5, seed=1, logprobs=True, top_logprobs=2),
               client.post("/predict", json={"prompt": "é\u2028x", "max_new_tokens": 5, "details": True,
                                             "logprobs": 2})]
    with app.app_context():
        for response in answers:
            assert response.status_code == 200 and response.mimetype == "application/json"
            assert response.get_data() == jsonify(response.get_json()).get_data()


def test_a_grammar_that_failed_while_a_request_waited_is_compiled_afresh_for_it(service):
    """Found by a review: a request handed a cached grammar that another request's failure then let go (its
    lexer past the engine's limits) was refused; it now takes the grammar compiled afresh."""
    from specdec.grammar import Constraint
    from specdec.serve.service import RequestRecord

    compiled = service.grammar(Constraint("regex", "a{3}", field="structured_outputs.regex"))
    compiled._fail(True)  # as another request's failure leaves it
    ids = service.encode("pick:")
    generation = service.generation(ids, service.settings.sampling.replace(max_new_tokens=8, seed=1),
                                    RequestRecord("r"), grammar=compiled)
    try:
        generation.run()
    finally:
        generation.close()
    assert generation.completion.text == "aaa" and generation.finish_reason() == "stop"


def test_a_large_text_is_tokenized_with_a_copy_of_the_tokenizer_under_its_own_lock(service):
    """Found by a review: a large text tokenized off the event loop held the tokenizer's lock meanwhile, and a
    greenlet that then took it (a stream's round, a small prompt) stopped the loop's thread until it was done.
    The pool's thread uses a copy, under a lock of its own: the same ids, with the shared lock held elsewhere."""
    import threading

    from specdec.serve.service import LARGE_TEXT, _text_size

    text = "ab cd " * (LARGE_TEXT // 5)
    expected = service.tokenize(text[:LARGE_TEXT // 2] + "")[:5]
    assert service.tokenize(text)[:5] == expected  # the copy is made at the first large text
    done = {}
    with service.tokenizer_lock:  # held, as by the engine thread or a greenlet
        worker = threading.Thread(target=lambda: done.setdefault("ids", service.tokenize(text)))
        worker.start()
        worker.join(60)
    assert not worker.is_alive() and len(done["ids"]) == len(service.tokenize(text))
    # keys and numbers count as written (a tool's 60,000 property names measured 15 characters)
    assert _text_size({"k" * 30_000: 1}) > LARGE_TEXT and _text_size({"enum": list(range(10_000))}) > LARGE_TEXT


def test_each_tokens_text_and_bytes_are_found_once(service, monkeypatch):
    """Found by the same audit: logprobs decoded every token alone, 21 a position, so an echoed prompt's scores
    (16 prompts of 4,000 tokens, 20 alternatives) held the event loop for 12 s; each id is decoded once."""
    calls = []
    decode = service.tokenizer.decode
    monkeypatch.setattr(service.tokenizer, "decode", lambda ids, **kwargs: calls.append(ids) or decode(ids, **kwargs))
    service._token_texts.clear()
    service._token_bytes.clear()
    assert [service.token_text(i) for i in (5, 6, 5, 5, 6)] == [decode([i], skip_special_tokens=False) for i in
                                                                 (5, 6, 5, 5, 6)]
    assert calls == [[5], [6]]
    assert service.token_bytes(7) == service.token_bytes(7) and list(service._token_bytes) == [7]


def test_prompt_over_the_context_is_context_length_exceeded(client):
    error = assert_openai_error(complete(client, prompt="a" * 250, max_tokens=10), 400, "context_length_exceeded",
                                "prompt")
    assert "256" in error["message"] and "max_tokens" in error["message"]
    error = assert_openai_error(chat(client, messages=[{"role": "user", "content": "a" * 260}]), 400,
                                "context_length_exceeded", "messages")
    # max_tokens left out: the prompt alone is at fault (the message named a default the client never sent)
    assert "max_tokens" not in error["message"]
    error = assert_openai_error(complete(client, prompt="a" * 256), 400, "context_length_exceeded", "prompt")
    assert "the prompt has 256" in error["message"] and "no room is left" in error["message"]
    assert "max_tokens" not in error["message"]


# --- streaming -------------------------------------------------------------------------------------------------

def test_completion_stream_with_usage(client):
    # the prompt cache reuses keys computed in other forwards (logits equal to the last bits only with it off)
    events = chunks(complete(client, stream=True, seed=5, max_tokens=30, stream_options={"include_usage": True},
                             cache_prompt=False))
    plain = complete(client, seed=5, max_tokens=30, cache_prompt=False).get_json()
    *content, usage = events
    for chunk in events:
        Completion.model_validate(chunk)
        assert chunk["object"] == "text_completion" and chunk["id"] == events[0]["id"]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    assert all(chunk["usage"] is None for chunk in content)
    assert "".join(chunk["choices"][0]["text"] for chunk in content) == plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in content[:-1]] == [None] * (len(content) - 1)
    last = content[-1]["choices"][0]
    assert last["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert last["speculative_decoding_stats"]["num_draft_tokens"] > 0
    assert all("speculative_decoding_stats" not in c["choices"][0] for c in content[:-1])
    assert len(content) > 2 and all(c["choices"][0]["text"] for c in content[:-1])  # no empty chunk before the last


@pytest.mark.parametrize("route, echo", [("completions", False), ("completions", True), ("chat", False)])
def test_a_text_only_stream_renders_the_rounds_it_takes_together_as_each_round_alone(client, route, echo):
    """Without logprobs or tools a stream's greenlet feeds the rounds it takes together and renders their chunks
    from their texts (Generation.rounds' render_texts); with a stop string that never matches each round is
    rendered alone on the engine thread, and with logprobs on the greenlet round by round: the same chunks (the
    round that ends decoding with finish_reason, no empty one), the echoed prompt first."""
    ask = complete if route == "completions" else chat
    body = {"max_tokens": 30, "seed": 6, "temperature": 0.9, "gamma": 3, **({"echo": True} if echo else {})}

    def stripped(events):  # the chunks without what differs by design: timings, ids, times, logprobs
        for event in events:
            event.pop("id"), event.pop("created")
            for choice in event["choices"]:
                choice.pop("logprobs", None)
                (choice.get("speculative_decoding_stats") or {}).update(time_to_first_token_seconds=None,
                                                                         total_seconds=None, tokens_per_second=None)
        return events

    together = stripped(chunks(ask(client, stream=True, **body)))
    alone = stripped(chunks(ask(client, stream=True, stop=["\x00never"], **body)))
    with_logprobs = stripped(chunks(ask(client, stream=True, **body, **(
        {"logprobs": 1} if route == "completions" else {"logprobs": True}))))
    assert together == alone == with_logprobs and len(together) > 4
    texts = [c["choices"][0]["text"] if route == "completions" else c["choices"][0]["delta"].get("content")
             for c in together]
    assert all(texts[1 if route == "chat" else 0:])  # no empty chunk
    plain = ask(client, **body).get_json()["choices"][0]
    assert "".join(texts[1 if route == "chat" else 0:]) == (plain["text"] if route == "completions"
                                                            else plain["message"]["content"])


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=40), index=st.integers(0, 3), chat=st.booleans(), include_usage=st.booleans())
def test_a_text_chunk_is_the_models_rendering(text, index, chat, include_usage):
    """A stream's text chunks are rendered once as a template (openai_routes.Reply._text_chunk): the same bytes as
    the pydantic models give, for any text (quotes, control characters, non-ASCII) and either shape."""
    from specdec.serve.openai_routes import Reply

    reply = Reply(chat=chat, id="cmpl-1", created=7, model="target", fingerprint="fp", include_usage=include_usage)
    assert reply._chunk(text, index) == reply._rendered_chunk(text, index)
    assert reply._chunk(text, index, role=True) == reply._rendered_chunk(text, index, role=True)
    assert json.loads(reply._chunk(text, index).removeprefix("data: "))["choices"][0]["text" if not chat else
                                                                                     "delta"] in (text, {"content": text})


def test_chat_stream_starts_with_the_role(client):
    events = chunks(chat(client, stream=True, seed=2, max_tokens=25))
    plain = chat(client, seed=2, max_tokens=25).get_json()
    for chunk in events:
        ChatCompletionChunk.model_validate(chunk)
        assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk  # not asked for
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in events[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in events) == plain["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:-1])


def test_stream_stop_string_is_never_sent(client):
    full = complete(client, temperature=0, max_tokens=60).get_json()["choices"][0]["text"]
    stop = full[20:24]
    expected = full[:full.find(stop)]
    events = chunks(complete(client, temperature=0, max_tokens=60, stop=stop, stream=True))
    assert "".join(c["choices"][0]["text"] for c in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    body = complete(client, temperature=0, max_tokens=60, stop=["never-there", stop]).get_json()
    assert body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"


def test_failure_mid_stream_is_an_openai_error_chunk(client, service, monkeypatch):
    fail_after_first_chunk(monkeypatch, service.decoder)
    events = chunks(chat(client, stream=True, max_tokens=30))
    error = events[-1]["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and "boom" not in error["message"]
    assert not service.scheduler.busy


def test_closing_a_stream_stops_generation(client, service, caplog):
    before = metric(client, "specdec_generated_tokens_total")
    with caplog.at_level(logging.INFO, logger="specdec.serve"):
        # seeded: a sampled <eos> in the first round would end the request before the close (seen once unseeded)
        response = client.post("/v1/completions", headers={"X-Request-ID": "v1-gone"},
                               json={"model": "target", "prompt": PROMPT, "max_tokens": 200, "gamma": 2, "seed": 1,
                                     "stream": True})
        assert next(iter(response.response)).startswith(b"data: ") and service.scheduler.busy
        response.close()
    assert not service.scheduler.busy
    assert metric(client, "specdec_generated_tokens_total") - before < 100  # the rounds decoded before the close, not 200 tokens
    assert any("request_id=v1-gone POST /v1/completions" in r.getMessage() and "finish_reason=cancelled"
               in r.getMessage() for r in caplog.records)


# --- logprobs, echo, several prompts ---------------------------------------------------------------------------

def plain_logprobs(pair, ids: list[int]) -> list[float]:
    """The target's log-probability of each token after the first, by one transformers forward without a cache."""
    target = pair[1]
    with torch.no_grad():
        rows = target(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return rows.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def shown(tokens: list[str]) -> str:
    """The text tokens show: special tokens (the tiny tokenizer's <unk>, <eos>, ...) have none."""
    return "".join(token for token in tokens if token not in SPECIALS)


def ids_of(service, tokens: list[str]) -> list[int]:
    return [service.tokenizer.convert_tokens_to_ids(token) for token in tokens]  # one character, one token


def check_shape(logprobs: dict, k: int) -> None:
    n = len(logprobs["tokens"])
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == n
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        if logprob is not None:  # the top k, and the chosen token
            assert top[token] == logprob and k <= len(top) <= k + 1 and max(top.values()) >= logprob


@pytest.mark.parametrize("drafter, verification", [("model", "token"), ("lookup", "block"), ("hybrid", "token")])
def test_completion_logprobs_are_the_targets_on_the_tokens_returned(client, service, pair, drafter, verification):
    """Sampled, echoed: every token's logprob (the prompt's from the prefill, the completion's from the
    verification rows) equals a plain forward of the target over prompt plus completion within 1e-4."""
    prompt = service.encode("one two three one two three")
    body = complete(client, prompt=prompt, echo=True, logprobs=3, max_tokens=24, temperature=0.8, seed=4,
                    drafter=drafter, verification=verification).get_json()
    Completion.model_validate(body)
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    check_shape(logprobs, 3)
    assert shown(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [len(shown(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    ids = ids_of(service, logprobs["tokens"])
    assert ids[:len(prompt)] == prompt and len(ids) == len(prompt) + body["usage"]["completion_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(plain_logprobs(pair, ids), abs=1e-4)


def test_greedy_logprobs_are_target_only_decodings(client):
    """(Bitwise where the logits are: tests/test_logprobs.py, with our CPU kernels; this app's tiny pair runs
    transformers' own.)"""
    target_only = complete(client, temperature=0, max_tokens=30, logprobs=2, method="target").get_json()
    expected = target_only["choices"][0]["logprobs"]
    for gamma in (4, None):
        logprobs = complete(client, temperature=0, max_tokens=30, logprobs=2, gamma=gamma).get_json()[
            "choices"][0]["logprobs"]
        assert logprobs["tokens"] == expected["tokens"] and logprobs["text_offset"] == expected["text_offset"]
        assert logprobs["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-5)
        for mine, theirs in zip(logprobs["top_logprobs"], expected["top_logprobs"]):
            assert mine == pytest.approx(theirs, abs=1e-5)


@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("prompt, shown_as", [("<bos>hello", "<bos>hello"), ("hi<eos>there", "hi<eos>there")])
def test_an_echoed_prompt_holding_a_special_tokens_text_has_offsets_into_it(client, prompt, shown_as, as_ids):
    """Found by an audit: the prompt's offsets skipped special tokens' text (`<bos>hello` gave 0, 0, 1, ...) while
    the echoed text holds it as sent; each offset is now where its token's text starts in the echoed prompt. Sent
    as token ids (lm-evaluation-harness's way), the prompt echoes as /detokenize gives those ids back, special
    tokens' text kept, as its logprobs' tokens show them (found by a later audit: it echoed `hello`, with the
    offsets of `<bos>` and `h` both 0)."""
    if as_ids:
        prompt = client.post("/tokenize", json={"prompt": prompt}).get_json()["tokens"]
        assert client.post("/detokenize", json={"tokens": prompt}).get_json()["prompt"] == shown_as
    for stream in (False, True):
        response = complete(client, prompt=prompt, echo=True, logprobs=0, max_tokens=2, temperature=0, stream=stream)
        if stream:
            events = [event["choices"][0] for event in chunks(response)]
            text = "".join(event["text"] for event in events)
            offsets = [o for event in events for o in (event["logprobs"] or {}).get("text_offset", [])]
            tokens = [t for event in events for t in (event["logprobs"] or {}).get("tokens", [])]
        else:
            choice = response.get_json()["choices"][0]
            text, offsets, tokens = choice["text"], choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
        assert text.startswith(shown_as)
        assert offsets == sorted(offsets) and len(offsets) == len(tokens)
        starts = [text.index(token, offset) == offset for token, offset in zip(tokens, offsets)
                  if token and offset < len(shown_as)]
        assert all(starts), (tokens, offsets)
        assert offsets[-2:] == [len(shown_as), len(shown_as) + len(tokens[-2])], (tokens, offsets)


def test_streamed_logprobs_go_with_their_text(client):
    plain = complete(client, seed=8, max_tokens=40, logprobs=1, echo=True).get_json()["choices"][0]
    events = chunks(complete(client, seed=8, max_tokens=40, logprobs=1, echo=True, stream=True))
    sent = 0
    for event in events:
        (choice,) = event["choices"]
        logprobs = choice["logprobs"]
        check_shape(logprobs, 1)
        assert logprobs["text_offset"][:1] in ([], [sent])  # each chunk's tokens start where its text does
        assert shown(logprobs["tokens"]) == choice["text"]
        sent += len(choice["text"])
    assert events[0]["choices"][0]["text"].startswith(PROMPT)  # echo: the prompt first
    joined = {key: [v for e in events for v in e["choices"][0]["logprobs"][key]] for key in plain["logprobs"]}
    assert joined == plain["logprobs"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_logprobs_with_the_text(client, stream):
    full = complete(client, temperature=0, max_tokens=60).get_json()["choices"][0]["text"]
    stop = full[20:23]
    expected = full[:full.find(stop)]
    response = complete(client, temperature=0, max_tokens=60, stop=stop, logprobs=0, stream=stream)
    choices = [e["choices"][0] for e in chunks(response)] if stream else response.get_json()["choices"]
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert "".join(c["text"] for c in choices) == expected == shown(tokens)
    assert all(len(top) == 1 for c in choices for top in c["logprobs"]["top_logprobs"])  # logprobs 0: the token


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, service, pair):
    body = complete(client, echo=True, logprobs=1, max_tokens=0).get_json()
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # prompt logprobs: a whole prefill
    ids = service.encode(PROMPT)
    assert ids_of(service, choice["logprobs"]["tokens"]) == ids
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(plain_logprobs(pair, ids), abs=1e-4)
    assert choice["speculative_decoding_stats"]["num_drafts"] == 0
    echoed = complete(client, echo=True, max_tokens=0).get_json()["choices"][0]
    assert echoed["text"] == PROMPT and echoed["logprobs"] is None



def test_echo_with_max_tokens_0_scores_a_prompt_that_fills_the_context(client, service, pair):
    """A prompt of exactly the context's 256 tokens fits when only scored (the engine refused it as leaving no
    room for a token it was not asked for; an audit). One token more is context_length_exceeded, as is the full
    prompt with a token to generate, both naming the prompt."""
    context = service.decoder.context_length
    ids = (service.encode(PROMPT) * 10)[:context]
    choice = complete(client, prompt=ids, echo=True, logprobs=0, max_tokens=0).get_json()["choices"][0]
    assert ids_of(service, choice["logprobs"]["tokens"]) == ids and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(plain_logprobs(pair, ids), abs=1e-4)
    for prompt, max_tokens in ((ids + ids[:1], 0), (ids, 1)):
        assert_openai_error(complete(client, prompt=prompt, echo=True, logprobs=0, max_tokens=max_tokens), 400,
                            "context_length_exceeded", "prompt")

def test_several_prompts_give_a_choice_each_in_order(client, service):
    prompts = ["def add(a, b):", "Hello", "one two one two"]
    singles = [complete(client, prompt=p, temperature=0, max_tokens=12, logprobs=1, cache_prompt=False).get_json()
               for p in prompts]
    ids = [service.encode(p) for p in prompts]
    for prompt in (prompts, ids):  # strings, or lists of token ids
        body = complete(client, prompt=prompt, temperature=0, max_tokens=12, logprobs=1, cache_prompt=False).get_json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        for choice, single in zip(body["choices"], singles):
            assert choice["text"] == single["choices"][0]["text"]
            assert choice["logprobs"] == single["choices"][0]["logprobs"]
        assert body["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
        assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    one = complete(client, prompt=ids[0], temperature=0, max_tokens=12).get_json()  # a list of token ids
    assert one["choices"][0]["text"] == singles[0]["choices"][0]["text"] and len(one["choices"]) == 1
    events = chunks(complete(client, prompt=prompts, temperature=0, max_tokens=12, stream=True))
    indices = [e["choices"][0]["index"] for e in events]
    assert indices == sorted(indices) and set(indices) == {0, 1, 2}  # one choice after the other
    for index, single in enumerate(singles):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == single["choices"][0]["text"]
        assert mine[-1]["finish_reason"] == single["choices"][0]["finish_reason"]
    assert not service.scheduler.busy


def test_n_gives_n_choices_per_prompt_each_with_its_own_seed(client, service):
    """n (OpenAI's): n choices per prompt, index prompt * n + j, decoded one after another. With a seed, choice 0 is
    the n = 1 answer with that seed and the others draw from seeds derived from it: they differ, and the request
    repeats exactly. Usage counts each prompt once; streamed, the choices come in order."""
    sampled = {"temperature": 1.0, "max_tokens": 12, "seed": 7, "cache_prompt": False}
    single = complete(client, **sampled).get_json()["choices"][0]["text"]
    body = complete(client, n=3, ignore_eos=True, **sampled).get_json()
    texts = [choice["text"] for choice in body["choices"]]
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert texts[0].startswith(single) and len(set(texts)) == 3  # the same draws, past an end-of-sequence
    assert [c["text"] for c in complete(client, n=3, ignore_eos=True, **sampled).get_json()["choices"]] == texts
    assert body["usage"]["prompt_tokens"] == len(service.encode(PROMPT))
    assert body["usage"]["completion_tokens"] == 36 == body["usage"]["total_tokens"] - body["usage"]["prompt_tokens"]
    prompts = ["def add(a, b):", "Hello"]
    greedy = complete(client, prompt=prompts, n=2, temperature=0, max_tokens=8).get_json()
    alone = [complete(client, prompt=p, temperature=0, max_tokens=8, method="target").get_json()["choices"][0]["text"]
             for p in prompts]  # target-only: several prompts and choices keep greedy equivalence (the fifth audit)
    assert [c["text"] for c in greedy["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    assert greedy["usage"]["prompt_tokens"] == sum(len(service.encode(p)) for p in prompts)
    replies = chat(client, n=2, **sampled).get_json()["choices"]
    assert [r["index"] for r in replies] == [0, 1] and replies[0]["message"] != replies[1]["message"]
    events = chunks(chat(client, n=2, stream=True, **sampled))
    indices = [e["choices"][0]["index"] for e in events if e["choices"]]
    assert indices == sorted(indices) and set(indices) == {0, 1}
    for index, reply in enumerate(replies):
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if e["choices"] and e["choices"][0]["index"] == index) == reply["message"]["content"]
    assert not service.scheduler.busy


def test_lm_eval_harness_loglikelihood_request(client, service, pair):
    """What lm-evaluation-harness's local-completions sends for a multiple-choice task: token ids, echo,
    logprobs 1, max_tokens 1; it reads token_logprobs[context:-1] and whether each is the top one."""
    contexts = [service.encode("Question: 2 + 2 = "), service.encode("Question: 3 + 3 = ")]
    requests = [contexts[0] + service.encode("4"), contexts[1] + service.encode("six")]
    body = complete(client, prompt=requests, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234).get_json()
    for choice, ids in zip(body["choices"], requests):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1
        assert logprobs["token_logprobs"][1:len(ids)] == pytest.approx(plain_logprobs(pair, ids), abs=1e-4)


def test_chat_logprobs(client):
    # cache_prompt false: a prompt served from the cache gives the same tokens, its logprobs only to rounding
    body = chat(client, max_tokens=12, seed=3, logprobs=True, top_logprobs=2, cache_prompt=False).get_json()
    ChatCompletion.model_validate(body)
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    assert shown([t["token"] for t in content]) == choice["message"]["content"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode()) and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= max(entry["top_logprobs"][1]["logprob"], entry["logprob"])
    events = chunks(chat(client, max_tokens=12, seed=3, logprobs=True, top_logprobs=2, stream=True, cache_prompt=False))
    assert events[0]["choices"][0]["logprobs"] is None  # the role
    assert [t for e in events[1:] for t in e["choices"][0]["logprobs"]["content"]] == content
    assert chat(client, max_tokens=3, logprobs=True).get_json()["choices"][0]["logprobs"]["content"][0][
        "top_logprobs"] == []
    assert chat(client, max_tokens=3).get_json()["choices"][0]["logprobs"] is None


def test_predict_logprobs_in_its_answer_and_its_stream(client):
    body = client.post("/predict", json={"prompt": PROMPT, "max_new_tokens": 16, "seed": 6, "logprobs": 2,
                                         "cache_prompt": False}).get_json()
    assert len(body["logprobs"]) == body["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 and set(entry) == {"id", "token", "logprob", "top_logprobs"}
               for entry in body["logprobs"])
    response = client.post("/predict", json={"prompt": PROMPT, "max_new_tokens": 16, "seed": 6, "logprobs": 2,
                                             "stream": True, "cache_prompt": False}, buffered=True)
    events = [json.loads(block.removeprefix("data: "))
              for block in response.get_data(as_text=True).strip().split("\n\n")]
    assert [entry for event in events for entry in event["logprobs"]] == body["logprobs"]
    assert all(shown([e["token"] for e in event["logprobs"]]) == event["text"]
               for event in events)
    assert "logprobs" not in client.post("/predict", json={"prompt": PROMPT, "max_new_tokens": 2}).get_json()
    error = client.post("/predict", json={"prompt": PROMPT, "logprobs": 21}).get_json()["error"]
    assert error["field"] == "logprobs"


# --- refusals and errors ---------------------------------------------------------------------------------------

REFUSED = [  # (route, field values, param, code)
    ("completions", {"n": 17}, "n", "invalid_value"),  # more choices than max_prompts_per_request (16)
    ("completions", {"n": 6, "prompt": ["a", "b", "c"]}, "n", "invalid_value"),  # 18 choices
    ("chat", {"n": 0}, "n", "invalid_value"),
    ("completions", {"logprobs": 21}, "logprobs", "invalid_value"),
    ("completions", {"logprobs": -1}, "logprobs", "invalid_value"),
    ("completions", {"logprobs": True}, "logprobs", "invalid_value"),
    ("chat", {"logprobs": 1}, "logprobs", "invalid_value"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # without logprobs: true
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ("chat", {"frequency_penalty": -2.01}, "frequency_penalty", "invalid_value"),
    ("chat", {"presence_penalty": "1"}, "presence_penalty", "invalid_value"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ("chat", {"repetition_penalty": 1000}, "repetition_penalty", "invalid_value"),
    ("completions", {"stop_token_ids": [100]}, "stop_token_ids", "invalid_value"),  # past the tiny vocabulary
    ("completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens", "invalid_value"),
    ("chat", {"min_tokens": -1}, "min_tokens", "invalid_value"),
    ("chat", {"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens", "invalid_value"),
    ("chat", {"stop_token_ids": [5], "response_format": {"type": "json_object"}}, "stop_token_ids",
     "invalid_value"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias.abc", "invalid_value"),
    ("chat", {"logit_bias": {"100": 1}}, "logit_bias", "invalid_value"),  # past the tiny vocabulary's 100 tokens
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "invalid_value"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "invalid_value"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "invalid_value"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "invalid_value"),
    ("chat", {"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar",
     "invalid_value"),
    ("chat", {"structured_outputs": {"json": {"type": "object", "description": "x" * 70_000}}},
     "structured_outputs.json", "invalid_value"),  # over the size limit
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name",
     "invalid_value"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    # found by an audit: a bad tool schema was named `tools`, its message the whole tools grammar; a function-form
    # tool_choice without its name was told the modes it is not
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {
        "name": "g", "parameters": {"type": "nonsense"}}}]}, "tools[1].function.parameters", "invalid_value"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
              "tool_choice": "required"}, "tools[0].function.parameters", "invalid_value"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "maximum": float("inf")}}}}}]}, "tools[0].function.parameters", "invalid_value"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}},
     "tool_choice.function", "missing_required_parameter"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": None}}}, "tool_choice.function.name",
     "invalid_value"),
    ("chat", {"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name",
     "missing_required_parameter"),
    ("chat", {"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name", "invalid_value"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "invalid_value"),  # without tools
    ("chat", {"functions": [{"name": "f"}]}, "functions", "unsupported_value"),
    ("completions", {"echo": 1}, "echo", "invalid_value"),
    ("completions", {"best_of": 2}, "best_of", "unsupported_value"),
    ("completions", {"suffix": "}"}, "suffix", "unsupported_value"),  # the tiny tokenizer has no infill tokens
    ("completions", {"suffix": "}", "echo": True}, "suffix", "invalid_value"),
    ("completions", {"n": True}, "n", "invalid_value"),
    ("chat", {"modalities": ["audio"]}, "modalities", "unknown_parameter"),
    ("completions", {"max_new_tokens": 5}, "max_new_tokens", "unknown_parameter"),
    # found by a fuzzing audit: a key not in lower snake_case (a JavaScript client's), or a type's name, was named
    # None, and one nested in a known field named its parent
    ("completions", {"maxTokens": 5}, "maxTokens", "unknown_parameter"),
    ("chat", {"Temperature": 0.5}, "Temperature", "unknown_parameter"),
    ("completions", {"str": 1}, "str", "unknown_parameter"),
    ("completions", {"stream": True, "stream_options": {"includeUsage": True}}, "stream_options.includeUsage",
     "unknown_parameter"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "Parameters": {}}}]},
     "tools[0].function.Parameters", "unknown_parameter"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "nickname": "bob"}]}, "messages[0].nickname",
     "unknown_parameter"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages[0].name", "invalid_value"),
    ("chat", {"messages": [{"role": "assistant", "content": "hi", "audio": {"id": "a"}}]}, "messages[0].audio",
     "invalid_value"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),  # no stream
    ("chat", {"stream": False, "stream_options": {"include_usage": False}}, "stream_options", "invalid_value"),
    ("completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "invalid_value"),
    ("chat", {"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", "invalid_value"),
    ("completions", {"temperature": 2.5}, "temperature", "invalid_value"),
    ("completions", {"temperature": 1e-9}, "temperature", "invalid_value"),
    ("chat", {"top_p": 0}, "top_p", "invalid_value"),
    ("completions", {"max_tokens": 0}, "max_tokens", "invalid_value"),  # only with echo
    ("chat", {"max_tokens": 0}, "max_tokens", "invalid_value"),
    ("completions", {"max_tokens": 1025}, "max_tokens", "invalid_value"),
    ("chat", {"max_completion_tokens": 1025}, "max_completion_tokens", "invalid_value"),
    ("chat", {"max_tokens": "5"}, "max_tokens", "invalid_value"),
    ("completions", {"gamma": 17}, "gamma", "invalid_value"),
    ("completions", {"method": "draft"}, "method", "invalid_value"),
    ("completions", {"drafter": "ngram"}, "drafter", "invalid_value"),
    ("chat", {"drafter": 1}, "drafter", "invalid_value"),
    ("chat", {"verification": "tree"}, "verification", "invalid_value"),
    ("completions", {"draft_confidence_threshold": 2}, "draft_confidence_threshold", "invalid_value"),
    ("completions", {"seed": 2**64}, "seed", "invalid_value"),
    ("completions", {"stop": [f"s{i}" for i in range(17)]}, "stop", "invalid_value"),
    ("completions", {"stop": [""]}, "stop", "invalid_value"),
    ("completions", {"prompt": [1, 100]}, "prompt", "invalid_value"),  # the tiny vocabulary is 0..99
    ("completions", {"prompt": [[1, 2], [3, 10**6]]}, "prompt", "invalid_value"),
    ("completions", {"prompt": [1, -2]}, "prompt", "invalid_value"),
    ("completions", {"prompt": [1, True]}, "prompt", "invalid_value"),
    ("completions", {"prompt": ["one", 2]}, "prompt", "invalid_value"),
    ("completions", {"prompt": [[1], []]}, "prompt", "invalid_value"),
    ("completions", {"prompt": ["one", ""]}, "prompt", "invalid_value"),
    ("completions", {"prompt": []}, "prompt", "invalid_value"),
    ("completions", {"prompt": ["p"] * 17}, "prompt", "invalid_value"),  # max_prompts_per_request is 16
    ("completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("chat", {"messages": []}, "messages", "invalid_value"),
    ("chat", {"messages": [{"role": "function", "content": "42"}]}, "messages[0].role", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "invalid_value"),
    ("chat", {"model": None}, "model", "invalid_value"),
]


@pytest.mark.parametrize("route, fields, param, code", REFUSED, ids=lambda v: json.dumps(v)[:40])
def test_unsupported_or_invalid_field_is_400_naming_it(client, route, fields, param, code):
    before = metric(client, "specdec_generated_tokens_total")
    response = (complete if route == "completions" else chat)(client, **fields)
    assert_openai_error(response, 400, code, param)
    assert metric(client, "specdec_generated_tokens_total") == before  # nothing was decoded


def test_logit_bias_is_applied_as_openai_applies_it(client):
    """OpenAI's logit_bias ({token id: bias}): -100 keeps the greedy answer's commonest token out, on both routes;
    100 all but forces a token even when sampling."""
    plain = complete(client, max_tokens=12, temperature=0, logprobs=0).get_json()["choices"][0]
    tokens = plain["logprobs"]["tokens"]
    banned = max(set(tokens), key=tokens.count)
    token_id = client.application.extensions["specdec"].tokenizer.convert_tokens_to_ids(banned)
    biased = complete(client, max_tokens=12, temperature=0, logit_bias={str(token_id): -100}).get_json()
    assert banned not in biased["choices"][0]["text"] and biased["choices"][0]["text"] != plain["text"]
    forced = chat(client, max_tokens=5, temperature=1, seed=2, logit_bias={str(token_id): 100}).get_json()
    assert forced["choices"][0]["message"]["content"] == banned * 5


def test_penalties_apply_on_both_routes_and_greedy_speculation_gives_target_onlys_answer(client):
    """presence_penalty and frequency_penalty (OpenAI's) and repetition_penalty (vLLM's extension) change the greedy
    answer, and speculative decoding's greedy answer under them is target-only decoding's, token for token."""
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5, "repetition_penalty": 1.2}
    for send, text in ((complete, lambda body: body["choices"][0]["text"]),
                       (chat, lambda body: body["choices"][0]["message"]["content"])):
        plain = text(send(client, max_tokens=24, temperature=0).get_json())
        penalized = text(send(client, max_tokens=24, temperature=0, **penalties).get_json())
        alone = text(send(client, max_tokens=24, temperature=0, method="target", **penalties).get_json())
        assert penalized == alone and penalized != plain
        assert max(map(penalized.count, set(penalized))) < max(map(plain.count, set(plain)))  # fewer repeats


def test_stop_token_ids_end_the_choice_at_the_first_one(client, service):
    """stop_token_ids (vLLM's extension) on both routes: the text ends with the first one's text, finish_reason
    stop."""
    plain = complete(client, max_tokens=20, temperature=0).get_json()["choices"][0]
    ids = service.encode(plain["text"])
    stop = ids[len(ids) // 2]
    text = service.decode(ids[: ids.index(stop) + 1])
    cut = complete(client, max_tokens=20, temperature=0, stop_token_ids=[stop]).get_json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (text, "stop") and plain["finish_reason"] == "length"
    replied = chat(client, max_tokens=20, temperature=0).get_json()["choices"][0]["message"]["content"]
    ids = service.encode(replied)
    stop = ids[len(ids) // 2]
    cut = chat(client, max_tokens=20, temperature=0, stop_token_ids=[stop]).get_json()["choices"][0]
    assert cut["message"]["content"] == service.decode(ids[: ids.index(stop) + 1])
    assert cut["finish_reason"] == "stop"


def test_missing_model_is_400(client):
    response = client.post("/v1/completions", json={"prompt": PROMPT})
    assert_openai_error(response, 400, "missing_required_parameter", "model")


def test_no_op_values_of_unsupported_fields_are_accepted(client):
    noop = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u-1",
            "stop": None, "seed": None}
    assert complete(client, max_tokens=3, echo=False, best_of=1, logprobs=None, suffix="", **noop).status_code == 200
    assert chat(client, max_tokens=3, logprobs=True, top_logprobs=0).status_code == 200
    response = chat(client, max_tokens=3, logprobs=False, top_logprobs=0, response_format={"type": "text"}, tools=[],
                    tool_choice="none", parallel_tool_calls=True, functions=[], function_call="none", **noop)
    assert response.status_code == 200, response.get_json()


def test_openai_platform_fields_are_accepted_and_leave_the_answer_as_it_is(client):
    """metadata, store, service_tier, prompt_cache_key and safety_identifier serve OpenAI's own platform: a client
    that sets them gets the answer it gets without them (greedy, so token for token), as vLLM answers."""
    plain = chat(client, max_tokens=6, temperature=0).get_json()["choices"][0]["message"]
    response = chat(client, max_tokens=6, temperature=0, metadata={"run": "r1", "team": "t"}, store=True,
                    service_tier="auto", prompt_cache_key="k-1", safety_identifier="user-hash")
    assert response.status_code == 200, response.get_json()
    assert response.get_json()["choices"][0]["message"] == plain
    error = chat(client, max_tokens=3, metadata={"k": 1}).get_json()["error"]  # OpenAI's values are strings
    assert error["param"].startswith("metadata")


def test_unknown_model_is_404_model_not_found(client):
    error = assert_openai_error(complete(client, model="gpt-4o"), 404, "model_not_found", "model")
    assert "'target'" in error["message"]
    assert_openai_error(chat(client, model="draft"), 404, "model_not_found", "model")


def test_retrieve_model_is_the_listed_card_and_404_for_any_other_id(client):
    listed = client.get("/v1/models").get_json()["data"][0]
    response = client.get("/v1/models/target")
    assert response.status_code == 200 and response.get_json() == listed
    for other in ("gpt-4o", "Qwen/Qwen2.5-0.5B", "draft"):
        error = assert_openai_error(client.get(f"/v1/models/{other}"), 404, "model_not_found", "model")
        assert repr(other) in error["message"]


@pytest.mark.parametrize("method, path, status, code", [
    ("POST", "/v1/embeddings", 404, "not_found"),
    ("POST", "/v1/models/target", 405, "method_not_allowed"),
    ("GET", "/v1", 404, "not_found"),
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("POST", "/v1/models", 405, "method_not_allowed"),
    # a doubled slash was werkzeug's 308 redirect to the merged path, in HTML (found by an audit)
    ("POST", "/v1//completions", 404, "not_found"),
    ("POST", "/v1/chat//completions", 404, "not_found"),
    ("GET", "/v1//models", 404, "not_found"),
    ("GET", "/v1/models//target", 404, "not_found"),
])
def test_unknown_route_or_method_under_v1(client, method, path, status, code):
    response = client.open(path, method=method, json={})
    assert_openai_error(response, status, code)
    if status == 405:
        assert "Allow" in response.headers


def test_an_answers_message_sent_back_as_the_sdk_dumps_it_is_taken(client):
    """`resp.choices[0].message.model_dump()` sent back (refusal, annotations, audio and function_call null) and a
    user's `name` (OpenAI's message schema; refused before, found by an audit) make the same prompt as the message
    without them; a refusal's text stands for null content."""
    def prompt_tokens(messages):
        response = chat(client, messages=messages, max_tokens=1, temperature=0)
        assert response.status_code == 200, response.get_json()
        return response.get_json()["usage"]["prompt_tokens"]

    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "more"}]
    dumped = [{**plain[0], "name": "bob"}, {**plain[1], "refusal": None, "annotations": None, "audio": None,
                                            "function_call": None, "tool_calls": None}, plain[2]]
    assert prompt_tokens(dumped) == prompt_tokens(plain)
    refused = [plain[0], {"role": "assistant", "content": None, "refusal": "hello"}, plain[2]]
    assert prompt_tokens(refused) == prompt_tokens(plain)


def test_body_errors_under_v1(client):
    assert_openai_error(client.post("/v1/completions", data="{", content_type="application/json"), 400,
                        "invalid_json")
    assert_openai_error(client.post("/v1/completions", data=json.dumps({"model": "target", "prompt": PROMPT}),
                                    content_type="text/plain"), 415, "unsupported_media_type")
    huge = json.dumps({"model": "target", "prompt": "a" * (1 << 20)})
    assert_openai_error(client.post("/v1/chat/completions", data=huge, content_type="application/json"), 413,
                        "body_too_large")


def test_errors_outside_v1_keep_the_predict_shape(client):
    error = client.get("/nope").get_json()["error"]
    assert set(error) == {"type", "message", "field"} and error["type"] == "not_found"
    error = client.post("/predict", json={"prompt": PROMPT, "n": 2}).get_json()["error"]
    assert error == {"type": "invalid_field", "message": "unknown field 'n'", "field": "n"}


def test_overload_is_503_with_retry_after(pair):
    app = make_app(pair, queue_size=0)
    slot = app.extensions["specdec"].scheduler.acquire()  # another request is decoding
    try:
        response = chat(app.test_client(), max_tokens=2)
    finally:
        slot.release()
    assert_openai_error(response, 503, "overloaded")
    assert response.headers["Retry-After"] == "5"
    assert chat(app.test_client(), max_tokens=2).status_code == 200


# --- shared with /predict: log line, metrics, OpenAPI ----------------------------------------------------------

def test_one_log_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="specdec.serve"):
        chat(client, max_tokens=5, ignore_eos=True, headers={"X-Request-ID": "v1-log-1"})  # no early <eos>
        client.post("/v1/chat/completions", json={"model": "target", "messages": MESSAGES, "best_of": 2},
                    headers={"X-Request-ID": "v1-log-2"})
    (ok,) = [r.getMessage() for r in caplog.records if "request_id=v1-log-1 " in r.getMessage()]
    for part in ("POST /v1/chat/completions", "status=200", "completion_tokens=5", "method=google"):
        assert part in ok
    (refused,) = [r.getMessage() for r in caplog.records if "request_id=v1-log-2 " in r.getMessage()]
    assert "status=400" in refused and "error=unknown_parameter" in refused


def test_acceptance_by_position_is_exported_from_start_up(pair):
    """Every draft position a request may propose (0 .. max_gamma - 1) is on /metrics before any request."""
    client = make_app(pair, max_gamma=6).test_client()
    text = client.get("/metrics").get_data(as_text=True)
    for i in range(6):
        assert f'specdec_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} 0.0' in text
    assert 'position="6"' not in text and "specdec_spec_decode_num_drafts_total 0.0" in text


def test_metrics_count_v1_requests_and_acceptance_by_position(client):
    served = '{endpoint="/v1/completions",status="200"}'
    requests_before = metric(client, "specdec_requests_total", served)
    lengths_before = (metric(client, "specdec_spec_decode_mean_acceptance_length_count"),
                      metric(client, "specdec_spec_decode_mean_acceptance_length_sum"))
    per_pos = [metric(client, "specdec_spec_decode_num_accepted_tokens_per_pos_total", f'{{position="{i}"}}')
               for i in range(4)]
    drafts_before = metric(client, "specdec_spec_decode_num_drafts_total")
    stats = complete(client, max_tokens=40, gamma=4, seed=11).get_json()["choices"][0]["speculative_decoding_stats"]
    assert metric(client, "specdec_requests_total", served) == requests_before + 1
    accepted = stats["num_accepted_tokens_per_pos"] + [0] * (4 - len(stats["num_accepted_tokens_per_pos"]))
    assert sum(accepted) > 0
    for i in range(4):
        assert metric(client, "specdec_spec_decode_num_accepted_tokens_per_pos_total",
                      f'{{position="{i}"}}') == per_pos[i] + accepted[i]
    assert metric(client, "specdec_spec_decode_num_drafts_total") == drafts_before + stats["num_drafts"]
    assert metric(client, "specdec_spec_decode_mean_acceptance_length_count") == lengths_before[0] + 1
    assert metric(client, "specdec_spec_decode_mean_acceptance_length_sum") == pytest.approx(
        lengths_before[1] + stats["mean_acceptance_length"])


def test_openapi_describes_the_v1_routes(pair):
    app = make_app(pair, max_new_tokens=4, max_new_tokens_limit=8, max_gamma=6)
    document = app.test_client().get("/openapi.json").get_json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}"} <= set(document["paths"])
    schemas = document["components"]["schemas"]
    for name, model in (("CompletionRequest", CompletionRequest), ("ChatCompletionRequest", ChatCompletionRequest)):
        request = schemas[name]
        assert set(request["properties"]) == set(model.model_fields) and request["additionalProperties"] is False
        assert request["properties"]["max_tokens"]["maximum"] == 8
        assert (request["properties"]["gamma"]["type"], request["properties"]["gamma"]["maximum"]) == ("integer", 6)
        assert request["properties"]["min_tokens"]["maximum"] == 8
        assert request["properties"]["model"]["enum"] == ["target"]
        assert request["properties"]["n"]["maximum"] == 16
    assert schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"]["maximum"] == 8
    assert "speculative_decoding_stats" in schemas["CompletionChoice"]["properties"]
    responses = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "415", "503"} <= set(responses)
    assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIErrorResponse")
    assert '"const":' not in json.dumps(document)  # OpenAPI 3.0 has no const


def json_schema_of(schema):
    """An OpenAPI 3.0 schema as JSON Schema (draft 4, whose boolean exclusive bounds 3.0 shares): `nullable`
    becomes a null branch."""
    if isinstance(schema, list):
        return [json_schema_of(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: json_schema_of(value) for key, value in schema.items() if key != "nullable"}
    return {"anyOf": [converted, {"type": "null"}]} if schema.get("nullable") is True else converted


def valid_by_the_document(document: dict, name: str, body: dict) -> bool:
    """Whether `body` is valid by the document's component schema `name`, as a JSON Schema validator reads it."""
    jsonschema = pytest.importorskip("jsonschema")
    root = {"$ref": f"#/components/schemas/{name}", "components": json_schema_of(document["components"])}
    return jsonschema.Draft4Validator(root).is_valid(body)


def taken_by_the_model(model, body: dict) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


TOKENIZE_BODIES = [  # (body, valid)
    ({}, False), ({"prompt": "x"}, True), ({"messages": [{"role": "user", "content": "hi"}]}, True),
    ({"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, False), ({"prompt": None}, False),
    ({"prompt": "x", "messages": None, "tools": None, "add_generation_prompt": None}, True),
    ({"prompt": "x", "tools": []}, False), ({"prompt": "x", "add_generation_prompt": True}, False),
    ({"prompt": "x", "continue_final_message": False}, False), ({"prompt": "x", "add_special_tokens": False}, True),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [], "add_generation_prompt": False}, True),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": None}, True),
]
STRUCTURED_OUTPUTS = [
    ({}, False), ({"regex": "a", "choice": ["b"]}, False), ({"regex": "a"}, True), ({"json_object": True}, True),
    ({"regex": "a", "json_object": False}, True), ({"json_object": False}, False), ({"regex": None}, False),
    ({"json": {"type": "object"}}, True), ({"json": "{}", "regex": None, "grammar": None}, True),
    ({"json": {}, "json_object": True}, False), ({"choice": ["b"], "json_object": None}, True),
    ({"grammar": "start: \"a\"", "choice": None, "json_object": True}, False),
]
RESPONSE_FORMATS = [
    ({"type": "json_schema"}, False), ({"type": "json_schema", "json_schema": None}, False),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}, True),
    ({"type": "text", "json_schema": {"name": "a"}}, False),
    ({"type": "json_object", "json_schema": {"name": "a"}}, False),
    ({"type": "text"}, True), ({"type": "json_object", "json_schema": None}, True),
]


@pytest.fixture(scope="module")
def document(pair):
    return make_app(pair).test_client().get("/openapi.json").get_json()


@pytest.mark.parametrize(("body", "valid"), TOKENIZE_BODIES)
def test_the_document_states_that_tokenize_takes_prompt_or_messages(document, body, valid):
    """Exactly one of prompt and messages, and the templating fields with messages only (a schema that required
    nothing called {} valid, which is a 400: schemathesis's ST202)."""
    assert valid_by_the_document(document, "TokenizeRequest", body) is valid
    assert taken_by_the_model(TokenizeRequest, body) is valid


def assert_every_request_with_it_agrees(document, field: str, value, valid: bool) -> None:
    """The document and the models agree on `value` of `field` in each request that takes a constraint."""
    for name, model, body in (
            ("PredictRequest", PredictRequest, {"prompt": "x"}),
            ("ChatCompletionRequest", ChatCompletionRequest, {"model": "target", "messages": MESSAGES}),
            ("CompletionRequest", CompletionRequest, {"model": "target", "prompt": "x"})):
        body = {**body, field: value}
        assert valid_by_the_document(document, name, body) is valid, name
        assert taken_by_the_model(model, body) is valid, name


@pytest.mark.parametrize(("structured_outputs", "valid"), STRUCTURED_OUTPUTS)
def test_the_document_states_that_structured_outputs_takes_exactly_one(document, structured_outputs, valid):
    assert_every_request_with_it_agrees(document, "structured_outputs", structured_outputs, valid)


@pytest.mark.parametrize(("response_format", "valid"), RESPONSE_FORMATS)
def test_the_document_states_that_json_schema_goes_with_its_type(document, response_format, valid):
    assert_every_request_with_it_agrees(document, "response_format", response_format, valid)


def test_a_nullable_enum_lists_null(document):
    """OpenAPI 3.0.3: an enum beside `nullable: true` must list null to allow it. A live schemathesis run found 13
    request fields (method, best_of, min_p, ...) documented as refusing the null the service takes."""
    def nullable_enums(node):
        if isinstance(node, dict):
            if node.get("nullable") is True and "enum" in node:
                yield node["enum"]
            for value in node.values():
                yield from nullable_enums(value)
        elif isinstance(node, list):
            for value in node:
                yield from nullable_enums(value)

    enums = list(nullable_enums(document))
    assert len(enums) > 10 and all(None in enum for enum in enums)
    for name, model, body in (("PredictRequest", PredictRequest, {"prompt": "x", "verification": None}),
                              ("CompletionRequest", CompletionRequest, {"model": "target", "prompt": "x",
                                                                        "best_of": None, "method": None}),
                              ("ChatCompletionRequest", ChatCompletionRequest, {"model": "target", "messages": MESSAGES,
                                                                                "function_call": None})):
        assert valid_by_the_document(document, name, body) and taken_by_the_model(model, body), name


REFUSAL_PART = {"type": "refusal", "refusal": "I cannot."}


@pytest.mark.parametrize(("message", "valid"), [
    ({"role": "assistant", "content": [REFUSAL_PART]}, True),
    ({"role": "user", "content": [REFUSAL_PART]}, False),
    ({"role": "system", "content": [{"type": "text", "text": "a"}, REFUSAL_PART]}, False),
    ({"role": "user", "content": [{"type": "text", "text": "a"}]}, True), ({"role": "tool", "content": "a"}, True),
])
def test_the_document_states_that_refusal_parts_are_an_assistants(document, message, valid):
    body = {"model": "target", "messages": [message]}
    assert valid_by_the_document(document, "ChatCompletionRequest", body) is valid
    assert taken_by_the_model(ChatCompletionRequest, body) is valid


def test_the_document_bounds_token_ids_by_the_served_vocabulary(pair, document):
    app = make_app(pair)
    last = app.extensions["specdec"].decoder.vocab_size - 1
    schemas = document["components"]["schemas"]
    for name in ("PredictRequest", "CompletionRequest", "ChatCompletionRequest"):
        assert schemas[name]["properties"]["stop_token_ids"]["items"]["maximum"] == last
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == last
    for ids, outside in (([last], [0, last + 1]), ([[0], [last]], [[0], [last + 1]])):  # prompts of token ids
        assert valid_by_the_document(document, "CompletionRequest", {"model": "target", "prompt": ids})
        assert not valid_by_the_document(document, "CompletionRequest", {"model": "target", "prompt": outside})
    for name, body in (("PredictRequest", {"prompt": "x"}), ("DetokenizeRequest", {})):
        field = "tokens" if name == "DetokenizeRequest" else "stop_token_ids"
        assert valid_by_the_document(document, name, {**body, field: [0, last]})
        assert not valid_by_the_document(document, name, {**body, field: [last + 1]})
    client = app.test_client()
    assert client.post("/detokenize", json={"tokens": [last + 1]}).status_code == 400  # what the bound states
    assert client.post("/detokenize", json={"tokens": [last]}).status_code == 200
    # the tokenizer routes' optional model is the served one, or null
    assert valid_by_the_document(document, "TokenizeRequest", {"prompt": "x", "model": None})
    assert not valid_by_the_document(document, "TokenizeRequest", {"prompt": "x", "model": "gpt-4o"})


def test_the_document_leaves_token_ids_unbounded_until_the_vocabulary_is_known(pair):
    from specdec.serve.openapi import openapi_document

    settings = make_app(pair).extensions["specdec"].settings
    schemas = openapi_document(settings)["components"]["schemas"]  # what /openapi.json says while loading
    assert "maximum" not in schemas["PredictRequest"]["properties"]["stop_token_ids"]["items"]
    assert "maximum" not in schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_against_the_v1_routes(pair, path, mode):
    """Requests drawn from /openapi.json: valid ones (that fit the context) get 200, invalid ones a 4xx, and every
    answer matches the document."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, settings

    from tests.support.document import check_against_the_document

    app = make_app(pair, max_new_tokens=4, max_new_tokens_limit=8)
    service = app.extensions["specdec"]
    operation = schemathesis.openapi.from_wsgi("/openapi.json", app)[path]["POST"]

    def fits(body: dict) -> bool:  # the document cannot say how many tokens a text makes
        try:
            if "messages" in body:
                request = ChatCompletionRequest.model_validate(body)
                prompts = [service.encode(messages=request.chat_messages(), tools=request.template_tools(),
                                          templating=request.templating())]
            else:  # token ids: in the vocabulary (the document cannot say how large it is)
                request = CompletionRequest.model_validate(body)
                prompts = [service.check_token_ids(prompt) if isinstance(prompt, list) else service.encode(prompt)
                           for prompt in request.prompts]
                if request.suffix:  # the tiny tokenizer has no fill-in-the-middle tokens: a 400
                    service.encode_infill(request.prompts[0], request.suffix)
            service.grammar(request.constraint())
        except (ApiError, SpecDecError, ValidationError):
            # over the context by itself; a grammar, or a rule across fields (exactly one structured output, a
            # tool_choice naming one of the tools), the document cannot state
            return False
        # the tiny tokenizer spells printable ASCII and newlines only: a constraint whose strings need other
        # characters can lead the grammar where no token goes on (a 400 saying so, not a 200)
        constraint = json.dumps([body.get("structured_outputs"), body.get("response_format")])
        if not constraint.isascii() or "\\u" in constraint:
            return False
        room = body.get("max_tokens") if body.get("max_tokens") is not None else body.get("max_completion_tokens")
        choices = len(prompts) * (request.n or 1)  # prompts times n: the document bounds each, not the product
        stops = request.stop_token_ids or []  # in the vocabulary, and not beside a grammar, which ends the answer
        if any(token >= service.decoder.vocab_size for token in stops) or (stops and request.constraint()):
            return False
        if request.min_tokens and (request.min_tokens > (service.settings.max_new_tokens if room is None else room)
                                   or request.constraint()):  # at most max_tokens, and not beside a grammar
            return False
        return choices <= service.settings.max_prompts_per_request and all(
            len(ids) + (1 if room is None else room) <= 256 for ids in prompts)

    assert check_against_the_document(operation, mode, fits, settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)))
    case = operation.schema["/v1/models"]["GET"].Case()
    case.validate_response(case.call())
    case = operation.schema["/v1/models/{model}"]["GET"].Case(path_parameters={"model": "target"})
    response = case.call()
    assert response.status_code == 200
    case.validate_response(response)


def test_a_405_is_labelled_by_its_routes_pattern_not_the_path_the_client_chose(client):
    """Every POST /v1/models/<anything> is a 405: labelled by the path, each made a new series on /metrics (3,000
    of them made it 263 MB)."""
    for name in ("a" * 50, "b" * 50):
        assert client.post(f"/v1/models/{name}").status_code == 405
    text = client.get("/metrics").get_data(as_text=True)
    assert "a" * 50 not in text and "b" * 50 not in text
    assert metric(client, "specdec_requests_total", '{endpoint="/v1/models/<path:model>",status="405"}') >= 2


def test_a_prompts_tokens_count_once_whatever_n_in_the_metrics_as_in_usage(client):
    before = metric(client, "specdec_prompt_tokens_total")
    usage = complete(client, max_tokens=2, n=3, seed=1).get_json()["usage"]
    assert metric(client, "specdec_prompt_tokens_total") - before == usage["prompt_tokens"]
    before = metric(client, "specdec_prompt_tokens_total")
    usage = complete(client, prompt=[PROMPT, PROMPT + " again"], max_tokens=2, n=2, seed=1).get_json()["usage"]
    assert metric(client, "specdec_prompt_tokens_total") - before == usage["prompt_tokens"]


@pytest.mark.parametrize("extra", [{"top_k": -1}, {"min_p": 0}, {"min_p": 0.0}, {"skip_special_tokens": True},
                                   {"include_stop_str_in_output": False}])
def test_vllms_fields_at_their_no_op_values_are_taken(client, extra):
    """Clients tuned for vLLM send its fields at their defaults; each was refused as an unknown parameter (top_k -1,
    vLLM's "every token", as below the bound). The answer is the one without them."""
    plain = complete(client, max_tokens=8, seed=3, top_k=0).get_json()["choices"][0]["text"]
    answer = complete(client, max_tokens=8, seed=3, **extra)
    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json()["choices"][0]["text"] == plain


@pytest.mark.parametrize("extra, param", [({"top_k": -2}, "top_k"), ({"min_p": 0.1}, "min_p"),
                                          ({"skip_special_tokens": False}, "skip_special_tokens"),
                                          ({"include_stop_str_in_output": True}, "include_stop_str_in_output")])
def test_vllms_fields_at_other_values_are_refused_naming_them(client, extra, param):
    error = complete(client, max_tokens=2, **extra).get_json()["error"]
    assert error["param"] == param, error


def test_stream_options_include_obfuscation_is_taken(client):
    """The SDK 3.x's field: this server never pads its chunks, so either value changes nothing."""
    for value in (False, True):
        response = complete(client, max_tokens=3, stream=True, stream_options={"include_obfuscation": value,
                                                                              "include_usage": True})
        assert response.status_code == 200
        assert chunks(response)[-1]["usage"]["completion_tokens"] == 3


def test_an_assistant_message_as_openai_answers_it_is_taken_back(client):
    """OpenAI's answers carry `annotations: []` and may hold refusal parts: a conversation saved from OpenAI and
    replayed here was refused."""
    for assistant in ({"role": "assistant", "content": "Hi.", "annotations": []},
                      {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Hi."},
                                                        {"type": "refusal", "refusal": "No more."}]}):
        answer = chat(client, max_tokens=2, messages=[*MESSAGES, assistant, {"role": "user", "content": "Go on."}])
        assert answer.status_code == 200, (assistant, answer.get_json())
    refused = chat(client, max_tokens=2, messages=[{"role": "user", "content": [{"type": "refusal",
                                                                                  "refusal": "x"}]}])
    assert refused.status_code == 400 and "assistant" in refused.get_json()["error"]["message"]


def test_a_content_part_with_an_unknown_field_is_told_so(client):
    """It was told "Input should be a valid string" (the union's first branch)."""
    error = chat(client, max_tokens=2, messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                               "foo": 1}]}]).get_json()["error"]
    assert "'foo'" in error["message"] and error["param"].startswith("messages[0].content"), error


def test_too_many_stop_strings_are_counted_once_in_the_message(client):
    error = complete(client, max_tokens=2, stop=[f"s{i}" for i in range(17)]).get_json()["error"]
    assert error["param"] == "stop" and error["message"].count("got") == 1, error


def test_a_chat_answer_without_max_tokens_runs_to_the_limit_as_vllms(client):
    """LangChain and the SDK's `parse` send no max_tokens: the server's 64 cut their answers (a structured answer
    of 97 tokens failed with LengthFinishReasonError). A chat answer now runs to max_new_tokens_limit, cut to the
    context; /v1/completions keeps the server's max_new_tokens (OpenAI's completions have a small default too)."""
    service = client.application.extensions["specdec"]
    usage = chat(client, seed=2, ignore_eos=True).get_json()["usage"]
    context = service.decoder.context_length
    assert usage["completion_tokens"] == min(service.settings.max_new_tokens_limit,
                                             context - usage["prompt_tokens"])
    assert usage["completion_tokens"] > service.settings.max_new_tokens
    usage = complete(client, seed=2, ignore_eos=True).get_json()["usage"]
    assert usage["completion_tokens"] == service.settings.max_new_tokens


def test_a_stream_of_several_choices_frees_the_engine_once_all_are_decoded_though_unread(client):
    """Each choice was started when its sender reached it, so a client that stopped reading an n = 3 stream held the
    engine until it was dropped. Now each choice is decoded as soon as the one before it is, and the engine
    released after the last, while the events wait for the client; they come whole and in order, as the same
    request answers unstreamed."""
    service = client.application.extensions["specdec"]
    body = {"prompt": PROMPT, "max_tokens": 30, "n": 3, "seed": 4, "ignore_eos": True}
    whole = complete(client, **body).get_json()
    response = client.post("/v1/completions", json={"model": "target", **body, "stream": True})
    events = iter(response.response)
    first = next(events)
    wait_until_engine_free(service)  # the client reads nothing meanwhile
    assert complete(client, max_tokens=2).status_code == 200  # served while the stream is unread
    blocks = [b.removeprefix("data: ") for b in (first + b"".join(events)).decode().strip().split("\n\n")]
    response.close()
    assert blocks[-1] == "[DONE]"
    texts = {}
    for chunk in map(json.loads, blocks[:-1]):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def _rounds_per_generation(monkeypatch) -> list:
    """Every Generation.rounds call, by the generation it was called on."""
    from specdec.serve.generation import Generation

    calls, rounds = [], Generation.rounds  # the generations themselves: an id() may be reused once one is freed
    monkeypatch.setattr(Generation, "rounds", lambda self, *args, **kwargs: calls.append(self)
                        or rounds(self, *args, **kwargs))
    return calls


def test_each_choice_of_a_stream_is_decoded_once(client, monkeypatch):
    """A choice is started by whichever comes first, the sender reaching it or the end of the choice before it; a
    review found the second one started it again (a second decoding job, outbox and wake-up for each choice)."""
    from specdec.serve.concurrency import _Outbox

    calls = _rounds_per_generation(monkeypatch)
    report_end = _Outbox._report_end
    # the end reported late, as under gevent, where the sender often takes it before the greenlet reporting it runs
    monkeypatch.setattr(_Outbox, "_report_end", lambda self, run: (time.sleep(0.05), report_end(self, run)))
    for _ in range(3):
        assert chunks(complete(client, max_tokens=6, n=3, seed=2, stream=True))
    time.sleep(0.2)
    assert len(calls) == 9 and len(set(calls)) == 9


def test_a_stream_left_by_its_client_starts_no_further_choice(client, service, monkeypatch):
    """A choice that ended because the client left (or with an error) is not followed by the next: it was started
    (a prefill and a round) only to be stopped."""
    calls = _rounds_per_generation(monkeypatch)
    response = client.post("/v1/completions", json={"model": "target", "prompt": PROMPT, "max_tokens": 200, "n": 3,
                                                    "seed": 1, "ignore_eos": True, "stream": True})
    assert next(iter(response.response)).startswith(b"data: ")
    response.close()
    time.sleep(0.2)  # an end reported late would start the next choice now
    assert len(calls) == 1 and not service.scheduler.busy


def test_a_chat_answer_without_max_tokens_may_ask_for_more_min_tokens_than_the_old_default(client):
    """The chat default is max_new_tokens_limit, so min_tokens 100 without max_tokens is taken (it was checked
    against the completions' default, 64, and refused)."""
    answer = chat(client, min_tokens=100, seed=1)
    assert answer.status_code == 200, answer.get_json()
    assert answer.get_json()["usage"]["completion_tokens"] >= 100


def test_later_choices_cache_hits_count_as_their_prompt_tokens_do_once_per_prompt(client, caplog):
    """The log line and /metrics counted the prompt once but the later choices' cache hits each time (n = 4 on a
    100-token prompt logged cached_tokens 297): both now count what usage counts."""
    before = metric(client, "specdec_prompt_cache_cached_tokens_total")
    with caplog.at_level(logging.INFO, logger="specdec.serve"):
        usage = chat(client, max_tokens=2, n=4, seed=3, headers={"X-Request-ID": "cached-once"}).get_json()["usage"]
    (line,) = [r.getMessage() for r in caplog.records if "request_id=cached-once " in r.getMessage()]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert f"prompt_tokens={usage['prompt_tokens']} " in line and f"cached_tokens={cached} " in line, line
    assert metric(client, "specdec_prompt_cache_cached_tokens_total") - before == cached
