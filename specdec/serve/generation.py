"""Driving one generation: pull rounds from the engine's stream, assemble the text, stop at stop strings, keep
the time budget, and render the answer as JSON or as Server-Sent Events.

`close` stops the engine, releases its slot and records the outcome; it is idempotent and runs on every path:
normal end, stop string, time limit, client disconnect, error. Whatever touches the engine's stream (a round,
ending, abandoning) runs on the engine thread (concurrency.py). So does a JSON answer's decoding with its text
assembly (`run`; without stop strings the text is assembled once decoding has ended), and a stream's rounds
(`rounds`, decoded ahead of the greenlet that writes them): with stop strings, with their text and events, so
that decoding stops at the round that completes one; without, the greenlet assembles the text and renders each
round as it takes it. The request's greenlet renders the rest once they have ended.
"""

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from ..stats import GenerationStats
from ..text import Completion
from .errors import to_api_error


class Generation:
    """One request's decoding, from the engine stream it was given to its last event."""

    def __init__(self, service, stream, slot, record, prompt_ids: list[int], max_new_tokens: int,
                 stop=(), details: bool = False, logprobs: bool = False, eos=(), min_tokens: int = 0,
                 counts_prompt: bool = True):
        self.service, self.stream, self.slot, self.record = service, stream, slot, record
        self.prompt_ids, self.max_new_tokens, self.details = prompt_ids, max_new_tokens, details
        self.logprobs = logprobs  # the request asked for the tokens' log-probabilities
        self.eos = frozenset(eos)  # the tokens that end this request's decoding (none with ignore_eos)
        self.prompt_logprobs = None  # the prompt's (TokenLogprobs, None for the first), when asked for
        self.completion = Completion(service.decode, prompt_ids, stop, service.models.text_concatenates, min_tokens)
        self.result = None
        self.new_tokens = 0
        self.deadline = time.perf_counter() + service.settings.request_timeout  # the engine is ours until then
        self.timed_out = False
        self.counts_prompt = counts_prompt  # its prompt tokens count (a /v1 request's later choices' do not)
        self.abandoned = False  # the client has gone (a JSON answer's): decoding ends at the next round's end
        self.final = False  # the round just decoded was the last: the next step ends without decoding
        self.closed = False
        self._close_lock = threading.Lock()
        self._stream_closed = False
        self._final_stats: GenerationStats | None = None  # the result's, with the wait for the engine: stats()

    @property
    def done(self) -> bool:
        return self.result is not None or self.completion.stopped

    @property
    def decoded(self) -> bool:
        """Decoding ended by itself (its result is in), not by a client gone or an error. Read by any thread."""
        return self.result is not None

    def step(self) -> list[dict] | None:
        """Decode one round with its text; the tokens it kept, or None when decoding has ended."""
        if self.done:
            return None
        chunk = self._next_chunk()
        if chunk is None:
            self.completion.finish()
            return None
        kept = self._feed(chunk)
        if self.completion.stopped:  # a stop string: no more rounds, but keep the engine's stats
            self._end()
        elif self._over_time(chunk):
            self.completion.finish()
        self.final = self.done or self._finished_by(chunk)
        return kept

    def _feed(self, chunk) -> list[dict]:
        """The round's tokens into the completion, under the tokenizer's lock taken once for the round."""
        with self.service.tokenizer_lock:
            return self.completion.feed(chunk.token_ids, chunk.sources, chunk.logprobs, self.service.models.decode_text)

    def _next_chunk(self):
        """The engine's next round (its chunk), or None once decoding has ended (the result kept). Called on the
        engine thread, as everything that advances the stream (`step`, `run`, a stream's rounds)."""
        chunk, result = _advance(self.stream)
        if chunk is None:
            self.result = result
            return None
        self.new_tokens += len(chunk.token_ids)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        return chunk

    def _over_time(self, chunk) -> bool:
        """Whether the time budget is spent, or the client has gone (decoding is then ended), unless this round
        ended it anyway."""
        if time.perf_counter() > self.deadline and not self._finished_by(chunk):
            self.timed_out = not self.abandoned
            self._end()
            return True
        return False

    def abandon(self) -> None:
        """The client has gone: end decoding after the round now decoding, as a spent time budget does (its
        deadline is what each round checks). From the request's greenlet (concurrency.watch_disconnect)."""
        self.abandoned = True
        self.deadline = float("-inf")

    def _end(self) -> None:
        """End decoding after the round just committed; the engine returns its result (and stats). On the engine
        thread."""
        self.result = _stop(self.stream)

    def _finished_by(self, chunk) -> bool:
        """Whether this round ended decoding anyway (max_new_tokens reached, or an end-of-sequence token)."""
        return (self.new_tokens >= self.max_new_tokens
                or bool(chunk.token_ids) and chunk.token_ids[-1] in self.eos)

    def run(self) -> None:
        """Decode to the end (a JSON answer) in one engine call, which also closes the stream: the rounds and their
        checks (stop strings, the time budget) run one after the other on the engine thread, with no hand-off to
        the request's greenlet between rounds. Detokenizing runs there too, under the tokenizer's lock; nothing
        else reads this generation's text until it returns.

        Without stop strings nothing needs the text before the end: the rounds are pulled from the stream in a
        loop that checks only the time budget (`_decode_deferred`), and their tokens are detokenized once decoding
        has ended: the same text. Python work between a small pair's forwards slows the forwards themselves
        (bench/README.md, "Rounds bound by overhead")."""
        self.service.engine.call(self._decode_all)

    def _decode_all(self) -> None:
        try:
            if self.completion.has_stop_strings:  # each round's text made and checked as it comes
                while self.step() is not None:
                    pass
            else:
                self._decode_deferred()
        finally:
            self._close_stream()  # here, not in a second engine call

    def _close_stream(self) -> None:
        """On the engine thread, once decoding has ended: close the engine's stream (its caches go to the prompt
        cache), so that the engine may serve the next request while this one's answer is still being sent."""
        if not self._stream_closed:
            held = _close(self.stream, self.service.decoder)
            self._stream_closed = True
            if held is not None:  # now, before the engine goes to the next request (which sets them again)
                self.service.metrics.observe_prompt_cache(held)

    def _decode_deferred(self) -> None:
        """`step` until the end, without stop strings, in one loop; the text made from all rounds at the end (on
        an error, from those decoded until then, without the held-back rest, as `step` leaves it)."""
        stream, clock, chunks, ended = self.stream, time.perf_counter, [], False
        try:
            while True:
                chunk, result = _advance(stream)
                if chunk is None:
                    self.result, ended = result, True
                    break
                chunks.append(chunk)
                self.new_tokens += len(chunk.token_ids)
                if clock() > self.deadline and self._over_time(chunk):  # read each round: abandon() moves it
                    ended = True
                    break
        finally:
            if chunks and chunks[0].prompt_logprobs is not None:
                self.prompt_logprobs = chunks[0].prompt_logprobs
            with self.service.tokenizer_lock:  # taken once for all rounds
                self.completion.extend(chunks, self.service.models.decode_text)
            if ended:
                self.completion.finish()
                self.final = True

    def rounds(self, render: Callable[[list[dict]], str | Iterable[str]],
               render_texts: Callable[[list[str], bool], str] | None = None,
               on_decoded: Callable[[], None] | None = None) -> Iterator[str]:
        """A stream's rounds, each rendered by `render(kept)` (its event, or several), decoded on the engine thread
        ahead of the sender: the engine thread never waits for the request's greenlet to send a round, and rounds
        decoded while it sent go out together. Once decoding has ended, the engine's stream is closed and the
        engine released at once, though the sender may still be writing to a client that reads slowly: such a
        client costs its own decoding, as a JSON answer does, and never holds the engine for others.

        With stop strings, each round's text is assembled and rendered on the engine thread as it is decoded, so
        that decoding stops at the round that completes one; until this ends, only the engine thread touches the
        generation. Without them, the engine thread only decodes and checks the time budget; the greenlet
        detokenizes and renders the rounds it takes (the completion is then the greenlet's alone), so that
        between two rounds the engine thread runs no more Python than a JSON answer's (bench/README.md, "Rounds
        bound by overhead"). There, `render_texts(texts, final)`, where the caller gives it, renders the rounds
        taken together from their texts alone (whether the last of them ends decoding): their tokens detokenized
        in one pass, no per-round Python beyond the event's own (for events that carry text only).

        Decoding starts at once, before the caller takes the first event; `on_decoded()` runs once it has ended
        (after the engine is released; concurrency.EngineThread.ahead's on_end), whatever the sender is doing
        then. Close the returned iterator to stop it, begun or not."""
        interval = self.service.settings.stream_interval
        release = self.slot.release if on_decoded is None else lambda: (self.slot.release(), on_decoded())
        if self.completion.has_stop_strings:
            def rendered():
                try:
                    while (kept := self.step()) is not None:
                        yield _joined(render(kept))
                finally:
                    self._close_stream()

            return self.service.engine.ahead(rendered(), interval, on_end=release)
        return self._rendered_by_sender(render, interval, render_texts, release)

    def _rendered_by_sender(self, render, interval: float, render_texts, release) -> Iterator[str]:
        def decoded():  # on the engine thread: (the round's chunk, whether it is the last)
            clock, deadline = time.perf_counter, self.deadline
            try:
                while not self.done and (chunk := self._next_chunk()) is not None:
                    if clock() > deadline:
                        self._over_time(chunk)
                    yield chunk, self.done or self._finished_by(chunk)
            finally:
                self._close_stream()

        def rendered(items: list) -> str:  # on the greenlet: the rounds it takes at once
            if render_texts is not None:
                self.final = items[-1][1]
                with self.service.tokenizer_lock:
                    texts = self.completion.feed_rounds([chunk for chunk, _ in items], self.service.models.decode_text)
                return render_texts(texts, self.final)
            events = []
            for chunk, self.final in items:
                events.append(_joined(render(self._feed(chunk))))
            return "".join(events)

        # then: decoding has ended (not reached when the client has gone)
        return self.service.engine.ahead(decoded(), interval, rendered, on_end=release, then=self.completion.finish)

    def finish_reason(self) -> str | None:
        if self.abandoned:
            return "cancelled"
        if self.completion.stopped:
            return "stop"
        if self.timed_out:
            return "time_limit"
        return self.result.finish_reason if self.result is not None else None

    def stats(self) -> GenerationStats | None:
        """The engine's stats (so far, if abandoned), with the wait for the engine; None for a stream that is not
        the engine's."""
        if self.result is not None:  # final: made once (the answer, the log line and the metrics read it)
            if self._final_stats is None:
                self._final_stats = replace(self.result.stats, queue_seconds=self.slot.waited)
            return self._final_stats
        if hasattr(self.stream, "stats"):
            stats = self.stream.stats()
        else:
            return None
        return replace(stats, queue_seconds=self.slot.waited)

    def usage(self) -> dict:
        completion = len(self.completion.tokens)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(self.prompt_ids) + completion}

    def cached_tokens(self) -> int:
        """Prompt tokens the prompt cache served (0 where it was not consulted)."""
        stats = self.stats()
        return (stats.cached_tokens or 0) if stats is not None else 0

    def body(self) -> dict:
        """The /predict answer."""
        stats = self.stats()
        body = {"text": self.completion.text, "finish_reason": self.finish_reason(), "usage": self.usage(),
                "stats": stats.as_dict() if stats else None}
        if self.details:
            body["tokens"] = self.completion.tokens
        if self.logprobs:
            body["logprobs"] = self.logprob_entries(range(self.completion.answered()))
        return body

    def _event(self, kept: list[dict]) -> dict:
        """/predict's event for one round."""
        event = {"text": self.completion.take()}
        if self.details:
            event["tokens"] = kept
        if self.logprobs:
            event["logprobs"] = self.logprob_entries(self.completion.take_tokens())
        return event

    def logprob_entries(self, indices: range) -> list[dict]:
        """/predict's `logprobs` of the completion's tokens at `indices`: id, token (its own text, special
        tokens shown), logprob and the top alternatives, each {id, token, logprob}."""
        service, entries = self.service, []
        for i in indices:
            figures = self.completion.logprobs[i]
            entries.append({"id": figures.token, "token": service.token_text(figures.token),
                            "logprob": figures.logprob,
                            "top_logprobs": [{"id": token, "token": service.token_text(token), "logprob": logprob}
                                             for token, logprob in figures.top]})
        return entries

    def events(self):
        """/predict's Server-Sent Events: one per committed chunk, then one with finish_reason, usage and stats.
        With logprobs, each event has those of the tokens whose text it completes."""
        try:
            text_only = not (self.details or self.logprobs)  # each round's event is its text alone
            yield from self.rounds(lambda kept: sse(self._event(kept)), _text_events if text_only else None)
            final = self.body()
            final["text"] = self.completion.take()
            final.pop("tokens", None)
            if self.logprobs:
                final["logprobs"] = self.logprob_entries(self.completion.take_tokens())
            yield sse(final)
        except Exception as error:  # the status line is sent already: report in-band, keep serving
            api_error = to_api_error(error, self.record.request_id)
            self.record.error = api_error.type
            yield sse(api_error.body())
        finally:
            self.close()

    def close(self) -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        try:
            if not self._stream_closed:  # abandoned before its decoding closed it
                self.service.engine.call(self._close_stream)
        finally:
            self.slot.release()
        record = self.record
        record.completion_tokens = (record.completion_tokens or 0) + len(self.completion.tokens)
        record.finish_reason = self.finish_reason() or "cancelled"
        stats = self.stats()
        record.acceptance_rate = stats.acceptance_rate if stats else None
        if stats is not None and stats.cached_tokens is not None and self.counts_prompt:
            record.cached_tokens = (record.cached_tokens or 0) + stats.cached_tokens
        self.service.metrics.observe_generation(len(self.prompt_ids), stats, self.counts_prompt)


