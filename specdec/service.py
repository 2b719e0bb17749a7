"""The HTTP service: a Flask application factory around one resident SpeculativeDecoder.

Models load once per process in a background thread started by `create_app` (under gunicorn: in the worker,
after fork), so /healthz answers at once and /readyz says 503 until the pair is resident. Requests go through
the engine one at a time (see scheduler.py). Every error leaves through one handler as JSON.
"""

import gc
import json
import logging
import os
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from flask import Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from .api import ApiError, Params, parse_predict, read_json_object
from .openapi import openapi_document
from .config import Settings, load_settings
from .detokenizer import Completion
from .engine import SpeculativeDecoder
from .errors import SpecDecError
from .kv_cache import input_device
from .metrics import Metrics
from .scheduler import Overloaded, Scheduler

logger = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
HTTP_ERROR_TYPES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
                    415: "unsupported_media_type"}
ENGINE_FIELDS = {"input_ids": "prompt"}  # engine argument -> request field


def create_app(config: Mapping | None = None) -> Flask:
    """The application. `config` overrides settings (see config.py), e.g. {"loader": fn} in tests."""
    settings = load_settings(config)
    app = Flask(__name__)
    # one byte of slack: werkzeug stops a chunked body at the limit without saying so; api.py checks the length
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes + 1
    app.json.sort_keys = False
    app.json.ensure_ascii = False
    service = Service(settings)
    app.extensions["specdec"] = service

    @app.before_request
    def start_record():
        sent = request.headers.get("X-Request-ID", "")
        g.record = RequestRecord(sent if REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex)

    @app.after_request
    def finish_record(response):
        record = g.record
        record.status = response.status_code
        if request.url_rule is not None:
            record.endpoint = request.url_rule.rule
        elif response.status_code == 405:  # a known path: the label set stays bounded
            record.endpoint = request.path
        record.route = f"{request.method} {request.path}"
        response.headers["X-Request-ID"] = record.request_id
        if response.is_streamed:
            response.call_on_close(lambda: service.finish(record))
        else:
            service.finish(record)
        return response

    @app.errorhandler(Exception)
    def error_response(error):
        api_error = to_api_error(error, g.get("record"))
        if g.get("record"):
            g.record.error = api_error.type
        return jsonify(api_error.body()), api_error.status, api_error.headers

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz():
        service.require_ready()
        return {"status": "ready", **service.info}

    @app.get("/metrics")
    def metrics():
        body, content_type = service.metrics.render()
        return Response(body, content_type=content_type)

    @app.get("/openapi.json")
    def openapi():
        return openapi_document(settings)

    @app.post("/predict")
    def predict():
        params = parse_predict(read_json_object(request, settings.max_body_bytes), settings)
        return service.predict(params, g.record)

    service.start_loading()
    return app


def to_api_error(error: Exception, record: "RequestRecord | None") -> ApiError:
    """Any exception as the ApiError to answer with; unexpected ones are logged with the request id."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, SpecDecError):
        return ApiError(422, "invalid_field", error.message, ENGINE_FIELDS.get(error.field, error.field))
    if isinstance(error, HTTPException) and error.code and error.code < 500:
        if error.code == 404:
            message = f"no such route: {request.path}"
        elif error.code == 405:
            message = f"{request.method} is not allowed on {request.path}"
        elif error.code == 413:
            message = f"the request body is over the limit of {current_app.config['MAX_CONTENT_LENGTH'] - 1} bytes"
        else:
            message = error.description
        headers = {k: v for k, v in error.get_headers() if k.lower() == "allow"}
        return ApiError(error.code, HTTP_ERROR_TYPES.get(error.code, "bad_request"), message, headers=headers)
    request_id = record.request_id if record else "-"
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        logger.error("request_id=%s ran out of memory", request_id, exc_info=error)
        _release_memory()
        return ApiError(500, "internal_error", f"the server ran out of memory for this request; quote request id "
                                               f"{request_id} when reporting it")
    logger.error("request_id=%s failed with an unexpected error", request_id, exc_info=error)
    return ApiError(500, "internal_error", f"internal error; quote request id {request_id} when reporting it")


def _release_memory() -> None:
    """After an out-of-memory error: free what the failed request held, so the next one starts clean."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass
