"""OpenAI's API shapes for the /v1 routes, as pydantic models that mirror OpenAI's (and the SDK's names): the
requests (strict types; unknown fields and unsupported features refused, never ignored), the answers, their
streamed chunks, the model list and the error shape. /openapi.json's /v1 schemas are generated from them.

Structured outputs (response_format, vLLM's structured_outputs) and tool calls take their shapes from
structured.py. A field OpenAI defines but this server does not implement (n > 1, penalties, ...) is accepted only at its
no-op value (or null), so a client that sends the default still works and one that asks for the feature gets a
400 naming it. The sampling fields (logprobs among them) map onto SamplingParams through protocol.sampling_params.
"""

import hashlib
import json
import re
from dataclasses import asdict
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..params import DRAFTERS, MAX_LOGPROBS, SEED_MAX, SEED_MIN, SERVED_METHODS, VERIFICATIONS, SamplingParams
from .config import Gamma, Probability, Settings, TopP
from .errors import ApiError
from .protocol import (
    CACHE_PROMPT_DESCRIPTION,
    CONFIDENCE_DESCRIPTION,
    DRAFTER_DESCRIPTION,
    GAMMA_DESCRIPTION,
    IGNORE_EOS_CONSTRAINED,
    IGNORE_EOS_DESCRIPTION,
    LOGIT_BIAS_DESCRIPTION,
    LOGPROBS_DESCRIPTION,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MIN_TOKENS_DESCRIPTION,
    SEED_DESCRIPTION,
    STOP_CONSTRAINED,
    VERIFICATION_DESCRIPTION,
    FrequencyPenalty,
    HugeInteger,
    LogitBias,
    PresencePenalty,
    RepetitionPenalty,
    StopTokenIds,
    Temperature,
    sampling_params,
    temperature_field,
)
from .structured import (
    MAX_TOOLS,
    Constraint,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolChoice,
    check_tools,
    request_constraint,
    template_messages,
    tool_constraint,
)

OPENAI_PREFIX = "/v1"
MAX_TEMPERATURE = 2.0  # OpenAI's bound
FINISH_REASONS = ("stop", "length", "tool_calls")  # a time limit reads as "length": the completion was cut short
# our error types -> OpenAI's error codes, where they differ
CODES = {"invalid_field": "invalid_value", "prompt_too_long": "context_length_exceeded",
         "unauthorized": "invalid_api_key"}


TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's, beside /v1: they answer errors in OpenAI's shape too


def is_openai_path(path: str) -> bool:
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/") or path in TOKENIZER_PATHS


# --- requests --------------------------------------------------------------------------------------------------

def _no_op_only(schema: dict | None, allowed: tuple, why: str):
    """A field OpenAI defines that this server supports only at its no-op value(s) `allowed` (or null): any other
    value is refused with `why`. Types must match exactly, so true is not 1 and 1.0 is not 1. `schema`
    describes the allowed values (None: only null)."""

    def check(value):
        if value is not None and not any(type(value) is type(ok) and value == ok for ok in allowed):
            raise PydanticCustomError("unsupported_value", why)
        return value

    described = {"type": "null"} if schema is None else {"anyOf": [schema, {"type": "null"}]}
    return Annotated[Any, AfterValidator(check), WithJsonSchema({**described, "description": why})]


