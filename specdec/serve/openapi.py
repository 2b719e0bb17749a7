"""The OpenAPI 3.0.3 description of the HTTP API, served at /openapi.json.

The request schema is generated from the pydantic model that validates requests (protocol.py), with this
server's limits patched in, so a client generator or a fuzzer (schemathesis) sees the real bounds. pydantic
writes JSON Schema 2020-12; `openapi30` restates it in OpenAPI 3.0's dialect (nullable, boolean exclusive
bounds), whose integers are JSON integers only, as the strict request models want them.
"""

from .config import Settings
from .errors import ERROR_TYPES
from .protocol import bound, bound_gamma, request_schema

FINISH_REASONS = ["length", "stop", "time_limit"]
SOURCES = ["draft", "lookup", "grammar", "resampled", "bonus", "target"]


def _nullable(type_: str) -> dict:
    return {"type": type_, "nullable": True}


def openapi30(schema):
    """A pydantic (JSON Schema 2020-12) schema in OpenAPI 3.0's dialect: `anyOf [X, null]` becomes X with
    `nullable: true` (a $ref X wrapped in allOf), a numeric exclusiveMinimum/Maximum becomes minimum/maximum with a
    boolean flag, `const` becomes a one-value enum, one patternProperties becomes additionalProperties (the keys'
    pattern is in the field's description), and the `title`s pydantic adds are dropped. A nullable enum lists
    null, as OpenAPI 3.0.3 asks."""
    if isinstance(schema, list):
        return [openapi30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    branches = schema.get("anyOf")
    if branches and {"type": "null"} in branches and len(branches) == 2:
        (other,) = [branch for branch in branches if branch != {"type": "null"}]
        if "$ref" in other:  # 3.0 ignores the siblings of a $ref
            other = {"allOf": [other]}
        schema = {**{k: v for k, v in schema.items() if k != "anyOf"}, **other, "nullable": True}
    elif branches and {"type": "null"} in branches:
        schema = {**schema, "anyOf": [branch for branch in branches if branch != {"type": "null"}], "nullable": True}
    schema = {key: openapi30(value) for key, value in schema.items() if key != "title"}
    if "const" in schema:  # 3.0 has no const
        schema["enum"] = [schema.pop("const")]
    patterns = schema.pop("patternProperties", None)
    if patterns and len(patterns) == 1:  # 3.0 has no patternProperties: the values' schema stays, not the keys'
        schema["additionalProperties"] = next(iter(patterns.values()))
    if schema.get("type") == "null":  # null only
        schema = {**{k: v for k, v in schema.items() if k != "type"}, "nullable": True, "enum": [None]}
    for exclusive, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        value = schema.get(exclusive)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            schema[inclusive], schema[exclusive] = value, True
    if schema.get("default", 0) is None:
        del schema["default"]
    if schema.get("nullable") is True and "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]  # 3.0.3: an enum beside nullable must list null to allow it
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
            "logprobs": {"type": "array", "items": {"$ref": "#/components/schemas/PredictTokenLogprob"},
                         "description": "with logprobs: one per token of the text"},
        },
    },
    "PredictTokenLogprob": {
        "type": "object", "required": ["id", "token", "logprob", "top_logprobs"],
        "description": "the target's log-probability of a token (log-softmax of its raw logits, before "
                       "temperature, top-k and top-p) and the most likely alternatives",
        "properties": {"id": {"type": "integer"}, "token": {"type": "string"}, "logprob": {"type": "number"},
                       "top_logprobs": {"type": "array", "items": {
                           "type": "object", "required": ["id", "token", "logprob"],
                           "properties": {"id": {"type": "integer"}, "token": {"type": "string"},
                                          "logprob": {"type": "number"}}}}},
    },
    "Ready": {
        "type": "object", "required": ["status", "models", "device", "dtype", "context_length"],
        "properties": {"status": {"type": "string", "enum": ["ready"]},
                       "models": {"type": "object", "required": ["draft", "target"],
                                  "properties": {"draft": {"type": "string"}, "target": {"type": "string"}}},
                       "device": {"type": "string"}, "dtype": {"type": "string"},
                       "context_length": _nullable("integer"),
                       "prompt_cache_bytes": {"type": "integer", "minimum": 0,
                                              "description": "the prompt cache's byte budget in force (0: off)"},
                       "load_seconds": {"type": "number", "description": "from the start of loading to ready, "
                                                                         "warm-up included"},
                       "resident_memory_bytes": {**_nullable("integer"),
                                                 "description": "the process's resident memory when it got ready"},
                       "peak_resident_memory_bytes": {"type": "integer",
                                                      "description": "the most it had while loading"}},
    },
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string", "enum": ["ok"]}}},
}

