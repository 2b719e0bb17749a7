"""The OpenAPI 3.0.3 description of the HTTP API, served at /openapi.json.

The request schema is generated from the pydantic model that validates requests (protocol.py), with this
server's limits patched in, so a client generator or a fuzzer (schemathesis) sees the real bounds. pydantic
writes JSON Schema 2020-12; `openapi30` restates it in OpenAPI 3.0's dialect (nullable, boolean exclusive
bounds), whose integers are JSON integers only, as the strict request models want them.
"""

from .config import Settings
from .errors import ERROR_TYPES
from .protocol import request_schema

FINISH_REASONS = ["length", "stop", "time_limit"]
SOURCES = ["draft", "lookup", "resampled", "bonus", "target"]


def _nullable(type_: str) -> dict:
    return {"type": type_, "nullable": True}


def openapi30(schema):
    """A pydantic (JSON Schema 2020-12) schema in OpenAPI 3.0's dialect: `anyOf [X, null]` becomes X with
    `nullable: true`, a numeric exclusiveMinimum/Maximum becomes minimum/maximum with a boolean flag, and the
    `title`s pydantic adds are dropped."""
    if isinstance(schema, list):
        return [openapi30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: openapi30(value) for key, value in schema.items() if key != "title"}
    branches = schema.get("anyOf")
    if branches and {"type": "null"} in branches and len(branches) == 2:
        (other,) = [branch for branch in branches if branch != {"type": "null"}]
        schema = {**{k: v for k, v in schema.items() if k != "anyOf"}, **other, "nullable": True}
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = schema.get(exclusive)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            schema[bound], schema[exclusive] = value, True
    if schema.get("default", 0) is None:
        del schema["default"]
    return schema


SCHEMAS = {
    "Error": {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["type", "message", "field"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ERROR_TYPES}, "message": {"type": "string"},
                           "field": _nullable("string")}}},
    },
    "Token": {
        "type": "object", "required": ["id", "text", "source"],
        "properties": {"id": {"type": "integer"}, "text": {"type": "string"},
                       "source": {"type": "string", "enum": SOURCES}},
    },
    "Usage": {
        "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {name: {"type": "integer", "minimum": 0}
                       for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
    },
    "PredictResponse": {
        "type": "object", "required": ["text", "finish_reason", "usage", "stats"],
        "properties": {
            "text": {"type": "string"},
            "finish_reason": {"type": "string", "enum": FINISH_REASONS},
            "usage": {"$ref": "#/components/schemas/Usage"},
            "stats": {"$ref": "#/components/schemas/GenerationStats"},
            "tokens": {"type": "array", "items": {"$ref": "#/components/schemas/Token"}},
        },
    },
    "Ready": {
        "type": "object", "required": ["status", "models", "device", "dtype", "context_length"],
        "properties": {"status": {"type": "string", "enum": ["ready"]},
                       "models": {"type": "object", "required": ["draft", "target"],
                                  "properties": {"draft": {"type": "string"}, "target": {"type": "string"}}},
                       "device": {"type": "string"}, "dtype": {"type": "string"},
                       "context_length": _nullable("integer")},
    },
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string", "enum": ["ok"]}}},
}

# One Server-Sent Event of a streamed answer (what schemathesis validates each event against).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": (
                 'a JSON object: {"text"} (and "tokens" with details) per round; the last one adds finish_reason, '
                 'usage and stats, or is {"error": {...}} if decoding failed after the stream started')}}}

_REQUEST_ID = {"X-Request-ID": {"description": "the client's X-Request-ID if it sent a plain one, else a new id",
                                "schema": {"type": "string"}}}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}


def _error(description: str, retry_after: bool = False) -> dict:
    headers = {**_REQUEST_ID, **(_RETRY_AFTER if retry_after else {})}
    return {"description": description, "headers": headers,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _ok(description: str, content: dict) -> dict:
    return {"description": description, "headers": _REQUEST_ID, "content": content}


def openapi_document(settings: Settings) -> dict:
    """The OpenAPI 3.0.3 document for a server running with `settings`."""
    json_of = lambda ref: {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}  # noqa: E731
    predict_responses = {
        "200": _ok("the completion: JSON, or with `stream` Server-Sent Events (`data: {...}` per round, then a "
                   "final event with finish_reason, usage and stats)",
                   {**json_of("PredictResponse"), "text/event-stream": {"schema": SSE_EVENT}}),
        "400": _error("invalid_json: the body is not UTF-8 JSON, or not a JSON object"),
        "413": _error(f"body_too_large: the body is over {settings.max_body_bytes} bytes"),
        "415": _error("unsupported_media_type: the body is not application/json"),
        "422": _error("invalid_field or prompt_too_long; `field` names the offending field"),
        "500": _error("internal_error: an unexpected failure; the message gives the request id"),
        "503": _error("overloaded (queue full or waited too long) or not_ready", retry_after=True),
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "specdec", "version": "1",
                 "description": f"Exact speculative decoding. Requests decode one at a time; "
                                f"up to {settings.queue_size} wait, each for at most {settings.queue_timeout:g} s; "
                                f"a request decodes for at most {settings.request_timeout:g} s."},
        "paths": {
            "/predict": {"post": {
                "operationId": "predict", "summary": "Complete a prompt",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/PredictRequest"}}}},
                "responses": predict_responses,
            }},
            "/healthz": {"get": {"operationId": "healthz", "summary": "The process is running",
                                 "responses": {"200": _ok("alive", json_of("Health"))}}},
            "/readyz": {"get": {"operationId": "readyz", "summary": "The models are loaded",
                                "responses": {"200": _ok("ready", json_of("Ready")),
                                              "503": _error("not_ready: still loading, or loading failed",
                                                            retry_after=True)}}},
            "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                                 "responses": {"200": _ok("Prometheus text format",
                                                          {"text/plain": {"schema": {"type": "string"}}})}}},
            "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                      "responses": {"200": _ok("OpenAPI 3.0.3",
                                                               {"application/json": {"schema": {"type": "object"}}})}}},
        },
        "components": {"schemas": {"PredictRequest": openapi30(request_schema(settings)),
                                   "GenerationStats": openapi30(stats_schema()),
                                   **SCHEMAS}},
    }


def stats_schema() -> dict:
    """GenerationStats as JSON Schema, from the dataclass itself (pydantic's TypeAdapter reads its fields)."""
    from pydantic import TypeAdapter

    from ..stats import GenerationStats

    return TypeAdapter(GenerationStats).json_schema()
