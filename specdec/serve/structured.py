"""Structured outputs and tool calls as the HTTP APIs take them: OpenAI's `response_format`, vLLM's
`structured_outputs`, OpenAI's `tools` and `tool_choice` (pydantic shapes, shared by /predict and the /v1 routes);
what each becomes for the engine (a grammar.Constraint); and the tool calls read back out of a completion.

Tool calls are written as the Hermes / Qwen2.5 chat templates ask: `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`, one block per call. `required` and a named function constrain the whole answer to such
blocks, their arguments to the function's parameter schema; `auto` lets the model write text and constrains a
call from its `<tool_call>` on (llguidance's lazy triggers, as in its StructTag).
"""

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from ..grammar import JSON_OPTIONS, MAX_CHOICES, Constraint

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*(\{.*?\})\s*" + re.escape(CALL_END), re.DOTALL)
# a call's beginning, up to where its arguments start: its name is then known
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names
MAX_TOOLS = 128


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[str, Field(pattern=FUNCTION_NAME)] = Field(description="the schema's name")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    # the JSON schema states _schema_with_its_type's rule (/openapi.json: a request valid by it is taken)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}}},
        {"required": ["json_schema"],
         "properties": {"type": {"const": "json_schema"}, "json_schema": {"type": "object"}}},
    ]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = Field(None, description="with type json_schema")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "response_format.json_schema is required with type "
                                      "json_schema, and only then", {"param": "response_format.json_schema"})
        return self

    def constraint(self, field: str = "response_format") -> Constraint | None:
        if self.type == "json_object":
            return Constraint("json_object", field=field)
        if self.type == "json_schema":
            schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
            return Constraint.json_schema(schema, field=f"{field}.json_schema.schema")
        return None


# structured_outputs' constraints other than json_object, each with the JSON schema of its value (not null)
CONSTRAINT_TYPES = {"json": {"anyOf": [{"type": "object"}, {"type": "string"}]}, "regex": {"type": "string"},
                    "choice": {"type": "array"}, "grammar": {"type": "string"}}