def _advance(stream):
    """(the next chunk, None), or (None, the result) once decoding has ended."""
    try:
        return next(stream), None
    except StopIteration as end:
        return None, end.value


def _close(stream, decoder):
    """Close the stream (its caches go to the prompt cache, if it takes them); what the prompt cache holds then."""
    stream.close()
    prompt_cache = getattr(decoder, "prompt_cache", None)
    return prompt_cache.held() if prompt_cache is not None else None


def _stop(stream):
    """End decoding after the round just committed; the engine's result."""
    try:
        stream.send("stop")
    except StopIteration as end:
        return end.value
    return None


def _joined(events: str | Iterable[str]) -> str:
    return events if isinstance(events, str) else "".join(events)


def sse(payload: dict) -> str:
    return f"data: {_to_json(payload)}\n\n"


# json.dumps(payload, ensure_ascii=False) with its encoder made once, not once a call
_to_json = json.JSONEncoder(ensure_ascii=False).encode

# a text no event holds, whose JSON marks where an event's text goes (text_template)
TEXT_PLACEHOLDER = "\x00specdec-text\x00"


def text_template(render: Callable[[str], str]) -> Callable[[str], str]:
    """`render` (an event of a text, its other fields fixed) as a template: its output for a placeholder, split
    around the placeholder's JSON, with a text's JSON put in its place. The same bytes as `render(text)`, without
    building and dumping the event each round (tests/test_openai.py, tests/test_service.py)."""
    before, after = render(TEXT_PLACEHOLDER).split(_to_json(TEXT_PLACEHOLDER))
    return lambda text: before + _to_json(text) + after


# /predict's event of a round's text alone (no tokens, no logprobs asked for)
_text_event = text_template(lambda text: sse({"text": text}))


def _text_events(texts: list[str], final: bool) -> str:
    """/predict's events of rounds taken together, from their texts (Generation.rounds' render_texts)."""
    return "".join([_text_event(text) for text in texts])
