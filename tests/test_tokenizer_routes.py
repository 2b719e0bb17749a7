"""vLLM's /tokenize and /detokenize: the token ids the generation routes feed the model (a prompt as
/v1/completions encodes it, a conversation with its tools as /v1/chat/completions does), counted whatever their
length; detokenize inverts them; bad requests are OpenAI-shaped 400s naming the field."""

import copy

import pytest
from tokenizers import processors

from tests.support.models import CHAT_TEMPLATE, make_app

pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.xdist_group("openai")]

PROMPT = "Who is the president of the USA"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a fact",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def app(pair):
    return make_app(pair, max_prompt_tokens=200)


@pytest.fixture
def client(app):
    return app.test_client()


def tokenize(client, **body):
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def assert_error(response, param, code="invalid_value", status=400):
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"


def test_a_prompt_becomes_the_tokens_completions_feed_the_model(client, app):
    tokenizer = app.extensions["specdec"].tokenizer
    body = tokenize(client, prompt=PROMPT)
    assert body["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    completion = client.post("/v1/completions", json={"model": "target", "prompt": PROMPT, "max_tokens": 1})
    assert completion.get_json()["usage"]["prompt_tokens"] == body["count"]
    models = client.get("/v1/models").get_json()["data"][0]
    assert body["max_model_len"] == models["max_model_len"]
    named = tokenize(client, model="target", prompt=PROMPT, return_token_strs=True)
    assert named["tokens"] == body["tokens"]
    assert named["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_conversation_becomes_the_tokens_chat_completions_feed_the_model(client, app, monkeypatch, tools):
    # a template that writes the tools' names in (the tiny one leaves tools out)
    monkeypatch.setattr(app.extensions["specdec"].tokenizer, "chat_template",
                        "{% if tools %}<bos>tools: {{ tools | map(attribute='function.name') | join(',') }}\n"
                        "{% endif %}" + CHAT_TEMPLATE)
    body = tokenize(client, messages=MESSAGES, **({"tools": tools} if tools else {}))
    chat = client.post("/v1/chat/completions", json={"model": "target", "messages": MESSAGES, "max_tokens": 1,
                                                     **({"tools": tools} if tools else {})})
    assert chat.status_code == 200, chat.get_data(as_text=True)
    assert chat.get_json()["usage"]["prompt_tokens"] == body["count"] == len(body["tokens"])
    if tools:
        assert body["count"] > tokenize(client, messages=MESSAGES)["count"]  # the template wrote the tools in


@pytest.fixture(scope="module")
def bos_app(pair):
    """The service over the tiny pair, its tokenizer adding a BOS to what it encodes with special tokens."""
    draft, target, tokenizer = pair
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.convert_tokens_to_ids("<bos>"))])
    return make_app((draft, target, tokenizer))


def test_add_special_tokens_adds_the_tokenizers_own_to_a_prompt_or_a_conversation(bos_app):
    client, tokenizer = bos_app.test_client(), bos_app.extensions["specdec"].tokenizer
    bos = tokenizer.convert_tokens_to_ids("<bos>")
    plain = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert tokenize(client, prompt=PROMPT)["tokens"] == [bos, *plain]  # as /v1/completions encodes it
    assert tokenize(client, prompt=PROMPT, add_special_tokens=True)["tokens"] == [bos, *plain]
    assert tokenize(client, prompt=PROMPT, add_special_tokens=False)["tokens"] == plain
    conversation = tokenize(client, messages=MESSAGES)["tokens"]  # the template writes its own <bos>s
    assert conversation == tokenize(client, messages=MESSAGES, add_special_tokens=False)["tokens"]
    assert tokenize(client, messages=MESSAGES, add_special_tokens=True)["tokens"] == [bos, *conversation]
    completion = client.post("/v1/completions", json={"model": "target", "prompt": PROMPT, "max_tokens": 1})
    assert completion.get_json()["usage"]["prompt_tokens"] == len(plain) + 1


def test_the_assistants_turn_is_opened_or_its_last_message_continued(client, app):
    tokenizer = app.extensions["specdec"].tokenizer

    def text(**body):
        return tokenizer.decode(tokenize(client, **body)["tokens"])

    opened = "<bos>system: Be brief.\n<bos>user: " + PROMPT + "\n"
    assert text(messages=MESSAGES) == opened + "<bos>assistant: "  # CHAT_TEMPLATE's generation prompt
    assert text(messages=MESSAGES, add_generation_prompt=False) == opened
    begun = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    assert text(messages=begun, continue_final_message=True) == opened + "<bos>assistant: The answer is"
    assert text(messages=begun, continue_final_message=True, add_generation_prompt=False) == (
        opened + "<bos>assistant: The answer is")
    assert text(messages=begun) == opened + "<bos>assistant: The answer is\n<bos>assistant: "


