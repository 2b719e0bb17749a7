"""Grammar constraints on the generated tokens, from llguidance: what a request may constrain its output to
(`Constraint`), their compilation (`GrammarCompiler`: the tokenizer's tables built once, compiled grammars
cached by a hash of their source), and one request's grammar state (`GrammarState`): the allowed-token mask at
the current position, the tokens the grammar forces there, and rollback when proposals are rejected.

The engine applies a position's mask to the target's and the draft's logits alike (engine.py); a drafter reads
the forced tokens (drafters.GuidedDrafter). Nothing here samples or knows about speculation.
"""

import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from .errors import SpecDecError

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_BYTES = 64 * 1024  # a schema, regex, grammar or list of choices longer than this is refused
MAX_CHOICES = 256
CACHE_SIZE = 64  # compiled grammars kept, least recently used first out
# JSON as the default pair writes it: ", " and ": " between items, no other whitespace (so braces, quotes, keys
# and separators are forced, and proposed for free)
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# llguidance's own bounds on one grammar's compilation and on each mask's computation: a client's grammar costs
# at most this much lexer and parser work, whatever it says
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_grammar_size=200_000, max_lexer_states=50_000)


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match. `kind`: json_schema (`source` a JSON schema, as JSON text),
    json_object (any JSON object; no source), regex, choice (`source` a JSON list of strings: exactly one of
    them), grammar (a Lark grammar, as llguidance reads it). `field` names the request field it came from, for
    errors. `parts`: constraints embedded in this one, each with its own field (a tool's parameters in the tools'
    grammar): where this one does not compile, the first part that does not compile alone is named instead."""

    kind: str
    source: str = ""
    field: str = "response_format"
    parts: tuple["Constraint", ...] = dataclass_field(default=(), compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecDecError(f"a constraint's kind must be one of {', '.join(KINDS)}, got {self.kind!r}",
                               field=self.field)
        if len(self.source.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
            raise SpecDecError(f"the {self.kind} is {len(self.source.encode('utf-8', 'surrogatepass'))} bytes "
                               f"long; the limit is {MAX_SOURCE_BYTES}", field=self.field)

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "response_format") -> "Constraint":
        if not isinstance(schema, (dict, bool)):
            raise SpecDecError("the JSON schema must be an object", field=field)
        # the keys in the client's order: an object's properties are written in the order its schema lists them
        # (as OpenAI's structured outputs write them), so the schema is not canonicalized by sorting
        try:
            source = json.dumps(schema, allow_nan=False)
        except ValueError:  # Python's JSON reads 1e400 as infinity, which JSON cannot write back
            raise SpecDecError("the JSON schema holds a number out of range (NaN, or an infinity such as 1e400)",
                               field=field) from None
        return cls("json_schema", source, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "structured_outputs.choice") -> "Constraint":
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise SpecDecError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings", field=field)
        return cls("choice", json.dumps(choices), field)

    @property
    def key(self) -> str:
        """The cache key: a hash of the kind and the source."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode("utf-8", "surrogatepass")).hexdigest()

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (not yet checked)."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(self.source)))
        return llguidance.LLMatcher.grammar_from_lark(self.source)


class _TokenTable:
    """A tokenizer as llguidance's generic wrapper reads it (each token's bytes, and an encoder), for tokenizers
    its Hugging Face reader does not take."""

    def __init__(self, tokenizer):
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids))
        special = set(self.special_token_ids)
        self.tokens = [(tokenizer.convert_ids_to_tokens(i) if i in special else tokenizer.decode([i])).encode()
                       for i in range(len(tokenizer))]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's tables for a Hugging Face tokenizer (about a second for a 150k vocabulary: build it once)."""
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except ValueError:  # a decoder its reader does not know (the tests' character tokenizer)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)), n_vocab=vocab_size)


class CompiledGrammar:
    """A checked grammar, ready to start a request's state from (a copy of its pristine matcher)."""

    def __init__(self, constraint: Constraint, matcher: llguidance.LLMatcher, vocab_size: int, width: int, eos: int,
                 compile_seconds: float, specials: torch.Tensor | None = None):
        self.constraint = constraint
        self.specials = specials
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.width = width  # the grammar tokenizer's vocabulary, which its bitmasks cover
        self.eos = eos  # the tokenizer's end-of-sequence token, the one proposed where the grammar is complete
        self.compile_seconds = compile_seconds
        self.failed = False  # a state of it failed: its matchers share a lexer in an error state, it is not reused

    def start(self, eos: set[int]) -> "GrammarState":
        """A request's state at the grammar's start; `eos`: the ids that end its generation."""
        matcher = self._matcher
        if matcher is None:  # failed since the compiler gave it out (GrammarCompiler.compile compiles it again)
            raise SpecDecError(f"the {self.constraint.kind} went beyond the grammar engine's limits while decoding "
                               f"another request; send it again", field=self.constraint.field)
        return GrammarState(matcher.deep_copy(), self.vocab_size, eos, self.eos, self.width, self.specials,
                            constraint=self.constraint, on_error=self._fail)

    def _fail(self, poisoned: bool) -> None:
        """A state of it failed (the compiler compiles it afresh for the next request). `poisoned`: its lexer,
        shared with the pristine matcher, went past the engine's limits: the pristine matcher is let go at once (it
        held some 90 MB for `a{999990}` as long as the cache kept the entry; found by a soak audit). A dead end, or
        one request's refused token, leaves it sound."""
        self.failed = True
        if poisoned:
            self._matcher = None


