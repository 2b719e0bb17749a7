"""The HTTP API's shapes: the /predict request (strict types, no unknown fields) as a pydantic model, the one
source that both validation and /openapi.json come from.

Parsing goes body size -> content type -> JSON -> fields; each failure is an ApiError that the service's one
error handler turns into `{"error": {"type", "message", "field"}}`. Bounds come from specdec.params.
"""

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import SpecDecError
from ..params import (
    ADAPTIVE_MAX_GAMMA,
    DRAFTERS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_BOUNDS,
    SEED_MAX,
    SEED_MIN,
    SERVED_METHODS,
    VERIFICATIONS,
    SamplingParams,
)
from .concurrency import TimeLimitExceeded, time_limit
from .config import ADAPTIVE, Gamma, Probability, Settings, TopP
from .errors import CLOSE, ApiError
from .structured import Constraint, ResponseFormat, StructuredOutputs, request_constraint

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
INT_DIGITS = sys.get_int_max_str_digits() or 4300  # Python refuses to parse longer integer literals


# Whitespace as both Python's str.isspace and JSON Schema's (ECMA-262) \s understand it, so the OpenAPI pattern
# and this check accept exactly the same prompts (they differ on \x1c-\x1f, \x85 and \ufeff).
WHITESPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
NOT_BLANK_PATTERN = f"[^{WHITESPACE}]"
NOT_BLANK = re.compile(NOT_BLANK_PATTERN)


# the request fields' descriptions that /predict and the OpenAI routes share
DRAFTER_DESCRIPTION = ("who proposes: the draft model, prompt lookup (n-grams of the prompt and the text so far), "
                       "or hybrid (lookup where it matches, the draft model elsewhere)")
VERIFICATION_DESCRIPTION = "how proposals are verified: token by token, or the block jointly (Sun et al. 2025)"
GAMMA_DESCRIPTION = "draft tokens proposed per round, or \"adaptive\": chosen each round from the acceptance rate"
CONFIDENCE_DESCRIPTION = ("the draft model ends its run before gamma after a token it gave a probability below "
                          "this (softmax of its logits, before temperature, top-k and top-p); 0: never")
IGNORE_EOS_DESCRIPTION = ("keep an end-of-sequence token and go on to the token limit (default false; not with "
                          "a response_format or structured_outputs constraint, nor with tools unless tool_choice is "
                          "none)")
STOP_TOKEN_IDS_DESCRIPTION = ("more token ids that end the completion as an end-of-sequence token does (vLLM's; "
                              "kept in the output, finish_reason stop; also with ignore_eos); not with a "
                              "response_format, structured_outputs or tools")
MIN_TOKENS_DESCRIPTION = ("generate at least this many tokens (vLLM's; default 0): until then the tokens that would "
                          "end the completion (end-of-sequence, stop_token_ids) are masked, as a grammar masks, and "
                          "no stop string is looked for; at most the token limit; not with a response_format, "
                          "structured_outputs or tools")
# why a request's ignore_eos is refused beside response_format or structured_outputs (/predict and /v1)
IGNORE_EOS_CONSTRAINED = ("ignore_eos cannot be combined with response_format or structured_outputs: a constrained "
                          "answer ends with an end-of-sequence token")
# why a request's stop strings are refused beside a constraint (/predict and /v1)
STOP_CONSTRAINED = ("stop cannot be combined with response_format, structured_outputs or a required or named "
                    "tool_choice: the grammar decides where the answer ends, and a stop string would cut it where "
                    "it does not parse")
SEED_DESCRIPTION = ("the same seed and request give the same completion (with cache_prompt false; with the prompt "
                    "cache, only where it holds the same); default random")
CACHE_PROMPT_DESCRIPTION = ("start from the prompt cache (reuse what an earlier request shared with this prompt) and "
                            "leave this request's caches in it; false: neither. Outputs follow the target's "
                            "distribution either way, but reused keys and values were computed in other forwards, "
                            "so logits may differ in their last bits (an int8 draft's by more: a seeded sample "
                            "then often differs): for a seed or logprobs reproducible to the bit whatever the "
                            "cache holds, send false")
LOGPROBS_DESCRIPTION = ("the target's log-probability of each token (log-softmax of its raw logits, before "
                        "temperature, top-k and top-p), with this many most likely alternatives")
LOGIT_BIAS_DESCRIPTION = (f"{{token id: bias}} (ids as strings of digits, biases from {-MAX_LOGIT_BIAS:g} to "
                          f"{MAX_LOGIT_BIAS:g}) added to the logits before temperature, top-k and top-p; "
                          f"{-MAX_LOGIT_BIAS:g} bans a token. The output follows the biased target's distribution "
                          f"exactly; logprobs stay the raw model's")


