"""The decoding engine: a drafter proposes tokens, the target scores them in one forward, a verification rule
keeps a prefix, caches roll back.

Batch size 1. The engine knows nothing about text, nor which drafter (drafters.py) or rule (verification.py)
it holds: token ids in, token ids with their provenance and stats out. Nothing here prints; per-round detail
goes to the DEBUG log.
"""

import dataclasses
import inspect
import logging
import numbers
import os
import time
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from . import verification
from .adaptive import AdaptiveGamma, CostProfile
from .compiled import StaticCachedModel, cache_for, takes_static_cache
from .drafters import SOURCES, GuidedDrafter, HybridDrafter, LookupDrafter, LookupSettings, ModelDrafter, Proposal
from .errors import SpecDecError
from .grammar import CompiledGrammar, GrammarState
from .kv_cache import CachedModel, context_length
from .models.memory import release_free_memory
from .params import (
    ADAPTIVE_MAX_GAMMA,
    DRAFTERS,
    GOLDEN,
    MAX_GAMMA,
    METHODS,
    MIN_TEMPERATURE,
    SPECULATIVE_METHODS,
    VERIFICATIONS,
    SamplingParams,
    splitmix64,
    token_ids,
)
from .prompt_cache import PromptCache, reusable
from .prompt_cache import crop as crop_cache
from .sampling import TokenLogprobs, logit_bias_vector, logits_to_probs, mask_logits, penalize, sample, token_logprobs
from .stats import GenerationStats
from .verification import accept_mask

logger = logging.getLogger(__name__)

__all__ = ["ADAPTIVE_MAX_GAMMA", "DRAFTERS", "MAX_GAMMA", "METHODS", "MIN_TEMPERATURE", "SPECULATIVE_METHODS",
           "VERIFICATIONS", "Chunk", "GenerationResult", "GenerationStats", "LookupSettings", "SamplingParams",
           "SpeculativeDecoder", "Stream", "TokenLogprobs", "check_vocabularies", "eos_token_ids"]


@dataclass
class Chunk:
    """Tokens committed by one round (one target forward, or one baseline step)."""

    token_ids: list[int]
    sources: list[str]
    # with params.logprobs: each token's log-probability and alternatives, from the target row it was verified on
    logprobs: list[TokenLogprobs] | None = None
    # with params.prompt_logprobs, on the first chunk only: the prompt's tokens' (None for the first token)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class GenerationResult:
    """What one `generate` call produced. `token_ids` are generated tokens only (EOS included, if hit)."""

    token_ids: list[int]
    sources: list[str]
    finish_reason: str  # "length" | "stop"
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprobs] | None = None  # with params.logprobs, one per token of token_ids
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with params.prompt_logprobs, one per prompt token


def check_vocabularies(draft_model, target_model, tokenizer=None) -> int:
    """The shared vocabulary size the pair decodes over, or a SpecDecError naming both sizes.

    Equal logit widths are required, unless a tokenizer shows that the wider one is only padding beyond the
    real tokens (Qwen pads 151,665 tokens to 151,936): then both are compared over the tokenizer's range and a
    padded id is never proposed.
    """
    draft_size = draft_model.config.get_text_config(decoder=True).vocab_size
    target_size = target_model.config.get_text_config(decoder=True).vocab_size
    if draft_size == target_size:
        return target_size
    shared = len(tokenizer) if tokenizer is not None else None
    if shared is None or shared > min(draft_size, target_size):
        raise SpecDecError(
            f"draft and target vocabularies differ: the draft has {draft_size} tokens, the target {target_size}"
            + ("" if shared is None else f", the tokenizer {shared}")
        )
    return shared


