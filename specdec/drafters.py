"""Ways of drafting: each proposes up to `limit` tokens after the committed sequence, with the distribution q each
was drawn from, and the engine verifies the Proposal the same way whoever made it.

- ModelDrafter: the draft model samples autoregressively from its own (warped) distribution q, and may end its
  run early after a token it is unsure of (`confidence_threshold`).
- LookupDrafter: prompt lookup. The longest suffix of the sequence (n-gram sizes from `max_ngram` down to
  `min_match`) is looked up among earlier positions of the prompt and the generated text, and the token that
  followed its most recent occurrence is proposed. It is a deterministic proposal, so it carries a one-hot q:
  the rule min(1, p/q) then accepts it with probability p(x) and resamples from norm(max(0, p - q)), which is
  p with x removed, so no special case is needed for exactness.
- HybridDrafter: at each position, the lookup's token where its match is at least `min_match` tokens long,
  else the draft model's.
- GuidedDrafter: any of the three under a grammar (grammar.py): where the grammar forces a token, that token as
  a one-hot proposal (drafter "grammar"); elsewhere the inner drafter's, the draft model's q masked to what the
  grammar allows, a lookup token it forbids taken as no match.

What proposes at each position depends only on the sequence before it (the committed tokens and this round's
proposals before it), never on random draws or on where the round began: a proposed token continues the match
of the sequence as extended by the proposals before it (the lookup indexes the round's own proposals as they are
made), and a drafter's cap (or the draft model's unsure token) ends the round rather than handing the position to
the other drafter. With adaptive gamma's per-position draws, the output then does not depend on the round lengths
chosen, as with the draft model alone.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .kv_cache import CachedModel
from .params import LookupSettings
from .sampling import mask_logits, sample, token_probability

SOURCES = {"model": "draft", "lookup": "lookup", "grammar": "grammar"}  # drafter -> the source label of its accepted tokens
# NgramIndex.update slices n-grams one by one for at most this many new positions (a round's), and by zipped
# slices for more (a prompt): each is the faster one there
SMALL_UPDATE = 16
MAX_FORCED = 32  # forced tokens proposed per round at most (each widens the target's forward by one)


@dataclass
class Proposal:
    """One round's draft: tokens x_1..x_k, the (V,) distribution q_i each was drawn from, and who proposed it."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    drafters: list[str] = field(default_factory=list)  # "model" | "lookup" | "grammar", per token
    stacked: torch.Tensor | None = None  # probs as one (k, V) tensor, where the drafter has it so already
    # under a grammar: the (V,) bool mask of the tokens it allowed at each proposed position
    allowed: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def draft_probs(self) -> torch.Tensor:
        """(k, V): row i - 1 is q_i."""
        return self.stacked if self.stacked is not None else torch.stack(self.probs)

    def add(self, token: int, probs: torch.Tensor | None, drafter: str) -> None:
        self.tokens.append(token)
        self.probs.append(probs)
        self.drafters.append(drafter)

    @property
    def drafter(self) -> str:
        """The drafter that served the round: the one of its first proposal ("none" if nothing was proposed)."""
        return self.drafters[0] if self.drafters else "none"


class NgramIndex:
    """n-gram -> the last position it ended at with a known next token, for n = 1..max_ngram, over a sequence
    that only grows (the committed tokens): each round indexes only the positions that gained a next token."""

    def __init__(self, max_ngram: int, indexed: int = 0):
        self.max_ngram = max_ngram
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = indexed  # n-grams ending before this position are in `last` (or not wanted there)

    def update(self, ids: list[int]) -> None:
        """Index the n-grams ending at positions indexed .. len(ids) - 2 (each now has its next token)."""
        end = len(ids) - 1
        if end <= self.indexed:
            return
        if end - self.indexed <= SMALL_UPDATE:  # a round's few tokens: slice each n-gram, in order
            for position in range(self.indexed, end):
                for n in range(1, min(self.max_ngram, position + 1) + 1):
                    self.last[tuple(ids[position - n + 1: position + 1])] = position
        else:
            for n in range(1, self.max_ngram + 1):
                first = max(self.indexed, n - 1)
                # the n-grams ending at first .. end - 1 as tuples, in order, so the latest position wins
                grams = zip(*(ids[first - n + 1 + j: end - n + 1 + j] for j in range(n)))
                self.last.update(zip(grams, range(first, end)))
        self.indexed = end

    def match(self, seq: list[int], min_n: int = 1, later: "NgramIndex | None" = None) -> tuple[int, int] | None:
        """(position, n) of the most recent indexed occurrence of seq's longest suffix with min_n <= n <=
        max_ngram; None if there is none. The token after it, ids[position + 1], is the lookup's proposal.
        `later`: an index of positions after all of this one's, looked up first at each n."""
        for n in range(min(self.max_ngram, len(seq)), min_n - 1, -1):
            gram = tuple(seq[-n:])
            position = later.last.get(gram) if later is not None else None
            if position is None:
                position = self.last.get(gram)
            if position is not None:
                return position, n
        return None


