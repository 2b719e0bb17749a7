"""The OpenAPI 3.0 description of the HTTP API, served at /openapi.json.

Written by hand to say exactly what api.py accepts (strict types, no unknown fields, null for the default) and
filled with this server's limits, so a client generator or a fuzzer (schemathesis) sees the real bounds.
"""

from .api import MAX_STOP_CHARS, MAX_STOP_STRINGS, MIN_TEMPERATURE, NOT_BLANK_PATTERN
from .config import Settings

ERROR_TYPES = ["invalid_json", "not_found", "method_not_allowed", "body_too_large", "unsupported_media_type",
               "invalid_field", "prompt_too_long", "overloaded", "not_ready", "internal_error", "bad_request"]
FINISH_REASONS = ["length", "stop", "time_limit"]


def _nullable(schema: dict, description: str) -> dict:
    return {**schema, "nullable": True, "description": description}


def _request_schema(s: Settings) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["prompt"],
        "properties": {
            "prompt": {"type": "string", "minLength": 1, "pattern": NOT_BLANK_PATTERN,
                       "description": f"the text to complete; at most {s.max_prompt_tokens} tokens, and prompt "
                                      f"plus max_new_tokens must fit the model context"},
            "max_new_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": s.max_new_tokens_limit},
                                        f"default {s.max_new_tokens}"),
            "temperature": _nullable({"type": "number", "minimum": 0,
                                      "not": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                              "maximum": MIN_TEMPERATURE, "exclusiveMaximum": True}},
                                     f"0 is greedy, otherwise at least {MIN_TEMPERATURE:g}; default "
                                     f"{s.temperature:g}"),
            "top_k": _nullable({"type": "integer", "minimum": 0}, f"0 keeps every token; default {s.top_k}"),
            "top_p": _nullable({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
                               f"default {s.top_p:g}"),
            "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
                              "the same seed and request give the same completion; default random"),
            "gamma": _nullable({"type": "integer", "minimum": 1, "maximum": s.max_gamma},
                               "draft tokens proposed per round; default "
                               + ("adaptive" if s.gamma is None else str(s.gamma))),
            "method": _nullable({"type": "string", "enum": ["google", "deepmind", "target"]},
                                f"default {s.method}"),
            "stop": _nullable({"type": "array", "maxItems": MAX_STOP_STRINGS,
                               "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                              "the completion ends before the first one found"),
            "chat": _nullable({"type": "boolean"}, "wrap the prompt in the model's chat template"),
            "details": _nullable({"type": "boolean"}, "add the per-token list"),
            "stream": _nullable({"type": "boolean"}, "answer with Server-Sent Events"),
        },
    }


SCHEMAS = {
    "Error": {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["type", "message", "field"], "additionalProperties": False,
            "properties": {"type": {"type": "string", "enum": ERROR_TYPES}, "message": {"type": "string"},
                           "field": {"type": "string", "nullable": True}}}},
    },
    "Token": {
        "type": "object", "required": ["id", "text", "source"],
        "properties": {"id": {"type": "integer"}, "text": {"type": "string"},
                       "source": {"type": "string", "enum": ["draft", "resampled", "bonus", "target"]}},
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
            "stats": {"type": "object", "required": ["method", "seed"],
                      "properties": {"method": {"type": "string"}, "seed": {"type": "integer"},
                                     "acceptance_rate": {"type": "number", "nullable": True}}},
            "tokens": {"type": "array", "items": {"$ref": "#/components/schemas/Token"}},
        },
    },
    "Ready": {
        "type": "object", "required": ["status", "models", "device", "dtype", "context_length"],
        "properties": {"status": {"type": "string", "enum": ["ready"]},
                       "models": {"type": "object", "required": ["draft", "target"],
                                  "properties": {"draft": {"type": "string"}, "target": {"type": "string"}}},
                       "device": {"type": "string"}, "dtype": {"type": "string"},
                       "context_length": {"type": "integer", "nullable": True}},
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
        "components": {"schemas": {"PredictRequest": _request_schema(settings), **SCHEMAS}},
    }
