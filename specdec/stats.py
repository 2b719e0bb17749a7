"""GenerationStats: what one generation did and cost, for finished and abandoned generations alike.

The engine fills it; the CLI prints it, the service serialises it (`as_dict`) and feeds its metrics from it, the
benchmark aggregates it. Reading it like a dict (`stats["new_tokens"]`) still works, as it did when it was one.
"""

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields


@dataclass(frozen=True, eq=True)
class GenerationStats(Mapping):
    method: str
    gamma: int | None  # None: adaptive, or a method without proposals
    drafter: str | None  # "model" | "lookup" | "hybrid"; None: a method without proposals
    verification: str | None  # "token" | "block"; None: a method without proposals
    # the draft model ends its run after a token it gave less than this (0: never); None: no draft model drafts
    draft_confidence_threshold: float | None
    seed: int
    prompt_tokens: int
    new_tokens: int  # generated tokens only, never the prompt's
    proposed: int  # draft tokens proposed to the target
    accepted: int  # ... and accepted by it
    acceptance_rate: float | None  # accepted / proposed
    tokens_per_target_forward: float | None  # generated tokens per target forward, the prompt's prefill included
    rounds: int
    drafts: int  # rounds that proposed at least one token (vLLM's num_drafts)
    # vLLM's definition: 1 + accepted / drafts, the tokens a round with a draft commits (always >= 1); None: no drafts
    mean_acceptance_length: float | None
    draft_forwards: int
    target_forwards: int
    draft_seconds: float
    target_seconds: float
    # each model's first forward (the prompt prefill, with the first proposal or token): the forwards after it
    # are the per-token costs that the Leviathan model's c describes
    draft_prefill_seconds: float
    target_prefill_seconds: float
    other_seconds: float  # outside both models' forwards: sampling, verification, bookkeeping
    total_seconds: float
    tokens_per_second: float | None
    # the first round includes the prompt prefill (time to first token); the rounds after it are the steady
    # state that Leviathan et al.'s expected speedup describes
    first_chunk_seconds: float
    first_chunk_tokens: int
    decode_tokens_per_second: float | None
    # accepted_per_position[i]: rounds whose draft token at position i (0-based) was accepted, for every position
    # a round proposed (zeros included: its length is the longest proposal)
    accepted_per_position: list[int] = field(default_factory=list)
    # per drafter ("model", "lookup"): tokens it proposed, and of those the target accepted
    proposed_by_drafter: dict[str, int] = field(default_factory=dict)
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)
    # rounds each drafter served (the drafter of a round's first proposal; "none": nothing was proposed, the
    # target drew the token alone), as counts and as shares of all rounds
    rounds_by_drafter: dict[str, int] = field(default_factory=dict)
    round_share_by_drafter: dict[str, float] = field(default_factory=dict)
    # under a grammar constraint: the accepted proposals the grammar forced, and the seconds spent in the grammar
    # (masks, forced tokens, consuming and rolling back); None without a constraint
    forced_tokens: int | None = None
    grammar_seconds: float | None = None
    finished: bool = True  # False: abandoned (client gone, error) before the engine returned
    queue_seconds: float | None = None  # the service's wait for the engine; None outside the service
    # prompt tokens the target did not prefill because the prompt cache held their keys and values from an earlier
    # request (0: it held none of them); None: the request did not consult it (off, opted out, compiled pair)
    cached_tokens: int | None = None

    def as_dict(self) -> dict:
        """The fields as a dict (`dataclasses.asdict`'s, with its lists and dicts copied: their items are numbers
        and strings, so one level is a deep copy, at a fifth of asdict's cost, paid by every answer)."""
        return {name: _copied(getattr(self, name)) for name in self._names()}

    # --- read-only mapping view --------------------------------------------------------------------------------

    def __getitem__(self, key: str):
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    @functools.cache
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _copied(value):
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


def summed(stats: "list[GenerationStats] | tuple[GenerationStats, ...]") -> dict:
    """Totals over several generations: tokens, seconds, proposals and acceptances (the CLI's table)."""
    proposed = sum(s.proposed for s in stats)
    accepted = sum(s.accepted for s in stats)
    tokens = sum(s.new_tokens for s in stats)
    seconds = sum(s.total_seconds for s in stats)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds if seconds > 0 else None,
            "acceptance_rate": accepted / proposed if proposed else None}
