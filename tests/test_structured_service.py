"""Structured outputs and tool calls through Flask's test client on the tiny pair: /predict takes response_format
and structured_outputs; a conversation with an assistant's tool calls and a tool's answer is accepted and
rendered; bad constraints are 4xx naming the field and the worker keeps serving; the grammar's work shows in the
stats and in /metrics."""

import json

import jsonschema
import pytest

from specdec.grammar import Constraint, GrammarCompiler
from specdec.serve.structured import (
    NamedToolChoice,
    Tool,
    ToolCallReader,
    content_of,
    parse_tool_calls,
    stream_pieces,
    template_messages,
    tool_constraint,
)

pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.xdist_group("openai")]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def metric(client, name):
    for line in client.get("/metrics").get_data(as_text=True).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_predict_takes_response_format_and_structured_outputs(client):
    forced_before = metric(client, "specdec_grammar_forced_tokens_total")
    body = client.post("/predict", json={"prompt": "Who is", "max_new_tokens": 60, "seed": 1, "details": True,
                                         "response_format": {"type": "json_schema", "json_schema": {
                                             "name": "x", "schema": SCHEMA}}}).get_json()
    assert body["finish_reason"] == "stop"
    jsonschema.validate(json.loads(body["text"]), SCHEMA)
    assert body["stats"]["forced_tokens"] > 0 and body["stats"]["grammar_seconds"] > 0
    assert "grammar" in {token["source"] for token in body["tokens"]}
    assert metric(client, "specdec_grammar_forced_tokens_total") == forced_before + body["stats"]["forced_tokens"]
    for seed in range(3):
        body = client.post("/predict", json={"prompt": "Who is", "seed": seed, "max_new_tokens": 10,
                                             "structured_outputs": {"choice": ["alpha", "beta"]}}).get_json()
        assert body["text"] in ("alpha", "beta")
    body = client.post("/predict", json={"prompt": "Who is", "max_new_tokens": 10, "grammar_drafter": False,
                                         "structured_outputs": {"regex": "[0-9]{3}"}}).get_json()
    assert len(body["text"]) == 3 and body["text"].isdigit() and body["stats"]["forced_tokens"] == 0


@pytest.mark.parametrize("extra, field", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {}}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None),
    ({"structured_outputs": {"choice": ["a", "b"]}, "ignore_eos": True}, "ignore_eos"),
    ({"structured_outputs": {"choice": ["a", "b"]}, "stop": ["b"]}, "stop"),
    ({"structured_outputs": {"regex": "a{999999}"}}, "structured_outputs.regex"),  # fails at its first token
    ({"structured_outputs": {"regex": "a{999999}"}}, "structured_outputs.regex"),  # and again, not "stop"
    ({"structured_outputs": {"regex": "ab\tc"}}, "structured_outputs.regex"),  # no token writes a tab: not "stop"
])
def test_predict_refuses_bad_constraints_naming_the_field(client, extra, field):
    response = client.post("/predict", json={"prompt": "Who is", **extra})
    assert response.status_code == 422
    error = response.get_json()["error"]
    assert error["type"] == "invalid_field" and error["message"] and "Traceback" not in error["message"]
    if field is not None:
        assert error["field"] == field
    assert client.post("/predict", json={"prompt": "Who is", "max_new_tokens": 2}).status_code == 200