def _stop_strings(value):
    """`stop`: a string or a list of strings, each non-empty and bounded (checked here, for a clear message)."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return value


def _is_id(item) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _prompts(value):
    """`prompt` in the shapes OpenAI allows: a string, a list of strings, a list of token ids, or a list of lists
    of token ids; none empty, token ids not negative (the vocabulary's bound is the service's to check)."""
    shape = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        if not value:
            raise ValueError("the prompt is empty")
        return value
    if not isinstance(value, list):
        raise ValueError(shape)
    if not value:
        raise ValueError("the list of prompts is empty")
    if all(isinstance(item, str) for item in value):
        if not all(value):
            raise ValueError("a prompt in the list is empty")
    elif all(_is_id(item) for item in value):
        _token_ids(value)
    elif all(isinstance(item, list) for item in value):
        for ids in value:
            if not ids or not all(_is_id(item) for item in ids):
                raise ValueError("each list of token ids must hold at least one token id, and token ids only")
            _token_ids(ids)
    else:
        raise ValueError(shape + ", not a mix")
    return value


def _token_ids(ids: list[int]) -> None:
    if any(token < 0 for token in ids):
        raise ValueError("token ids cannot be negative")


def _text_content(value):
    """A message's `content`: a string, or a list of {"type": "text", "text"} parts (an assistant's may hold
    {"type": "refusal", "refusal"} parts too, as OpenAI's answers do), or null."""
    if value is None:
        return value
    if isinstance(value, list):
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "refusal"):
                raise ValueError(f"only text content parts are supported, not {kind!r}" if kind
                                 else 'each content part must be an object {"type": "text", "text": ...}')
            if unknown := sorted(set(part) - {"type", kind}):  # named here: the union's error would not say it
                raise ValueError(f"content[{i}] has an unknown field {unknown[0]!r} (a {kind} part holds type and "
                                 f"{kind})")
    elif not isinstance(value, str):
        raise ValueError("content must be a string or a list of text parts")
    return value


def _utf8(value: str) -> str:
    """Text the tokenizer can take: no lone surrogates (JSON can escape them; UTF-8 cannot hold them)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (it is not valid Unicode)") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = Field(None, description="send a last chunk with empty choices and the usage")
    include_obfuscation: bool | None = Field(None, description="accepted: this server never pads chunks (OpenAI's "
                                                               "obfuscation field is not sent)")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Text


class RefusalPart(BaseModel):
    """An assistant's refusal, as a content part (OpenAI's answers sent back): its text stands for the part."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["refusal"]
    refusal: Text

    @property
    def text(self) -> str:
        return self.refusal