def _token_ids(bias: dict[str, float]) -> dict[int, float]:
    ids = {int(token): amount for token, amount in bias.items()}
    if len(ids) < len(bias):
        raise ValueError("a token id is given twice (with and without leading zeros)")
    return ids


# OpenAI's logit_bias, as /predict and the OpenAI routes take it: JSON's keys are strings, the engine's ids ints
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
         Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]],
    AfterValidator(_token_ids)]


# the penalties on the tokens so far, as /predict and the OpenAI routes take them (SamplingParams checks them too)
_PENALIZED = ("before temperature, top-k and top-p; the output follows the penalized target's distribution "
              "exactly, logprobs stay the raw model's")
PresencePenalty = Annotated[float | None, Field(
    ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False,
    description=f"subtracted from the logit of every token already generated (OpenAI's; default 0), {_PENALIZED}")]
FrequencyPenalty = Annotated[float | None, Field(
    ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False,
    description=f"times a token's count among those generated, subtracted from its logit (OpenAI's; default 0), "
                f"{_PENALIZED}")]
RepetitionPenalty = Annotated[float | None, Field(
    ge=REPETITION_PENALTY_BOUNDS[0], le=REPETITION_PENALTY_BOUNDS[1], allow_inf_nan=False,
    description=f"a token in the prompt or the output has a positive logit divided by this and a negative one "
                f"multiplied (transformers' and vLLM's; default 1, none), before the other two penalties, "
                f"{_PENALIZED}")]


StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]] | None, Field(description=STOP_TOKEN_IDS_DESCRIPTION)]


def _not_tiny(value: float | None) -> float | None:
    if value is not None and 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    return value


# a request's temperature, on /predict and the OpenAI routes alike: unset, 0 (greedy) or at least MIN_TEMPERATURE
Temperature = Annotated[float | None, AfterValidator(_not_tiny)]


def temperature_field(**bounds) -> Any:
    """The Field of a Temperature, with the gap (0, MIN_TEMPERATURE) in its JSON schema; `bounds`: more of them."""
    return Field(None, ge=0, allow_inf_nan=False, description=f"0 is greedy, otherwise at least {MIN_TEMPERATURE:g}",
                 json_schema_extra={"not": {"type": "number", "exclusiveMinimum": 0,
                                            "exclusiveMaximum": MIN_TEMPERATURE}}, **bounds)