def test_a_conversation_with_tool_calls_and_tool_answers_is_accepted(client, service_tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}
    messages = [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    response = client.post("/v1/chat/completions", json={"model": "target", "messages": messages, "tools": tools,
                                                         "tool_choice": "none", "max_tokens": 4})
    assert response.status_code == 200, response.get_json()
    rendered = template_messages([{**messages[1], "tool_calls": [call]}])[0]
    assert rendered["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}  # an object for the template


def test_tool_calls_are_read_back_and_text_kept():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", ' \
           '"arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Sure." and [c.function.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].function.arguments) == {"x": 1} and calls[0].id != calls[1].id
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>\n{broken\n</tool_call>") == ("<tool_call>\n{broken\n</tool_call>", [])


@pytest.mark.parametrize("cut", ["<tool_call>", '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", '
                                 '"arguments": '])
def test_a_last_call_cut_before_its_arguments_is_not_given_as_text(cut):
    """Found trying the quick start: tool_choice "required" with parallel calls, the default pair repeated its call
    until max_tokens cut the fourth one after its opening tag, and the answer's content was "<tool_call>"."""
    whole = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
    content, calls = parse_tool_calls("Here.\n" + whole + cut)
    assert content == "Here." and [json.loads(c.function.arguments) for c in calls] == [{"x": 1}]
    assert parse_tool_calls(whole + cut)[0] is None
    assert parse_tool_calls(cut) == (None, [])  # a call's markup is never content (it was, where nothing parsed)


@pytest.mark.parametrize("cut, arguments", [('{"x": 2', '{"x": 2'), ('{"x": "}{"}', '{"x": "}{"}'),
                                            ('{"x": 2}}', '{"x": 2}'), ('{"x": 2}}\n</tool', '{"x": 2}')])
def test_a_last_call_cut_in_or_after_its_arguments_is_a_call_as_far_as_decoded(cut, arguments):
    """Found by an audit: max_tokens cut the closing tag, a stream had sent the call (its arguments complete) and
    then its markup as content, while the answer whole gave the markup alone. Now both give the call, its
    arguments as far as they were decoded (what ToolCallReader streams), and no markup."""
    text = 'Here.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", ' \
           '"arguments": ' + cut
    content, calls = parse_tool_calls(text)
    assert content == "Here." and [(c.function.name, c.function.arguments) for c in calls] == [
        ("f", '{"x": 1}'), ("g", arguments)]
    reader, pieces = ToolCallReader(), []
    for end in range(len(text) + 1):
        pieces += reader.read(text[:end])
    assert "".join(piece for i, call_id, _, piece in pieces if i == 1 and not call_id) == arguments
    alone = parse_tool_calls(text[text.rindex("<tool_call>"):])
    assert alone[0] is None and [c.function.arguments for c in alone[1]] == [arguments]


def test_tool_calls_read_as_the_text_grows_stream_their_arguments_as_parsed():
    """Character by character: each call's id and name once the name is complete, then its arguments' own text in
    pieces, which join to the arguments `parse_tool_calls` reads from the whole text (braces and quotes inside
    strings included)."""
    text = ('<tool_call>\n{"name": "f", "arguments": {"x": "a}\\"{", "y": [1, {"z": 2}]}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    reader, pieces = ToolCallReader(), []
    for end in range(len(text) + 1):
        pieces += reader.read(text[:end])
    heads = [(index, name) for index, call_id, name, _ in pieces if call_id]
    assert heads == [(0, "f"), (1, "g")]
    arguments = ["".join(piece for i, call_id, _, piece in pieces if i == index and not call_id) for index in (0, 1)]
    assert arguments == [call.function.arguments for call in parse_tool_calls(text)[1]]
    assert json.loads(arguments[0]) == {"x": 'a}"{', "y": [1, {"z": 2}]}
    assert sum(1 for i, call_id, _, _ in pieces if i == 0 and not call_id) > 10  # in pieces, not at the end
    assert reader.read(text) == []  # nothing twice


def test_a_streamed_tool_call_sends_its_arguments_as_they_are_decoded(client):
    """The required tool's call streamed by OpenAI's chunks: the id and name once, then the arguments in several
    pieces, which join to the arguments of the same request answered whole."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a", "b", "why"], "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                       "b": {"type": "integer", "minimum": 0, "maximum": 999},
                       "why": {"type": "string", "minLength": 8, "maxLength": 16}}}}}
    body = {"model": "target", "messages": [{"role": "user", "content": "add"}], "tools": [tool], "seed": 3,
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 120}
    whole = client.post("/v1/chat/completions", json=body).get_json()["choices"][0]
    response = client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(line.removeprefix("data: ")) for line in response.get_data(as_text=True).splitlines()
              if line.startswith("data: {")]
    deltas = [call for chunk in chunks for choice in chunk["choices"]
              for call in choice["delta"].get("tool_calls") or []]
    assert whole["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the answer is calls alone: its content null streamed too (the fifth audit: the first delta's "" made the
    # SDK's streamed message content "" where the answer whole has null)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"} and whole["message"]["content"] is None
    assert all(choice["delta"].get("content") is None for chunk in chunks for choice in chunk["choices"])
    heads = [d for d in deltas if d.get("id")]
    assert len(heads) == 1 and heads[0]["function"]["name"] == "add" and heads[0]["type"] == "function"
    pieces = [d["function"]["arguments"] for d in deltas if not d.get("id")]
    assert len(pieces) > 1
    assert "".join(pieces) == whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert set(json.loads("".join(pieces))) == {"a", "b", "why"}


def test_a_tool_call_cut_by_max_tokens_streams_as_it_answers_whole(client):
    """For every max_tokens that cuts the required call (before its name, in its arguments, in its closing tag),
    the stream's deltas accumulate to the answer whole: the same calls with the same arguments, the same
    content, finish_reason "length" (found by an audit: a cut closing tag gave the call streamed, then its
    markup as content, and the markup alone whole)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    body = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "temperature": 0,
            "tool_choice": "required", "parallel_tool_calls": False}
    full = client.post("/v1/chat/completions", json={**body, "max_tokens": 120}).get_json()
    length = full["usage"]["completion_tokens"]
    assert full["choices"][0]["finish_reason"] == "tool_calls" and length > 12
    for max_tokens in [*range(3, 12, 4), *range(length - 14, length)]:
        whole = client.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens}).get_json()["choices"][0]
        response = client.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens, "stream": True})
        deltas = [json.loads(line.removeprefix("data: "))["choices"][0] for line in
                  response.get_data(as_text=True).splitlines() if line.startswith("data: {")]
        calls, content = {}, "".join(d["delta"].get("content") or "" for d in deltas)
        for call in (c for d in deltas for c in d["delta"].get("tool_calls") or []):
            name = calls.setdefault(call["index"], [None, ""])
            name[0] = call["function"].get("name") or name[0]
            name[1] += call["function"].get("arguments") or ""
        expected = [[c["function"]["name"], c["function"]["arguments"]] for c in whole["message"].get("tool_calls") or []]
        assert [calls[i] for i in sorted(calls)] == expected, max_tokens
        assert (content or None) == whole["message"]["content"], max_tokens
        assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "length", max_tokens
        assert "<tool_call" not in content and "</tool" not in content, max_tokens  # markup is never content