class GrammarCompiler:
    """Compiles constraints for one tokenizer into CompiledGrammars, `cache_size` most recently used kept."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        """`tokenizer`: a Hugging Face tokenizer, or llguidance's tables already built (LLTokenizer)."""
        self.vocab_size = vocab_size  # the engine's (shared) vocabulary: masks have this width
        self.tokenizer = tokenizer if isinstance(tokenizer, llguidance.LLTokenizer) \
            else ll_tokenizer(tokenizer, max(vocab_size, len(tokenizer)))
        # the special tokens (an unknown-token, a padding token): checked one by one where a mask allows them
        self.specials = torch.tensor([t for t in range(min(vocab_size, self.tokenizer.vocab_size))
                                      if self.tokenizer.is_special_token(t)], dtype=torch.long)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self.hits = self.misses = 0

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's CompiledGrammar, from the cache if it was compiled before; a SpecDecError naming
        the constraint's field if it is invalid or beyond the limits."""
        key = constraint.key
        if key in self._cache and self._cache[key].failed:  # compiled again, with a lexer of its own
            del self._cache[key]
        if key in self._cache:
            self.hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        self.misses += 1
        start = time.perf_counter()
        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as error:
            self._blame_a_part(constraint)
            raise SpecDecError(f"invalid {constraint.kind}: {error}", field=constraint.field) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            self._blame_a_part(constraint)
            raise SpecDecError(f"invalid or unsupported {constraint.kind}: {_first_lines(matcher.get_error())}",
                               field=constraint.field)
        compiled = CompiledGrammar(constraint, matcher, self.vocab_size, self.tokenizer.vocab_size,
                                   self.tokenizer.eos_token, time.perf_counter() - start, self.specials)
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        logger.debug("compiled a %s grammar in %.4fs", constraint.kind, compiled.compile_seconds)
        return compiled

    def _blame_a_part(self, constraint: Constraint) -> None:
        """The first of the constraint's parts that does not compile alone: its error, naming its field."""
        for part in constraint.parts:
            self.compile(part)


def _first_lines(message: str, lines: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:lines])


