"""The official `openai` client against the /v1 routes of a live gunicorn on 127.0.0.1 with the saved tiny pair:
completions and chat, streamed and not; greedy output equal to the engine's own target-only greedy decoding;
usage; a conversation served from the prompt cache; a stop string split across two chunks; the model list; BadRequestError with its param; the SDK's
retries ending in its 503 error; a client that goes away; and the OpenAI documentation's example bodies sent
raw, as curl sends them."""

import json
import re
import shutil
import subprocess
import threading
import time

import openai
import pytest
import requests
import torch

from bench.stress import DELAY_ENV, Server
from specdec import SpeculativeDecoder
from specdec.engine import eos_token_ids
from specdec.params import SamplingParams
from specdec.text import decoder_of, encode_messages, encode_prompt

pytestmark = pytest.mark.xdist_group("openai")

PROMPT = "Who is the president of the USA"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_pair_dirs):
    """One request decodes, one may wait; a target forward sleeps 10 ms, so a long request holds the engine
    for seconds (the overload test); a 503 asks for a retry after 1 s."""
    draft_dir, target_dir = tiny_pair_dirs
    server = Server(tmp_path_factory.mktemp("openai") / "server.log", env={DELAY_ENV: "0.01"},
                    draft_model=draft_dir, target_model=target_dir, device="cpu", loader="bench.stress:faulty_pair",
                    queue_size=1, queue_timeout=30, retry_after=1)
    server.wait_ready(timeout=90)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any-key", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(pair):
    """The engine's greedy target-only decoding of the saved pair, as transformers loads it (the server's copy
    runs the CPU kernels and an int8 draft)."""
    draft, target, tokenizer = pair
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    eos = eos_token_ids(target, tokenizer)

    def greedy(max_tokens: int, prompt: str | None = None, messages: list[dict] | None = None):
        ids = encode_prompt(tokenizer, prompt) if messages is None else encode_messages(tokenizer, messages)
        result = decoder.generate(ids, params=SamplingParams(max_new_tokens=max_tokens, method="target",
                                                              temperature=0), eos_token_id=eos)
        return decoder_of(tokenizer)(result.token_ids), len(ids), len(result.token_ids)

    return greedy


def stats_of(choice) -> dict:
    return choice.model_extra["speculative_decoding_stats"]


# --- completions and chat ---------------------------------------------------------------------------------------

def test_models_list(client):
    (model,) = client.models.list().data
    assert model.id == "target" and model.object == "model" and model.owned_by == "specdec"
    assert model.model_extra["metadata"]["draft"] == "draft" and model.model_extra["max_model_len"] == 256
    assert client.models.retrieve("target") == model  # GET /v1/models/{model}


def test_completion_greedy_equals_the_targets_greedy_completion(client, reference):
    text, prompt_tokens, completion_tokens = reference(48, prompt=PROMPT)
    completion = client.completions.create(model="target", prompt=PROMPT, max_tokens=48, temperature=0)
    (choice,) = completion.choices
    assert choice.text == text and choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == prompt_tokens == len(PROMPT)
    assert completion.usage.completion_tokens == completion_tokens == 48
    assert completion.usage.total_tokens == prompt_tokens + completion_tokens
    stats = stats_of(choice)
    assert stats["method"] == "google" and stats["gamma"] == 4 and 0 < stats["num_draft_tokens"]
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"


def test_completion_stream_equals_the_answer(client, reference):
    text, prompt_tokens, completion_tokens = reference(48, prompt=PROMPT)
    stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    *content, usage = chunks
    assert "".join(chunk.choices[0].text for chunk in content) == text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert len(content) > 2 and stats_of(content[-1].choices[0])["num_draft_tokens"] > 0
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (
        prompt_tokens, completion_tokens)


