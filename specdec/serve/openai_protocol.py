"""OpenAI's API shapes for the /v1 routes, as pydantic models that mirror OpenAI's (and the SDK's names): the
requests (strict types; unknown fields and unsupported features refused, never ignored), the answers, their
streamed chunks, the model list and the error shape. /openapi.json's /v1 schemas are generated from them.

A field OpenAI defines but this server does not implement (n > 1, logprobs, penalties, tools, ...) is accepted
only at its no-op value (or null), so a client that sends the default still works and one that asks for the
feature gets a 400 naming it. The sampling fields map onto SamplingParams through protocol.sampling_params.
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

from ..params import DRAFTERS, SEED_MAX, SEED_MIN, SERVED_METHODS, VERIFICATIONS, SamplingParams
from .config import Settings
from .errors import ApiError
from .protocol import (
    CONFIDENCE_DESCRIPTION,
    DRAFTER_DESCRIPTION,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    VERIFICATION_DESCRIPTION,
    HugeInteger,
    Temperature,
    sampling_params,
    temperature_field,
)

OPENAI_PREFIX = "/v1"
MAX_TEMPERATURE = 2.0  # OpenAI's bound
FINISH_REASONS = ("stop", "length")  # a time limit reads as "length": the completion was cut short
# our error types -> OpenAI's error codes, where they differ
CODES = {"invalid_field": "invalid_value", "prompt_too_long": "context_length_exceeded",
         "unauthorized": "invalid_api_key"}


def is_openai_path(path: str) -> bool:
    return path == OPENAI_PREFIX or path.startswith(OPENAI_PREFIX + "/")


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
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return value


def _one_prompt(value):
    """`prompt`: a string, or a list holding exactly one string (the shapes OpenAI allows, at batch size 1)."""
    if isinstance(value, list):
        if value and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            raise ValueError("token-id prompts are not supported; send the prompt as text")
        if len(value) != 1 or not isinstance(value[0], str):
            raise ValueError("prompt must be a string or a list of exactly one string (one prompt per request)")
    elif not isinstance(value, str):
        raise ValueError("prompt must be a string or a list of exactly one string")
    if not (value if isinstance(value, str) else value[0]):
        raise ValueError("the prompt is empty")
    return value


def _text_content(value):
    """A message's `content`: a string, or a list of {"type": "text", "text"} parts."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content parts are supported, not {kind!r}" if kind
                                 else 'each content part must be an object {"type": "text", "text": ...}')
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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message of the conversation; it goes through the target's chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="developer is OpenAI's newer name for system, and goes to the template as system")
    content: Annotated[Text | list[TextPart], BeforeValidator(_text_content)] = Field(
        description="a string, or text parts (joined with newlines)")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Request(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(description="the served model's id, as /v1/models lists it")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: Temperature = temperature_field(le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="nucleus sampling mass")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX,
                             description="the same seed and request give the same completion; default random")
    stop: Annotated[StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None,
                    BeforeValidator(_stop_strings)] = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings; the completion ends before the first one found, "
                          f"which is not returned")
    stream: bool | None = Field(None, description="answer with Server-Sent Events of chunks")
    stream_options: StreamOptions | None = Field(
        None, description="for a stream; an answer that is not streamed always has its usage")
    user: str | None = Field(None, description="accepted and ignored")
    n: _no_op_only({"type": "integer", "enum": [1]}, (1,),
                   "only 1 is supported (one choice per request)") = None
    presence_penalty: _no_op_only({"type": "number", "enum": [0]}, (0, 0.0),
                                  "not supported (only 0)") = None
    frequency_penalty: _no_op_only({"type": "number", "enum": [0]}, (0, 0.0),
                                   "not supported (only 0)") = None
    logit_bias: _no_op_only({"type": "object", "maxProperties": 0}, ({},),
                            "not supported (only an empty object)") = None
    # extensions, as in /predict
    top_k: int | None = Field(None, ge=0, description="extension: 0 keeps every token")
    gamma: int | None = Field(None, ge=1, description="extension: draft tokens proposed per round")
    method: Literal[SERVED_METHODS] | None = Field(None, description="extension: the decoding method")
    drafter: Literal[DRAFTERS] | None = Field(None, description="extension: " + DRAFTER_DESCRIPTION)
    verification: Literal[VERIFICATIONS] | None = Field(None, description="extension: " + VERIFICATION_DESCRIPTION)
    draft_confidence_threshold: float | None = Field(None, ge=0, le=1, allow_inf_nan=False,
                                                     description="extension: " + CONFIDENCE_DESCRIPTION)

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling(self, settings: Settings) -> SamplingParams:
        """The configured defaults with this request's sampling fields; a bad value is a 400 naming the field."""
        try:
            # every SamplingParams field this request has, by the same name (as /predict reads them); the length
            # under OpenAI's name
            requested = {name: getattr(self, name, None) for name in SamplingParams.field_names()}
            return sampling_params(settings, **{**requested, "max_new_tokens": self.requested_max_tokens})
        except ApiError as error:
            if error.field == "max_new_tokens":
                error.field = self.max_tokens_field
                error.message = error.message.replace("max_new_tokens", self.max_tokens_field)
            raise