class ChatMessage(BaseModel):
    """One message of the conversation; it goes through the target's chat template (with an assistant's tool
    calls, and the tools' answers as role tool)."""

    # the JSON schema states _refusals_are_the_assistants' rule (/openapi.json: a message valid by it is taken)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "null"}, {
            "type": "array", "items": {"$ref": "#/components/schemas/TextPart"}}]}}},
    ]})

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer is OpenAI's newer name for system, and goes to the template as system")
    content: Annotated[Text | list[TextPart | RefusalPart] | None, BeforeValidator(_text_content)] = Field(
        None, description="a string, or text parts (joined with newlines); null for an assistant's tool calls")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")
    name: Text | None = Field(None, description="the participant's name; given to the chat template with the "
                                                "message (a template that has no use for it, as Qwen2.5's, leaves it)")
    # what an answer's message holds beside content and tool_calls (the SDK's `message.model_dump()` sends them
    # back): a refusal's text stands for the content where there is none; the others must be null
    refusal: Text | None = Field(None, description="an assistant's refusal, as answers carry it: its text where "
                                                   "content is null")
    annotations: list[dict] | None = Field(None, description="accepted and left out of the prompt (an answer's "
                                                             "message holds it: citations)")
    audio: None = Field(None, description="accepted as null (an answer's message holds it)")
    function_call: None = Field(None, description="accepted as null (the deprecated form of tool_calls)")
    parsed: Any = Field(None, exclude=True, description="accepted and left out of the prompt (the SDK's parse and "
                                                        "stream helpers' messages hold the parsed content)")

    @model_validator(mode="after")
    def _refusals_are_the_assistants(self):
        if self.role != "assistant" and isinstance(self.content, list) and any(
                isinstance(part, RefusalPart) for part in self.content):
            raise PydanticCustomError("invalid_value", "only an assistant's content may hold refusal parts")
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)

    def for_template(self) -> dict:
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Request(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="the served model's id, as /v1/models lists it")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: Temperature = temperature_field(le=MAX_TEMPERATURE)
    top_p: TopP | None = Field(None, description="nucleus sampling mass")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX,
                             description=SEED_DESCRIPTION)
    stop: Annotated[StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None,
                    BeforeValidator(_stop_strings)] = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; the completion ends before the first one found, "
                          f"which is not returned; not with response_format, structured_outputs or a required or "
                          f"named tool_choice (under auto, a call it cuts is given as far as it was decoded)")
    stream: bool | None = Field(None, description="answer with Server-Sent Events of chunks")
    stream_options: StreamOptions | None = Field(
        None, description="for a stream; an answer that is not streamed always has its usage")
    user: str | None = Field(None, description="accepted and ignored")
    n: int | None = Field(None, ge=1, description="choices for each prompt (default 1), decoded one after another "
                                                  "(with a seed, the first draws from it and the others from seeds "
                                                  "derived from it); at most the server's max_prompts_per_request "
                                                  "choices in all")
    presence_penalty: PresencePenalty = None
    frequency_penalty: FrequencyPenalty = None
    logit_bias: LogitBias | None = Field(None, description=LOGIT_BIAS_DESCRIPTION)
    repetition_penalty: RepetitionPenalty = None  # an extension, as vLLM's
    stop_token_ids: StopTokenIds = None  # an extension, as vLLM's
    min_tokens: int | None = Field(None, ge=0, description="extension (vLLM's): " + MIN_TOKENS_DESCRIPTION)
    # extensions, as in /predict
    top_k: int | None = Field(None, ge=-1, description="extension: 0 (or -1, vLLM's way) keeps every token")
    # vLLM's, at the values that change nothing here (clients tuned for vLLM send them as they are)
    min_p: _no_op_only({"type": "number", "enum": [0]}, (0, 0.0), "only 0 is supported (no min-p cut)") = None
    skip_special_tokens: _no_op_only({"type": "boolean", "enum": [True]}, (True,),
                                     "only true is supported: completions leave special tokens out") = None
    include_stop_str_in_output: _no_op_only({"type": "boolean", "enum": [False]}, (False,),
                                            "only false is supported: the stop string is not returned") = None
    gamma: Gamma | None = Field(None, description="extension: " + GAMMA_DESCRIPTION)
    method: Literal[SERVED_METHODS] | None = Field(None, description="extension: the decoding method")
    drafter: Literal[DRAFTERS] | None = Field(None, description="extension: " + DRAFTER_DESCRIPTION)
    verification: Literal[VERIFICATIONS] | None = Field(None, description="extension: " + VERIFICATION_DESCRIPTION)
    draft_confidence_threshold: Probability | None = Field(None, description="extension: " + CONFIDENCE_DESCRIPTION)
    cache_prompt: bool | None = Field(None, description="extension: " + CACHE_PROMPT_DESCRIPTION)
    ignore_eos: bool | None = Field(None, description="extension (vLLM's): " + IGNORE_EOS_DESCRIPTION)
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema (the answer follows the schema)")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM's): json, regex, choice or grammar constrain the answer")
    grammar_drafter: bool | None = Field(None, description="extension: under a constraint, propose the tokens the "
                                                           "grammar forces (default true)")

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.formats_answer:
            raise PydanticCustomError("invalid_value", "give response_format or structured_outputs, not both",
                                      {"param": "structured_outputs"})
        if self.ignore_eos and (self.structured_outputs is not None or self.formats_answer):
            raise PydanticCustomError("invalid_value", IGNORE_EOS_CONSTRAINED, {"param": "ignore_eos"})
        if self.stop and (self.structured_outputs is not None or self.formats_answer):
            raise PydanticCustomError("invalid_value", STOP_CONSTRAINED, {"param": "stop"})
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:  # as vLLM
            raise PydanticCustomError("invalid_value", "stream_options is only allowed with stream: true",
                                      {"param": "stream_options"})
        return self

    @property
    def formats_answer(self) -> bool:
        """A response_format other than text constrains the answer."""
        return self.response_format is not None and self.response_format.type != "text"

    def constraint(self, special_tool_tokens: bool = False) -> Constraint | None:
        """What the answer must match, if anything."""
        return request_constraint(self.response_format, self.structured_outputs)

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling_fields(self) -> dict:
        """Every SamplingParams field this request has, by the same name (as /predict reads them); vLLM's top_k -1
        is 0, every token kept."""
        fields = {name: getattr(self, name, None) for name in SamplingParams.field_names()}
        if fields.get("top_k") == -1:
            fields["top_k"] = 0
        return fields

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    # without max_tokens: the server's max_new_tokens, or (a chat answer, as vLLM's) max_new_tokens_limit
    runs_to_the_limit: ClassVar[bool] = False

    def sampling(self, settings: Settings) -> SamplingParams:
        """The configured defaults with this request's sampling fields; a bad value is a 400 naming the field."""
        max_tokens = self.requested_max_tokens
        if max_tokens is None and self.runs_to_the_limit:
            max_tokens = settings.max_new_tokens_limit
        try:
            return sampling_params(settings, **{**self.sampling_fields(), "max_new_tokens": max_tokens})
        except ApiError as error:
            if error.field == "max_new_tokens":
                error.field = self.max_tokens_field
            error.message = error.message.replace("max_new_tokens", self.max_tokens_field)  # min_tokens' names it
            raise


