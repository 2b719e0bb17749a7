"""The OpenAI-compatible routes, as a second Blueprint under /v1: /v1/completions, /v1/chat/completions and
/v1/models.

They share everything with /predict: the body limits, the engine and its queue (Service.generation), the
request id, the log line and the metrics. Only the shapes differ (openai_protocol.py): each answer is built from
the same Generation, as one JSON object or as OpenAI's Server-Sent Events.
"""

import time
from dataclasses import dataclass

from flask import Blueprint, current_app, g, request

from .errors import ApiError, to_api_error
from .generation import Generation, sse
from .openai_protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChoiceDelta,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionUsage,
    Model,
    ModelList,
    ModelMetadata,
    SpeculativeDecodingStats,
    fingerprint,
    openai_error,
    parse,
)
from .protocol import read_json_object

openai_routes = Blueprint("openai", __name__, url_prefix="/v1")
DONE = "data: [DONE]\n\n"


def service():
    return current_app.extensions["specdec"]


def served_model(svc) -> str:
    """The id clients name the pair by: the target's display name (the draft is in the model's metadata)."""
    return svc.models.info["models"]["target"]


@openai_routes.record_once
def _created(state):
    state.app.extensions["specdec.openai.created"] = int(time.time())


def model_card(svc) -> Model:
    """The served model as /v1/models describes it: the target's id, the draft and the defaults in its metadata."""
    info, sampling = svc.models.info, svc.settings.sampling
    return Model(id=served_model(svc), created=current_app.extensions["specdec.openai.created"],
                 max_model_len=info["context_length"],
                 metadata=ModelMetadata(draft=info["models"]["draft"], target=info["models"]["target"],
                                        device=info["device"], dtype=info["dtype"], method=sampling.method,
                                        gamma=sampling.gamma, drafter=sampling.drafter,
                                        verification=sampling.verification,
                                        draft_confidence_threshold=sampling.draft_confidence_threshold))


@openai_routes.get("/models")
def models():
    svc = service()
    svc.require_ready(g.record.started)
    return ModelList(data=[model_card(svc)]).model_dump()


@openai_routes.get("/models/<path:model>")  # a hub id has a slash in it
def retrieve_model(model: str):
    svc = service()
    check_model(svc, model)
    return model_card(svc).model_dump()


@openai_routes.post("/completions")
def completions():
    svc = service()
    req = parse(CompletionRequest, read_json_object(request, svc.settings.max_body_bytes, svc.settings.body_timeout))
    sampling = req.sampling(svc.settings)
    check_model(svc, req.model)
    prompt_ids = svc.encode(req.prompt_text, field_name="prompt")
    return answer(svc, req, prompt_ids, sampling, "prompt", chat=False)


@openai_routes.post("/chat/completions")
def chat_completions():
    svc = service()
    req = parse(ChatCompletionRequest, read_json_object(request, svc.settings.max_body_bytes,
                                                        svc.settings.body_timeout))
    sampling = req.sampling(svc.settings)
    check_model(svc, req.model)
    prompt_ids = svc.encode(messages=req.chat_messages(), field_name="messages")
    return answer(svc, req, prompt_ids, sampling, "messages", chat=True)


def check_model(svc, name: str) -> None:
    svc.require_ready(g.record.started)
    if name != served_model(svc):
        raise ApiError(404, "model_not_found", f"the model {name!r} does not exist; this server serves "
                                               f"{served_model(svc)!r} (see /v1/models)", "model")


def answer(svc, req, prompt_ids: list[int], sampling, prompt_field: str, chat: bool):
    """Fit the completion into the context, start the generation, answer as JSON or as a stream."""
    sampling = sampling.replace(max_new_tokens=room(svc, prompt_ids, sampling.max_new_tokens,
                                                    req.requested_max_tokens is not None, req.max_tokens_field,
                                                    prompt_field))
    generation = svc.generation(prompt_ids, sampling, g.record, req.stop_strings)
    reply = Reply(chat=chat, id=("chatcmpl-" if chat else "cmpl-") + g.record.request_id, created=int(time.time()),
                  model=served_model(svc), fingerprint=fingerprint(svc.models.info, svc.settings),
                  include_usage=req.include_usage)
    return svc.respond(generation, bool(req.stream), events=reply.events, body=reply.body)