def _exactly_one_of(types: dict[str, dict]) -> list[dict]:
    """JSON schemas of structured_outputs with exactly one constraint given: one of `types` not null (and
    json_object not true), or json_object true (and the others null or left out)."""
    null = {"type": "null"}
    branches = [{"required": [name], "properties": {**{other: null for other in types if other != name},
                                                    name: schema, "json_object": {"not": {"const": True}}}}
                for name, schema in types.items()]
    return branches + [{"required": ["json_object"],
                        "properties": {**{name: null for name in types}, "json_object": {"const": True}}}]


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a JSON schema), regex (Rust's regex syntax), choice (one of
    these strings) or grammar (a Lark grammar as llguidance reads it, or llama.cpp's GBNF); json_object: any JSON
    object."""

    # the JSON schema states _exactly_one's rule (/openapi.json: a request valid by it is taken)
    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"anyOf": _exactly_one_of(CONSTRAINT_TYPES)})

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect), or GBNF")
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise PydanticCustomError("invalid_value", "structured_outputs takes exactly one of json, regex, choice, "
                                      "grammar and json_object", {"param": "structured_outputs"})
        return self

    def constraint(self, field: str = "structured_outputs") -> Constraint:
        if self.json_ is not None:
            if isinstance(self.json_, str):
                return Constraint("json_schema", self.json_, field=f"{field}.json")
            return Constraint.json_schema(self.json_, field=f"{field}.json")
        if self.regex is not None:
            return Constraint("regex", self.regex, field=f"{field}.regex")
        if self.choice is not None:
            return Constraint.choice(self.choice, field=f"{field}.choice")
        if self.grammar is not None:
            return Constraint("grammar", self.grammar, field=f"{field}.grammar")
        return Constraint("json_object", field=f"{field}.json_object")


def request_constraint(response_format: ResponseFormat | None,
                       structured_outputs: StructuredOutputs | None) -> Constraint | None:
    """The request's one constraint (the request models refuse both at once); a SpecDecError naming the field
    where a constraint cannot be built (a schema that is not an object, or over the size limit)."""
    if structured_outputs is not None:
        return structured_outputs.constraint()
    return response_format.constraint() if response_format is not None else None


# --- tools -----------------------------------------------------------------------------------------------------

class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, Field(pattern=FUNCTION_NAME)] = Field(description="the function's name")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of its arguments (an object)")
    strict: bool | None = Field(None, description="accepted; the arguments always follow the schema")


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


# an object is read as a named choice, anything else as a mode: a bad object's error names its own field
# (tool_choice.function.name), not the modes it is not (capitalized tags stay out of an error's param)
ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("Mode")]
                       | Annotated[NamedToolChoice, Tag("Named")],
                       Discriminator(lambda value: "Named" if isinstance(value, dict) else "Mode")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str = Field(description="the arguments, as a JSON text")
    # accepted in a conversation's history and left out (the SDK's parse and stream helpers' messages hold it)
    parsed_arguments: Any = Field(None, exclude=True, description="accepted and ignored (the SDK's parsed form)")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # accepted in a conversation's history and left out (the SDK's stream helper's messages hold it)
    index: int | None = Field(None, exclude=True, description="accepted and ignored (a streamed call's index)")


def check_tools(tools: list[Tool] | None, tool_choice) -> None:
    """A named tool_choice must name one of the tools; tool names are unique."""
    names = [tool.function.name for tool in tools or []]
    if len(set(names)) != len(names):
        raise PydanticCustomError("invalid_value", "tool names must be unique", {"param": "tools"})
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise PydanticCustomError("invalid_value", f"tool_choice names the function {tool_choice.function.name!r}, "
                                  "which is not among the tools", {"param": "tool_choice.function.name"})
    if tool_choice in ("auto", "required") and not names:
        raise PydanticCustomError("invalid_value", f"tool_choice {tool_choice!r} needs tools",
                                  {"param": "tool_choice"})


# a function defined without `parameters` takes none (OpenAI: "omitting parameters defines a function with an empty
# parameter list"): its arguments are {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _call_schema(function: FunctionDefinition) -> dict:
    return function.parameters if function.parameters is not None else NO_PARAMETERS


def _compact(schema: dict) -> dict:
    """A tool's parameters as embedded in the tools' grammar: JSON written as response_format's is
    (grammar.JSON_OPTIONS, llguidance's per-schema `x-guidance` options), the client's own options first, as
    response_format takes them."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_OPTIONS, **own} if isinstance(own, dict) else JSON_OPTIONS}


def tool_constraint(tools: list[Tool], tool_choice, parallel: bool, special: bool) -> Constraint | None:
    """The grammar of an answer under tool_choice: required, only calls (one, or with `parallel` one or more, a
    newline between two, and one after the last allowed); named, exactly one call of that function (as vLLM and
    OpenAI answer it); auto, text with calls anywhere in it (each constrained from its <tool_call> on); none: no
    grammar. `special`: <tool_call> and </tool_call> are tokens of the tokenizer
    (Qwen2.5's), matched as such."""
    if tool_choice == "none" or not tools:
        return None
    indexed = list(enumerate(tools))  # each with its index in the request, for errors
    if isinstance(tool_choice, NamedToolChoice):
        indexed = [(i, tool) for i, tool in indexed if tool.function.name == tool_choice.function.name]
        parallel = False
    begin, end = (CALL_BEGIN, CALL_END) if special else (json.dumps(CALL_BEGIN), json.dumps(CALL_END))
    lines = ["%llguidance {}"]
    bodies = []
    for i, (_, tool) in enumerate(indexed):
        head = json.dumps('{"name"' + JSON_OPTIONS["key_separator"] + json.dumps(tool.function.name)
                          + JSON_OPTIONS["item_separator"] + '"arguments"' + JSON_OPTIONS["key_separator"])
        lines.append(f"fn_{i}: {head} %json {json.dumps(_compact(_call_schema(tool.function)))} \"}}\"")
        bodies.append(f"fn_{i}")
    body = " | ".join(bodies)
    if tool_choice == "auto":
        if special:
            lines.append(f"call: TEXT {begin} \"\\n\" ({body}) \"\\n\" {end}")
        else:  # a lazy lexeme: text up to the first <tool_call>
            lines.append(f"call_trig[lazy]: TEXT {begin}")
            lines.append(f"call: call_trig \"\\n\" ({body}) \"\\n\" {end}")
        lines.append(f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(CALL_BEGIN)}(.|\\n)*/")  # a call's opening tag starts a call
        lines.insert(1, "start: (call)* TEXT" if parallel else "start: call? TEXT")
    else:
        lines.append(f"call: {begin} \"\\n\" ({body}) \"\\n\" {end}")
        # a newline after a call may end the answer (the default pair writes one, then its end token: when the
        # newline had to begin another call, parallel calls went on inventing calls up to max_tokens)
        lines.insert(1, "start: call (\"\\n\" call)* \"\\n\"?" if parallel else "start: call")
    parameters = tuple(Constraint.json_schema(_call_schema(tool.function), field=f"tools[{i}].function.parameters")
                       for i, tool in indexed)  # named instead of the whole grammar where one does not compile
    return Constraint("grammar", "\n".join(lines), field="tools", parts=parameters)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, `content_of(text)`; the calls) of a completion. A call's arguments are the
    model's own JSON text where they are an object after the name (as `ToolCallReader` streams them), else
    re-serialized. A last call left unfinished (max_tokens, or the time limit) is a call too once its name is
    complete and its arguments have begun, with its arguments as far as they were decoded: what `ToolCallReader`
    has streamed of it, so that a stream and the same request answered whole agree. Its markup is never text."""
    calls, rest = [], 0  # rest: where the text after the last whole call begins
    for match in CALL.finditer(text):
        rest = match.end()
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        head = CALL_HEAD.match(match.group(1))
        end = value_end(match.group(1), head.end()) if head and isinstance(arguments, dict) else None
        raw = match.group(1)[head.end():end] if end is not None else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(id=call_id(), function=FunctionCall(name=call["name"], arguments=raw)))
    tail = text.find(CALL_BEGIN, rest)
    unfinished = tail >= 0 and CALL_END not in text[tail:]
    if unfinished and (call := _unfinished_call(text[tail + len(CALL_BEGIN):])) is not None:
        calls.append(call)
    return content_of(text), calls


def content_of(text: str, final: bool = True) -> str | None:
    """The text outside the tool calls of a completion (an answer's `content`), or None if there is none: the
    calls taken out, and a last call left unfinished (its closing tag not decoded) with its markup, without the
    whitespace around what is left. While the text still grows (`final` False), also without a tail that may yet
    become a call's opening tag, or whitespace before one: so what a stream has sent of it is always the
    beginning of what it is once the text is whole (tests/test_structured_service.py), and a stream sends the
    content as it is decoded."""
    closed = text.rfind(CALL_END)
    tail = text.find(CALL_BEGIN, 0 if closed < 0 else closed + len(CALL_END))
    if tail >= 0:  # a call begun and not ended
        text = text[:tail]
    elif not final:  # "<tool_c": maybe the beginning of a call
        text = text[:len(text) - _tag_begun(text)]
    outside = CALL.sub("", text).lstrip()
    return outside.rstrip() or None


def _tag_begun(text: str) -> int:
    """The length of the longest end of `text` that begins CALL_BEGIN (0: none)."""
    return next((n for n in range(min(len(CALL_BEGIN) - 1, len(text)), 0, -1) if CALL_BEGIN.startswith(text[-n:])), 0)


def _unfinished_call(body: str) -> ToolCall | None:
    """A call whose closing tag was never decoded, read as `ToolCallReader` streams it: its name once complete,
    its arguments from their start to the end of their JSON value or of the text; None before its arguments
    begin."""
    head = CALL_HEAD.match(body)
    if head is None or head.end() >= len(body):
        return None
    try:
        name = json.loads(f'"{head.group(1)}"')
    except json.JSONDecodeError:
        return None
    end = value_end(body, head.end())
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=body[head.end():end or len(body)]))


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array that starts at text[start] ends (the index after it), or None if it does not
    end within the text (or does not start there)."""
    if start >= len(text) or text[start] not in "{[":
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class ToolCallReader:
    """Tool calls read out of a completion's text as it grows, as OpenAI streams them: a call's id and name once its
    name is complete, then its arguments' JSON text piece by piece as it is decoded, up to the object's end.
    `read(text)` takes the whole text so far and returns [(index, id or None, name or None, arguments piece)]."""

    def __init__(self):
        self.calls: list[dict] = []  # {"start": where its arguments start in the text, "sent": chars sent, "done"}

    def read(self, text: str) -> list[tuple[int, str | None, str | None, str]]:
        out, begin = [], 0
        for index in range(len(self.calls) + 1):
            begin = text.find(CALL_BEGIN, begin)
            if begin < 0:
                break
            begin += len(CALL_BEGIN)
            if index == len(self.calls):
                head = CALL_HEAD.match(text, begin)
                if head is None or head.end() >= len(text):
                    break  # its name is not complete yet, or its arguments have not begun
                try:
                    name = json.loads(f'"{head.group(1)}"')
                except json.JSONDecodeError:
                    break
                self.calls.append({"start": head.end(), "sent": 0, "done": text[head.end()] not in "{["})
                out.append((index, call_id(), name, ""))
            call = self.calls[index]
            if call["done"]:
                continue
            end = value_end(text, call["start"])
            stop = len(text) if end is None else end
            piece = text[call["start"] + call["sent"]:stop]
            if piece:
                out.append((index, None, None, piece))
            call["sent"] = stop - call["start"]
            call["done"] = end is not None
        return out


def stream_pieces(text: str, start: int, said: str, reader: ToolCallReader) -> tuple[list[tuple[str, Any]], str]:
    """What a stream sends of a completion's `text` that grew past `start` characters: ("content", text) and
    ("call", ToolCallReader piece) in the order the text holds them (the text before a call, the call, the text
    after it, where one round decoded them all), and the content sent so far once they are (`said` before)."""
    cuts = {len(text)} | {match.start() for match in re.finditer(re.escape(CALL_BEGIN), text) if match.start() > start} \
        | {match.end() for match in re.finditer(re.escape(CALL_END), text) if match.end() > start}
    out = []
    for cut in sorted(cuts):
        now = content_of(text[:cut], final=False) or ""
        if len(now) > len(said):
            out.append(("content", now[len(said):]))
            said = now
        out.extend(("call", piece) for piece in reader.read(text[:cut]))
    return out, said


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a chat template: an assistant's tool calls with their arguments as objects (the templates
    write them with `tojson`), as transformers' chat templates expect."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"], "arguments": _as_object(call["function"]["arguments"])}}
                for call in calls]}
        rendered.append(message)
    return rendered


def _as_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