class ModelDrafter:
    """The draft model as a drafter: it owns its KV cache for the request. Its first forward of a round feeds
    every token it has not seen (committed since, or proposed by the lookup) in one forward.

    `confidence_threshold`: the draft ends its run after a token it gave a probability below this (softmax of its
    logits, before temperature, top-k and top-p), instead of drafting on to gamma. That decision reads the draft's
    own outputs only, never the target's or the verification's draws, so exactness is untouched; it saves the
    draft forwards and the verification width that proposals after an unsure token mostly waste. 0 never stops.
    """

    name = "model"

    def __init__(self, model: CachedModel, probs: Callable[..., torch.Tensor],
                 forward: Callable[[CachedModel, list[int]], torch.Tensor], confidence_threshold: float = 0.0,
                 greedy: bool = False):
        self.model = model
        # (logits, context=sequence) -> the warped distribution, as for the target (engine._Warper)
        self.probs = probs
        self.forward = forward  # the request's timed forward: (model, new tokens) -> logits of the last one
        self.confidence_threshold = confidence_threshold
        # temperature 0 and a verification that reads tokens only (engine._verify_greedy): the argmax, no q
        self.greedy = greedy

    def draw(self, seq: list[int], generator: torch.Generator,
             allowed: torch.Tensor | None = None) -> tuple[int, torch.Tensor, bool] | None:
        """The draft's next token after seq, the distribution q it was drawn from, and whether the run may go on
        after it (the draft's probability of it reaches confidence_threshold). `allowed`: a grammar's (V,) mask,
        applied to the logits before temperature, top-k and top-p, as for the target; None where the draft gives
        every allowed token probability 0 (a draft over part of the vocabulary, models/draft_vocab.py): no proposal."""
        logits = self.forward(self.model, seq[self.model.length:])[-1]
        masked = logits if allowed is None else mask_logits(logits, allowed)
        if allowed is not None and not bool(torch.isfinite(masked).any()):
            return None
        if self.greedy:  # q would be the one-hot of this token, and a draw from it this token
            q, token = None, self.probs.argmax(masked.unsqueeze(0), context=seq)[0]
        else:
            q = self.probs(masked, context=seq)
            token = sample(q, generator)
        vocab = self.probs.vocab_size if q is None else q.size(-1)
        go_on = (self.confidence_threshold <= 0
                 or token_probability(logits[:vocab], token) >= self.confidence_threshold)
        return token, q, go_on

    def propose(self, ids: list[int], gamma: int, limit: int, generator_at) -> Proposal:
        """Up to min(gamma, limit) tokens drawn autoregressively, ending early after an unsure one; proposal i's
        draw from generator_at(i)."""
        proposal, seq = Proposal(), list(ids)
        for i in range(min(gamma, limit)):
            token, q, go_on = self.draw(seq, generator_at(i))
            proposal.add(token, q, self.name)
            seq.append(token)
            if not go_on:
                break
        return proposal

    def rollback(self, length: int) -> None:
        self.model.rollback(length)