@pytest.mark.parametrize("choice, more", [("required", True), ({"type": "function", "function": {"name": "add"}}, False)])
def test_a_named_function_is_called_once_required_tools_as_often_as_the_model_likes(service_tokenizer, choice, more):
    """After one complete call, `required` with parallel calls may go on to another; a named function may only
    end (as vLLM and OpenAI answer it), whatever parallel_tool_calls says."""
    tools = [Tool(type="function", function={"name": "add", "parameters": {"type": "object"}})]
    choice = choice if isinstance(choice, str) else NamedToolChoice.model_validate(choice)
    eos = service_tokenizer.convert_tokens_to_ids("<eos>")
    state = GrammarCompiler(service_tokenizer, len(service_tokenizer)).compile(
        tool_constraint(tools, choice, parallel=True, special=False)).start({eos})
    for token in service_tokenizer.encode('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
                                          add_special_tokens=False):
        assert state.allows(token)
        state.advance(token)
    allowed = state.allowed().nonzero().flatten().tolist()
    assert eos in allowed and (len(allowed) > 1) == more


def test_required_parallel_calls_may_end_after_the_newline_a_call_is_followed_by(service_tokenizer):
    """The default pair writes a newline after a call, then its end token: the fifth audit found the newline made
    another call mandatory (`call ("\n" call)*`), so that parallel required calls went on to max_tokens."""
    tools = [Tool(type="function", function={"name": "add", "parameters": {"type": "object"}})]
    grammar = tool_constraint(tools, "required", parallel=True, special=False)
    call = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    assert accepts(service_tokenizer, grammar, call + "\n")
    assert accepts(service_tokenizer, grammar, call + "\n" + call + "\n") and accepts(service_tokenizer, grammar,
                                                                                     call + "\n" + call)
    assert not accepts(service_tokenizer, grammar, call + "\n\n")  # one newline, not any text