def test_chat_greedy_and_streamed(client, reference):
    text, prompt_tokens, completion_tokens = reference(40, messages=MESSAGES)
    answer = client.chat.completions.create(model="target", messages=MESSAGES, max_completion_tokens=40,
                                            temperature=0, extra_body={"gamma": 3, "method": "deepmind"})
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert stats_of(choice)["method"] == "deepmind" and stats_of(choice)["gamma"] == 3
    chunks = list(client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=40, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_a_conversation_reuses_its_history_and_answers_as_without_the_prompt_cache(client, reference):
    """Each turn sends the whole conversation again: the prompt cache serves more of it each turn, and the greedy
    answers are those of the same conversation sent with cache_prompt false (and the engine's own, uncached)."""
    messages = [{"role": "system", "content": "You answer in one line. (conversation 1)"},
                {"role": "user", "content": "Name three colours."}]
    cached = []
    for turn in range(4):
        body = {"model": "target", "messages": messages, "max_tokens": 16, "temperature": 0}
        answer = client.chat.completions.create(**body)
        plain = client.chat.completions.create(**body, extra_body={"cache_prompt": False})
        text = answer.choices[0].message.content
        assert text == plain.choices[0].message.content == reference(16, messages=messages)[0]
        assert plain.usage.prompt_tokens_details.cached_tokens == 0
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < answer.usage.prompt_tokens
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn}?"}]
    assert all(later > earlier for earlier, later in zip(cached, cached[1:])), cached
    assert cached[1] > 40  # the first turn's prompt and most of its answer


def test_sampled_stream_equals_the_answer_with_the_same_seed(client):
    # cache_prompt false: reused keys come from forwards of other widths, so a draw may differ at a rounding tie
    body = {"model": "target", "messages": MESSAGES, "max_tokens": 30, "temperature": 0.9, "top_p": 0.95, "seed": 7,
            "extra_body": {"cache_prompt": False}}
    answer = client.chat.completions.create(**body)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True))
    assert streamed == answer.choices[0].message.content and stats_of(answer.choices[0])["seed"] == 7


def test_a_stop_string_split_across_chunks_never_leaks(client):
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 60, "temperature": 0}
    pieces = [c.choices[0].text for c in client.completions.create(**body, stream=True)]
    full = "".join(pieces)
    # a stop string made of the end of one chunk and the start of the next, found first at that boundary
    stop = None
    for i in range(1, len(pieces) - 1):
        boundary = len("".join(pieces[:i]))
        for before, after in ((2, 2), (1, 2), (2, 1), (1, 1)):
            candidate = full[boundary - before:boundary + after]
            if (len(pieces[i - 1]) >= before and len(pieces[i]) >= after
                    and full.find(candidate) == boundary - before):
                stop = candidate
                break
        if stop:
            break
    assert stop, pieces
    expected = full[:full.find(stop)]
    chunks = list(client.completions.create(**body, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    answer = client.completions.create(**body, stop=stop)
    assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "stop"


# --- logprobs, echo, token ids, several prompts ------------------------------------------------------------------

def plain_logprobs(target, ids: list[int]) -> list[float]:
    """The target's log-probability of each token after the first: one transformers forward, no cache."""
    with torch.no_grad():
        rows = target(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return rows.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def test_completion_logprobs_streamed_and_not_with_token_ids_and_echo(client, pair):
    """The server runs our CPU kernels and an int8 draft; its logprobs are still the target's (a plain forward
    of the transformers-loaded target, within 1e-4), and the stream carries the same ones."""
    _, target, tokenizer = pair
    ids = encode_prompt(tokenizer, PROMPT)
    body = {"model": "target", "prompt": ids, "max_tokens": 20, "temperature": 0.8, "seed": 3, "logprobs": 2,
            "echo": True}
    answer = client.completions.create(**body)
    (choice,) = answer.choices
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT) and logprobs.token_logprobs[0] is None
    tokens = tokenizer.convert_tokens_to_ids(logprobs.tokens)
    assert tokens[:len(ids)] == ids and len(tokens) == len(ids) + answer.usage.completion_tokens
    assert logprobs.token_logprobs[1:] == pytest.approx(plain_logprobs(target, tokens), abs=1e-4)
    assert all(len(top) in (2, 3) for top in logprobs.top_logprobs[1:])
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.token_logprobs] == logprobs.token_logprobs
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == logprobs.text_offset


def test_several_prompts_are_choices_in_order(client, reference):
    prompts = [PROMPT, "def add(a, b):", "Hello"]
    expected = [reference(12, prompt=prompt)[0] for prompt in prompts]
    answer = client.completions.create(model="target", prompt=prompts, max_tokens=12, temperature=0, logprobs=0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == expected
    assert all(len(c.logprobs.tokens) >= 1 for c in answer.choices)
    texts = {}
    for chunk in client.completions.create(model="target", prompt=prompts, max_tokens=12, temperature=0,
                                           stream=True):
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == expected


def test_chat_logprobs_streamed_and_not(client, reference):
    text = reference(20, messages=MESSAGES)[0]
    off = {"cache_prompt": False}  # logprobs equal to the bit: no keys reused from forwards of other widths
    answer = client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=20, temperature=0,
                                            logprobs=True, top_logprobs=3, extra_body=off)
    content = answer.choices[0].logprobs.content
    assert answer.choices[0].message.content == text
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)  # greedy
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    chunks = list(client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=20, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True, extra_body=off))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]