class PredictRequest(BaseModel):
    """A /predict body as sent. null (or leaving a field out) means the configured default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, json_schema_extra={"pattern": NOT_BLANK_PATTERN},
                        description="the text to complete; it must fit the server's prompt limit, and prompt "
                                    "plus max_new_tokens the model context")
    max_new_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: Temperature = temperature_field()
    # (openapi.py restates these bounds in OpenAPI 3.0's dialect)
    top_k: int | None = Field(None, ge=0, description="0 keeps every token")
    top_p: TopP | None = Field(None, description="nucleus sampling mass")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX,
                             description=SEED_DESCRIPTION)
    gamma: Gamma | None = Field(None, description=GAMMA_DESCRIPTION)
    method: Literal[SERVED_METHODS] | None = None
    drafter: Literal[DRAFTERS] | None = Field(None, description=DRAFTER_DESCRIPTION)
    verification: Literal[VERIFICATIONS] | None = Field(None, description=VERIFICATION_DESCRIPTION)
    draft_confidence_threshold: Probability | None = Field(None, description=CONFIDENCE_DESCRIPTION)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS, description="the completion ends before the first one found; not with "
                                                      "response_format or structured_outputs")
    chat: bool | None = Field(None, description="wrap the prompt in the model's chat template")
    cache_prompt: bool | None = Field(None, description=CACHE_PROMPT_DESCRIPTION)
    ignore_eos: bool | None = Field(None, description=IGNORE_EOS_DESCRIPTION)
    details: bool | None = Field(None, description="add the per-token list")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="add `logprobs`: " + LOGPROBS_DESCRIPTION)
    logit_bias: LogitBias | None = Field(None, description=LOGIT_BIAS_DESCRIPTION)
    stop_token_ids: StopTokenIds = None
    min_tokens: int | None = Field(None, ge=0, description=MIN_TOKENS_DESCRIPTION)
    presence_penalty: PresencePenalty = None
    frequency_penalty: FrequencyPenalty = None
    repetition_penalty: RepetitionPenalty = None
    stream: bool | None = Field(None, description="answer with Server-Sent Events")
    response_format: ResponseFormat | None = Field(
        None, description="as OpenAI's: text, json_object (any JSON object) or json_schema")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="as vLLM's: json, regex, choice or grammar constrain the completion")
    grammar_drafter: bool | None = Field(None, description="under a constraint, propose the tokens the grammar "
                                                           "forces (default true)")

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not NOT_BLANK.search(value):
            raise ValueError("the prompt must contain more than whitespace")
        return value


@dataclass(frozen=True)
class PredictParams:
    """A validated /predict request with the configured defaults filled in (a seed of None: the service draws one)."""

    prompt: str
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    chat: bool = False
    details: bool = False
    stream: bool = False
    constraint: Constraint | None = None  # what the completion must match


def read_json_object(request, max_bytes: int, timeout: float | None = None) -> dict:
    """The body of a Flask request as a JSON object, or the ApiError (413, 415, 408, 400) saying why not.

    A body that has not arrived within `timeout` seconds is answered 408 (under gevent; see concurrency.py). An
    answer that leaves the body unread (413, 408, a malformed chunk) closes the connection (RFC 9110, 15.5.9): the
    server would otherwise wait for the rest of it, and the client's next request there would be lost."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, "body_too_large", f"the request body has {request.content_length} bytes; "
                                              f"the limit is {max_bytes}", headers=CLOSE)
    charset = request.mimetype_params.get("charset", "utf-8").lower()
    if request.mimetype != "application/json" or charset not in ("utf-8", "utf8"):
        sent = request.headers.get("Content-Type") or "none"
        raise ApiError(415, "unsupported_media_type",
                       f"send the body as application/json (UTF-8); the Content-Type was {sent}")
    try:
        with time_limit(timeout) if timeout else contextlib.nullcontext():
            data = request.get_data(cache=False)  # a chunked body (no Content-Length) is read up to max_bytes + 1
    except TimeLimitExceeded:
        raise ApiError(408, "body_timeout", f"the request body did not arrive within {timeout:g} s",
                       headers=CLOSE) from None
    except Exception as error:  # noqa: BLE001 - a body the server cannot parse (a bad chunk), else re-raised
        if not _unparsable_body(error):
            raise
        raise ApiError(400, "bad_request", f"the request body cannot be read: {type(error).__name__} "
                                           "(its chunked encoding is malformed)", headers=CLOSE) from None
    if len(data) > max_bytes:
        raise ApiError(413, "body_too_large", f"the request body is over the limit of {max_bytes} bytes",
                       headers=CLOSE)
    try:
        body = json.loads(data.decode("utf-8"), parse_int=_parse_int)
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_json", "the body is not valid UTF-8") from None
    except json.JSONDecodeError as error:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", f"the body must be a JSON object, got {_json_type(body)}")
    return body


def _unparsable_body(error: Exception) -> bool:
    """Whether reading a body failed on the body itself: gunicorn's parse errors (an invalid chunk size, a
    chunk longer than it said), not a fault of the service's."""
    return any(cls.__module__ == "gunicorn.http.errors" for cls in type(error).__mro__)


class HugeInteger:
    """An integer literal too long for Python to parse: no field accepts it, and the 422 names the field."""

    def __init__(self, digits: int):
        self.digits = digits

    def __str__(self) -> str:
        return f"an integer of {self.digits} digits"


def _parse_int(text: str) -> "int | HugeInteger":
    digits = len(text.lstrip("-"))
    return int(text) if digits <= INT_DIGITS else HugeInteger(digits)


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
             type(None): "null", HugeInteger: "number"}
    return names.get(type(value), type(value).__name__)


def sampling_params(settings: Settings, **requested) -> SamplingParams:
    """The configured defaults with a request's sampling fields (those not None) applied, checked against the
    server's limits; a bad value is a 422 naming the field."""
    requested = {name: value for name, value in requested.items() if value is not None}
    max_new_tokens = requested.get("max_new_tokens", settings.max_new_tokens)
    if max_new_tokens > settings.max_new_tokens_limit:
        raise ApiError(422, "invalid_field", f"max_new_tokens must be at most {settings.max_new_tokens_limit}, "
                                             f"got {max_new_tokens}", "max_new_tokens")
    gamma = requested.get("gamma")
    if gamma == ADAPTIVE:
        if not settings.takes_adaptive_gamma:  # max_gamma bounds what a request proposes
            raise ApiError(422, "invalid_field", f"adaptive gamma proposes up to {ADAPTIVE_MAX_GAMMA} tokens a "
                                                 f"round, over this server's max_gamma of {settings.max_gamma}", "gamma")
        requested["gamma"] = None  # adaptive, whatever the server's default
    elif gamma is not None and gamma > settings.max_gamma:
        raise ApiError(422, "invalid_field", f"gamma must be at most {settings.max_gamma}, got {gamma}", "gamma")
    try:
        return settings.sampling.replace(**requested)
    except SpecDecError as error:
        raise ApiError(422, "invalid_field", error.message, error.field) from None