def test_a_chat_templates_refusal_is_a_400_naming_the_messages(pair):
    """A template's raise_exception (roles out of order, say) is the request's fault, not the server's."""
    draft, target, tokenizer = pair
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the user speaks first') }}"
                               "{% endif %}" + CHAT_TEMPLATE)
    client = make_app((draft, target, tokenizer)).test_client()
    refused = [{"role": "assistant", "content": "hi"}]
    for path, body in (("/tokenize", {"messages": refused}),
                       ("/v1/chat/completions", {"model": "target", "messages": refused, "max_tokens": 2})):
        response = client.post(path, json=body)
        assert_error(response, "messages")
        assert "the user speaks first" in response.get_json()["error"]["message"]
    assert tokenize(client, messages=[{"role": "user", "content": "hi"}])["count"] > 0


def test_detokenize_inverts_tokenize_special_tokens_included(client):
    for body in ({"prompt": PROMPT}, {"messages": MESSAGES}):
        tokens = tokenize(client, **body)["tokens"]
        response = client.post("/detokenize", json={"model": "target", "tokens": tokens})
        assert response.status_code == 200
        text = response.get_json()["prompt"]
        assert tokenize(client, prompt=text)["tokens"][-len(tokens):] == tokens
        if "prompt" in body:
            assert text.endswith(PROMPT)
    assert client.post("/detokenize", json={"tokens": []}).get_json() == {"prompt": ""}


def test_a_prompt_past_the_limits_is_counted_not_refused(client):
    long = " ".join(["word"] * 60)
    assert tokenize(client, prompt=long)["count"] > 200  # max_prompt_tokens
    refused = client.post("/v1/completions", json={"model": "target", "prompt": long, "max_tokens": 1})
    assert_error(refused, "prompt", "context_length_exceeded")


@pytest.mark.parametrize("path, body, param, code", [
    ("/tokenize", {}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": PROMPT, "tools": TOOLS}, "tools", "invalid_value"),
    ("/tokenize", {"messages": []}, "messages", "invalid_value"),
    ("/tokenize", {"prompt": 5}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": PROMPT, "add_generation_prompt": False}, "add_generation_prompt", "invalid_value"),
    ("/tokenize", {"prompt": PROMPT, "continue_final_message": True}, "continue_final_message", "invalid_value"),
    ("/tokenize", {"prompt": PROMPT, "add_special_tokens": 1}, "add_special_tokens", "invalid_value"),
    ("/tokenize", {"prompt": PROMPT, "add_bos": True}, "add_bos", "unknown_parameter"),
    # the last message is the user's: nothing to continue; continuing excludes opening the assistant's turn
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message", "invalid_value"),
    ("/tokenize", {"messages": MESSAGES + [{"role": "assistant", "content": "It"}], "continue_final_message": True,
                   "add_generation_prompt": True}, "continue_final_message", "invalid_value"),
    ("/detokenize", {"tokens": [1, 100]}, "tokens", "invalid_value"),  # the tiny vocabulary is 0..99
    ("/detokenize", {"tokens": [1, -2]}, "tokens[1]", "invalid_value"),
    ("/detokenize", {"tokens": "1 2"}, "tokens", "invalid_value"),
    ("/detokenize", {}, "tokens", "missing_required_parameter"),
])
def test_bad_requests_are_openai_shaped_400s_naming_the_field(client, path, body, param, code):
    assert_error(client.post(path, json=body), param, code)


def test_another_model_is_404_and_a_bad_body_400(client):
    assert_error(client.post("/tokenize", json={"model": "gpt-4o", "prompt": PROMPT}), "model", "model_not_found",
                 404)
    response = client.post("/detokenize", data="{", content_type="application/json")
    assert response.status_code == 400 and "error" in response.get_json()


def test_the_api_description_documents_both_routes(client):
    document = client.get("/openapi.json").get_json()
    for path, request, answer in (("/tokenize", "TokenizeRequest", "TokenizeResponse"),
                                  ("/detokenize", "DetokenizeRequest", "DetokenizeResponse")):
        post = document["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(answer)
        assert {"400", "404", "503"} <= set(post["responses"])
    assert set(document["components"]["schemas"]["TokenizeResponse"]["properties"]) == {
        "count", "max_model_len", "tokens", "token_strs"}
