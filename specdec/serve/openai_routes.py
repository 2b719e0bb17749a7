"""The OpenAI-compatible routes, as a second Blueprint under /v1: /v1/completions, /v1/chat/completions and
/v1/models.

They share everything with /predict: the body limits, the engine and its queue (Service.generation), the
request id, the log line and the metrics. Only the shapes differ (openai_protocol.py): each answer is built from
the same Generation, as one JSON object or as OpenAI's Server-Sent Events.
"""

import threading
import time
from dataclasses import dataclass, field

from flask import Blueprint, current_app, g, request

from ..errors import SpecDecError
from ..params import choice_seed
from ..text import token_pieces
from .errors import ApiError, to_api_error
from .generation import Generation, sse, text_template
from .openai_protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
    FunctionCallDelta,
    Model,
    ModelList,
    ModelMetadata,
    SpeculativeDecodingStats,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    fingerprint,
    openai_error,
    parse,
)
from .protocol import read_json_object
from .structured import ToolCallReader, parse_tool_calls, stream_pieces

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
    prompts, limit = req.prompts, svc.settings.max_prompts_per_request
    if len(prompts) > limit:
        raise ApiError(400, "invalid_value", f"prompt: at most {limit} prompts may be sent in one request, got "
                                             f"{len(prompts)}", "prompt")
    check_choices(req, len(prompts), limit)
    grammar = svc.grammar(constrained(req, svc))
    if req.suffix:  # fill in the middle: each prompt before the suffix
        prompt_ids = [svc.encode_infill(svc.check_vocabulary(prompt, "prompt") if isinstance(prompt, list) else prompt,
                                        req.suffix) for prompt in prompts]
    else:
        prompt_ids = [svc.check_token_ids(prompt, "prompt") if isinstance(prompt, list)
                      else svc.encode(prompt, field_name="prompt") for prompt in prompts]
    # a token-id prompt echoes as /detokenize gives it: its special tokens' text kept, as its logprobs' tokens show
    echoes = [prompt if isinstance(prompt, str) else svc.detokenize(prompt) for prompt in prompts] if req.echo else None
    return answer(svc, req, prompt_ids, sampling, "prompt", chat=False, echoes=echoes, grammar=grammar)


@openai_routes.post("/chat/completions")
def chat_completions():
    svc = service()
    req = parse(ChatCompletionRequest, read_json_object(request, svc.settings.max_body_bytes,
                                                        svc.settings.body_timeout))
    sampling = req.sampling(svc.settings)
    check_model(svc, req.model)
    check_choices(req, 1, svc.settings.max_prompts_per_request)
    grammar = svc.grammar(constrained(req, svc))
    prompt_ids = svc.encode(messages=req.chat_messages(), field_name="messages", tools=req.template_tools(),
                            templating=req.templating())
    return answer(svc, req, [prompt_ids], sampling, "messages", chat=True, grammar=grammar)


def constrained(req, svc):
    """The request's constraint (structured outputs, or its tool calls' grammar); a 400 naming the field that
    cannot make one."""
    try:
        return req.constraint(svc.special_tool_tokens)
    except SpecDecError as error:
        raise ApiError(400, "invalid_value", error.message, error.field) from None


def check_choices(req, prompts: int, limit: int) -> None:
    """n choices for each prompt: at most `limit` (max_prompts_per_request) in all, or a 400 naming n."""
    if req.n is not None and prompts * req.n > limit:
        raise ApiError(400, "invalid_value", f"n: {req.n} choices for each of {prompts} prompt(s) make "
                                             f"{prompts * req.n}; at most {limit} choices may be asked for in one "
                                             f"request", "n")


def check_model(svc, name: str) -> None:
    svc.require_ready(g.record.started)
    if name != served_model(svc):
        raise ApiError(404, "model_not_found", f"the model {name!r} does not exist; this server serves "
                                               f"{served_model(svc)!r} (see /v1/models)", "model")