# One Server-Sent Event of a streamed answer (what schemathesis validates each event against).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": (
                 'a JSON object: {"text"} (and "tokens" with details, "logprobs" with logprobs) per round; the '
                 'last one adds finish_reason, usage and stats, or is {"error": {...}} if decoding failed after the stream started')}}}

_REQUEST_ID = {"X-Request-ID": {"description": "the client's X-Request-ID if it sent a plain one, else a new id",
                                "schema": {"type": "string"}}}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}


def _error(description: str, retry_after: bool = False) -> dict:
    headers = {**_REQUEST_ID, **(_RETRY_AFTER if retry_after else {})}
    return {"description": description, "headers": headers,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _ok(description: str, content: dict) -> dict:
    return {"description": description, "headers": _REQUEST_ID, "content": content}


def openapi_document(settings: Settings, served_model: str | None = None, vocab_size: int | None = None) -> dict:
    """The OpenAPI 3.0.3 document for a server running with `settings` (and serving `served_model`, once
    loaded: the one model id the /v1 routes accept, and its vocabulary of `vocab_size` tokens: the token ids
    requests may name)."""
    json_of = lambda ref: {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}  # noqa: E731
    predict_responses = {
        "200": _ok("the completion: JSON, or with `stream` Server-Sent Events (`data: {...}` per round, then a "
                   "final event with finish_reason, usage and stats)",
                   {**json_of("PredictResponse"), "text/event-stream": {"schema": SSE_EVENT}}),
        "400": _error("invalid_json: the body is not UTF-8 JSON, or not a JSON object"),
        "408": _error(f"body_timeout: the body did not arrive within {settings.body_timeout:g} s"),
        "413": _error(f"body_too_large: the body is over {settings.max_body_bytes} bytes"),
        "415": _error("unsupported_media_type: the body is not application/json"),
        "422": _error("invalid_field or prompt_too_long; `field` names the offending field"),
        "500": _error("internal_error: an unexpected failure; the message gives the request id"),
        "503": _error("overloaded (queue full or waited too long), not_ready, or shutting_down (the server is "
                      "draining after SIGTERM)", retry_after=True),
    }
    keyed = bool(settings.api_keys_file.strip())
    openai_paths, openai_schemas = openai_document(settings, served_model, keyed, vocab_size)
    predict = request_schema(settings)
    _in_vocabulary(predict["properties"]["stop_token_ids"], vocab_size)
    predict_parts = predict.pop("$defs", {})  # the shapes it shares with /v1 (response_format, ...)
    metrics_responses = {"200": _ok("Prometheus text format", {"text/plain": {"schema": {"type": "string"}}})}
    if keyed:  # auth.py: every route but the open ones needs a key
        predict_responses["401"] = _error("unauthorized: no API key, or not a valid one (`WWW-Authenticate`)")
        if not settings.metrics_public:
            metrics_responses["401"] = predict_responses["401"]
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
                **({"security": [{"bearer": []}]} if keyed else {}),
            }},
            "/healthz": {"get": {"operationId": "healthz", "summary": "The process is running",
                                 "responses": {"200": _ok("alive", json_of("Health"))}}},
            "/readyz": {"get": {"operationId": "readyz", "summary": "The models are loaded",
                                "responses": {"200": _ok("ready", json_of("Ready")),
                                              "503": _error("not_ready (still loading, or loading failed) or "
                                                            "shutting_down (draining after SIGTERM)",
                                                            retry_after=True)}}},
            "/metrics": {"get": {"operationId": "metrics", "summary": "Prometheus metrics",
                                 "responses": metrics_responses,
                                 **({"security": [{"bearer": []}]} if keyed and not settings.metrics_public else {})}},
            "/openapi.json": {"get": {"operationId": "openapi", "summary": "This document",
                                      "responses": {"200": _ok("OpenAPI 3.0.3",
                                                               {"application/json": {"schema": {"type": "object"}}})}}},
            **openai_paths,
        },
        "components": {"schemas": {"PredictRequest": openapi30(predict),
                                   **{name: openapi30(schema) for name, schema in predict_parts.items()},
                                   "GenerationStats": openapi30(stats_schema()),
                                   **SCHEMAS, **openai_schemas},
                       **({"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}} if keyed else {})},
    }


def stats_schema() -> dict:
    """GenerationStats as JSON Schema, from the dataclass itself (pydantic's TypeAdapter reads its fields)."""
    from pydantic import TypeAdapter

    from ..stats import GenerationStats

    return TypeAdapter(GenerationStats).json_schema()


# --- the OpenAI-compatible routes (openai_routes.py) -----------------------------------------------------------

OPENAI_SSE_EVENT = {"type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string", "description": (
                        "a JSON chunk (Completion or ChatCompletionChunk); with stream_options.include_usage a last "
                        "chunk with empty choices and the usage; [DONE] at the end; an {\"error\": {...}} chunk "
                        "if decoding failed after the stream started")}}}