def accepts(service_tokenizer, constraint, text: str, ending: bool = True) -> bool:
    """Whether the constraint's grammar takes `text` token by token (and then, with `ending`, may end)."""
    eos = service_tokenizer.convert_tokens_to_ids("<eos>")
    state = GrammarCompiler(service_tokenizer, len(service_tokenizer)).compile(constraint).start({eos})
    for token in service_tokenizer.encode(text, add_special_tokens=False):
        if not state.allows(token):
            return False
        state.advance(token)
    return not ending or state.allows(eos)


@pytest.mark.parametrize("parallel", [True, False])
def test_under_auto_every_call_is_constrained_and_text_after_the_last_holds_none(service_tokenizer, parallel):
    """Found by an audit: under tool_choice auto the text after a call was free, so a second `<tool_call>` with
    arguments against the schema, or of no tool, parsed as a call (and parallel_tool_calls false let it in). Text
    outside the calls may not hold a call's opening tag now: each `<tool_call>` starts a constrained call."""
    tools = [Tool(type="function", function={"name": "f", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}})]
    grammar = tool_constraint(tools, "auto", parallel=parallel, special=False)
    call = '<tool_call>\n{"name": "f", "arguments": {"on": true}}\n</tool_call>'
    assert accepts(service_tokenizer, grammar, "Sure. " + call + " Done.")
    assert accepts(service_tokenizer, grammar, "No call.")
    assert accepts(service_tokenizer, grammar, call + "\n" + call) == parallel
    for bad in ['<tool_call>\n{"name": "f", "arguments": {"on": "yes"}}\n</tool_call>',
                '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>']:
        assert not accepts(service_tokenizer, grammar, call + " then " + bad, ending=False)
        assert not accepts(service_tokenizer, grammar, "text " + bad, ending=False)
    # arguments in response_format's JSON: no whitespace but the separators (found by the same audit)
    assert not accepts(service_tokenizer, grammar, '<tool_call>\n{"name": "f", "arguments": { "on":true}',
                       ending=False)


def test_a_tools_own_json_options_are_kept(service_tokenizer):
    """The compact JSON options go under a tool's own `x-guidance` (found reviewing the compact-arguments change,
    which replaced them): a tool that asks for lenient schemas compiles, as the same schema does as a
    response_format."""
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}},
              "x-guidance": {"lenient": True}}
    tools = [Tool(type="function", function={"name": "f", "parameters": schema})]
    assert accepts(service_tokenizer, tool_constraint(tools, "required", parallel=False, special=False),
                   '<tool_call>\n{"name": "f", "arguments": {"when": "now"}}\n</tool_call>')
    assert accepts(service_tokenizer, Constraint.json_schema(schema), '{"when": "now"}')