# --- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call, param", [
    (lambda c: c.completions.create(model="target", prompt=PROMPT, n=17), "n"),
    (lambda c: c.completions.create(model="target", prompt=PROMPT, logprobs=21), "logprobs"),
    (lambda c: c.completions.create(model="target", prompt=[1, 2, 100]), "prompt"),  # the vocabulary is 0..99
    (lambda c: c.completions.create(model="target", prompt=[]), "prompt"),
    (lambda c: c.completions.create(model="target", prompt=["p"] * 17), "prompt"),  # max_prompts_per_request
    (lambda c: c.completions.create(model="target", prompt=PROMPT, max_tokens=0), "max_tokens"),  # without echo
    (lambda c: c.completions.create(model="target", prompt=PROMPT, temperature=2.5), "temperature"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, presence_penalty=2.5),
     "presence_penalty"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, frequency_penalty=-3.0),
     "frequency_penalty"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, logprobs=True, top_logprobs=21),
     "top_logprobs"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, top_logprobs=2), "top_logprobs"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format.json_schema.schema"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, tools=[
        {"type": "function", "function": {"parameters": {"type": "object"}}}]), "tools[0].function.name"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, max_completion_tokens=5000),
     "max_completion_tokens"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, extra_body={"gamma": 0}), "gamma"),
    (lambda c: c.chat.completions.create(model="target", messages=MESSAGES, tools=[
        {"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice.function.name"),
])
def test_invalid_requests_raise_bad_request_error_with_the_param(client, call, param):
    with pytest.raises(openai.BadRequestError) as raised:
        call(client)
    assert raised.value.status_code == 400 and raised.value.param == param and raised.value.type == (
        "invalid_request_error")


def test_an_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o-mini")


def test_overload_raises_the_sdks_503_error_after_its_retries(server):
    """One long request decodes and one waits (the queue holds one): the SDK's request is refused with a 503,
    waits the Retry-After, is refused again, and raises."""
    refused = '{endpoint="/v1/completions",status="503"}'
    long_body = {"model": "target", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "method": "target",
                 "stream": True}
    held = []

    def hold():
        held.append(requests.post(server.url + "/v1/completions", json=long_body, stream=True, timeout=60))

    threads = [threading.Thread(target=hold) for _ in range(2)]
    try:
        threads[0].start()
        deadline = time.monotonic() + 20
        while server.metric("specdec_engine_busy") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        threads[1].start()
        while server.metric("specdec_queue_depth") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        before = server.metric("specdec_requests_total", refused)
        retrying = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=1, timeout=30)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as raised:
            retrying.completions.create(model="target", prompt=PROMPT, max_tokens=5)
        assert time.monotonic() - started >= 1  # it waited the Retry-After once
        assert raised.value.status_code == 503 and raised.value.code == "overloaded"
        assert raised.value.response.headers["Retry-After"] == "1"
        assert server.metric("specdec_requests_total", refused) == before + 2  # the first try and one retry
        assert server.metric("specdec_engine_busy") == 1  # the long request was still decoding throughout
    finally:
        threads[0].join(30)
        for response in held:
            response.close()  # disconnects: the held request stops, the waiting one starts, then stops too
        threads[1].join(30)
        for response in held:
            response.close()
    deadline = time.monotonic() + 20
    while server.metric("specdec_engine_busy") or server.metric("specdec_queue_depth"):
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)


def test_a_client_that_goes_away_stops_the_generation(server, client):
    generated = server.metric("specdec_generated_tokens_total")
    stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_headers={"X-Request-ID": "v1-disconnects"})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    while not re.search(r"request_id=v1-disconnects POST /v1/completions .*finish_reason=cancelled", server.log()):
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.05)
    assert server.metric("specdec_generated_tokens_total") - generated < 200
    # greedy, as the cancelled request was (which had not stopped): a sampled one may draw EOS first
    assert client.completions.create(model="target", prompt=PROMPT, max_tokens=3,
                                     temperature=0).usage.completion_tokens == 3


