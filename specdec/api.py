"""The HTTP API's shapes: the /predict request (strict types, no unknown fields) and the JSON error.

Parsing goes body size -> content type -> JSON -> fields; each failure is an ApiError that the service's one
error handler turns into `{"error": {"type", "message", "field"}}`.
"""

import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import Settings

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An error answer: HTTP status, a stable `type`, a human message, the offending field (if any)."""

    def __init__(self, status: int, type: str, message: str, field: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.field = status, type, message, field
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"type": self.type, "message": self.message, "field": self.field}}


class PredictRequest(BaseModel):
    """A /predict body as sent. null (or leaving a field out) means the configured default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    gamma: int | None = Field(None, ge=1)
    method: Literal["google", "deepmind", "target"] | None = None
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS)
    chat: bool | None = None
    details: bool | None = None
    stream: bool | None = None


@dataclass(frozen=True)
class Params:
    """A validated request with the configured defaults filled in (seed stays None: the service draws one)."""

    prompt: str
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    gamma: int | None  # None: adaptive
    method: str
    stop: tuple[str, ...]
    chat: bool
    details: bool
    stream: bool


def read_json_object(request, max_bytes: int) -> dict:
    """The body of a Flask request as a JSON object, or the ApiError (413, 415, 400) saying why not."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, "body_too_large", f"the request body has {request.content_length} bytes; "
                                              f"the limit is {max_bytes}")
    charset = request.mimetype_params.get("charset", "utf-8").lower()
    if request.mimetype != "application/json" or charset not in ("utf-8", "utf8"):
        sent = request.headers.get("Content-Type") or "none"
        raise ApiError(415, "unsupported_media_type",
                       f"send the body as application/json (UTF-8); the Content-Type was {sent}")
    data = request.get_data(cache=False)  # werkzeug raises 413 here for an over-long chunked body
    try:
        body = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_json", "the body is not valid UTF-8") from None
    except json.JSONDecodeError as error:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", f"the body must be a JSON object, got {type(body).__name__}")
    return body


def parse_predict(body: dict, settings: Settings) -> Params:
    """Validate a /predict body against the schema and the configured limits; 422 naming the first bad field."""
    try:
        req = PredictRequest.model_validate(body)
    except ValidationError as error:
        raise _invalid_field(error.errors()[0]) from None
    max_new_tokens = settings.max_new_tokens if req.max_new_tokens is None else req.max_new_tokens
    if max_new_tokens > settings.max_new_tokens_limit:
        raise ApiError(422, "invalid_field", f"max_new_tokens must be at most {settings.max_new_tokens_limit}, "
                                             f"got {max_new_tokens}", "max_new_tokens")
    if req.gamma is not None and req.gamma > settings.max_gamma:
        raise ApiError(422, "invalid_field", f"gamma must be at most {settings.max_gamma}, got {req.gamma}", "gamma")

    def default(value, name):
        return getattr(settings, name) if value is None else value

    return Params(prompt=req.prompt, max_new_tokens=max_new_tokens,
                  temperature=default(req.temperature, "temperature"), top_k=default(req.top_k, "top_k"),
                  top_p=default(req.top_p, "top_p"), seed=req.seed, gamma=default(req.gamma, "gamma"),
                  method=default(req.method, "method"), stop=tuple(req.stop or ()), chat=bool(req.chat),
                  details=bool(req.details), stream=bool(req.stream))


def _invalid_field(error: dict) -> ApiError:
    loc = error["loc"]
    field = str(loc[0]) if loc else None
    where = field + "".join(f"[{part}]" for part in loc[1:]) if loc else "body"
    if error["type"] == "extra_forbidden":
        message = f"unknown field {field!r}"
    elif error["type"] == "missing":
        message = f"{field} is required"
    else:
        message = f"{where}: {error['msg']}, got {_short(error.get('input'))}"
    return ApiError(422, "invalid_field", message, field)


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