def answer(svc, req, prompts: list[list[int]], sampling, prompt_field: str, chat: bool,
           echoes: list[str] | None = None, grammar=None):
    """Fit each completion into the context, start decoding, answer as JSON or as a stream: n choices for each
    prompt (req.n), choice j of a prompt with the j-th seed derived from the request's (params.choice_seed)."""
    n = req.n or 1
    samplings = [sampling.replace(max_new_tokens=room(svc, ids, sampling.max_new_tokens,
                                                      req.requested_max_tokens is not None, req.max_tokens_field,
                                                      prompt_field), seed=choice_seed(sampling.seed, j))
                 for ids in prompts for j in range(n)]
    prompts = [ids for ids in prompts for _ in range(n)]
    echoes = None if echoes is None else [echo for echo in echoes for _ in range(n)]
    choices = Choices(svc, g.record, prompts, samplings, req.stop_strings, echoes, grammar, n=n)
    reply = Reply(chat=chat, id=("chatcmpl-" if chat else "cmpl-") + g.record.request_id, created=int(time.time()),
                  model=served_model(svc), fingerprint=fingerprint(svc.models.info, svc.settings),
                  include_usage=req.include_usage, logprobs=sampling.logprobs is not None,
                  tools=chat and req.calls_tools, only_calls=chat and req.only_calls)
    return svc.respond(choices, bool(req.stream), events=reply.events, body=reply.body, large=reply.logprobs)


def room(svc, prompt_ids: list[int], max_tokens: int, requested: bool, max_field: str, prompt_field: str) -> int:
    """The completion's token budget: the one requested, if prompt and completion fit the context; else, when
    the request left it to the server, the configured default cut to what the context leaves."""
    context = svc.decoder.context_length
    if context is None or len(prompt_ids) + max_tokens <= context:
        return max_tokens
    left = context - len(prompt_ids)
    if not requested and left >= 1:
        return left
    if not requested:  # the prompt alone fills the context: nothing the client set is at fault but the prompt
        raise ApiError(400, "prompt_too_long", f"this model's maximum context length is {context} tokens, and the "
                                               f"{prompt_field} has {len(prompt_ids)}: no room is left for the "
                                               "completion", prompt_field)
    raise ApiError(400, "prompt_too_long", f"this model's maximum context length is {context} tokens, but "
                                           f"{len(prompt_ids) + max_tokens} were requested ({len(prompt_ids)} in the "
                                           f"{prompt_field}, {max_tokens} for the completion, {max_field})",
                   prompt_field)


def finish_reason(generation: Generation, calls: bool = False) -> str:
    """stop, length (a time limit cut it short too), or tool_calls (it stopped after making calls)."""
    if generation.finish_reason() == "stop":
        return "tool_calls" if calls else "stop"
    return "length"