class LookupDrafter:
    """Prompt lookup: the continuation of the most recent earlier occurrence of the sequence's longest suffix."""

    name = "lookup"

    def __init__(self, vocab_size: int, settings: LookupSettings = LookupSettings(), min_match: int | None = None):
        self.vocab_size = vocab_size
        self.settings = settings
        self.min_match = settings.min_match if min_match is None else min_match
        self.index = NgramIndex(settings.max_ngram)  # the committed tokens
        # the n-grams that end where this round's proposals gave a token its next one (from the last committed
        # token's on): not committed, so not in `index`
        self.round = NgramIndex(settings.max_ngram)
        # one-hot rows, allocated once per request and reset entry by entry: a fresh (k, V) tensor each round
        # would cost milliseconds in page faults alone at V = 151,936
        self._one_hots: torch.Tensor | None = None
        self._set: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, tokens) of the entries now 1

    def next_token(self, seq: list[int]) -> int | None:
        """The lookup's proposal after seq (the committed tokens, then this round's proposals), or None.

        The most recent occurrence counts, among the committed tokens and this round's proposals alike, so the
        answer depends on the sequence alone, not on which of its tokens a round boundary left uncommitted."""
        self.round.update(seq)  # seq only grows within a round
        found = self.index.match(seq, self.min_match, later=self.round)
        return None if found is None else seq[found[0] + 1]

    def one_hots(self, tokens: list[int]) -> torch.Tensor:
        """(len(tokens), V): row i is 1 at tokens[i], 0 elsewhere. Valid until the next round starts."""
        if self._one_hots is None:
            self._one_hots = torch.zeros(self.settings.max_tokens, self.vocab_size)
        self._clear()
        self._set = (torch.arange(len(tokens)), torch.tensor(tokens))
        self._one_hots[self._set] = 1.0
        return self._one_hots[: len(tokens)]

    def _clear(self) -> None:
        if self._set is not None:
            self._one_hots[self._set] = 0.0
            self._set = None

    def start(self, ids: list[int]) -> None:
        """Index the committed sequence (only what was committed since the last round); a new round."""
        self.index.update(ids)
        self.round = NgramIndex(self.settings.max_ngram, indexed=max(len(ids) - 1, 0))

    def propose(self, ids: list[int], gamma: int, limit: int, generator_at=None) -> Proposal:
        """Up to min(max_tokens, limit) tokens, each continuing the match as extended by the ones before it;
        none if the sequence's suffix has no earlier occurrence. gamma (the draft model's length) is unused."""
        self.start(ids)
        seq = list(ids)
        for _ in range(min(self.settings.max_tokens, limit)):
            token = self.next_token(seq)
            if token is None:
                break
            seq.append(token)
        tokens = seq[len(ids):]
        if not tokens:
            return Proposal()
        stacked = self.one_hots(tokens)
        return Proposal(tokens, list(stacked.unbind(0)), [self.name] * len(tokens), stacked)

    def rollback(self, length: int) -> None:
        """Nothing to undo: the index holds committed tokens only."""


class HybridDrafter:
    """Lookup where its match is long enough (hybrid_min_match), the draft model elsewhere, decided per position.

    A round is served by the drafter of its first position and ends where the other one would take over, unless
    `extend` lets them mix (the lookup continuing where the draft model's tokens found a match, and the draft
    model again where that match ends, if it does before the lookup's cap); each drafter's cap (gamma for the
    model, max_tokens for the lookup) ends the round, and so does a token the draft model was unsure of. A round
    the lookup starts always runs to its cap or the limit: its proposals copy earlier text, whose n-grams all have
    a known next token, so mixing starts with the draft model.
    """

    name = "hybrid"

    def __init__(self, model: ModelDrafter, lookup: LookupDrafter, settings: LookupSettings = LookupSettings()):
        self.model, self.lookup, self.settings = model, lookup, settings

    def propose(self, ids: list[int], gamma: int, limit: int, generator_at) -> Proposal:
        self.lookup.start(ids)
        proposal, seq = Proposal(), list(ids)
        counts = {"model": 0, "lookup": 0}
        caps = {"model": gamma, "lookup": self.settings.max_tokens}
        for i in range(limit):
            token = self.lookup.next_token(seq)
            drafter = "model" if token is None else "lookup"
            if counts[drafter] >= caps[drafter] or (proposal.drafters and drafter != proposal.drafters[0]
                                                     and not self.settings.extend):
                break
            q, go_on = None, True  # a lookup token's one-hot row is filled in below, all of them in one write
            if token is None:
                token, q, go_on = self.model.draw(seq, generator_at(i))
            proposal.add(token, q, drafter)
            counts[drafter] += 1
            seq.append(token)
            if not go_on:  # the draft model was unsure of its token
                break
        if counts["lookup"]:
            at = [i for i, drafter in enumerate(proposal.drafters) if drafter == "lookup"]
            rows = self.lookup.one_hots([proposal.tokens[i] for i in at])
            for i, row in zip(at, rows.unbind(0)):
                proposal.probs[i] = row
            if not counts["model"]:
                proposal.stacked = rows
        return proposal

    def rollback(self, length: int) -> None:
        self.model.rollback(length)