def openai_document(settings: Settings, served_model: str | None, keyed: bool = False,
                    vocab_size: int | None = None) -> tuple[dict, dict]:
    """The /v1 paths and their schemas, generated from the pydantic models of openai_protocol.py (requests as
    validated, answers as serialised), with this server's limits, model id and vocabulary size patched in;
    `keyed`: API keys are required (auth.py)."""
    from pydantic.json_schema import models_json_schema

    from .openai_protocol import ANSWER_MODELS, REQUEST_MODELS

    _, generated = models_json_schema([(model, "validation") for model in REQUEST_MODELS]
                                      + [(model, "serialization") for model in ANSWER_MODELS],
                                      ref_template="#/components/schemas/{model}")
    schemas = generated["$defs"]
    for name, max_fields in (("CompletionRequest", ("max_tokens",)),
                             ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens"))):
        props = schemas[name]["properties"]
        for field in max_fields:
            bound(props[field], settings.max_new_tokens_limit, f"default {settings.max_new_tokens}, or less if "
                                                               f"the context has less room")
        bound(props["min_tokens"], settings.max_new_tokens_limit)  # and at most the request's max_tokens
        bound_gamma(props["gamma"], settings)
        bound(props["n"], settings.max_prompts_per_request)
        if served_model is not None:
            props["model"]["enum"] = [served_model]
        _in_vocabulary(props["stop_token_ids"], vocab_size)
    _in_vocabulary(schemas["CompletionRequest"]["properties"]["prompt"], vocab_size)  # its token-id prompts
    _in_vocabulary(schemas["DetokenizeRequest"]["properties"]["tokens"], vocab_size)
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if branch.get("items", {}).get("type") in ("string", "array"):  # several prompts
            branch["maxItems"] = settings.max_prompts_per_request
    schemas = {name: openapi30(schema) for name, schema in schemas.items()}
    if served_model is not None:  # optional on the tokenizer routes: null (or left out) is the served model too
        for name in ("TokenizeRequest", "DetokenizeRequest"):
            schemas[name]["properties"]["model"]["enum"] = [served_model, None]

    ref = lambda name: {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}  # noqa: E731

    def error(description: str, retry_after: bool = False) -> dict:
        return {**_error(description, retry_after), "content": ref("OpenAIErrorResponse")}

    errors = {
        "400": error("invalid_request_error: `param` names the field; `code` is invalid_value, unsupported_value "
                     "(a feature this server does not implement), unknown_parameter, missing_required_parameter, "
                     "context_length_exceeded or invalid_json"),
        "404": error("model_not_found: `model` is not the served model"),
        "408": error(f"body_timeout: the body did not arrive within {settings.body_timeout:g} s"),
        "413": error(f"body_too_large: the body is over {settings.max_body_bytes} bytes"),
        "415": error("unsupported_media_type: the body is not application/json"),
        "500": error("server_error: an unexpected failure; the message gives the request id"),
        "503": error("overloaded (queue full or waited too long), not_ready, or shutting_down (draining after "
                     "SIGTERM)", retry_after=True),
    }
    not_ready = error("not_ready (still loading, or loading failed) or shutting_down (draining after SIGTERM)",
                      retry_after=True)  # the model routes' only 503s
    unauthorized = {"401": error("invalid_api_key: no API key, or not a valid one (`WWW-Authenticate`)")}
    security = {"security": [{"bearer": []}]} if keyed else {}

    def create(operation: str, summary: str, request: str, answer: str, chunk: str) -> dict:
        return {"post": {
            "operationId": operation, "summary": summary,
            "requestBody": {"required": True, "content": ref(request)},
            "responses": {"200": _ok(f"the {answer}, or with `stream` Server-Sent Events of {chunk} chunks",
                                     {**ref(answer), "text/event-stream": {"schema": OPENAI_SSE_EVENT}}),
                          **errors, **(unauthorized if keyed else {})},
            **security,
        }}

    def tokenizer(operation: str, summary: str, request: str, answer: str) -> dict:
        return {"post": {
            "operationId": operation, "summary": summary,
            "requestBody": {"required": True, "content": ref(request)},
            "responses": {"200": _ok(f"the {answer}", ref(answer)),
                          **{code: errors[code] for code in ("400", "404", "408", "413", "415", "500")},
                          "503": not_ready, **(unauthorized if keyed else {})},
            **security,
        }}

    paths = {
        "/v1/completions": create("createCompletion", "Complete a prompt (OpenAI-compatible)",
                                  "CompletionRequest", "Completion", "Completion"),
        "/v1/chat/completions": create("createChatCompletion", "Answer a conversation (OpenAI-compatible)",
                                       "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"),
        "/v1/models": {"get": {"operationId": "listModels", "summary": "The served model (OpenAI-compatible)",
                               "responses": {"200": _ok("the target model; the draft is in its metadata",
                                                        ref("ModelList")),
                                             "503": not_ready,
                                             **(unauthorized if keyed else {})},
                               **security}},
        "/tokenize": tokenizer("tokenize", "The token ids a prompt or a conversation becomes (vLLM's)",
                               "TokenizeRequest", "TokenizeResponse"),
        "/detokenize": tokenizer("detokenize", "The text of token ids, special tokens included (vLLM's)",
                                 "DetokenizeRequest", "DetokenizeResponse"),
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel", "summary": "The served model by its id (OpenAI-compatible)",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string", **({"enum": [served_model]} if served_model else {})},
                            "description": "the served model's id, as /v1/models lists it"}],
            "responses": {"200": _ok("the target model; the draft is in its metadata", ref("Model")),
                          "404": errors["404"],
                          "503": not_ready,
                          **(unauthorized if keyed else {})},
            **security}},
    }
    return paths, schemas


def _in_vocabulary(prop: dict, vocab_size: int | None) -> None:
    """The served vocabulary's bound on every token id a property's schema holds (its integers: the items of a
    list of ids, or of lists of ids); none while the models load (`vocab_size` None)."""
    if vocab_size is None:
        return
    if prop.get("type") == "integer":
        prop["maximum"] = vocab_size - 1
    for key in ("items", "anyOf"):
        for part in (prop[key] if isinstance(prop.get(key), list) else [prop.get(key)]):
            if isinstance(part, dict):
                _in_vocabulary(part, vocab_size)
