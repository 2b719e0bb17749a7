"""Structured outputs on the real default pair (Qwen2.5-Coder-Instruct 0.5B draft, 1.5B target): greedy
constrained speculative decoding reproduces greedy constrained target-only decoding token for token, the answer
validates against its schema, and the grammar's forced tokens are proposed and accepted; a tool offered through
the chat template is called, under tool_choice required, with arguments taken from the conversation. (Under auto
this 1.5B coder model answers the same question with a ```json block rather than a <tool_call>: text, as auto
allows.)"""

import json

import jsonschema
import pytest

from specdec import SamplingParams, SpeculativeDecoder, load_pair
from specdec.engine import eos_token_ids
from specdec.grammar import Constraint, GrammarCompiler
from specdec.serve.structured import Tool, parse_tool_calls, tool_constraint
from specdec.text import encode_messages

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("real_models")]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "languages": {"type": "array", "items": {"type": "string"}}}}
PASSAGE = ("Extract the person as JSON. Passage: Maria Lopez, 34, moved to Lisbon last year. She writes Rust and "
           "Python at work and Go on weekends.")
WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}})


@pytest.fixture(scope="module")
def real():
    draft, target, tokenizer = load_pair()
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    return decoder, tokenizer, GrammarCompiler(tokenizer, decoder.vocab_size), eos_token_ids(target, tokenizer)


@pytest.mark.parametrize("drafter, forced", [("model", True), ("model", False), ("hybrid", True)])
def test_greedy_constrained_speculative_equals_constrained_target_only(real, drafter, forced):
    decoder, tokenizer, compiler, eos = real
    grammar = compiler.compile(Constraint.json_schema(SCHEMA))
    prompt = encode_messages(tokenizer, [{"role": "user", "content": PASSAGE}])
    reference = decoder.generate(prompt, params=SamplingParams(max_new_tokens=80, method="target", temperature=0),
                                 grammar=grammar, eos_token_id=eos)
    result = decoder.generate(prompt, params=SamplingParams(max_new_tokens=80, temperature=0, drafter=drafter,
                                                            grammar_drafter=forced), grammar=grammar,
                              eos_token_id=eos)
    assert result.token_ids == reference.token_ids and result.finish_reason == "stop"
    answer = json.loads(tokenizer.decode(result.token_ids, skip_special_tokens=True))
    jsonschema.validate(answer, SCHEMA)
    assert answer["name"] == "Maria Lopez" and answer["age"] == 34
    assert (result.stats.accepted_by_drafter.get("grammar", 0) > 5) == forced


@pytest.mark.parametrize("parallel", [False, True])
def test_a_tool_offered_through_the_template_is_called_with_arguments_from_the_conversation(real, parallel):
    """With parallel calls too (the SDK's default) the answer ends after the one call asked for: the fifth audit
    found the model's newline after a call made another call mandatory, and it invented calls for other cities
    until max_tokens."""
    decoder, tokenizer, compiler, eos = real
    messages = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    prompt = encode_messages(tokenizer, messages, tools=[WEATHER.model_dump(exclude_none=True)])
    grammar = compiler.compile(tool_constraint([WEATHER], "required", parallel, special=True))
    result = decoder.generate(prompt, params=SamplingParams(max_new_tokens=60, temperature=0), grammar=grammar,
                              eos_token_id=eos)
    content, calls = parse_tool_calls(tokenizer.decode(result.token_ids, skip_special_tokens=True))
    assert result.finish_reason == "stop" and [call.function.name for call in calls] == ["get_weather"]
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER.function.parameters)
    assert arguments["city"] == "Paris"