class GrammarState:
    """One request's position in its grammar: the tokens consumed so far (committed, then this round's
    proposals), the mask and forced token at the current position, and rollback.

    End-of-sequence tokens: the grammar has one (the tokenizer's); every id in `eos` is allowed exactly where it
    is, and none is fed to the matcher (a generation ends on it). `seconds` is the time spent in the grammar
    (masks, forced tokens, state), `masks` the masks computed.

    llguidance builds its lexer lazily, so a grammar within the limits at compilation may exceed them later (a
    regex such as `a{999999}`, at its first token): the matcher then fails, and so does the request, with a
    SpecDecError naming the constraint's field (`on_error` is told first), never an output cut short as if the
    grammar were complete.

    A dead end (the grammar goes on only through text no token writes: a character outside a character-level
    vocabulary without byte tokens) allows only the end-of-sequence tokens there, as an end would, and fails the
    request once such an end is committed (`sync`), not while it is only proposed: a draft may explore a dead end
    the target then rejects, and every method must fail exactly where target-only decoding would."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: set[int], preferred_eos: int | None = None,
                 width: int | None = None, specials: torch.Tensor | None = None, *,
                 constraint: Constraint | None = None, on_error=None):
        self.matcher = matcher
        self.constraint = constraint
        self._on_error = on_error
        self.vocab_size = vocab_size
        self.eos = sorted(t for t in eos if t < vocab_size)
        self.end = preferred_eos if preferred_eos in self.eos else (self.eos[0] if self.eos else None)
        self.specials = None if specials is None else specials[~torch.isin(specials, torch.tensor(self.eos))]
        self.tokens: list[int] = []  # consumed, in order
        self._bits = llguidance.torch.allocate_token_bitmask(1, max(vocab_size, width or 0))
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._mask: torch.Tensor | None = None  # the current position's, until the state moves
        self._dead_ends: set[int] = set()  # positions (len(tokens) there) found to be dead ends on the path consumed
        self.seconds = 0.0
        self.masks = 0

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar allows at the current position."""
        if self._mask is None:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(self.matcher, self._bits)
            self._check()
            bits = ((self._bits[0].unsqueeze(-1) >> self._shifts) & 1).flatten()[: self.vocab_size].bool()
            refused = self._refuse_specials(bits)
            can_end = self.matcher.is_accepting() or self.matcher.is_stopped()
            if refused and not can_end and not bool(bits.any()):  # only refused tokens were offered
                if not self.eos:  # nothing could end it here: fail at once
                    self._dead_end()
                self._dead_ends.add(len(self.tokens))
            if self.eos:
                bits[self.eos] = can_end
            if not bool(bits.any()):  # complete: nothing is possible but to end
                bits[self.eos] = True
                if not self.eos:  # a model without an end-of-sequence token goes on unconstrained
                    bits[:] = True
            self._mask = bits
            self.masks += 1
            self.seconds += time.perf_counter() - start
        return self._mask

    def _refuse_specials(self, bits: torch.Tensor) -> bool:
        """Clear the special tokens a mask allows that the matcher would refuse; whether it cleared any. Where a
        grammar needs bytes no token makes (a character outside a character-level vocabulary, which has no byte
        tokens), llguidance's mask and forced tokens offer the unknown-token, which it then refuses to consume."""
        refused = False
        if self.specials is None or not len(self.specials):
            return refused
        for token in self.specials[bits[self.specials]].tolist():
            if not self.matcher.validate_tokens([token]):
                bits[token] = False
                refused = True
        return refused

    def forced(self) -> int | None:
        """The token the grammar forces here (the first of its forced string, as the tokenizer would write it;
        an end-of-sequence token once the grammar is complete), or None where it allows a choice."""
        start = time.perf_counter()
        try:
            if self.matcher.is_stopped():
                return self.end
            tokens = self.matcher.compute_ff_tokens()
            self._check()
            return tokens[0] if tokens and tokens[0] < self.vocab_size else None
        finally:
            self.seconds += time.perf_counter() - start

    def _check(self) -> None:
        """Raise if the matcher has failed: the request's constraint went beyond the grammar engine's limits."""
        if self.matcher.is_error():
            error = self.matcher.get_error()  # llguidance's: "lexer error: ..." past its limits
            self._fail(f"is beyond the grammar engine's limits after {len(self.tokens)} tokens "
                       f"({_first_lines(error, 1)}); simplify it (smaller repetition counts, fewer alternatives)",
                       poisoned=error.startswith("lexer error"))

    def _dead_end(self, at: int | None = None) -> None:
        """Raise for a dead end `at` tokens in (where the grammar goes on only through text no token of the
        vocabulary writes): ending there would answer "stop" with text that does not match (found by an audit)."""
        at = len(self.tokens) if at is None else at
        self._fail(f"cannot be completed with this model's tokens after {at} tokens: it goes on only through text "
                   f"that no token writes (a character outside the vocabulary)")

    def _fail(self, problem: str, poisoned: bool = False) -> None:
        if self._on_error is not None:
            self._on_error(poisoned)
        kind, field = (self.constraint.kind, self.constraint.field) if self.constraint else ("grammar", None)
        raise SpecDecError(f"the {kind} {problem}", field=field)

    def allows(self, token: int) -> bool:
        return bool(self.allowed()[token])

    def advance(self, token: int) -> None:
        """Consume one allowed token (an end-of-sequence token only moves the position)."""
        if token in self.eos:
            self.allowed()  # marks a dead end here, if this is one (the engine has this mask already)
        start = time.perf_counter()
        if token not in self.eos and not self.matcher.consume_token(token):
            self._check()
            raise SpecDecError(f"the grammar cannot take token {token}")  # an engine bug: it proposed no such token
        self.tokens.append(token)
        self._mask = None
        self.seconds += time.perf_counter() - start

    def sync(self, generated: list[int]) -> None:
        """Move to the end of `generated` (the committed tokens): roll back what they do not share with the
        tokens consumed (rejected proposals), consume the rest."""
        common = 0
        for mine, theirs in zip(self.tokens, generated):
            if mine != theirs:
                break
            common += 1
        if common < len(self.tokens):
            start = time.perf_counter()
            dropped = self.tokens[common:]
            self.matcher.rollback(sum(1 for t in dropped if t not in self.eos))
            del self.tokens[common:]
            self._dead_ends = {position for position in self._dead_ends if position <= common}
            self._mask = None
            self.seconds += time.perf_counter() - start
        for token in generated[common:]:
            self.advance(token)
        if any(position < len(generated) and generated[position] in self.eos for position in self._dead_ends):
            self._dead_end(at=min(self._dead_ends))