class Choices:
    """A /v1 request's generations, a choice each (n in a row for each prompt: `prompts` holds each prompt n
    times), decoded one after another. Several choices hold the engine for the whole request; each generation
    starts when the one before it has ended."""

    def __init__(self, svc, record, prompts: list[list[int]], samplings: list, stop, echoes: list[str] | None,
                 grammar=None, n: int = 1):
        self.svc, self.record, self.prompts, self.samplings, self.stop = svc, record, prompts, samplings, stop
        self.n = n  # choices per prompt
        self.grammar = grammar  # the constraint every choice follows (grammar.CompiledGrammar), if any
        self.echoes = echoes  # with echo: each prompt's text, returned before its completion
        self.slot = svc.acquire(record) if len(prompts) > 1 else None
        self.abandoned = False  # the client has gone: each choice ends after its first round
        self.generations = [self._start(0)]  # a single prompt waits for the engine here (503 before answering)

    def _start(self, index: int) -> Generation:
        generation = self.svc.generation(self.prompts[index], self.samplings[index], self.record, self.stop,
                                         slot=self.slot, grammar=self.grammar, counts_prompt=index % self.n == 0)
        if index:  # the request's choices share one time budget, the first's: request_timeout holds the engine
            generation.deadline = min(generation.deadline, self.generations[0].deadline)
        return generation

    def generation(self, index: int) -> Generation:
        """Choice `index`'s generation, started (with those before it) if it was not yet."""
        while index >= len(self.generations):
            self.generations.append(self._start(len(self.generations)))
        return self.generations[index]

    def __iter__(self):
        """(index, generation), each started when reached."""
        for index in range(len(self.prompts)):
            yield index, self.generation(index)

    def release_engine(self) -> None:
        """The last choice is decoded: the engine goes to the next request (a stream's events may still be on their
        way to the client)."""
        if self.slot is not None:
            self.slot.release()

    def run(self) -> None:
        for _, generation in self:
            if self.abandoned:
                generation.abandon()
            try:
                generation.run()
            finally:
                generation.close()

    def abandon(self) -> None:
        """The client has gone (Generation.abandon): the choice decoding ends, and those after it at once."""
        self.abandoned = True
        for generation in self.generations:
            generation.abandon()

    def close(self) -> None:
        for generation in self.generations:
            generation.close()
        if self.slot is not None:
            self.slot.release()

    def usage(self) -> dict:
        """Completion tokens of every choice; prompt tokens (and those the prompt cache served) once per prompt,
        as OpenAI counts them with n: its first choice's."""
        usages = [generation.usage() for generation in self.generations]
        firsts = self.generations[:: self.n]
        usage = {"prompt_tokens": sum(u["prompt_tokens"] for u in usages[:: self.n]),
                 "completion_tokens": sum(u["completion_tokens"] for u in usages)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        usage["prompt_tokens_details"] = {"cached_tokens": sum(g.cached_tokens() for g in firsts)}
        return usage

    def echo(self, index: int) -> str:
        return self.echoes[index] if self.echoes is not None else ""


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf (vLLM's floor, too)


@dataclass(frozen=True)
class Reply:
    """How one /v1 request is answered: its id, time and model, and the shapes of its choices."""

    chat: bool
    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool
    logprobs: bool = False  # the request asked for logprobs
    tools: bool = False  # a chat answer that may hold tool calls: they are read out of its text
    only_calls: bool = False  # a chat answer that is calls alone: its content is null, streamed too
    # a text chunk's rendering as a template, by choice index (_text_chunk)
    _text_templates: dict = field(default_factory=dict, repr=False, compare=False)

    def _header(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}

    # --- logprobs: (token id, TokenLogprobs or None, text offset) entries in the two shapes -------------------

    def _call_deltas(self, pieces, streamed: dict[int, str], index: int):
        """A chunk per piece of a tool call, as OpenAI streams one: its id and name first, then its arguments."""
        for i, call_id, name, arguments in pieces:
            if name is not None:
                streamed[i] = ""
                delta = ToolCallDelta(index=i, id=call_id, type="function",
                                      function=FunctionCallDelta(name=name, arguments=""))
            else:
                streamed[i] += arguments
                delta = ToolCallDelta(index=i, function=FunctionCallDelta(arguments=arguments))
            yield self._chunk(None, index, calls=[delta])

    def _prompt_entries(self, choices: Choices, index: int, generation: Generation) -> list[tuple]:
        """The prompt's tokens, with echo and logprobs: offsets from their text pieces."""
        if not self.logprobs or choices.echoes is None or generation.prompt_logprobs is None:
            return []
        entries, offset, echo = [], 0, choices.echo(index)
        pieces = token_pieces(choices.svc.decode, generation.prompt_ids)
        if "".join(pieces) != echo:  # a prompt sent as text that holds a special token's text
            shown = token_pieces(choices.svc.detokenize, generation.prompt_ids)  # such tokens as written
            pieces = shown if "".join(shown) == echo else pieces
        for token, figures, piece in zip(generation.prompt_ids, generation.prompt_logprobs, pieces):
            entries.append((token, figures, offset))
            offset += len(piece)
        return entries

    def _entries(self, choices: Choices, index: int, generation: Generation, tokens: range) -> list[tuple]:
        """The completion's tokens at `tokens`, with logprobs; offsets in the choice's text."""
        if not self.logprobs:
            return []
        completion, base = generation.completion, len(choices.echo(index))
        return [(completion.tokens[i]["id"], completion.logprobs[i], base + completion.offsets[i]) for i in tokens]

    def _logprobs(self, svc, entries: list[tuple]):
        if not self.logprobs:
            return None
        if self.chat:
            def top(token: int, logprob: float) -> dict:
                return {"token": svc.token_text(token), "logprob": _finite(logprob),
                        "bytes": list(svc.token_bytes(token))}
            return ChoiceLogprobs(content=[TokenLogprob(**top(token, figures.logprob),
                                                        top_logprobs=[TopLogprob(**top(*alt)) for alt in figures.top])
                                           for token, figures, _ in entries])
        tops = []
        for token, figures, _ in entries:
            if figures is None:
                tops.append(None)
                continue
            alternatives = {svc.token_text(alt): _finite(logprob) for alt, logprob in figures.top}
            tops.append({**alternatives, **{svc.token_text(token): _finite(figures.logprob)}})
        return CompletionLogprobs(tokens=[svc.token_text(token) for token, _, _ in entries],
                                  token_logprobs=[None if figures is None else _finite(figures.logprob)
                                                  for _, figures, _ in entries],
                                  top_logprobs=tops, text_offset=[offset for _, _, offset in entries])

    # --- the answer ------------------------------------------------------------------------------------------

    def body(self, choices: Choices) -> dict:
        """The whole answer, as one JSON object."""
        usage = CompletionUsage(**choices.usage())
        answers = []
        for index, generation in enumerate(choices.generations):
            completion = generation.completion
            entries = self._prompt_entries(choices, index, generation) + self._entries(
                choices, index, generation, range(completion.answered()))
            logprobs = self._logprobs(choices.svc, entries)
            text, calls = choices.echo(index) + completion.text, []
            if self.tools:
                text, calls = parse_tool_calls(text)
            reason = finish_reason(generation, bool(calls))
            stats = SpeculativeDecodingStats.of(generation.stats())
            if self.chat:
                message = ChatCompletionMessage(content=text, tool_calls=calls or None)
                answers.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason,
                                          speculative_decoding_stats=stats))
            else:
                answers.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason,
                                                speculative_decoding_stats=stats))
        kind = ChatCompletion if self.chat else Completion
        return kind(**self._header(), choices=answers, usage=usage).model_dump()

    def _chunk(self, text: str | None, index: int = 0, reason: str | None = None, stats=None, role: bool = False,
               usage: dict | None = None, logprobs=None, calls=None) -> str:
        if (isinstance(text, str) and reason is None and stats is None and not role and usage is None
                and logprobs is None and calls is None):
            return self._text_chunk(text, index)
        return self._rendered_chunk(text, index, reason, stats, role, usage, logprobs, calls)

    def _text_chunk(self, text: str, index: int) -> str:
        """A chunk of text alone (most of a stream's): the models' own rendering as a template made once
        (generation.text_template), without building and dumping the models each round (about 20 us a round,
        run on the greenlet beside the engine thread)."""
        template = self._text_templates.get(index)
        if template is None:
            template = self._text_templates[index] = text_template(lambda text: self._rendered_chunk(text, index))
        return template(text)

    def _rendered_chunk(self, text: str | None, index: int = 0, reason: str | None = None, stats=None,
                        role: bool = False, usage: dict | None = None, logprobs=None, calls=None) -> str:
        if usage is not None:
            choices = []
        elif self.chat:
            delta = ChoiceDelta(role="assistant" if role else None, content=text, tool_calls=calls)
            choices = [ChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason,
                                   speculative_decoding_stats=stats)]
        else:
            choices = [CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason,
                                        speculative_decoding_stats=stats)]
        kind = ChatCompletionChunk if self.chat else Completion
        chunk = kind(**self._header(), choices=choices,
                     usage=None if usage is None else CompletionUsage(**usage))
        return sse(chunk.model_dump(exclude=None if self.include_usage else {"usage"}))

    def events(self, choices: Choices):
        """OpenAI's stream: each choice in turn, a chunk per decoded round that adds text (a chat stream starts
        with the role; with echo, the prompt comes first), finish_reason and the stats on the choice's last
        content chunk, the usage chunk if asked for, then [DONE]. Text that may turn out to be the start of a
        stop string is held back until it is known not to be, and a token's logprobs go with its text."""
        primed, started, lock, closing = {}, set(), threading.Lock(), False

        def prime(index: int) -> None:  # a choice's decoding begun, once: its events run to their first (None)
            if index == len(choices.prompts):  # the last is decoded: the engine is free, whatever the client reads
                choices.release_engine()
                return
            with lock:
                if closing or index in started:
                    return
                started.add(index)
                try:
                    events = self._choice_events(choices, index, choices.generation(index), lambda: prime_next(index))
                    next(events)
                except BaseException:
                    started.discard(index)
                    raise
                primed[index] = events

        def prime_next(index: int) -> None:  # when a choice's work has ended (on the loop, or the engine thread)
            if not choices.generations[index].decoded:  # a client gone, or an error: no more choices
                return
            try:
                prime(index + 1)
            except Exception:  # noqa: BLE001 - the sender, reaching it, starts it again and reports the error
                pass

        try:
            for index in range(len(choices.prompts)):
                prime(index)
                yield from primed.pop(index)
                choices.generations[index].close()
            if self.include_usage:
                yield self._chunk(None, usage=choices.usage())
            yield DONE
        except Exception as error:  # the status line is sent already: report in-band, as OpenAI does
            api_error = to_api_error(error, choices.record.request_id)
            choices.record.error = api_error.type
            yield sse(openai_error(api_error)[0])
            yield DONE
        finally:
            with lock:
                closing = True
                left = list(primed.values())
            for events in left:  # decoded ahead for a client gone (or after an error): stopped
                events.close()
            choices.close()

    def _choice_events(self, choices: Choices, index: int, generation: Generation,
                       on_decoded=None):
        completion = generation.completion
        text, entries = choices.echo(index), []  # not sent yet: the round that ended decoding goes with finish
        first = True
        reader, streamed = ToolCallReader(), {}  # with tools: the calls so far, and each one's arguments sent
        said = ""  # with tools: the content sent so far (content_of the text so far)

        def render(kept):  # a round's chunks, on the engine thread (Generation.rounds)
            nonlocal text, entries, first, said
            if first:
                entries += self._prompt_entries(choices, index, generation)
                first = False
            start = len(text)
            text += completion.take()
            if self.tools:  # the text outside the calls as it grows, the calls as they are decoded, in text order
                pieces, said = stream_pieces(text, start, said, reader)
                for kind, piece in pieces:
                    if kind == "content":
                        yield self._chunk(piece, index)
                    else:
                        yield from self._call_deltas([piece], streamed, index)
                return
            entries += self._entries(choices, index, generation, completion.take_tokens())
            if not generation.final and (text or entries):
                yield self._chunk(text, index, logprobs=self._logprobs(choices.svc, entries))
                text, entries = "", []

        def render_texts(texts: list[str], final: bool) -> str:  # rounds of text alone, taken together
            nonlocal text
            chunks, last = [], len(texts) - 1
            for i, piece in enumerate(texts):
                text += piece
                if text and not (final and i == last):
                    chunks.append(self._text_chunk(text, index))
                    text = ""
            return "".join(chunks)

        text_only = not (self.tools or self.logprobs)  # a round's chunk is its text alone (no entries, no calls)
        rounds = generation.rounds(render, render_texts if text_only else None, on_decoded)
        try:
            yield None  # primed: decoding has begun (Reply.events takes this before the events)
            if self.chat:
                yield self._chunk(None if self.only_calls else "", index, role=True)
            yield from rounds
            text += completion.take()
            entries += self._entries(choices, index, generation, completion.take_tokens())
            stats = SpeculativeDecodingStats.of(generation.stats())
            if self.tools:  # the calls in the text, then the content not sent yet
                content, calls = parse_tool_calls(text)
                yield from self._call_deltas(reader.read(text), streamed, index)
                for i, call in enumerate(calls):  # what the reader could not stream: the rest of each call
                    if i not in streamed:
                        yield from self._call_deltas([(i, call.id, call.function.name, "")], streamed, index)
                    sent = streamed[i]
                    if call.function.arguments != sent and call.function.arguments.startswith(sent):
                        yield from self._call_deltas([(i, None, None, call.function.arguments[len(sent):])], streamed,
                                                     index)
                rest = content[len(said):] if content and content.startswith(said) else None
                yield self._chunk(rest if rest or not (calls or said) else None, index,
                                  finish_reason(generation, bool(calls)), stats, logprobs=self._logprobs(choices.svc, entries))
                return
            yield self._chunk(text, index, finish_reason(generation), stats, logprobs=self._logprobs(choices.svc, entries))
        finally:
            rounds.close()  # begun or not: a choice decoded ahead for a client gone stops
