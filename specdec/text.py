"""Text in and out of the engine: prompts (or chat messages) to token ids, and committed token ids to text,
incrementally (UTF-8-safe detokenization, stop strings, per-token text, and which tokens' text has been sent, so
that a token's log-probability goes out with its text).

The engine knows nothing about text; the CLI and the service encode through `encode_prompt`/`encode_messages`
and feed each committed chunk to a Detokenizer or a Completion.
"""

import functools
from collections.abc import Callable, Iterable, Sequence

from jinja2 import TemplateError, TemplateSyntaxError

from .errors import SpecDecError

PROMPT_CONTEXT = 6  # prompt tokens decoded along with the first new ones, so a leading space survives


def encode_messages(tokenizer, messages: Sequence[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    add_special_tokens: bool = False) -> list[int]:
    """Token ids of chat messages ({"role", "content"} with string content, an assistant's "tool_calls") through
    the tokenizer's chat template, by default with the generation prompt added: ready for the assistant's reply.
    `tools` (OpenAI's function tools) go to the template, which writes them into the prompt. With
    `continue_final_message` the last message stays open (the reply continues it: it must be the assistant's),
    without the generation prompt; `add_special_tokens` adds the tokenizer's own (a BOS the template may have
    written already). A template that refuses the conversation (its `raise_exception`: roles out of order, a
    role it does not know) is a SpecDecError naming `messages`."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecDecError("the target's tokenizer has no chat template", field="chat")
    if continue_final_message and add_generation_prompt:
        raise SpecDecError("continue_final_message and add_generation_prompt exclude each other",
                           field="continue_final_message")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise SpecDecError("continue_final_message continues the last message, which must be the assistant's",
                           field="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
    except TemplateSyntaxError:
        raise  # the served template itself is broken: the server's fault, not the request's
    except TemplateError as error:
        raise SpecDecError(f"the chat template refused these messages: {error}", field="messages") from None
    except ValueError as error:  # continue_final_message where the template does not write the message out whole
        if not continue_final_message:
            raise
        raise SpecDecError(f"the chat template cannot continue the last message: {error}",
                           field="continue_final_message") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def encode_prompt(tokenizer, text: str, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a prompt: as plain text (with the tokenizer's special tokens, unless not
    `add_special_tokens`), or with `chat` as one user turn in the chat template."""
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


# fill-in-the-middle's (prefix, suffix, middle) tokens, as model families spell them: Qwen2.5-Coder's (and
# CodeGemma's, DeepSeek-V2's), StarCoder's
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """The tokenizer's (prefix, suffix, middle) fill-in-the-middle token ids, or None if it has none. Looked up
    name by name (a token the vocabulary lacks maps to None or to the unknown token, and does not map back):
    get_vocab() would build the whole 151k-entry dict on every request."""
    for names in FIM_TOKENS:
        ids = tokenizer.convert_tokens_to_ids(list(names))
        if None not in ids and tokenizer.convert_ids_to_tokens(ids) == list(names):
            return tuple(ids)
    return None


def longest_token(tokenizer) -> int:
    """The most characters one token's spelling has (its vocabulary string: byte-level BPE's one character a byte,
    SentencePiece's ▁ for a space, an added token's whole text). No token covers more of a text than that, so a
    text over `n` times this many characters tokenizes to more than `n` tokens, known without tokenizing it."""
    spellings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(spelling) for spelling in spellings if spelling), default=1)


def encode_infill(tokenizer, prefix: str | list[int], suffix: str) -> list[int]:
    """Token ids of a fill-in-the-middle prompt in prefix-suffix-middle order: <prefix> prefix <suffix> suffix
    <middle>, the model then writing what goes between (the prefix as text, or as token ids). SpecDecError naming
    `suffix` where the tokenizer has no such tokens."""
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise SpecDecError("this model has no fill-in-the-middle tokens, so a suffix cannot be used",
                           field="suffix")
    head = prefix if isinstance(prefix, list) else tokenizer.encode(prefix, add_special_tokens=False)
    return [ids[0], *head, ids[1], *tokenizer.encode(suffix, add_special_tokens=False), ids[2]]