PromptText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Request):
    """POST /v1/completions."""

    model_config = ConfigDict(json_schema_extra={"not": {  # max_tokens 0 only with echo
        "required": ["max_tokens"],
        "properties": {"max_tokens": {"type": "integer", "maximum": 0}, "echo": {"not": {"enum": [True]}}}}})

    prompt: Annotated[PromptText | Annotated[list[PromptText], Field(min_length=1)] | TokenIds
                      | Annotated[list[TokenIds], Field(min_length=1)], BeforeValidator(_prompts)] = Field(
        description="the text to complete: a string, a list of strings, a list of token ids or a list of lists of "
                    "token ids; several prompts give one choice each (index 0, 1, ...), decoded one after another, "
                    "up to the server's max_prompts_per_request")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate at most; 0 (with echo) scores the "
                                                           "prompt alone")
    echo: bool | None = Field(None, description="return the prompt before the completion (and with logprobs, the "
                                                "prompt tokens' logprobs, null for the first)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=LOGPROBS_DESCRIPTION + " (and the "
                                                                                                "chosen token)")
    suffix: Text | None = Field(None, description="insertion: the text after the completion; the model fills in the "
                                                  "middle with its fill-in-the-middle tokens (prefix, suffix, "
                                                  "middle), where it has them (Qwen2.5-Coder, StarCoder); empty or "
                                                  "null: a plain completion")
    best_of: _no_op_only({"type": "integer", "enum": [1]}, (1,), "only 1 is supported") = None

    @model_validator(mode="after")
    def _nothing_to_do(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("invalid_value", "max_tokens: 0 generates nothing; it is allowed with echo "
                                      "(to score the prompt)", {"param": "max_tokens"})
        if self.suffix and self.echo:
            raise PydanticCustomError("invalid_value", "echo cannot be combined with a suffix (insertion)",
                                      {"param": "suffix"})
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or all(isinstance(item, int) for item in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def sampling_fields(self) -> dict:
        # echo scores the prompt from its prefill: with logprobs, or alone (max_tokens 0) to return it
        scored = self.echo and (self.logprobs is not None or self.max_tokens == 0)
        return {**super().sampling_fields(), "prompt_logprobs": (self.logprobs or 0) if scored else None}


class _ChatTemplating(BaseModel):
    """vLLM's fields for how a conversation goes through the chat template (/v1/chat/completions, /tokenize)."""

    add_generation_prompt: bool | None = Field(
        None, description="extension (vLLM's): open the assistant's turn after the messages (default true, false "
                          "with continue_final_message)")
    continue_final_message: bool | None = Field(
        None, description="extension (vLLM's): leave the last message, which must be the assistant's, open: the "
                          "answer continues it (an assistant's reply begun by the client)")
    add_special_tokens: bool | None = Field(
        None, description="extension (vLLM's): also add the tokenizer's own special tokens (a BOS) to the "
                          "template's text (default false: the template writes those it wants)")

    def templating(self) -> dict:
        """text.encode_messages' keywords for these fields, the defaults resolved."""
        continued = bool(self.continue_final_message)
        opened = self.add_generation_prompt if self.add_generation_prompt is not None else not continued
        return {"add_generation_prompt": opened, "continue_final_message": continued,
                "add_special_tokens": bool(self.add_special_tokens)}


class ChatCompletionRequest(_ChatTemplating, _Request):
    """POST /v1/chat/completions."""

    runs_to_the_limit: ClassVar[bool] = True

    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"not": {  # not both max_completion_tokens and max_tokens
            "required": ["max_completion_tokens", "max_tokens"],
            "properties": {"max_completion_tokens": {"type": "integer"}, "max_tokens": {"type": "integer"}}}},
        {"not": {  # top_logprobs only with logprobs: true
            "required": ["top_logprobs"],
            "properties": {"top_logprobs": {"type": "integer", "minimum": 1}, "logprobs": {"not": {"enum": [True]}}}}},
    ]})

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    max_tokens: int | None = Field(None, ge=1, description="the older name of max_completion_tokens")
    logprobs: bool | None = Field(None, description="return each token's logprob: the target's log-softmax of its "
                                                    "raw logits, before temperature, top-k and top-p")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with logprobs: this many most likely alternatives per token")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="functions the model may call; "
                                     "they go into the prompt through the chat template")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required, or "
                                                             "a named function; required and named constrain the "
                                                             "answer to calls, auto each call once it starts")
    parallel_tool_calls: bool | None = Field(None, description="more than one call in an answer (default true)")
    # OpenAI's fields for its own platform (stored completions, tiers, its prompt cache, abuse monitoring), which
    # leave the answer as it is: accepted and ignored, as `user` is, so that clients that set them keep working
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="accepted and ignored (nothing is stored)")
    store: bool | None = Field(None, description="accepted and ignored (nothing is stored)")
    service_tier: str | None = Field(None, max_length=64, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, max_length=1024, description="accepted and ignored (the prompt "
                                         "cache matches prompts by their tokens; see cache_prompt)")
    safety_identifier: str | None = Field(None, max_length=1024, description="accepted and ignored")
    functions: _no_op_only({"type": "array", "maxItems": 0}, ([],),
                           "function calling is not supported (only an empty list)") = None
    function_call: _no_op_only({"type": "string", "enum": ["none"]}, ("none",),
                               "function calling is not supported (only \"none\")") = None

    @model_validator(mode="after")
    def _one_max_tokens(self):
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise PydanticCustomError("invalid_value", "give max_completion_tokens or max_tokens (its older "
                                      "name), not both", {"param": "max_tokens"})
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs: true",
                                      {"param": "top_logprobs"})
        check_tools(self.tools, self.tool_choice)
        if self.calls_tools and (self.structured_outputs is not None or self.formats_answer):
            raise PydanticCustomError("invalid_value", "a response_format or structured_outputs cannot be combined "
                                      "with tools (unless tool_choice is none)", {"param": "tool_choice"})
        if self.ignore_eos and self.calls_tools:
            raise PydanticCustomError("invalid_value", "ignore_eos cannot be combined with tools (unless tool_choice "
                                      "is none): their grammar ends the answer with an end-of-sequence token",
                                      {"param": "ignore_eos"})
        if self.stop and self.only_calls:
            raise PydanticCustomError("invalid_value", STOP_CONSTRAINED, {"param": "stop"})
        return self

    @property
    def calls_tools(self) -> bool:
        """Tools are offered, and tool_choice is not none: the answer may hold tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def only_calls(self) -> bool:
        """tool_choice is required or names a function: the answer is calls, no content."""
        return self.calls_tools and self.tool_choice not in (None, "auto")

    def constraint(self, special_tool_tokens: bool = False) -> Constraint | None:
        if self.calls_tools:
            return tool_constraint(self.tools, self.tool_choice or "auto", self.parallel_tool_calls is not False,
                                   special_tool_tokens)
        return super().constraint()

    def sampling_fields(self) -> dict:
        return {**super().sampling_fields(), "logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        return conversation(self.messages)

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (none with tool_choice none)."""
        return template_tools(self.tools) if self.calls_tools else None


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """Chat messages as the chat template takes them."""
    return template_messages([message.for_template() for message in messages])


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """Tools as the chat template takes them."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def parse(model: type[BaseModel], body: dict) -> BaseModel:
    """Validate a /v1 body; a 400 naming the first bad field (OpenAI's `param`)."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _invalid(error.errors()[0]) from None


def _invalid(error: dict) -> ApiError:
    kind, loc = error["type"], list(error["loc"])
    # an unknown key ends its location as the client spelled it (maxTokens, Temperature, str); before it, and in
    # any other error's location, pydantic's union tags are left out
    named = loc.pop() if kind == "extra_forbidden" and loc else None
    loc = [part for part in loc if isinstance(part, int) or FIELD_NAME.fullmatch(part)] + ([named] if named else [])
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    if kind == "extra_forbidden":
        return ApiError(400, "unknown_parameter", f"unrecognized request argument {param!r}: this server does not "
                                                  f"support it", param)
    if kind == "missing":
        return ApiError(400, "missing_required_parameter", f"{param} is required", param)
    message = error["msg"].removeprefix("Value error, ")
    code = "unsupported_value" if kind == "unsupported_value" else "invalid_value"
    if not loc:  # a check across fields names its field itself
        return ApiError(400, code, message, error.get("ctx", {}).get("param"))
    return ApiError(400, code, f"{param}: {message}, got {_short(error.get('input'))}", param)


FIELD_NAME = re.compile(r"(?!(str|int|float|bool|list|dict)$)[a-z_][a-z0-9_]*")  # not a type tag


def _short(value) -> str:
    if isinstance(value, HugeInteger):
        return str(value)
    try:
        text = json.dumps(value)
    except (RecursionError, TypeError, ValueError):  # nested too deeply to echo
        text = f"a JSON {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


# --- answers ---------------------------------------------------------------------------------------------------

class _Omitting(BaseModel):
    """An answer part whose fields named in `omit_if_none` are left out when None, as OpenAI leaves them out."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        return {key: value for key, value in handler(self).items()
                if not (value is None and key in self.omit_if_none)}


class SpeculativeDecodingStats(BaseModel):
    """What speculation did for this choice, as vLLM names it (an extension field of each choice)."""

    method: str = Field(description="google, deepmind or target (no draft)")
    gamma: int | None = Field(description="draft tokens proposed per round; null: adaptive, or no draft")
    drafter: str | None = Field(description="model, lookup or hybrid; null: no proposals (target)")
    verification: str | None = Field(description="token or block; null: no proposals (target)")
    draft_confidence_threshold: float | None = Field(
        description="the draft model's confidence stop (0: none); null: no draft model drafts")
    seed: int = Field(description="the seed used (drawn at random when the request gave none)")
    num_drafts: int = Field(description="rounds that proposed at least one draft token")
    num_draft_tokens: int = Field(description="draft tokens proposed to the target")
    num_accepted_tokens: int = Field(description="draft tokens the target accepted")
    draft_acceptance_rate: float | None = Field(description="num_accepted_tokens / num_draft_tokens")
    mean_acceptance_length: float | None = Field(
        description="as vLLM defines it: 1 + num_accepted_tokens / num_drafts, the tokens a round with a draft "
                    "commits (at least 1); null: no drafts")
    num_accepted_tokens_per_pos: list[int] = Field(
        description="[i]: rounds whose draft token at position i (0-based) was accepted, for every position "
                    "proposed in the request (zeros included)")
    num_draft_tokens_by_drafter: dict[str, int] = Field(
        default_factory=dict, description="num_draft_tokens by drafter: model, lookup, grammar (forced tokens)")
    num_accepted_tokens_by_drafter: dict[str, int] = Field(default_factory=dict,
                                                           description="num_accepted_tokens by drafter")
    num_forced_tokens: int | None = Field(None, description="under a constraint: accepted tokens the grammar forced")
    grammar_seconds: float | None = Field(None, description="under a constraint: seconds spent in the grammar "
                                                            "(masks, forced tokens, state)")

    @classmethod
    def of(cls, stats) -> "SpeculativeDecodingStats | None":
        if stats is None:
            return None
        return cls(method=stats.method, gamma=stats.gamma, drafter=stats.drafter, verification=stats.verification,
                   draft_confidence_threshold=stats.draft_confidence_threshold, seed=stats.seed,
                   num_drafts=stats.drafts, num_draft_tokens=stats.proposed,
                   num_accepted_tokens=stats.accepted, draft_acceptance_rate=stats.acceptance_rate,
                   mean_acceptance_length=stats.mean_acceptance_length,
                   num_accepted_tokens_per_pos=list(stats.accepted_per_position),
                   num_draft_tokens_by_drafter=dict(stats.proposed_by_drafter),
                   num_accepted_tokens_by_drafter=dict(stats.accepted_by_drafter),
                   num_forced_tokens=stats.forced_tokens, grammar_seconds=stats.grammar_seconds)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prompt cache, not prefilled again")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class _Answer(BaseModel):
    id: str
    object: str
    created: int = Field(description="Unix time of the request")
    model: str
    system_fingerprint: str = Field(description="changes when the served pair or its configuration does")


class CompletionLogprobs(BaseModel):
    """A completion choice's logprobs, in OpenAI's completions shape: one entry per token of the choice's text
    (the prompt's first, with echo), each the target's log-softmax of its raw logits."""

    tokens: list[str] = Field(description="each token's own text")
    token_logprobs: list[float | None] = Field(description="each token's logprob; null for the prompt's first")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="the most likely tokens at each position (as many as logprobs asks), and the chosen one")
    text_offset: list[int] = Field(description="where each token's text starts in the choice's text")


class CompletionChoice(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"speculative_decoding_stats"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None = Field(None, description="with logprobs (in a stream: the chunk's tokens)")
    finish_reason: Literal[FINISH_REASONS] | None = Field(description="null until the last chunk of a stream")
    speculative_decoding_stats: SpeculativeDecodingStats | None = Field(
        None, description="on the answer, or on the last content chunk of a stream")


class Completion(_Answer):
    """The answer of /v1/completions; streamed, each chunk has this shape too (with the text so far added)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = Field(None, description="null in chunks; in the usage chunk of a stream")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's bytes (part of a character, for some tokens)")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the most likely tokens here, as many as top_logprobs asks")


class ChoiceLogprobs(BaseModel):
    """A chat choice's logprobs, in OpenAI's chat shape."""

    content: list[TokenLogprob] | None


class ChatCompletionMessage(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, description="the calls the answer makes, if any")


class ChatChoice(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"speculative_decoding_stats"})

    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal[FINISH_REASONS]
    speculative_decoding_stats: SpeculativeDecodingStats | None = None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: CompletionUsage


class FunctionCallDelta(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"name"})

    name: str | None = None
    arguments: str