def room(svc, prompt_ids: list[int], max_tokens: int, requested: bool, max_field: str, prompt_field: str) -> int:
    """The completion's token budget: the one requested, if prompt and completion fit the context; else, when
    the request left it to the server, the configured default cut to what the context leaves."""
    context = svc.decoder.context_length
    if context is None or len(prompt_ids) + max_tokens <= context:
        return max_tokens
    left = context - len(prompt_ids)
    if not requested and left >= 1:
        return left
    raise ApiError(400, "prompt_too_long", f"this model's maximum context length is {context} tokens, but "
                                           f"{len(prompt_ids) + max_tokens} were requested ({len(prompt_ids)} in the "
                                           f"{prompt_field}, {max_tokens} for the completion, {max_field})",
                   prompt_field)


def finish_reason(generation: Generation) -> str:
    return "stop" if generation.finish_reason() == "stop" else "length"  # a time limit cut it short too


@dataclass(frozen=True)
class Reply:
    """How one /v1 request is answered: its id, time and model, and the shapes of its choice."""

    chat: bool
    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool

    def _header(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}

    def body(self, generation: Generation) -> dict:
        """The whole answer, as one JSON object."""
        text, reason = generation.completion.text, finish_reason(generation)
        stats = SpeculativeDecodingStats.of(generation.stats())
        usage = CompletionUsage(**generation.usage())
        if self.chat:
            choice = ChatChoice(index=0, message=ChatCompletionMessage(content=text), finish_reason=reason,
                                speculative_decoding_stats=stats)
            return ChatCompletion(**self._header(), choices=[choice], usage=usage).model_dump()
        choice = CompletionChoice(index=0, text=text, finish_reason=reason, speculative_decoding_stats=stats)
        return Completion(**self._header(), choices=[choice], usage=usage).model_dump()

    def _chunk(self, text: str | None, reason: str | None = None, stats=None, role: bool = False,
               usage: dict | None = None) -> str:
        if usage is not None:
            choices = []
        elif self.chat:
            delta = ChoiceDelta(role="assistant" if role else None, content=text)
            choices = [ChunkChoice(index=0, delta=delta, finish_reason=reason, speculative_decoding_stats=stats)]
        else:
            choices = [CompletionChoice(index=0, text=text, finish_reason=reason, speculative_decoding_stats=stats)]
        kind = ChatCompletionChunk if self.chat else Completion
        chunk = kind(**self._header(), choices=choices,
                     usage=None if usage is None else CompletionUsage(**usage))
        return sse(chunk.model_dump(exclude=None if self.include_usage else {"usage"}))

    def events(self, generation: Generation):
        """OpenAI's stream: a chunk per decoded round that adds text (a chat stream starts with the role),
        finish_reason and the stats on the last content chunk, the usage chunk if asked for, then [DONE]. Text
        that may turn out to be the start of a stop string is held back until it is known not to be."""
        try:
            if self.chat:
                yield self._chunk("", role=True)
            last = ""  # the text of the round that ended decoding: it goes with finish_reason
            while generation.step() is not None:
                text = generation.completion.take()
                if generation.final:
                    last += text
                elif text or last:
                    yield self._chunk(last + text)
                    last = ""
            last += generation.completion.take()
            yield self._chunk(last, finish_reason(generation), SpeculativeDecodingStats.of(generation.stats()))
            if self.include_usage:
                yield self._chunk(None, usage=generation.usage())
            yield DONE
        except Exception as error:  # the status line is sent already: report in-band, as OpenAI does
            api_error = to_api_error(error, generation.record.request_id)
            generation.record.error = api_error.type
            yield sse(openai_error(api_error)[0])
            yield DONE
        finally:
            generation.close()