def decoder_of(tokenizer) -> Callable[[list[int]], str]:
    """token ids -> text as completions show it: special tokens skipped, spaces as the tokens have them.

    For a fast tokenizer whose class decodes as transformers' generic one does (Qwen's, Llama's, GPT-2's: the
    Rust tokenizer's decode, then no clean-up), the Rust tokenizer is called directly: the same text, without the
    Python wrapper around it (1 against 4 us a call; the service decodes up to twice a token). A class that
    decodes its own way (CodeGen's, Marian's, ...) is asked through its `decode`."""
    backend = _generic_backend(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _generic_backend(tokenizer):
    """The Rust tokenizer behind `tokenizer`, where its class's decode is transformers' generic one; else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the tokenizer's own decode
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode):
        return tokenizer.backend_tokenizer
    return None


def concatenates(tokenizer) -> bool:
    """Whether `decoder_of(tokenizer)` decodes two tokens to the two texts joined wherever each decodes to valid
    text alone: a Rust tokenizer called directly whose decoder is byte-level BPE's (the tokens' bytes joined, then
    UTF-8) or Fuse (the tokens' strings joined). Not SentencePiece's Metaspace (it drops the space at the start of
    a text), WordPiece's or a Sequence of decoders."""
    backend = _generic_backend(tokenizer)
    return backend is not None and type(backend.decoder).__name__ in ("ByteLevel", "Fuse")


def token_pieces(decode: Callable[[list[int]], str], token_ids: list[int], prompt_ids: Sequence[int] = ()) -> list[str]:
    """The text each token adds, decoded in context; a token ending inside a multi-byte character shows with
    the next one, and the last piece holds anything still held back."""
    detokenizer = Detokenizer(decode, list(prompt_ids))
    pieces = [detokenizer.add(token) for token in token_ids]
    if pieces:
        pieces[-1] += detokenizer.flush()
    return pieces


class Detokenizer:
    """The text each new token adds, decoded in context (the offsets scheme of TGI and vLLM).

    A token that ends inside a UTF-8 character (byte-level BPE) adds "" and the token completing the character
    adds all of it, so the pieces always join to valid text.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int], concatenative: bool = False):
        self._decode = decode
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0  # ids[prefix:read] is the context whose text was already emitted
        self._read = len(self._ids)
        self._alone: dict[int, str] = {}  # token id -> its text decoded alone (the usual context: add_all)
        # `decode` joins texts (`concatenates`): a token after one whose text came whole adds its own text alone
        self._concatenative = concatenative

    def add(self, token_id: int) -> str:
        return self.add_all((token_id,))[0]

    def add_all(self, token_ids: Iterable[int], decode: Callable[[list[int]], str] | None = None) -> list[str]:
        """[self.add(token_id) for token_id in token_ids], in one loop, through `decode` if given (the same
        function, called without a per-call lock: the caller holds it). The usual context of a token is the one
        token before it, whose text alone is then decoded once per token id."""
        decode = decode or self._decode
        ids, prefix, read, alone, pieces = self._ids, self._prefix, self._read, self._alone, []
        concatenative = self._concatenative
        for token_id in token_ids:
            ids.append(token_id)
            if read - prefix == 1:
                before = alone.get(ids[prefix])
                if before is None:
                    before = alone[ids[prefix]] = decode(ids[prefix:read])
                if concatenative and read == len(ids) - 1 and "\ufffd" not in before:
                    # [previous, this]: its text is the previous one's and this one's joined, where both are whole
                    text = alone.get(token_id)
                    if text is None:
                        text = alone[token_id] = decode([token_id])
                    if text and "\ufffd" not in text:
                        prefix, read = read, len(ids)
                        pieces.append(text)
                        continue
            else:
                before = decode(ids[prefix:read])
            after = decode(ids[prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                prefix, read = read, len(ids)
                pieces.append(after[len(before):])
            else:
                pieces.append("")
        self._prefix, self._read = prefix, read
        return pieces

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes to U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):]


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for: for a byte-level BPE (GPT-2, Qwen, Llama 3) its own bytes, also where it
    holds part of a multi-byte character; else the UTF-8 of its text."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ == "ByteLevel":
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is not None and all(c in _BYTE_OF for c in token):
            return bytes(_BYTE_OF[c] for c in token)
    return tokenizer.decode([token_id], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False).encode("utf-8", errors="replace")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


class Completion:
    """The completion so far: kept tokens with their text and source, the text cut at the first stop string,
    and how much of the text may be sent without ever having to take it back. `logprobs` and `offsets` run
    beside `tokens`: each token's log-probabilities (None when not asked for) and where its text starts."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int], stop: Iterable[str] = (),
                 concatenative: bool = False, min_tokens: int = 0):
        self._detokenizer = Detokenizer(decode, prompt_ids, concatenative)
        self._stop = [s for s in stop if s]
        self._min_tokens = min_tokens  # no stop string cuts the text before this many tokens (vLLM's min_tokens)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self.tokens: list[dict] = []  # {"id", "text", "source"}, up to the token that completed a stop string
        self.logprobs: list = []  # the engine's TokenLogprobs of each token, or None
        self.offsets: list[int] = []  # where each token's text starts in `text` (before a stop string's cut)
        self._tokens_sent = 0
        self.stopped = False  # a stop string was found
        self.finished = False
        self._sent = 0

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def feed(self, token_ids: list[int], sources: list[str], logprobs: list | None = None,
             decode: Callable[[list[int]], str] | None = None) -> list[dict]:
        """Add one committed chunk (with its tokens' log-probabilities, if any); returns the tokens kept from it
        (those after a stop string are dropped). `decode`: as Detokenizer.add_all's."""
        if not self._stop:  # nothing can cut the text: the chunk's tokens in one loop
            return self._append_all(token_ids, sources, logprobs, decode)
        kept = []
        if self.stopped:
            return kept
        # the chunk's pieces at once (the detokenizer may run past a stop string: nothing reads it after one)
        pieces = self._detokenizer.add_all(token_ids[:len(sources)], decode)
        for i, (token_id, source, piece) in enumerate(zip(token_ids, sources, pieces)):
            self.logprobs.append(logprobs[i] if logprobs is not None else None)
            self.offsets.append(len(self.text))
            self._append(token_id, source, piece, kept)
            if self.stopped:
                break
        return kept

    def extend(self, chunks: Iterable, decode: Callable[[list[int]], str] | None = None) -> None:
        """Feed each chunk (an engine Chunk: token_ids, sources, logprobs) in turn, the tokens kept dropped: the
        same state as `feed` gives; without stop strings in one loop (a JSON answer's rounds detokenized at the
        end: bench/README.md, "A thinner service, again")."""
        if self._stop:
            for chunk in chunks:
                self.feed(chunk.token_ids, chunk.sources, chunk.logprobs, decode)
            return
        token_ids, sources, logprobs, _ = _joined_rounds(chunks)
        self._append_all(token_ids, sources, logprobs, decode)

    def feed_rounds(self, chunks: Sequence, decode: Callable[[list[int]], str] | None = None) -> list[str]:
        """Feed rounds where no stop string can cut the text (engine Chunks: token_ids, sources, logprobs), their
        tokens detokenized in one pass; each round's text as `take` would give it after the round (the first's
        with any text not taken before), all of it taken (none with no rounds)."""
        if self._stop:
            raise ValueError("feed_rounds is for a completion without stop strings")
        if not chunks:
            return []
        token_ids, sources, logprobs, ends = _joined_rounds(chunks)
        first = len(self.tokens)
        self._append_all(token_ids, sources, logprobs, decode)
        offsets, text, texts, start = self.offsets, self.text, [], self._sent
        for n in ends:
            first += n
            end = offsets[first] if first < len(offsets) else len(text)
            texts.append(text[start:end])
            start = end
        self._sent = len(text)
        return texts

    def _append_all(self, token_ids: list[int], sources: list[str], logprobs: list | None,
                    decode: Callable[[list[int]], str] | None) -> list[dict]:
        """Add tokens where no stop string can cut the text; the tokens added."""
        n = min(len(token_ids), len(sources))
        pieces = self._detokenizer.add_all(token_ids[:n], decode)
        kept = [{"id": token_id, "text": piece, "source": source}
                for token_id, piece, source in zip(token_ids, pieces, sources)]
        offset, offsets = len(self.text), self.offsets
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        self.tokens += kept
        self.logprobs += logprobs[:n] if logprobs is not None else [None] * n
        self.text += "".join(pieces)
        return kept

    def finish(self) -> None:
        """Decoding ended: release the held-back text (unless a stop string already cut it)."""
        if not self.stopped and not self.finished:
            rest = self._detokenizer.flush()
            if rest:
                self.text += rest
                if self.tokens:
                    self.tokens[-1]["text"] += rest
                self._cut(len(rest))
        self.finished = True

    def take(self) -> str:
        """Text not sent yet that no later token can change (a possible start of a stop string is held)."""
        end = len(self.text) if self.stopped or self.finished else len(self.text) - self._held()
        piece = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece

    def answered(self) -> int:
        """How many tokens the answer's text shows: all of them, except where a stop string cut the text, the
        tokens whose text lies wholly after the cut."""
        if not self.stopped:
            return len(self.tokens)
        return sum(1 for offset in self.offsets if offset < len(self.text))

    def take_tokens(self) -> range:
        """The tokens whose text `take` has now sent in full (at the end, every token the answer shows): each
        goes out once, with the text it belongs to. A token with no text of its own (a special token, or the
        first bytes of a character another token completes) goes with the text after it, as `answered` counts
        it: where a stop string cuts right after it, it is not reported at all."""
        if self.stopped or self.finished:
            end = self.answered()
        else:
            end, sent = self._tokens_sent, self._sent
            while end < len(self.tokens):
                offset, length = self.offsets[end], len(self.tokens[end]["text"])
                if offset + length > sent or not length and offset >= sent:
                    break
                end += 1
        taken = range(self._tokens_sent, max(end, self._tokens_sent))
        self._tokens_sent = taken.stop
        return taken

    def _append(self, token_id: int, source: str, piece: str, kept: list[dict]) -> None:
        token = {"id": token_id, "text": piece, "source": source}
        self.tokens.append(token)
        kept.append(token)
        self.text += piece
        self._cut(len(piece))

    def _cut(self, added: int) -> None:
        """Cut the text at the first stop string that the last `added` characters may have completed (none before
        min_tokens tokens: as vLLM, a stop string completed before then is not looked for again)."""
        if not self._stop or not added or len(self.tokens) < self._min_tokens:
            return
        start = max(0, len(self.text) - added - self._longest_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper prefix of some stop string."""
        for n in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0


def _joined_rounds(chunks: Iterable) -> tuple[list[int], list[str], list, list[int]]:
    """The rounds' tokens, sources and log-probabilities (None where not asked for) joined, and how many tokens
    each round holds (as feed's zip: no more than it has sources)."""
    token_ids, sources, logprobs, counts = [], [], [], []
    for chunk in chunks:
        n = min(len(chunk.token_ids), len(chunk.sources))
        token_ids += chunk.token_ids[:n]
        sources += chunk.sources[:n]
        logprobs += chunk.logprobs[:n] if chunk.logprobs is not None else [None] * n
        counts.append(n)
    return token_ids, sources, logprobs, counts