@pytest.fixture
def service_tokenizer(app):
    return app.extensions["specdec"].tokenizer


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": "Who is", "response_format": {"type": "json_object"}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1 + 2?"}],
                              "tools": [{"type": "function", "function": {"name": "add"}}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1 + 2?"}], "tool_choice": "none",
                              "tools": [{"type": "function", "function": {"name": "add"}}]}, 200),
])
def test_ignore_eos_with_a_grammar_is_refused_before_decoding(client, path, body, status):
    """A grammar ends the answer with an end-of-sequence token, so ignore_eos beside one is a 400 naming it, from
    the request's validation (schemathesis drew ignore_eos with tools: the engine refused it, after the document
    had let it through); tools with tool_choice none have no grammar."""
    response = client.post(path, json={"model": "target", "max_tokens": 3, "ignore_eos": True, **body})
    assert response.status_code == status, response.get_json()
    if status == 400:
        error = response.get_json()["error"]
        assert error["param"] == "ignore_eos" and "end-of-sequence" in error["message"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
ADD = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}}}]
CHAT = {"messages": [{"role": "user", "content": "1 + 2?"}]}


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": "Who is", "response_format": {"type": "json_object"}}, 400),
    ("/v1/completions", {"prompt": "Who is", "structured_outputs": {"json": SCHEMA}}, 400),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "p", "schema": SCHEMA}}}, 400),
    ("/v1/chat/completions", {**CHAT, "tools": ADD, "tool_choice": "required"}, 400),
    # auto (the default with tools): agent frameworks send a stop word beside their tools (a review)
    ("/v1/chat/completions", {**CHAT, "tools": ADD}, 200),
    ("/v1/chat/completions", {**CHAT, "tools": ADD, "tool_choice": {"type": "function", "function": {"name": "add"}}},
     400),
    ("/v1/chat/completions", {**CHAT, "tools": ADD, "tool_choice": "none"}, 200),
    ("/v1/completions", {"prompt": "Who is", "response_format": {"type": "text"}}, 200),
])
@pytest.mark.parametrize("stop", [", ", ["zz", "}"]])
def test_stop_strings_with_a_grammar_are_refused_naming_stop(client, path, body, status, stop):
    """A stop string cut a constrained answer where it did not parse (`{"name": "zzzzzz"`), and the answer still
    said finish_reason stop (tool_calls for a call cut to `{"`), where one that ends so must parse and validate (an
    audit): refused, as stop_token_ids, min_tokens and ignore_eos are; without a grammar, stop strings apply."""
    response = client.post(path, json={"model": "target", "max_tokens": 3, "stop": stop, **body})
    assert response.status_code == status, response.get_json()
    if status == 400:
        error = response.get_json()["error"]
        assert error["param"] == "stop" and "does not parse" in error["message"], error
    assert client.post(path, json={"model": "target", "max_tokens": 3, "stop": [], **body}).status_code == 200


def test_a_logit_bias_under_a_grammar_acts_within_what_the_grammar_allows(client, service_tokenizer):
    """The bias is added before the grammar's mask: banning the first letter of one choice leaves the other, and a
    token the grammar forbids stays forbidden however it is favoured."""
    a, b, z = (service_tokenizer.convert_tokens_to_ids(letter) for letter in "abz")
    body = {"prompt": "Who is", "max_new_tokens": 10, "structured_outputs": {"choice": ["alpha", "beta"]}}
    for seed in range(3):
        for banned, answer in ((a, "beta"), (b, "alpha")):
            reply = client.post("/predict", json={**body, "seed": seed, "logit_bias": {str(banned): -100,
                                                                                       str(z): 100}}).get_json()
            assert reply["text"] == answer, reply