# --- the documentation's examples, sent raw -----------------------------------------------------------------

def curl(url: str, body: str, stream: bool = False) -> tuple[int, str]:
    """POST `body` as the OpenAI documentation's curl examples do (any API key), with curl when there is one."""
    headers = ["Content-Type: application/json", "Authorization: Bearer any-key"]
    if shutil.which("curl"):
        command = ["curl", "-s", "-w", "\n%{http_code}", *(["-N"] if stream else []), url]
        for header in headers:
            command += ["-H", header]
        done = subprocess.run([*command, "-d", body], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        text, _, status = done.stdout.rpartition("\n")
        return int(status), text
    response = requests.post(url, data=body.encode(), timeout=60,
                             headers=dict(header.split(": ", 1) for header in headers))
    return response.status_code, response.text


def test_the_documented_example_bodies(server):
    status, text = curl(server.url + "/v1/completions",
                        '{"model": "target", "prompt": "Say this is a test", "max_tokens": 7, "temperature": 0}')
    assert status == 200, text
    body = json.loads(text)
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == "length" and "speculative_decoding_stats" in body["choices"][0]

    chat = {"model": "target", "messages": [{"role": "developer", "content": "You are a helpful assistant."},
                                            {"role": "user", "content": "Hello!"}]}
    status, text = curl(server.url + "/v1/chat/completions", json.dumps(chat))
    assert status == 200, text
    answer = json.loads(text)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
    as_system = {**chat, "messages": [{**chat["messages"][0], "role": "system"}, chat["messages"][1]]}
    status, text = curl(server.url + "/v1/chat/completions", json.dumps(as_system))
    assert json.loads(text)["usage"]["prompt_tokens"] == answer["usage"]["prompt_tokens"]  # the same template role

    status, text = curl(server.url + "/v1/chat/completions", json.dumps({**chat, "stream": True}), stream=True)
    lines = [line for line in text.split("\n") if line]
    assert status == 200 and lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    first = json.loads(lines[0].removeprefix("data: "))
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"

    status, text = curl(server.url + "/v1/models", "")
    assert status == 405  # curl -d makes it a POST; the list is a GET
    assert json.loads(requests.get(server.url + "/v1/models", timeout=10).text)["data"][0]["id"] == "target"


def test_a_megabyte_to_tokenize_leaves_the_event_loop_answering(server):
    """Found by an audit of costly valid requests: /tokenize (which takes no engine slot) tokenized a megabyte of
    text on the event loop, holding /healthz (and every connection) for 2 s. A large text is tokenized on a thread
    (concurrency.off_loop), the loop answering meanwhile, within issue 16's 1 s."""
    text = ("abc def " * 131_000)[:1_040_000]  # under max_body_bytes, with the JSON around it
    response, latencies = healthz_during(server, "/tokenize", {"prompt": text}, every=0.05)
    assert response.status_code == 200 and response.json()["count"] >= len(text) // 8
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


def healthz_during(server, path: str, body: dict, every: float):
    """POST `body` to `path` on a thread while /healthz is asked every `every` seconds: (the POST's response, each
    /healthz's seconds)."""
    answer, latencies = {}, []
    worker = threading.Thread(target=lambda: answer.setdefault(
        "response", requests.post(server.url + path, json=body, timeout=300)))
    worker.start()
    while worker.is_alive():
        started = time.perf_counter()
        assert requests.get(server.url + "/healthz", timeout=30).status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(every)
    worker.join()
    return answer["response"], latencies


def test_an_answer_with_logprobs_is_made_off_the_event_loop(server):
    """Found by the same audit: an answer's logprobs (21 tokens a position, an echoed prompt's included) were made
    and encoded on the event loop: 16 echoed prompts of 4,000 tokens held /healthz for 12 s. Here 16 prompts of
    250 tokens (the tiny pair's context), which held it for most of a second."""
    prompts = ["".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(250)) for i in range(16)]
    body = {"model": "target", "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 20, "temperature": 0}
    response, latencies = healthz_during(server, "/v1/completions", body, every=0.02)
    choices = response.json()["choices"]
    assert len(choices) == 16 and all(len(choice["logprobs"]["tokens"]) >= 251 for choice in choices)
    assert max(latencies) < 0.4, sorted(latencies)[-5:]