class OneHotRows:
    """(n, V) one-hot rows for deterministic proposals, in one buffer allocated once per request and reset entry
    by entry (a fresh (k, V) tensor each round costs page faults at V = 151,936). Valid until the next call."""

    def __init__(self, rows: int, vocab_size: int):
        self.buffer = torch.zeros(rows, vocab_size)
        self._set: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        if self._set is not None:
            self.buffer[self._set] = 0.0
        self._set = (torch.arange(len(tokens)), torch.tensor(tokens))
        self.buffer[self._set] = 1.0
        return self.buffer[: len(tokens)]


class GuidedDrafter:
    """A drafter under a grammar. At each position: the token the grammar forces there, if `forced` and it
    forces one (a one-hot q, drafter "grammar"); else the inner drafter's, the draft model drawing from its q
    masked to the grammar's allowed tokens, and a lookup token the grammar forbids counting as no match.

    `guide` is the request's grammar state (grammar.GrammarState), at the committed sequence's end when a round
    starts; proposing advances it over the proposals (the engine rolls it back to what is committed). What is
    proposed at a position still depends only on the sequence before it: the forced token and the mask are the
    grammar's at that sequence. A cap (gamma for the draft model, the lookup's max_tokens, MAX_FORCED) ends the
    round, as in HybridDrafter."""

    name = "grammar"

    def __init__(self, inner, guide, vocab_size: int, forced: bool = True):
        self.inner, self.guide, self.forced = inner, guide, forced
        self.model = inner if isinstance(inner, ModelDrafter) else getattr(inner, "model", None)
        self.lookup = inner if isinstance(inner, LookupDrafter) else getattr(inner, "lookup", None)
        self.settings = self.lookup.settings if self.lookup is not None else LookupSettings()
        self.mixed = isinstance(inner, HybridDrafter)  # the lookup where it matches, the model elsewhere
        self.one_hots = OneHotRows(MAX_FORCED + self.settings.max_tokens, vocab_size)

    def _inner_token(self, seq: list[int], allowed: torch.Tensor, generator: torch.Generator):
        """(token, q or None, drafter, go_on) from the inner drafter at this position, or None: no proposal."""
        if self.lookup is not None:
            token = self.lookup.next_token(seq)
            if token is not None and bool(allowed[token]):
                return token, None, "lookup", True
            if not self.mixed:
                return None
        drawn = self.model.draw(seq, generator, allowed)
        if drawn is None:
            return None
        token, q, go_on = drawn
        return token, q, "model", go_on

    def propose(self, ids: list[int], gamma: int, limit: int, generator_at) -> Proposal:
        if self.lookup is not None:
            self.lookup.start(ids)
        guide, proposal, seq = self.guide, Proposal(), list(ids)
        caps = {"model": gamma, "lookup": self.settings.max_tokens, "grammar": MAX_FORCED}
        counts = dict.fromkeys(caps, 0)
        for i in range(limit):
            allowed = guide.allowed()
            forced = guide.forced() if self.forced else None
            if forced is not None and bool(allowed[forced]):
                token, q, drafter, go_on = forced, None, "grammar", True
            else:
                drawn = self._inner_token(seq, allowed, generator_at(i))
                if drawn is None:
                    break
                token, q, drafter, go_on = drawn
            firsts = [d for d in proposal.drafters if d != "grammar"]
            if counts[drafter] >= caps[drafter] or (drafter != "grammar" and firsts and drafter != firsts[0]
                                                     and not self.settings.extend):
                break
            proposal.add(token, q, drafter)
            proposal.allowed.append(allowed)
            counts[drafter] += 1
            seq.append(token)
            if token in guide.eos:  # nothing is proposed past the end
                break
            guide.advance(token)
            if not go_on:
                break
        # the grammar's and the lookup's rows (a greedy draft model's have no q either: nothing reads them)
        one_hot = [i for i, (q, d) in enumerate(zip(proposal.probs, proposal.drafters)) if q is None and d != "model"]
        if one_hot:
            rows = self.one_hots([proposal.tokens[i] for i in one_hot])
            for i, row in zip(one_hot, rows.unbind(0)):
                proposal.probs[i] = row
        return proposal

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)