def test_a_function_without_parameters_takes_none(service_tokenizer):
    """OpenAI: "omitting parameters defines a function with an empty parameter list". It was held to
    {"type": "object"}, which let a named call write any keys (an audit saw `{"zzzz...&=ffff` cut at length)."""
    tools = [Tool(type="function", function={"name": "now"})]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "now"}})
    constraint = tool_constraint(tools, named, parallel=False, special=False)
    assert accepts(service_tokenizer, constraint, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not accepts(service_tokenizer, constraint, '<tool_call>\n{"name": "now", "arguments": {"a"',
                       ending=False)


GROWING = [
    'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\nDone.  ',
    '  Hello <tool world <tool_cal',
    'A <tool_call>\n{"name": "f", "arguments": {"x"',
    '<tool_call>\n{"name": "f", "argu',
    'no calls at all\n',
    '<tool_call>\n{broken\n</tool_call> after',
    'x\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n'
    '</tool_call>',
]


@pytest.mark.parametrize("text", GROWING)
def test_the_content_streamed_as_the_text_grows_is_always_the_beginning_of_the_answers(text):
    """Under tools a stream held all content to the end (an agent's answer came in one piece, after it was all
    decoded). `content_of(text, final=False)` is what may be sent while the text grows: never markup, never a
    tail that may still start a call's tag or be whitespace before one; so each is the beginning of the next and
    of the answer's content (parse_tool_calls', the same function with final=True)."""
    answer = parse_tool_calls(text)[0] or ""
    assert answer == (content_of(text) or "")
    sent = ""
    for end in range(len(text) + 1):
        now = content_of(text[:end], final=False) or ""
        assert now.startswith(sent) and answer.startswith(now), (text[:end], now)
        assert "<tool_call" not in now or "{broken" in now, now
        sent = now


def test_text_before_a_call_is_sent_before_the_call_ends_and_a_cut_calls_markup_is_never_content():
    text = GROWING[0]
    assert content_of(text[:text.index("<tool_call>") + 3], final=False) == "Sure."
    assert content_of(text[:text.index("</tool_call>")], final=False) == "Sure."
    assert parse_tool_calls(text)[0] == "Sure.\n\nDone."
    for cut in ("<tool_call>", '<tool_call>\n{"name": "f", "argu'):  # was the markup itself, as content
        assert parse_tool_calls(cut)[0] is None and parse_tool_calls("Hi " + cut)[0] == "Hi"


def test_under_tools_auto_a_stream_sends_its_content_as_it_is_decoded(client):
    """The same request streamed and whole: the content deltas join to the whole answer's content, and come in
    several chunks before the last (they came all in the last)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "seed": 5,
            "max_tokens": 40}
    whole = client.post("/v1/chat/completions", json=body).get_json()["choices"][0]
    response = client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [json.loads(line.removeprefix("data: "))["choices"][0] for line in
              response.get_data(as_text=True).splitlines() if line.startswith("data: {")]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert whole["message"]["content"] and content == whole["message"]["content"]
    assert not whole["message"].get("tool_calls")  # the random model writes text
    assert sum(1 for d in deltas[:-1] if d["delta"].get("content")) >= 2


def test_a_stream_sends_text_and_calls_in_the_order_the_text_holds_them():
    """The fifth audit: where one round decoded the end of a call's arguments and text after the call, the text
    went out first (each round sent its content, then its calls). Whatever rounds the text comes in, the pieces
    follow the text: the content before the call, the call's head and arguments, the content after it; joined,
    the answer whole's content and arguments."""
    text = ('Let me check. <tool_call>\n{"name": "f", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
            ' Done.')
    for size in (1, 3, 7, 40, len(text)):
        reader, said, order = ToolCallReader(), "", []
        for start in range(0, len(text), size):
            pieces, said = stream_pieces(text[:start + size], start, said, reader)
            order += [(kind, piece if kind == "content" else piece[3]) for kind, piece in pieces]
        assert "".join(piece for kind, piece in order if kind == "content") == content_of(text), size
        assert "".join(piece for kind, piece in order if kind == "call") == \
            parse_tool_calls(text)[1][0].function.arguments, size
        calls = [i for i, (kind, _) in enumerate(order) if kind == "call"]
        assert "".join(piece for kind, piece in order[:calls[0]] if kind == "content") == "Let me check.", size
        assert "".join(piece for kind, piece in order[calls[-1]:] if kind == "content").strip() == "Done.", size


def test_an_sdk_helpers_message_sent_back_in_the_history_is_taken(client):
    """The fifth audit: the openai SDK's stream() and parse() helpers give messages with `parsed`, and tool calls
    with `index` and `function.parsed_arguments`; an agent loop that sent one back got a 400 on its second turn.
    They are accepted and left out of the prompt: the same prompt as without them."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    helper = [plain[0], {**plain[1], "parsed": None, "refusal": None, "tool_calls": [
        {**call, "index": 0, "function": {**call["function"], "parsed_arguments": {"x": 1}}}]}, plain[2]]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    answers = [client.post("/v1/chat/completions", json={"model": "target", "messages": messages, "tools": tools,
                                                          "max_tokens": 3, "temperature": 0, "tool_choice": "none",
                                                          "cache_prompt": False})
               for messages in (plain, helper)]
    assert [answer.status_code for answer in answers] == [200, 200], answers[1].get_json()
    assert answers[0].get_json()["usage"] == answers[1].get_json()["usage"]
    assert answers[0].get_json()["choices"][0]["message"] == answers[1].get_json()["choices"][0]["message"]
    parsed = {"role": "assistant", "content": "{\"ok\": true}", "parsed": {"ok": True}}
    assert client.post("/v1/chat/completions", json={"model": "target", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, parsed, {"role": "user", "content": "again"}]}).status_code == 200