def parse_predict(body: dict, settings: Settings) -> PredictParams:
    """Validate a /predict body against the schema and the configured limits; 422 naming the first bad field."""
    try:
        req = PredictRequest.model_validate(body)
    except ValidationError as error:
        raise _invalid_field(error.errors()[0]) from None
    sampling = sampling_params(settings, **{name: getattr(req, name, None) for name in SamplingParams.field_names()})
    try:
        constraint = request_constraint(req.response_format, req.structured_outputs)
    except SpecDecError as error:
        raise ApiError(422, "invalid_field", error.message, error.field) from None
    if constraint is not None and sampling.ignore_eos:
        raise ApiError(422, "invalid_field", IGNORE_EOS_CONSTRAINED, "ignore_eos")
    if constraint is not None and req.stop:
        raise ApiError(422, "invalid_field", STOP_CONSTRAINED, "stop")
    return PredictParams(prompt=req.prompt, sampling=sampling, stop=tuple(req.stop or ()), chat=bool(req.chat),
                         details=bool(req.details), stream=bool(req.stream), constraint=constraint)


def request_schema(settings: Settings) -> dict:
    """The JSON Schema of a /predict body, from PredictRequest, with this server's limits and defaults."""
    schema = PredictRequest.model_json_schema(ref_template="#/components/schemas/{model}")  # $defs: the document's
    props = schema["properties"]
    defaults = settings.sampling
    bound(props["max_new_tokens"], maximum=settings.max_new_tokens_limit,
          default=f"default {defaults.max_new_tokens}")
    bound(props["min_tokens"], maximum=settings.max_new_tokens_limit)  # and at most the request's max_new_tokens
    bound_gamma(props["gamma"], settings)
    for name in ("temperature", "top_k", "top_p", "method", "drafter", "verification", "draft_confidence_threshold"):
        bound(props[name], default=f"default {getattr(defaults, name)}")
    props["prompt"]["description"] += f" (at most {settings.max_prompt_tokens} tokens)"
    return schema


def bound_gamma(prop: dict, settings: Settings) -> None:
    """gamma's schema with the server's settings: at most max_gamma, and "adaptive" only where max_gamma allows the
    draft lengths adaptive gamma chooses (sampling_params refuses it otherwise)."""
    bound(prop, maximum=settings.max_gamma,
          default="default " + ("adaptive" if settings.gamma is None else str(settings.gamma)))
    if not settings.takes_adaptive_gamma:
        prop["anyOf"] = [branch for branch in prop["anyOf"] if branch.get("type") != "string"]
        prop["description"] += f" (not \"adaptive\" here: it proposes up to {ADAPTIVE_MAX_GAMMA})"


def bound(prop: dict, maximum: int | None = None, default: str | None = None) -> None:
    """Patch one property's schema with the server's settings: a maximum on its integer branch (of a nullable or
    several-typed property), its default in its description."""
    if maximum is not None:
        for branch in prop.get("anyOf", [prop]):
            if branch.get("type") == "integer":
                branch["maximum"] = maximum
    if default:
        prop["description"] = f"{prop['description']}; {default}" if prop.get("description") else default


# the marks pydantic puts in an error's location beside the body's own keys (a union's branches, a dict's key)
PYDANTIC_MARK = re.compile(r"\[key\]|(?:constrained|function|lax)-[a-z-]+(?:\[.*\])?|(?:literal|nullable|tagged-union|union"
                           r"|json-or-python|list|dict|tuple)\[.*\]")


def _invalid_field(error: dict) -> ApiError:
    # pydantic's marks of a union's branch ("constrained-int", "literal['adaptive']") or of a dict's key ("[key]")
    # are no place in the body; the field itself (loc[0]) and a key ("-1", "a-b") always are
    loc = error["loc"][:1] + tuple(part for part in error["loc"][1:] if not (
        isinstance(part, str) and PYDANTIC_MARK.fullmatch(part)))
    field = str(loc[0]) if loc else None
    where = field + "".join(f"[{part}]" for part in loc[1:]) if loc else "body"
    if error["type"] == "extra_forbidden":  # a nested one by its path: structured_outputs.regexx
        message = f"unknown field {'.'.join(map(str, loc))!r}"
    elif error["type"] == "missing":
        message = f"{field} is required"
    else:
        message = f"{where}: {error['msg'].removeprefix('Value error, ')}, got {_short(error.get('input'))}"
    return ApiError(422, "invalid_field", message, field)


def _short(value) -> str:
    if isinstance(value, (float, HugeInteger)):
        text = str(value)
    else:
        try:
            text = json.dumps(value)
        except (RecursionError, TypeError, ValueError):  # nested too deeply to echo
            text = f"a JSON {_json_type(value)}"
    return text if len(text) <= 60 else text[:57] + "..."
