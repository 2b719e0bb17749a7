"""Structured outputs and tool calls through the official `openai` client, against a live gunicorn serving the
saved tiny pair: `chat.completions.parse` with a pydantic model, response_format json_schema and json_object,
vLLM's structured_outputs, tools under tool_choice required, a named function and auto, a full tool round trip,
and streamed tool calls accumulated by the SDK's stream helper; LangChain's ChatOpenAI with_structured_output
(json_schema) and bind_tools with a tool round trip. The tiny models write nonsense, so each answer is checked for
what the constraint promises: it parses and validates (jsonschema)."""

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from bench.stress import Server

pytestmark = pytest.mark.xdist_group("openai")

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                                  "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}}


class Pet(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=30)
    kind: str = Field(pattern="^(cat|dog)$")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_pair_dirs):
    draft_dir, target_dir = tiny_pair_dirs
    server = Server(tmp_path_factory.mktemp("structured") / "server.log", draft_model=draft_dir,
                    target_model=target_dir, device="cpu", max_new_tokens=200, max_new_tokens_limit=400,
                    prompt_cache_bytes=0)  # the same seed, the same answer: bit for bit only without the cache
    server.wait_ready(timeout=90)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any-key", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_returns_parsed(client):
    for seed in range(3):
        completion = client.chat.completions.parse(model="target", messages=MESSAGES, response_format=Pet,
                                                   seed=seed, max_completion_tokens=200)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        stats = completion.model_extra["choices"][0]["speculative_decoding_stats"] if completion.model_extra \
            else choice.model_extra["speculative_decoding_stats"]
        assert stats["num_forced_tokens"] > 0 and stats["num_accepted_tokens_by_drafter"]["grammar"] > 0


def test_json_schema_and_json_object(client):
    schema = {**Pet.model_json_schema(), "additionalProperties": False}  # no extra keys: short enough to end
    answer = client.chat.completions.create(model="target", messages=MESSAGES, max_completion_tokens=200, seed=1,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "pet", "schema": schema, "strict": True}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    answer = client.chat.completions.create(model="target", messages=MESSAGES, max_completion_tokens=40, seed=2,
                                            temperature=0, response_format={"type": "json_object"})
    text = answer.choices[0].message.content
    assert text.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_choice_and_regex_on_completions(client):
    for seed in range(3):
        answer = client.completions.create(model="target", prompt="Yes or no?", max_tokens=10, seed=seed,
                                           extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert answer.choices[0].text in ("yes", "no")
        answer = client.completions.create(model="target", prompt="A date:", max_tokens=20, seed=seed,
                                           extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}})
        assert len(answer.choices[0].text) == 7 and answer.choices[0].text[:2] == "20"


def _check_calls(message, tools):
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_and_named(client, parallel):
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        answer = client.chat.completions.create(model="target", messages=MESSAGES, tools=[WEATHER, ADD], seed=3,
                                                tool_choice=choice, parallel_tool_calls=parallel,
                                                max_completion_tokens=200)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls" and message.tool_calls and not message.content
        _check_calls(message, [WEATHER, ADD])
        if not parallel or choice != "required":  # a named function is called once, as vLLM and OpenAI do
            assert len(message.tool_calls) == 1
        if choice != "required":
            assert message.tool_calls[0].function.name == "add"


def test_tool_choice_auto_answers_in_text_or_with_valid_calls(client):
    for seed in range(3):
        answer = client.chat.completions.create(model="target", messages=MESSAGES, tools=[WEATHER], seed=seed,
                                                tool_choice="auto", max_completion_tokens=60)
        choice = answer.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check_calls(choice.message, [WEATHER])
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content is not None


def test_a_tool_round_trip(client):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.chat.completions.create(model="target", messages=messages, tools=[ADD], tool_choice="required",
                                           parallel_tool_calls=False, seed=4, max_completion_tokens=100)
    call = first.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])}]
    final = client.chat.completions.create(model="target", messages=messages, tools=[ADD], seed=4,
                                           tool_choice="none", max_completion_tokens=20)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_streamed_tool_calls_accumulate_in_the_sdk_helper(client):
    with client.chat.completions.stream(model="target", messages=MESSAGES, tools=[WEATHER, ADD], seed=5,
                                        tool_choice="required", max_completion_tokens=200) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.tool_calls
    _check_calls(message, [WEATHER, ADD])
    streamed = client.chat.completions.create(model="target", messages=MESSAGES, tools=[WEATHER, ADD], seed=5,
                                              tool_choice="required", max_completion_tokens=200)
    assert [c.function.arguments for c in streamed.choices[0].message.tool_calls] == [
        c.function.arguments for c in message.tool_calls]  # the same seed: the same calls, streamed or not
    # the helper's message sent back as it is, as agent loops do (the fifth audit: its `parsed`, `index` and
    # `parsed_arguments` were refused as unknown, a 400 on the loop's second turn)
    results = [{"role": "tool", "tool_call_id": call.id, "content": "ok"} for call in message.tool_calls]
    after = client.chat.completions.create(model="target", messages=[*MESSAGES, message, *results],
                                           tools=[WEATHER, ADD], tool_choice="none", max_completion_tokens=5)
    assert after.choices[0].message.content is not None


def test_bad_structured_inputs_are_400_naming_the_field(client):
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
         "response_format.json_schema.schema"),
        (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex"),
        (dict(extra_body={"structured_outputs": {"grammar": "start: missing_rule"}}), "structured_outputs.grammar"),
        (dict(extra_body={"structured_outputs": {"json": {"type": "object", "description": "x" * 70_000}}}),
         "structured_outputs.json"),
        (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
        (dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="target", messages=MESSAGES, max_completion_tokens=5, **kwargs)
        assert raised.value.param == param and raised.value.type == "invalid_request_error"
    assert client.chat.completions.create(model="target", messages=MESSAGES, max_completion_tokens=5).choices


# --- LangChain (langchain-openai) --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="target", base_url=server.url + "/v1", api_key="any-key",
                                       max_retries=0, timeout=120, max_completion_tokens=150, seed=6)


def test_langchain_with_structured_output_json_schema(chat_model):
    pet = chat_model.with_structured_output(Pet, method="json_schema").invoke("Describe a pet.")
    assert isinstance(pet, Pet)


def test_langchain_bind_tools_round_trip(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage

    with_tools = chat_model.bind_tools([ADD], tool_choice="add", parallel_tool_calls=False)
    messages = [HumanMessage("What is 2 + 3?")]
    reply = with_tools.invoke(messages)
    assert [call["name"] for call in reply.tool_calls] == ["add"]
    call = reply.tool_calls[0]
    jsonschema.validate(call["args"], ADD["function"]["parameters"])
    messages += [reply, ToolMessage(str(call["args"]["a"] + call["args"]["b"]), tool_call_id=call["id"])]
    final = chat_model.bind_tools([ADD], tool_choice="none").invoke(messages)
    assert isinstance(final.content, str) and final.content and not final.tool_calls