class ToolCallDelta(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChoiceDelta(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"role", "content", "tool_calls"})

    role: Literal["assistant"] | None = Field(None, description="in the first chunk only")
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, description="a call's id and name, then its arguments")


class ChunkChoice(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"speculative_decoding_stats"})

    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = Field(None, description="with logprobs: the chunk's tokens")
    finish_reason: Literal[FINISH_REASONS] | None = Field(description="on the last content chunk")
    speculative_decoding_stats: SpeculativeDecodingStats | None = Field(None, description="on the last content chunk")


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice] = Field(description="empty in the usage chunk")
    usage: CompletionUsage | None = Field(None, description="with stream_options.include_usage: null, except in "
                                                            "the last chunk")


class ModelMetadata(BaseModel):
    draft: str = Field(description="the draft model that proposes tokens")
    target: str = Field(description="the target model whose distribution the output follows exactly")
    device: str
    dtype: str
    method: str = Field(description="the default decoding method")
    gamma: int | None = Field(description="the default draft length; null: adaptive")
    drafter: str = Field(description="the default drafter: model, lookup or hybrid")
    verification: str = Field(description="the default verification rule: token or block")
    draft_confidence_threshold: float = Field(description="the default draft-confidence stop (0: none)")


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    max_model_len: int | None = Field(description="the context length in tokens (as vLLM reports it)")
    metadata: ModelMetadata


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorObject(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error (4xx) or server_error (5xx)")
    param: str | None = Field(description="the request field at fault, if any")
    code: str | None


class OpenAIErrorResponse(BaseModel):
    error: ErrorObject


def openai_error(error: ApiError) -> tuple[dict, int]:
    """An ApiError as OpenAI shapes it: (body, status); field errors are 400, as OpenAI answers them."""
    status = 400 if error.status == 422 else error.status
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = OpenAIErrorResponse(error=ErrorObject(message=error.message, type=kind, param=error.field,
                                                 code=CODES.get(error.type, error.type)))
    return body.model_dump(), status


# what an answer depends on: the pair as loaded (ModelHost.info: not its load's seconds and memory, which differ on
# every start) and the settings that choose and shape it, with the decoding defaults
FINGERPRINTED_INFO = ("models", "device", "dtype", "context_length", "prompt_cache_bytes")
FINGERPRINTED_SETTINGS = ("target_model", "draft_model", "device_map", "draft_quantization", "compile", "weights",
                          "quantize", "draft_vocab_size", "lookup_max_ngram", "lookup_max_tokens", "lookup_min_match",
                          "hybrid_min_match", "hybrid_extend")


def fingerprint(info: dict, settings: Settings) -> str:
    """system_fingerprint: a digest of the served pair and the decoding defaults, the same on every start with the
    same ones (a restart or another replica is the same backend)."""
    served = {"info": {key: info.get(key) for key in FINGERPRINTED_INFO},
              "settings": {name: getattr(settings, name) for name in FINGERPRINTED_SETTINGS},
              "sampling": asdict(settings.sampling)}
    return "fp_" + hashlib.sha256(json.dumps(served, sort_keys=True, default=str).encode()).hexdigest()[:12]


# --- vLLM's /tokenize and /detokenize ---------------------------------------------------------------------------

class TokenizeRequest(_ChatTemplating):
    """POST /tokenize (vLLM's): the token ids this server feeds the model for a prompt, encoded as /v1/completions
    encodes one, or for a conversation, as /v1/chat/completions encodes it (its tools and templating fields
    included). The prompt limits do not apply: the answer's count and max_model_len say whether a request would
    fit."""

    # the JSON schema states _prompt_or_messages' rule (/openapi.json: a request valid by it is taken)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"anyOf": [
        {"required": ["prompt"], "properties": {
            "prompt": {"type": "string"},
            **{name: {"type": "null"} for name in ("messages", "tools", "add_generation_prompt",
                                                   "continue_final_message")}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]})

    model: str | None = Field(None, description="the served model's id, as /v1/models lists it (optional)")
    prompt: Text | None = Field(None, description="text, encoded with the tokenizer's special tokens (as a "
                                                  "/v1/completions prompt; add_special_tokens false leaves them "
                                                  "out); give prompt or messages")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="a conversation, through the chat "
                                               "template with the assistant's turn opened (as /v1/chat/completions)")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="with messages: the tools the chat "
                                     "template writes into the prompt")
    return_token_strs: bool | None = Field(None, description="also return each token as the vocabulary spells it")

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "give prompt or messages (one of them)", {"param": "prompt"})
        if self.messages is None:
            for name in ("tools", "add_generation_prompt", "continue_final_message"):
                if getattr(self, name) is not None:
                    raise PydanticCustomError("invalid_value", f"{name} applies to messages only", {"param": name})
        return self

    def encoding(self) -> dict:
        """svc.tokenize's arguments: the prompt, or the conversation and its tools, with how to encode them."""
        if self.messages is None:
            return {"prompt": self.prompt, "templating": {"add_special_tokens": self.add_special_tokens is not False}}
        return {"messages": conversation(self.messages), "tools": template_tools(self.tools), "field_name": "messages",
                "templating": self.templating()}


class TokenizeResponse(BaseModel):
    count: int = Field(description="the number of tokens")
    max_model_len: int | None = Field(description="the model context, in tokens (null: unbounded)")
    tokens: list[int]
    token_strs: list[str] | None = Field(description="with return_token_strs: each token as the vocabulary "
                                                     "spells it")


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids to text, special tokens included (so it inverts /tokenize)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="the served model's id, as /v1/models lists it (optional)")
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="token ids of the served vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the text of the tokens")


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
ANSWER_MODELS = (Completion, ChatCompletion, ChatCompletionChunk, ModelList, OpenAIErrorResponse, TokenizeResponse,
                 DetokenizeResponse)