class RequestRecord:
    """What the per-request log line and the request metrics say about one request."""

    request_id: str
    started: float = field(default_factory=time.perf_counter)
    status: int | None = None
    endpoint: str = "unmatched"
    route: str = ""
    error: str | None = None
    method: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    acceptance_rate: float | None = None
    finish_reason: str | None = None
    generation: "Generation | None" = None
    done: bool = False


class Service:
    """Per-app state: settings, metrics, the scheduler, and (once loaded) the decoder and tokenizer."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.scheduler = Scheduler(settings.queue_size, settings.queue_timeout, self.metrics.queue_changed)
        self.decoder: SpeculativeDecoder | None = None
        self.tokenizer = None
        self.eos_token_ids: list[int] = []
        self.info: dict = {}
        self.load_error: str | None = None
        self._loaded = threading.Event()
        self._load_lock = threading.Lock()
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._tokenizer_lock = threading.Lock()  # fast tokenizers are not safe for concurrent use

    # --- loading -------------------------------------------------------------------------------------------

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="specdec-load", daemon=True).start()

    def wait_until_loaded(self, timeout: float | None = None) -> bool:
        """True once loading has finished (successfully or not) within `timeout` seconds."""
        return self._loaded.wait(timeout)

    def on_load_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(message)` if loading fails (at once, if it already has). gunicorn exits the worker."""
        with self._load_lock:
            if self.load_error is None:
                self._failure_callbacks.append(callback)
                return
        callback(self.load_error)

    def _load(self) -> None:
        s = self.settings
        start = time.perf_counter()
        logger.info("loading draft %s and target %s (device %s, dtype %s)", s.draft_model, s.target_model,
                    s.device, s.dtype)
        try:
            draft, target, tokenizer = (s.loader or _load_pair)(s)
            decoder = SpeculativeDecoder(draft, target, tokenizer)
            eos = {tokenizer.eos_token_id} | _ids(getattr(getattr(target, "generation_config", None),
                                                          "eos_token_id", None))
            self.eos_token_ids = sorted(t for t in eos if t is not None)
            warmup = tokenizer.encode("Hello", add_special_tokens=False)[:1] or [0]
            decoder.generate(warmup, max_new_tokens=2, method=s.method, gamma=s.gamma, temperature=0)
            self.info = {"models": {"draft": _name(draft, s.draft_model), "target": _name(target, s.target_model)},
                         "device": str(input_device(target)), "dtype": str(target.dtype).removeprefix("torch."),
                         "context_length": decoder.context_length}
            self.tokenizer, self.decoder = tokenizer, decoder
            self.metrics.ready.set(1)
            logger.info("models ready in %.1f s: %s", time.perf_counter() - start, json.dumps(self.info))
        except Exception as error:  # noqa: BLE001 - any failure must be reported, and stops a gunicorn worker
            message = str(error) if isinstance(error, SpecDecError) else f"{type(error).__name__}: {error}"
            logger.error("model loading failed: %s", message, exc_info=not isinstance(error, SpecDecError))
            with self._load_lock:
                self.load_error = message
                callbacks = list(self._failure_callbacks)
            for callback in callbacks:
                callback(message)
        finally:
            self._loaded.set()

    def require_ready(self) -> None:
        if self.decoder is not None:
            return
        if self.load_error is not None:  # the reason (paths and all) is in the log, not in answers
            raise ApiError(503, "not_ready", "model loading failed; the server log says why")
        raise ApiError(503, "not_ready", "the models are still loading",
                       headers={"Retry-After": str(self.settings.retry_after)})

    # --- requests ------------------------------------------------------------------------------------------

    def decode(self, token_ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def encode(self, params: Params) -> list[int]:
        """The prompt's token ids (through the chat template if asked), checked against the length limits."""
        tokenizer = self.tokenizer
        with self._tokenizer_lock:
            if params.chat:
                if not getattr(tokenizer, "chat_template", None):
                    raise ApiError(422, "invalid_field", "this model has no chat template", "chat")
                text = tokenizer.apply_chat_template([{"role": "user", "content": params.prompt}], tokenize=False,
                                                     add_generation_prompt=True)
                ids = tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = tokenizer.encode(params.prompt, add_special_tokens=True)
        if not ids:
            raise ApiError(422, "invalid_field", "the prompt encodes to no tokens", "prompt")
        if len(ids) > self.settings.max_prompt_tokens:
            raise ApiError(422, "prompt_too_long", f"the prompt has {len(ids)} tokens; the limit is "
                                                   f"{self.settings.max_prompt_tokens}", "prompt")
        context = self.decoder.context_length
        if context is not None and len(ids) + params.max_new_tokens > context:
            raise ApiError(422, "prompt_too_long",
                           f"the prompt has {len(ids)} tokens and max_new_tokens is {params.max_new_tokens}, but "
                           f"the model context holds {context} tokens", "prompt")
        return ids

    def predict(self, params: Params, record: RequestRecord) -> Response:
        self.require_ready()
        record.method = params.method
        prompt_ids = self.encode(params)
        record.prompt_tokens = len(prompt_ids)
        seed = secrets.randbits(63) if params.seed is None else params.seed
        try:
            slot = self.scheduler.acquire()
        except Overloaded as error:
            raise ApiError(503, "overloaded", str(error),
                           headers={"Retry-After": str(self.settings.retry_after)}) from None
        try:
            stream = self.decoder.stream(prompt_ids, max_new_tokens=params.max_new_tokens, method=params.method,
                                         gamma=params.gamma, temperature=params.temperature, top_k=params.top_k,
                                         top_p=params.top_p, seed=seed, eos_token_id=self.eos_token_ids)
        except BaseException:
            slot.release()
            raise
        generation = record.generation = Generation(self, params, prompt_ids, seed, stream, slot, record)
        if params.stream:
            # A client that stops reading would block a write, and hold the engine, for ever: under gunicorn, no
            # write of this stream may block longer than the time budget (gunicorn resets it for the next request).
            sock = request.environ.get("gunicorn.socket")
            if sock is not None:
                sock.settimeout(self.settings.request_timeout)
            return Response(generation.events(), mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            generation.run()
        finally:
            generation.close()
        return jsonify(generation.body())

    def finish(self, record: RequestRecord) -> None:
        """End of a request (for a stream: when the server closes it): release, count, log one line."""
        if record.done:
            return
        record.done = True
        if record.generation is not None:
            record.generation.close()
        seconds = time.perf_counter() - record.started
        self.metrics.observe_request(record.endpoint, record.status or 0, seconds)
        rate = "-" if record.acceptance_rate is None else f"{record.acceptance_rate:.3f}"
        logger.info("request_id=%s %s status=%s prompt_tokens=%s completion_tokens=%s method=%s "
                    "acceptance_rate=%s seconds=%.3f finish_reason=%s error=%s", record.request_id, record.route,
                    record.status, _dash(record.prompt_tokens), _dash(record.completion_tokens),
                    _dash(record.method), rate, seconds, _dash(record.finish_reason), _dash(record.error))


class Generation:
    """One request's decoding: pulls chunks from the engine stream, assembles text, stops at stop strings.

    `close` stops the engine (closing its generator), releases the engine slot and records the outcome; it is
    idempotent and runs on every path: normal end, stop string, client disconnect, error.
    """

    def __init__(self, service: Service, params: Params, prompt_ids: list[int], seed: int, stream, slot, record):
        self.service, self.params, self.prompt_ids, self.seed = service, params, prompt_ids, seed
        self.stream, self.slot, self.record = stream, slot, record
        self.completion = Completion(service.decode, prompt_ids, params.stop)
        self.result = None
        self.chunks = self.new_tokens = self.accepted = 0
        self.started = time.perf_counter()
        self.deadline = self.started + service.settings.request_timeout  # the engine is ours until then
        self.timed_out = False
        self.closed = False
        self._close_lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.result is not None or self.completion.stopped

    def step(self) -> list[dict] | None:
        """Decode one round; the tokens it kept, or None when decoding has ended."""
        if self.done:
            return None
        try:
            chunk = next(self.stream)
        except StopIteration as end:
            self.result = end.value
            self.completion.finish()
            return None
        self.chunks += 1
        self.new_tokens += len(chunk.token_ids)
        self.accepted += chunk.sources.count("draft")
        kept = self.completion.feed(chunk.token_ids, chunk.sources)
        if self.completion.stopped:  # a stop string: no more rounds, but keep the engine's stats
            self._end()
        elif time.perf_counter() > self.deadline and not self._finished_by(chunk):  # the time budget is spent
            self.timed_out = True
            self._end()
            self.completion.finish()
        return kept

    def _end(self) -> None:
        """End decoding after the round just committed; the engine returns its result (and stats)."""
        try:
            self.stream.send("stop")
        except StopIteration as end:
            self.result = end.value

    def _finished_by(self, chunk) -> bool:
        """Whether this round ended decoding anyway (max_new_tokens reached, or an end-of-sequence token)."""
        return (self.new_tokens >= self.params.max_new_tokens
                or bool(chunk.token_ids) and chunk.token_ids[-1] in self.service.eos_token_ids)

    def run(self) -> None:
        while self.step() is not None:
            pass

    def finish_reason(self) -> str | None:
        if self.completion.stopped:
            return "stop"
        if self.timed_out:
            return "time_limit"
        return self.result.finish_reason if self.result is not None else None

    def stats(self) -> dict:
        if self.result is not None:
            stats = dict(self.result.stats)
        else:  # abandoned (client gone, error): the engine's own counters are gone, so count from the chunks
            total = time.perf_counter() - self.started
            speculative = self.params.method in ("google", "deepmind")
            stats = {"method": self.params.method, "gamma": self.params.gamma if speculative else None,
                     "seed": self.seed, "prompt_tokens": len(self.prompt_ids), "new_tokens": self.new_tokens,
                     "proposed": None, "accepted": self.accepted if speculative else 0, "acceptance_rate": None,
                     "tokens_per_target_forward": self.new_tokens / self.chunks if self.chunks else None,
                     "rounds": self.chunks, "target_forwards": self.chunks, "total_seconds": total,
                     "tokens_per_second": self.new_tokens / total if total > 0 else None}
        stats["queue_seconds"] = self.slot.waited
        return stats

    def usage(self) -> dict:
        completion = len(self.completion.tokens)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(self.prompt_ids) + completion}

    def body(self) -> dict:
        body = {"text": self.completion.text, "finish_reason": self.finish_reason(), "usage": self.usage(),
                "stats": self.stats()}
        if self.params.details:
            body["tokens"] = self.completion.tokens
        return body

    def events(self):
        """Server-Sent Events: one per committed chunk, then one with finish_reason, usage and stats."""
        try:
            while (kept := self.step()) is not None:
                event = {"text": self.completion.take()}
                if self.params.details:
                    event["tokens"] = kept
                yield _sse(event)
            yield _sse({"text": self.completion.take(), "finish_reason": self.finish_reason(),
                        "usage": self.usage(), "stats": self.stats()})
        except Exception as error:  # the status line is sent already: report in-band, keep serving
            api_error = to_api_error(error, self.record)
            self.record.error = api_error.type
            yield _sse(api_error.body())
        finally:
            self.close()

    def close(self) -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        try:
            self.stream.close()
        finally:
            self.slot.release()
        record = self.record
        record.completion_tokens = len(self.completion.tokens)
        record.finish_reason = self.finish_reason() or "cancelled"
        stats = self.stats()
        record.acceptance_rate = stats.get("acceptance_rate")
        self.service.metrics.observe_generation(len(self.prompt_ids), stats)


def _load_pair(settings: Settings):
    from . import load_pair  # the model-loading stack is imported only when a pair is loaded

    return load_pair(draft=settings.draft_model, target=settings.target_model, device=settings.device,
                     dtype=settings.dtype, draft_quantization=settings.draft_quantization)


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _name(model, configured: str) -> str:
    """The model's name for /readyz: a Hugging Face id as is, a local folder or file by its last component only
    (answers never show server paths)."""
    name = str(getattr(model, "name_or_path", None) or configured)
    return os.path.basename(os.path.normpath(name)) if os.path.exists(name) else name


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