def eos_token_ids(target_model, tokenizer=None, eos_token_id=None) -> set[int]:
    """The ids that end a generation: `eos_token_id` if given (an int, a list or a tensor), else the target's
    generation config's (or its config's), together with the tokenizer's eos token if a tokenizer is given."""
    if eos_token_id is None:
        config = getattr(target_model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(target_model.config, "eos_token_id", None)
    ids = set(_as_ids(eos_token_id))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _checked_eos(value, vocab_size: int) -> list[int]:
    """A caller's eos_token_id (an id, a list of ids or a tensor) as a list of ids of the vocabulary; a SpecDecError
    naming it otherwise (a typo would have disabled stopping without a word)."""
    ids = value.tolist() if hasattr(value, "tolist") else value  # a tensor's or a NumPy array's, or scalar's
    if isinstance(ids, (set, frozenset, range)):
        ids = list(ids)  # token_ids checks each id before it sorts them
    elif not isinstance(ids, (list, tuple)):
        ids = [ids]  # one id: anything but an integer is refused as one
    ids = token_ids(ids, "eos_token_id") or ()
    _in_vocabulary(ids, vocab_size, "eos_token_id")
    return list(ids)


def _in_vocabulary(ids: tuple[int, ...], vocab_size: int, name: str) -> None:
    """A SpecDecError naming `name` if one of the sorted `ids` is past the vocabulary."""
    if ids and ids[-1] >= vocab_size:
        raise SpecDecError(f"{name}: token {ids[-1]} is not in the vocabulary of {vocab_size} tokens", field=name)


def seeded_generator(seed: int) -> torch.Generator:
    """A request's generator: its 64-bit seed mixed by splitmix64 first, since torch's CPU generator keeps only the
    low 32 bits of the seed it is given (seeds 2**32 apart drew the same samples)."""
    return torch.Generator(device="cpu").manual_seed(splitmix64(seed))


def position_generator(seed: int, position: int) -> torch.Generator:
    """A generator for the draws at one sequence position, derived from (seed, position) by splitmix64: the
    draws at a position then do not depend on how many were made before it."""
    return torch.Generator(device="cpu").manual_seed(splitmix64(seed + (position + 1) * GOLDEN))


class _Request:
    """All mutable state of one generate call: sequence, caches, RNG, counters and timers."""

    def __init__(self, prompt: list[int], params: SamplingParams, limit: int | None, seed: int, eos: set[int],
                 vocab_size: int | None = None, cache_prompt: bool = False, guide: GrammarState | None = None):
        self.ids = list(prompt)
        self.guide = guide  # the grammar's state, at the end of what is committed between rounds
        self.prompt_len = len(prompt)
        self.params = params
        # the prompt cache: consulted when the request starts and given the caches back when it ends
        self.cache_prompt = cache_prompt
        self.reused: dict = {}  # role -> a DynamicCache from the prompt cache, holding a prefix of the prompt
        self.cached_tokens: int | None = None  # prompt tokens the decoding model did not prefill; None: not consulted
        self.caches: dict[str, CachedModel] = {}  # role -> this request's cache of that model
        self.interrupted = False  # a forward raised: its cache may hold some layers' keys of its tokens, not all
        self.max_new_tokens = params.max_new_tokens
        self.limit = limit
        self.seed = seed
        self.generator = seeded_generator(seed)
        self.eos = eos
        self.sources: list[str] = []
        self.vocab_size = vocab_size  # logprobs are over the shared vocabulary, as tokens are drawn from it
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.finish_reason: str | None = None
        self.proposed = 0
        self.accepted = 0
        self.accepted_per_position: list[int] = []  # one entry per draft position proposed so far
        self.rounds = 0
        self.drafts = 0  # rounds with at least one proposal
        self.proposed_by_drafter: dict[str, int] = {}
        self.accepted_by_drafter: dict[str, int] = {}
        self.rounds_by_drafter: dict[str, int] = {}  # by the drafter of each round's first proposal, or "none"
        self.forwards = {"draft": 0, "target": 0}
        self.seconds = {"draft": 0.0, "target": 0.0}
        self.prefill_seconds = {"draft": 0.0, "target": 0.0}  # each model's first forward: the prompt prefill
        self.started = time.perf_counter()
        self.first_chunk: tuple[float, int] | None = None  # (seconds since start, tokens) of the first commit

    @property
    def generated(self) -> int:
        return len(self.ids) - self.prompt_len

    def budget(self) -> int:
        """How many tokens the next round may commit: what max_new_tokens and the context still allow."""
        budget = self.max_new_tokens - self.generated
        if self.limit is not None:
            budget = min(budget, self.limit - len(self.ids))
        return budget

    def cache_for(self, role: str, model) -> CachedModel:
        """The request's KV cache of one model ("target" or "draft"): the prompt cache's, where it gave one, else
        the model's static one where it has a compiled form (compiled.py), else a new one."""
        if role not in self.caches:
            self.caches[role] = cache_for(model, self.needed, self.ids if self.cache_prompt else None,
                                          self.reused.pop(role, None))
            if self.cache_prompt and role == self.decoding_role:
                self.cached_tokens = self.caches[role].length
        return self.caches[role]

    @property
    def needed(self) -> int:
        """The most tokens this request's caches may hold."""
        return self.prompt_len + self.max_new_tokens + 1

    @property
    def roles(self) -> tuple[str, ...]:
        """The models this request decodes with."""
        if not self.params.speculative:
            return ("draft",) if self.params.method == "draft" else ("target",)
        return ("target",) if self.params.drafter == "lookup" else ("draft", "target")

    @property
    def decoding_role(self) -> str:
        """The model whose prefill the prompt cache saves: the draft's for draft-only decoding, else the
        target's."""
        return "draft" if self.params.method == "draft" else "target"

    def forward(self, role: str, model: CachedModel, tokens: list[int], keep: int = 1) -> torch.Tensor:
        """A timed forward of the draft or target model."""
        start = time.perf_counter()
        self.interrupted = True
        logits = model.forward(tokens, keep)
        self.interrupted = False
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        seconds = time.perf_counter() - start
        if not self.forwards[role]:
            self.prefill_seconds[role] = seconds
        self.seconds[role] += seconds
        self.forwards[role] += 1
        return logits

    def record_round(self, proposal: Proposal, accepted: int) -> None:
        self.proposed += len(proposal)
        self.accepted += accepted
        self.rounds += 1
        for counts, drafters in ((self.proposed_by_drafter, proposal.drafters),
                                 (self.accepted_by_drafter, proposal.drafters[:accepted])):
            for drafter in drafters:
                counts[drafter] = counts.get(drafter, 0) + 1
        self.rounds_by_drafter[proposal.drafter] = self.rounds_by_drafter.get(proposal.drafter, 0) + 1
        if len(proposal):
            self.drafts += 1
        if len(proposal) > len(self.accepted_per_position):
            self.accepted_per_position.extend([0] * (len(proposal) - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def prefilled(self, role: str) -> bool:
        """Whether the model's prefill has run: its later forwards follow cached tokens of this request's."""
        return self.forwards[role] > 0

    def prefill(self, role: str, model: CachedModel) -> torch.Tensor:
        """The forward over the prompt's tokens not in the cache (all but a prefix the prompt cache held): the
        logits of its last position, (1, V). With prompt_logprobs (never with the prompt cache), the forward keeps
        every position's row and the prompt's log-probabilities are taken from them."""
        if self.params.prompt_logprobs is None:
            return self.forward(role, model, self.ids[model.length:], keep=1)
        rows = self.forward(role, model, self.ids, keep=self.prompt_len)  # (n, V): row i predicts token i + 1
        self.prompt_logprobs = [None] + token_logprobs(rows[:-1, : self.vocab_size], self.ids[1:],
                                                       self.params.prompt_logprobs)
        return rows[-1:]

    def commit(self, tokens: list[int], sources: list[str], logits: torch.Tensor | None = None) -> Chunk:
        """Append tokens, cut at the first EOS or at the budget, and set finish_reason when done. `logits`:
        (>= len(tokens), V), row i the target's logits that token i was verified (or drawn) on; read only when
        the request asks for logprobs."""
        first = self.first_chunk is None
        tokens = tokens[: self.budget()]
        for i, token in enumerate(tokens):
            if token in self.eos:
                tokens = tokens[: i + 1]
                self.finish_reason = "stop"
                break
        sources = sources[: len(tokens)]
        logprobs = None
        if self.logprobs is not None:
            logprobs = token_logprobs(logits[:, : self.vocab_size], tokens, self.params.logprobs) if tokens else []
            self.logprobs.extend(logprobs)
        if first:
            self.first_chunk = (time.perf_counter() - self.started, len(tokens))
        self.ids.extend(tokens)
        self.sources.extend(sources)
        if self.guide is not None:  # rejected proposals out, the committed tokens in
            self.guide.sync(self.ids[self.prompt_len:])
        if self.finish_reason is None and self.budget() <= 0:
            self.finish_reason = "length"
        return Chunk(tokens, sources, logprobs, self.prompt_logprobs if first else None)

    def stats(self, finished: bool = True) -> GenerationStats:
        total = time.perf_counter() - self.started
        new = self.generated
        target_forwards = self.forwards["target"]
        first_seconds, first_tokens = self.first_chunk or (total, new)
        later = total - first_seconds
        speculative = self.params.speculative
        return GenerationStats(
            method=self.params.method, gamma=self.params.gamma if speculative else None,
            drafter=self.params.drafter if speculative else None,
            verification=self.params.verification if speculative else None,
            draft_confidence_threshold=(self.params.draft_confidence_threshold
                                        if speculative and self.params.drafter != "lookup" else None),
            seed=self.seed, prompt_tokens=self.prompt_len, new_tokens=new, proposed=self.proposed,
            accepted=self.accepted, acceptance_rate=self.accepted / self.proposed if self.proposed else None,
            tokens_per_target_forward=new / target_forwards if target_forwards else None, rounds=self.rounds,
            drafts=self.drafts, mean_acceptance_length=1 + self.accepted / self.drafts if self.drafts else None,
            draft_forwards=self.forwards["draft"], target_forwards=target_forwards,
            draft_seconds=self.seconds["draft"], target_seconds=self.seconds["target"],
            draft_prefill_seconds=self.prefill_seconds["draft"],
            target_prefill_seconds=self.prefill_seconds["target"],
            other_seconds=max(0.0, total - self.seconds["draft"] - self.seconds["target"]), total_seconds=total,
            tokens_per_second=new / total if total > 0 else None, first_chunk_seconds=first_seconds,
            first_chunk_tokens=first_tokens,
            decode_tokens_per_second=(new - first_tokens) / later if new > first_tokens and later > 0 else None,
            accepted_per_position=list(self.accepted_per_position),
            proposed_by_drafter=dict(self.proposed_by_drafter), accepted_by_drafter=dict(self.accepted_by_drafter),
            rounds_by_drafter=dict(self.rounds_by_drafter),
            round_share_by_drafter={d: n / self.rounds for d, n in self.rounds_by_drafter.items()},
            forced_tokens=self.accepted_by_drafter.get("grammar", 0) if self.guide is not None else None,
            grammar_seconds=self.guide.seconds if self.guide is not None else None,
            finished=finished, cached_tokens=self.cached_tokens)

    def result(self) -> GenerationResult:
        return GenerationResult(self.ids[self.prompt_len:], list(self.sources), self.finish_reason or "length",
                                self.stats(), self.logprobs, self.prompt_logprobs)


class Stream(Generator):
    """The iterator `SpeculativeDecoder.stream` returns: a generator of Chunks whose return value (the
    StopIteration's) is the GenerationResult. `stats()` is the generation's stats so far, at any time: also
    after `close()` abandoned it."""

    def __init__(self, request: _Request, rounds: Generator):
        self._request = request
        self._rounds = rounds

    def send(self, value):
        return self._rounds.send(value)

    def throw(self, *args):
        return self._rounds.throw(*args)

    def close(self) -> None:
        self._rounds.close()

    def stats(self) -> GenerationStats:
        req = self._request
        return req.stats(finished=req.finish_reason is not None)


# prompts this long or longer: the first token comes from the target's prefill alone (`_first_token`)
FIRST_TOKEN_ALONE_FROM = 32


def _lookup_settings(lookup) -> LookupSettings:
    """LookupSettings, or a mapping of its fields made into one; anything else a SpecDecError naming `lookup`."""
    if isinstance(lookup, LookupSettings):
        return lookup
    if isinstance(lookup, Mapping):
        if unknown := sorted(set(lookup) - {field.name for field in dataclasses.fields(LookupSettings)}):
            raise SpecDecError(f"lookup: unknown setting {unknown[0]!r}", field="lookup")
        return LookupSettings(**lookup)
    raise SpecDecError(f"lookup must be a LookupSettings (or a dict of its fields), got {type(lookup).__name__}",
                       field="lookup")


class SpeculativeDecoder:
    """Exact speculative decoding for a draft/target pair of Hugging Face causal LMs sharing a vocabulary."""

    def __init__(self, draft_model, target_model, tokenizer=None, lookup: LookupSettings = LookupSettings(),
                 prompt_cache_bytes: int = 0, first_token_alone_from: int = FIRST_TOKEN_ALONE_FROM):
        self.draft_model = draft_model.eval()
        self.target_model = target_model.eval()
        self.vocab_size = check_vocabularies(draft_model, target_model, tokenizer)
        limits = [n for n in (context_length(draft_model), context_length(target_model)) if n]
        self.context_length = min(limits) if limits else None
        # measured forward costs of this pair on this machine, kept across requests for adaptive gamma
        self.cost_profile = CostProfile()
        self.lookup = _lookup_settings(lookup)  # prompt lookup's knobs, for the lookup and hybrid drafters
        # both models' caches kept across requests (prompt_cache.py), within prompt_cache_bytes (0: off)
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        # called as round_observer(draft_tokens, draft_probs, target_probs) with every block before it is
        # verified (target_probs: the k rows p_1..p_k); the benchmark compares the rules on the same blocks
        self.round_observer = None
        # speculative decoding of a prompt this long or longer draws its first token from the target's prefill
        # alone, before the draft model prefills (`_first_token`)
        self.first_token_alone_from = first_token_alone_from

    def first_token_alone(self, prompt_len: int) -> bool:
        """Whether speculative decoding of a prompt of prompt_len tokens draws its first token from the target's
        prefill alone, the draft model prefilling in the second round (`_first_token`)."""
        return prompt_len >= self.first_token_alone_from

    def generate(self, input_ids, max_new_tokens: int = 64, method: str = "google", gamma: int | None = 4,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_id=None, *, params: SamplingParams | None = None, grammar: CompiledGrammar | None = None,
                 **sampling) -> GenerationResult:
        """Decode up to max_new_tokens after input_ids. gamma=None chooses the draft length adaptively.

        `sampling`: any other SamplingParams field by its name, e.g. drafter ("model", "lookup" or "hybrid"),
        verification ("token" or "block"), draft_confidence_threshold, logit_bias ({token id: bias}),
        presence_penalty, frequency_penalty, repetition_penalty, logprobs, ignore_eos (SamplingParams says what
        each does). `params`, if given, holds them all: a sampling keyword beside it is an error. `grammar`
        (grammar.GrammarCompiler.compile's) constrains the output: the target's distribution with the tokens the
        grammar forbids removed, at every position, before temperature, top-k and top-p."""
        stream = self.stream(input_ids, max_new_tokens=max_new_tokens, method=method, gamma=gamma,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                             params=params, grammar=grammar, **sampling)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    def stream(self, input_ids, max_new_tokens: int = 64, method: str = "google", gamma: int | None = 4,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               eos_token_id=None, *, params: SamplingParams | None = None, grammar: CompiledGrammar | None = None,
               **sampling) -> Stream:
        """Like `generate`, but yields each round's committed tokens as a Chunk and returns the GenerationResult.

        Arguments are checked here, before decoding starts. `send("stop")` ends decoding with finish_reason
        "stop" (a caller's stop string) and raises StopIteration carrying the result; `close()` just abandons it.
        """
        prompt = self._prompt(input_ids)
        keywords = {"max_new_tokens": max_new_tokens, "method": method, "gamma": gamma, "temperature": temperature,
                    "top_k": top_k, "top_p": top_p, "seed": seed}
        if params is None:
            unknown = sorted(set(sampling) - set(SamplingParams.field_names()))
            if unknown:
                raise SpecDecError(f"unknown sampling argument {unknown[0]!r}", field=unknown[0])
            params = SamplingParams(**keywords, **sampling)
        elif not isinstance(params, SamplingParams):
            raise SpecDecError(f"params must be a SamplingParams, got {type(params).__name__}", field="params")
        else:  # a keyword beside params would be ignored: refused instead (it cannot tell a default given again)
            if clash := [name for name, value in keywords.items() if value != _STREAM_DEFAULTS[name]] + list(sampling):
                raise SpecDecError(f"{clash[0]} was given beside params: set it in params (params.replace("
                                   f"{clash[0]}=...))", field=clash[0])
        seed = int.from_bytes(os.urandom(8), "little") >> 1 if params.seed is None else params.seed % 2**64
        # a prompt may fill the context when it is only scored (max_new_tokens 0: one forward of its positions)
        if self.context_length is not None and len(prompt) + (params.max_new_tokens > 0) > self.context_length:
            raise SpecDecError(
                f"the prompt has {len(prompt)} tokens and leaves no room in the model context of "
                f"{self.context_length} tokens", field="input_ids")

        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:
            raise SpecDecError(f"logit_bias: token {params.logit_bias[-1][0]} is not in the vocabulary of "
                               f"{self.vocab_size} tokens", field="logit_bias")
        if grammar is not None and grammar.vocab_size != self.vocab_size:
            raise SpecDecError(f"the grammar was compiled for {grammar.vocab_size} tokens, the pair has "
                               f"{self.vocab_size}", field="grammar")
        _in_vocabulary(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        if grammar is not None and params.stop_token_ids:
            raise SpecDecError("stop_token_ids cannot be combined with a grammar constraint, which decides where "
                               "the output ends", field="stop_token_ids")
        if grammar is not None and params.min_tokens:
            raise SpecDecError("min_tokens cannot be combined with a grammar constraint, which decides where the "
                               "output ends", field="min_tokens")
        if grammar is not None and params.ignore_eos:
            raise SpecDecError("ignore_eos cannot be combined with a grammar constraint, which ends with an "
                               "end-of-sequence token", field="ignore_eos")
        if eos_token_id is not None:
            eos_token_id = _checked_eos(eos_token_id, self.vocab_size)
        eos = eos_token_ids(self.target_model, eos_token_id=eos_token_id)
        req = _Request(prompt, params, self.context_length, seed, set(params.ending_tokens(eos)),
                       self.vocab_size, cache_prompt=self.caches_prompt(params),
                       guide=None if grammar is None else grammar.start(eos))
        warper = _Warper.for_request(params, self.vocab_size, len(prompt), req.eos)
        return Stream(req, self._run(req, warper))

    def caches_prompt(self, params: SamplingParams) -> bool:
        """Whether a request reads and feeds the prompt cache: it is on, the request did not opt out and needs no
        prompt logprobs (every prompt row, so a full prefill). A compiled model's prompt cache is its static
        cache, which holds the latest request's sequence (compiled.py)."""
        return (self.prompt_cache.enabled and params.cache_prompt and params.prompt_logprobs is None
                and params.max_new_tokens > 0)

    def _run(self, req: "_Request", probs: "_Warper"):
        params = req.params
        if self.prompt_cache.enabled:  # here, on the engine's thread, when decoding starts
            self._save_held(req)
        if req.cache_prompt:
            req.reused = self.prompt_cache.take(req.ids)
            req.cached_tokens = 0  # its decoding model's cache says how many, once made (_Request.cache_for)
        try:
            if params.max_new_tokens == 0:  # the prompt scored alone (prompt_logprobs): its prefill, nothing drawn
                req.prefill("target", CachedModel(self.target_model))
                yield req.commit([], [])
            elif params.speculative and params.gamma is None and params.temperature > 0:
                yield from self._speculate_adaptive(req, probs)
            elif params.speculative:
                yield from self._speculate(req, probs)
            else:
                yield from self._autoregress(req, probs)
        finally:  # also when abandoned (closed at a round's end) or failed
            try:
                if req.cache_prompt:
                    self._keep(req)
            finally:
                for model in req.caches.values():
                    if isinstance(model, StaticCachedModel):
                        model.release()
        result = req.result()
        logger.debug("generate done: %s", result.stats)
        return result

    def _save_held(self, req: "_Request") -> None:
        """Before the request writes over what its models' static caches hold (compiled.py), give the prompt cache
        a copy: one entry, the longest sequence held, with each cache holding a prefix of it. A request that does
        not read the prompt cache (`cache_prompt` false, prompt logprobs) writes over all of it."""
        if req.max_new_tokens == 0:  # the prompt scored alone, on a dynamic cache
            return
        models = {"draft": self.draft_model, "target": self.target_model}
        overwritten = [(role, models[role].specdec_static) for role in req.roles
                       if takes_static_cache(models[role], req.needed)
                       and models[role].specdec_static.overwritten_by(req.ids if req.cache_prompt else [])]
        if not overwritten:
            return
        sequence = max((static.held for _, static in overwritten), key=len)
        self.prompt_cache.put(sequence, {role: static.held_cache() for role, static in overwritten
                                         if sequence[: len(static.held)] == static.held})

    def _keep(self, req: "_Request") -> None:
        """Give the request's caches to the prompt cache, holding the committed tokens but the newest (never fed):
        the caches it decoded with, cropped to them (a round cut short by an error may have fed proposals it never
        committed), and those it took and did not use. Nothing when a forward raised: its cache may hold some
        layers' keys of its tokens and not others', and no entry may claim tokens its caches do not hold."""
        if req.interrupted:
            return
        kept = len(req.ids) - 1
        for model in req.caches.values():
            if isinstance(model, StaticCachedModel):  # its static cache keeps them for the next request
                model.hold(req.ids[:kept])
        caches = dict(req.reused)
        caches.update({role: model.cache for role, model in req.caches.items()})
        caches = {role: cache for role, cache in caches.items() if reusable(cache)}
        if not caches:
            return
        for cache in caches.values():
            crop_cache(cache, kept)
        self.prompt_cache.put(req.ids[:kept], caches)
        # the entries it evicted and the request's own transients were freed into the C heap, which keeps their
        # pages resident: handed back, resident memory follows what the cache holds (2-12 ms on the default pair)
        release_free_memory()

    def _prompt(self, input_ids) -> list[int]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() not in (1, 2) or input_ids.dim() == 2 and input_ids.size(0) != 1:
                raise SpecDecError(f"only batch size 1 is supported: input_ids must have shape (n,) or (1, n), got "
                                   f"{tuple(input_ids.shape)}", field="input_ids")
            input_ids = input_ids.reshape(-1).tolist()
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise SpecDecError("input_ids must be a non-empty list of token ids or a 1 x n tensor", field="input_ids")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < self.vocab_size
               for t in input_ids):  # Integral: numpy's integers too
            raise SpecDecError(f"input_ids must be integers in [0, {self.vocab_size})", field="input_ids")
        return [int(t) for t in input_ids]

    def _autoregress(self, req: _Request, probs: "_Warper") -> Iterator[Chunk]:
        """Target-only or draft-only decoding with a KV cache: one forward, one token."""
        role = "target" if req.params.method == "target" else "draft"
        model = req.cache_for(role, self.target_model if role == "target" else self.draft_model)
        while req.finish_reason is None:
            logits = req.forward(role, model, req.ids[model.length:]) if req.prefilled(role) \
                else req.prefill(role, model)
            allowed = None if req.guide is None else req.guide.allowed()
            token = probs.argmax(logits[-1:], allowed, req.ids)[0] if probs.greedy else \
                sample(probs(logits[-1], allowed, req.ids), req.generator)
            req.rounds += 1
            if (yield req.commit([token], ["target"], logits[-1:])) == "stop":
                req.finish_reason = "stop"

    def _drafter(self, req: _Request, probs: "_Warper"):
        """The request's drafter, as its params name it; it owns the draft model's cache, if it uses one."""
        def forward(model: CachedModel, tokens: list[int]) -> torch.Tensor:
            return req.forward("draft", model, tokens)

        kind = req.params.drafter
        lookup = LookupDrafter(self.vocab_size, self.lookup,
                               min_match=self.lookup.hybrid_min_match if kind == "hybrid" else None)
        if kind == "lookup":
            drafter = lookup
        else:
            model = ModelDrafter(req.cache_for("draft", self.draft_model), probs, forward,
                                 req.params.draft_confidence_threshold, greedy=self._greedy(probs))
            drafter = model if kind == "model" else HybridDrafter(model, lookup, self.lookup)
        if req.guide is None:
            return drafter
        return GuidedDrafter(drafter, req.guide, self.vocab_size, forced=req.params.grammar_drafter)

    def _speculate(self, req: _Request, probs: "_Warper") -> Iterator[Chunk]:
        """Google (Leviathan et al. Alg. 1) or DeepMind (Chen et al. Alg. 2) speculative sampling: the drafter
        proposes up to gamma tokens (the lookup up to its own maximum), the target scores them and the bonus
        position in one forward (the first time, after the prompt's own prefill: `_score`), the verification rule
        keeps a prefix and gives the next token's distribution.

        gamma is fixed, or, for greedy decoding with gamma=None, chosen each round by adaptive gamma: greedy output
        is the target's argmax at every position whatever lengths are chosen, so those rounds keep their bonus
        token, which adaptive sampling gives up to stay reproducible (`_speculate_adaptive`)."""
        drafter, target = self._drafter(req, probs), req.cache_for("target", self.target_model)
        generator = req.generator
        adaptive = AdaptiveGamma(max_gamma=ADAPTIVE_MAX_GAMMA, costs=self.cost_profile) \
            if req.params.gamma is None else None
        if (yield from self._first_token(req, drafter, target, probs, generator)) == "stop":
            req.finish_reason = "stop"
        while req.finish_reason is None:
            limit = req.budget() - 1  # never propose past max_new_tokens or the context
            before = dict(req.seconds), dict(req.forwards)

            # 1. the drafter proposes x_1..x_k with the distributions q_1..q_k they were drawn from
            gamma = req.params.gamma if adaptive is None else adaptive.choose()
            proposal = drafter.propose(req.ids, gamma, limit, lambda i: generator)
            k = len(proposal)

            # 2. the target scores all k + 1 positions in one forward: p_1 .. p_{k+1} (each masked by the grammar
            # at the sequence it follows)
            logits = self._score(req, target, proposal.tokens)

            # 3. keep a prefix of the proposals, then draw the next token (resampled, or the bonus after all k)
            if self._greedy(probs):
                choices = probs.argmax(logits, self._masks(req, proposal, k + 1), req.ids, proposal.tokens)
                accepted, next_token = self._verify_greedy(proposal, choices)
            else:
                p = probs(logits, self._masks(req, proposal, k + 1), req.ids, proposal.tokens)
                accepted, next_probs = self._verify(req, proposal, p, lambda i: generator)
                next_token = sample(next_probs, generator)
            chunk = req.commit(proposal.tokens[:accepted] + [next_token], self._sources(proposal, accepted, k),
                               logits)
            if adaptive is not None and k and set(proposal.drafters) == {"model"}:
                adaptive.update(k, accepted)  # alpha is the draft model's, as in `_speculate_adaptive`
            if (yield self._end_round(req, drafter, target, chunk, proposal, accepted, k + 1, before)) == "stop":
                req.finish_reason = "stop"

    def _speculate_adaptive(self, req: _Request, probs: "_Warper") -> Iterator[Chunk]:
        """Speculative sampling (temperature > 0) with the draft length chosen each round from measured costs
        (adaptive.py). Greedy decoding needs none of what follows: `_speculate` chooses its lengths and keeps the
        bonus token.

        The draft length depends on wall-clock timings, so the output must not depend on it: every position's
        token goes through the same steps (proposed, then accepted or resampled from the residual, or drawn by
        the target where nothing was proposed), with its draws from a generator of its own, derived from
        (seed, position), and the drafters decide each position from the sequence before it alone. A round whose
        proposals are all accepted ends without a bonus token; the draft's extra forward that this costs is the
        price of the same seed giving the same completion whatever lengths were chosen.

        That holds for token verification, where a round's outcome never depends on the draws of the positions
        after its first rejection, which the next round draws again. Block verification's outcome does (its scan
        runs from the end of the block), so drawing those positions again would reuse draws it has seen and bias
        the next round: it draws from the request's one generator instead, and its output depends on the lengths
        chosen, while its samples stay exactly the target's.
        """
        drafter, target = self._drafter(req, probs), req.cache_for("target", self.target_model)
        # its last proposal replaces the bonus token: ADAPTIVE_MAX_GAMMA proposals at most, as greedy's rounds
        adaptive = AdaptiveGamma(max_gamma=ADAPTIVE_MAX_GAMMA - 1, costs=self.cost_profile, bonus=False)
        per_position = req.params.verification == "token"
        first = position_generator(req.seed, len(req.ids)) if per_position else req.generator
        if (yield from self._first_token(req, drafter, target, probs, first)) == "stop":
            req.finish_reason = "stop"
        while req.finish_reason is None:
            start = len(req.ids)
            budget = req.budget()
            generators: dict[int, torch.Generator] = {}

            def generator_at(i: int) -> torch.Generator:
                if not per_position:
                    return req.generator
                if i not in generators:
                    generators[i] = position_generator(req.seed, start + i)
                return generators[i]

            before = dict(req.seconds), dict(req.forwards)
            # the draft model proposes gamma + 1 tokens (its last replaces the bonus); the target's width is k
            proposal = drafter.propose(req.ids, adaptive.choose() + 1, budget, generator_at)
            k = len(proposal)
            if k:
                logits = self._score(req, target, proposal.tokens[:-1])
                p = probs(logits, self._masks(req, proposal, k), req.ids, proposal.tokens[:-1])
                # no bonus row (all k accepted ends the round): a zero row stands in for it, never drawn from
                accepted, next_probs = self._verify(req, proposal, torch.cat((p, p.new_zeros(1, p.size(-1)))),
                                                    generator_at)
            else:  # nothing proposed: the target draws this position's token alone
                logits = self._score(req, target, [])
                p = probs(logits, self._masks(req, proposal, 1), req.ids)
                accepted, next_probs = 0, p[0]
            tokens = proposal.tokens[:accepted]
            if accepted < k or not k:
                tokens.append(sample(next_probs, generator_at(accepted)))
            chunk = req.commit(tokens, self._sources(proposal, accepted, k)[: len(tokens)], logits)
            if k and set(proposal.drafters) == {"model"}:
                # alpha is the draft model's: rounds the lookup served say nothing about it
                adaptive.update(k - 1, min(accepted, k - 1))
            if (yield self._end_round(req, drafter, target, chunk, proposal, accepted, max(k, 1), before)) == "stop":
                req.finish_reason = "stop"

    def _first_token(self, req: _Request, drafter, target: CachedModel, probs: "_Warper",
                     generator: torch.Generator):
        """The first round of speculative decoding for a prompt of `first_token_alone_from` tokens or more: the
        target's prefill alone, and the first token drawn from it, as target-only decoding draws it; what the
        round's `yield` got back ("stop" ends decoding); for a shorter prompt nothing (no round).

        The first token is then out after one prefill, not two: the draft model prefills (the prompt and this
        token) in the next round, while the client already has it; the time to first token loses the draft's
        prefill and its first proposals. No forward is added: in a speculative first round the target's prefill
        goes alone anyway (`_score`), and its row verifies only the first proposal. Shorter prompts, whose
        prefills cost little, keep the speculative first round (and the statistical tests, whose continuations
        of short prompts are 3 tokens long, test both orders)."""
        if not self.first_token_alone(req.prompt_len):
            return None
        before = dict(req.seconds), dict(req.forwards)
        proposal = Proposal()
        logits = self._score(req, target, [])
        p = probs(logits, self._masks(req, proposal, 1), req.ids)
        chunk = req.commit([sample(p[0], generator)], self._sources(proposal, 0, 0), logits)
        return (yield self._end_round(req, drafter, target, chunk, proposal, 0, 1, before))

    @staticmethod
    def _score(req: _Request, target: CachedModel, extra: list[int]) -> torch.Tensor:
        """The target's logits for the position after the committed sequence and after each of `extra`
        (len(extra) + 1 rows), in one forward over the uncached tokens.

        Except the first time: then the prompt goes alone (what of it the prompt cache did not hold), the forward
        target-only decoding starts with, and `extra` after it with the cache. Every target row is then computed as target-only decoding computes it
        (a prefill over the prompt, then forwards after cached tokens, which our CPU kernels make bitwise the
        same as one token at a time), so greedy output is target-only's token for token, near ties included.
        Folded into the prefill, the first proposals would go through the prefill's matrix products instead
        (a rounding step of bfloat16 away). It costs one forward more per request. With prompt_logprobs the
        prefill keeps every prompt row (`_Request.prefill`).
        """
        if req.prefilled("target"):
            return req.forward("target", target, req.ids[target.length:] + extra, keep=len(extra) + 1)
        first = req.prefill("target", target)
        return torch.cat((first, req.forward("target", target, extra, keep=len(extra)))) if extra else first

    @staticmethod
    def _masks(req: _Request, proposal: Proposal, rows: int) -> torch.Tensor | None:
        """Under a grammar, (rows, V): the mask at each proposed position, then the one after the proposals (the
        grammar state stands there after proposing); None without one."""
        if req.guide is None:
            return None
        masks = proposal.allowed[:rows]
        if len(masks) < rows:
            masks = masks + [req.guide.allowed()]
        return torch.stack(masks)

    @staticmethod
    def _sources(proposal: Proposal, accepted: int, k: int) -> list[str]:
        """Provenance of a round's committed tokens: the accepted proposals by drafter, then the target's token."""
        return [SOURCES[d] for d in proposal.drafters[:accepted]] + ["resampled" if accepted < k else "bonus"]

    def _end_round(self, req: _Request, drafter, target: CachedModel, chunk: Chunk, proposal: Proposal,
                   accepted: int, width: int, before: tuple[dict, dict]) -> Chunk:
        """Count the round, roll both caches back to the committed prefix, feed the decoder's cost profile."""
        req.record_round(proposal, accepted)
        # the newest committed token is fed next round
        target.rollback(len(req.ids) - 1)
        drafter.rollback(len(req.ids) - 1)
        # every round's costs feed the profile, except those with a prompt prefill (the target's is the first
        # round, the draft model's the second): they say nothing about per-token cost
        warm = all(before[1][role] > 0 or req.forwards[role] == before[1][role] for role in ("draft", "target"))
        spent = {role: (req.seconds[role] - before[0][role], req.forwards[role] - before[1][role])
                 if warm else (0.0, 0) for role in ("draft", "target")}
        self.cost_profile.record(*spent["draft"], *spent["target"], width=width)
        logger.debug("round %d: drafter=%s proposed=%d accepted=%d committed=%d", req.rounds, proposal.drafter,
                     len(proposal), accepted, len(chunk.token_ids))
        return chunk

    def _greedy(self, probs: "_Warper") -> bool:
        """Whether a request's rounds take greedy decoding's short path (`_verify_greedy`, the draft model's argmax
        in `ModelDrafter.draw`): at temperature 0, unless a round observer wants each round's distributions."""
        return probs.greedy and self.round_observer is None

    @staticmethod
    def _verify_greedy(proposal: Proposal, choices: list[int]) -> tuple[int, int]:
        """(tau, next token) at temperature 0, from the target's argmax at each of the k + 1 positions: p and q are
        one-hots, so either rule keeps exactly the proposals that are the target's argmax, up to the first that is
        not, and the residual there (p - q, clipped) is p's one-hot, as the bonus is after all k: the same tokens
        and counts as `_verify` (tested), without building the distributions or drawing uniforms, which no
        greedy output depends on."""
        tokens = proposal.tokens
        accepted = next((i for i, (x, y) in enumerate(zip(tokens, choices)) if x != y), len(tokens))
        return accepted, choices[accepted]

    def _verify(self, req: _Request, proposal: Proposal, p: torch.Tensor, generator_at) -> tuple[int, torch.Tensor]:
        """(tau, next_probs) under the request's verification rule (verification.py), p with k + 1 rows.

        The variants differ in how they draw the uniforms. Google draws all k at once; DeepMind, under the token
        rule, walks the proposals in order, one uniform each, and stops at the first rejection (Chen et al.
        Alg. 2). Block verification scans the block from its end, so it needs all k uniforms at once, and then
        the two variants draw alike. With per-position generators (adaptive gamma) each uniform comes from its
        position's generator, so the variants draw alike there too. `generator_at(i)` is proposal i's generator.
        """
        k = len(proposal)
        if not k:
            return 0, p[0]
        x = torch.tensor(proposal.tokens, device=p.device)
        q = proposal.draft_probs().to(p.device)
        rule = req.params.verification
        first = generator_at(0)
        if req.params.method == "deepmind" and rule == "token" and all(generator_at(i) is first for i in range(k)):
            uniforms = torch.zeros(k, dtype=torch.float64)  # entries after the first rejection are never read
            for t in range(k):
                uniforms[t] = torch.rand(1, generator=first, dtype=torch.float64)
                if not bool(accept_mask(x[t:t + 1], q[t:t + 1], p[t:t + 1], uniforms[t:t + 1])[0]):
                    break
        elif all(generator_at(i) is first for i in range(k)):
            uniforms = torch.rand(k, generator=first, dtype=torch.float64)
        else:
            uniforms = torch.cat([torch.rand(1, generator=generator_at(i), dtype=torch.float64) for i in range(k)])
        if self.round_observer is not None:
            self.round_observer(x, q, p[:k])
        return verification.VERIFIERS[rule](x, q, p, uniforms)


# stream's arguments and their defaults: the sampling keywords a call beside `params` must leave as they are
_STREAM_DEFAULTS = {name: parameter.default
                    for name, parameter in inspect.signature(SpeculativeDecoder.stream).parameters.items()}


class _Warper:
    """Logits -> the distribution sampled from, identical for draft and target (and the baselines): a request's
    logit bias added, its penalties applied (at the sequence each row follows: `context`), the tokens that end
    decoding masked where fewer than min_tokens have been generated, a grammar's mask, then temperature, top-k
    and top-p."""

    def __init__(self, temperature: float, top_k: int, top_p: float, vocab_size: int,
                 logit_bias: tuple[tuple[int, float], ...] | None = None,
                 penalties: tuple[float, float, float] | None = None, prompt_len: int = 0,
                 min_tokens: int = 0, ending: Iterable[int] = ()):
        self.temperature, self.top_k, self.top_p, self.vocab_size = temperature, top_k, top_p, vocab_size
        self.logit_bias = logit_bias
        self._bias: dict[tuple, torch.Tensor] = {}  # the bias as a vector, by (device, logits' size)
        self.penalties = penalties  # (presence, frequency, repetition): sampling.penalize's; None: no penalty
        self.prompt_len = prompt_len  # the context's first prompt_len tokens are the prompt
        # the tokens that end decoding, masked in a row that follows fewer than min_tokens generated tokens
        self.min_tokens, self.ending = min_tokens, sorted(ending)

    @classmethod
    def for_request(cls, params: SamplingParams, vocab_size: int, prompt_len: int, ending: Iterable[int] = ()
                    ) -> "_Warper":
        penalties = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
        return cls(params.temperature, params.top_k, params.top_p, vocab_size, params.logit_bias,
                   penalties if params.penalized else None, prompt_len, params.min_tokens, ending)

    def __call__(self, logits: torch.Tensor, allowed: torch.Tensor | None = None, context: list[int] | None = None,
                 proposed: list[int] = ()) -> torch.Tensor:
        """(..., V') logits -> (..., V) probabilities; `allowed`, a grammar's (..., V) mask, removes the tokens it
        forbids first. Row i follows `context` and the first i tokens `proposed` (read under a penalty only)."""
        return logits_to_probs(self._masked(logits, allowed, context, proposed), self.temperature, self.top_k,
                               self.top_p)

    @property
    def greedy(self) -> bool:
        """Temperature 0: every distribution is the one-hot of its argmax, and a draw from it is that argmax."""
        return self.temperature == 0

    def argmax(self, logits: torch.Tensor, allowed: torch.Tensor | None = None, context: list[int] | None = None,
               proposed: list[int] = ()) -> list[int]:
        """(n, V') logits -> each row's token under greedy decoding: the argmax of what `__call__` would make a
        one-hot of, which is also what `sample` draws from that one-hot."""
        return self._masked(logits, allowed, context, proposed).argmax(dim=-1).tolist()

    def _masked(self, logits: torch.Tensor, allowed: torch.Tensor | None, context: list[int] | None = None,
                proposed: list[int] = ()) -> torch.Tensor:
        logits = logits[..., : self.vocab_size]
        if self.logit_bias:  # added in float32, before the mask and the warpers (as a logits processor is)
            key = (logits.device, logits.size(-1))
            if key not in self._bias:
                self._bias[key] = logit_bias_vector(self.logit_bias, logits.size(-1), logits.device)
            logits = logits.float() + self._bias[key]
        if self.penalties is not None:
            if context is None:
                raise RuntimeError("a penalized request's logits need the sequence they follow")
            rows = logits.reshape(-1, logits.size(-1))
            logits = penalize(rows, context + list(proposed), self.prompt_len, *self.penalties).reshape(logits.shape)
        if self.min_tokens and self.ending:
            if context is None:
                raise RuntimeError("a request with min_tokens needs the sequence its logits follow")
            logits = self._unending(logits, len(context) - self.prompt_len)
        return logits if allowed is None else mask_logits(logits, allowed)

    def _unending(self, logits: torch.Tensor, generated: int) -> torch.Tensor:
        """(..., V) logits whose row i follows `generated` + i generated tokens, the ending tokens at -inf in the
        rows before min_tokens (a copy; the logits as they are where no row is)."""
        rows = logits.reshape(-1, logits.size(-1))
        masked = min(rows.size(0), self.min_tokens - generated)
        if masked <= 0:  # every row past min_tokens: the rest of the request
            return logits
        ending = [t for t in self.ending if t < rows.size(-1)]  # a draft's vocabulary may be the smaller
        if not ending:
            return logits
        rows = rows.clone()
        rows[:masked, ending] = float("-inf")
        return rows.reshape(logits.shape)