PromptText = Annotated[str, Field(min_length=1)]


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: Annotated[PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=1)],
                      BeforeValidator(_one_prompt)] = Field(
        description="the text to complete: a string, or a list of exactly one string")
    echo: _no_op_only({"type": "boolean", "enum": [False]}, (False,), "not supported (only false)") = None
    suffix: _no_op_only({"type": "string", "enum": [""]}, ("",), "insertion is not supported (only an empty suffix)") = None
    best_of: _no_op_only({"type": "integer", "enum": [1]}, (1,), "only 1 is supported") = None
    logprobs: _no_op_only(None, (), "not supported") = None

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra={"not": {  # not both max_completion_tokens and max_tokens
        "required": ["max_completion_tokens", "max_tokens"],
        "properties": {"max_completion_tokens": {"type": "integer"}, "max_tokens": {"type": "integer"}}}})

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    max_tokens: int | None = Field(None, ge=1, description="the older name of max_completion_tokens")
    logprobs: _no_op_only({"type": "boolean", "enum": [False]}, (False,),
                          "not supported (only false)") = None
    top_logprobs: _no_op_only({"type": "integer", "enum": [0]}, (0,),
                              "not supported (only 0)") = None
    response_format: _no_op_only(
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"type": "string", "enum": ["text"]}}},
        ({"type": "text"},), "no JSON mode or structured output (only {\"type\": \"text\"})") = None
    tools: _no_op_only({"type": "array", "maxItems": 0}, ([],), "function calling is not supported (only an empty list)") = None
    tool_choice: _no_op_only({"type": "string", "enum": ["none"]}, ("none",),
                             "function calling is not supported (only \"none\")") = None
    parallel_tool_calls: _no_op_only({"type": "boolean"}, (True, False),
                                     "accepted: without tools it changes nothing") = None
    functions: _no_op_only({"type": "array", "maxItems": 0}, ([],),
                           "function calling is not supported (only an empty list)") = None
    function_call: _no_op_only({"type": "string", "enum": ["none"]}, ("none",),
                               "function calling is not supported (only \"none\")") = None

    @model_validator(mode="after")
    def _one_max_tokens(self):
        if self.max_completion_tokens is not None and self.max_tokens is not None:
            raise PydanticCustomError("invalid_value", "give max_completion_tokens or max_tokens (its older "
                                      "name), not both", {"param": "max_tokens"})
        return self

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict]:
        return [{"role": "system" if message.role == "developer" else message.role, "content": message.text()}
                for message in self.messages]


def parse(model: type[_Request], body: dict) -> _Request:
    """Validate a /v1 body; a 400 naming the first bad field (OpenAI's `param`)."""
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _invalid(error.errors()[0]) from None


def _invalid(error: dict) -> ApiError:
    loc = [part for part in error["loc"] if isinstance(part, int) or FIELD_NAME.fullmatch(part)]  # no union tags
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    kind = error["type"]
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

    @classmethod
    def of(cls, stats) -> "SpeculativeDecodingStats | None":
        if stats is None:
            return None
        return cls(method=stats.method, gamma=stats.gamma, drafter=stats.drafter, verification=stats.verification,
                   draft_confidence_threshold=stats.draft_confidence_threshold, seed=stats.seed,
                   num_drafts=stats.drafts, num_draft_tokens=stats.proposed,
                   num_accepted_tokens=stats.accepted, draft_acceptance_rate=stats.acceptance_rate,
                   mean_acceptance_length=stats.mean_acceptance_length,
                   num_accepted_tokens_per_pos=list(stats.accepted_per_position))


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Answer(BaseModel):
    id: str
    object: str
    created: int = Field(description="Unix time of the request")
    model: str
    system_fingerprint: str = Field(description="changes when the served pair or its configuration does")


class CompletionChoice(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"speculative_decoding_stats"})

    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal[FINISH_REASONS] | None = Field(description="null until the last chunk of a stream")
    speculative_decoding_stats: SpeculativeDecodingStats | None = Field(
        None, description="on the answer, or on the last content chunk of a stream")


class Completion(_Answer):
    """The answer of /v1/completions; streamed, each chunk has this shape too (with the text so far added)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = Field(None, description="null in chunks; in the usage chunk of a stream")


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"speculative_decoding_stats"})

    index: int
    message: ChatCompletionMessage
    logprobs: None = None
    finish_reason: Literal[FINISH_REASONS]
    speculative_decoding_stats: SpeculativeDecodingStats | None = None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChoiceDelta(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"role", "content"})

    role: Literal["assistant"] | None = Field(None, description="in the first chunk only")
    content: str | None = None


class ChunkChoice(_Omitting):
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"speculative_decoding_stats"})

    index: int
    delta: ChoiceDelta
    logprobs: None = None
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


def fingerprint(info: dict, settings: Settings) -> str:
    """system_fingerprint: a digest of the served pair and the decoding defaults."""
    served = {"info": info, "sampling": asdict(settings.sampling)}
    return "fp_" + hashlib.sha256(json.dumps(served, sort_keys=True, default=str).encode()).hexdigest()[:12]


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)
ANSWER_MODELS = (Completion, ChatCompletion, ChatCompletionChunk, ModelList, OpenAIErrorResponse)
