"""Sampling parameters: the one frozen, validated type that the engine, CLI, HTTP API, config and benchmark share;
and prompt lookup's settings (LookupSettings), which the engine, CLI, config and benchmark share.

Method names and every bound live here; the HTTP request models and the settings take theirs from these names.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from .errors import SpecDecError

METHODS = ("target", "draft", "deepmind", "google")  # target, draft: one model alone (baselines)
SPECULATIVE_METHODS = ("google", "deepmind")
SERVED_METHODS = ("google", "deepmind", "target")  # what a request or the service configuration may pick
DRAFTERS = ("model", "lookup", "hybrid")  # who proposes: the draft model, prompt lookup, or lookup else the model
VERIFICATIONS = ("token", "block")  # the rule that judges a proposal: token by token, or the block jointly
MAX_GAMMA = 64  # a hard bound on proposals per round; adaptive gamma stays far below it
ADAPTIVE_MAX_GAMMA = 8
MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32; 0 means greedy
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's bound)
MAX_LOOKUP = 64  # the longest suffix prompt lookup matches, and the most it proposes in a round
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # seeds are taken modulo 2**64
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's bound): -100 bans a token, 100 all but forces it
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's bound)
REPETITION_PENALTY_BOUNDS = (0.01, 100.0)  # 1 is none; the bounds keep a divided logit far inside float32


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. Checked when built: a bad value raises SpecDecError naming the field.

    gamma None chooses the draft length adaptively; temperature 0 is greedy; top_k 0 and top_p 1 cut nothing;
    seed None draws a random seed (the stats report the one used). `drafter`, `verification` and
    `draft_confidence_threshold` matter to the speculative methods only: who proposes (drafters.py), which rule
    verifies (verification.py), and the draft model's probability of its own token below which it ends its run
    before gamma (0: never; gamma stays the most it proposes).

    `grammar_drafter`: under a grammar constraint, propose the tokens the grammar forces (drafters.GuidedDrafter)
    before the drafter goes on; without a constraint it changes nothing.

    `logprobs` (None: off) reports each generated token's log-probability under the target's raw distribution
    (log-softmax of its logits, before temperature, top-k and top-p) with that many most likely alternatives;
    `prompt_logprobs` the same for the prompt's tokens, from the prefill. With `prompt_logprobs`, max_new_tokens
    may be 0: the prompt is scored alone.

    `cache_prompt` (llama.cpp's name): the request may start from the engine's prompt cache and leaves its caches
    there; false opts out of both. It changes no distribution, only what is prefilled.

    `ignore_eos` (llama.cpp's and vLLM's name): an end-of-sequence token is kept and decoding goes on, to
    max_new_tokens (benchmarks that must generate a fixed number of tokens); not with a grammar constraint, which
    ends with EOS.

    `logit_bias` (OpenAI's): {token id: bias in [-100, 100]} added to the target's logits (and the draft's) before
    temperature, top-k and top-p, so the output follows the biased target's distribution exactly; given as a
    mapping, kept as ((id, bias), ...) sorted by id. Ids must be below the vocabulary's size (checked by the
    engine). Log-probabilities stay the raw model's.

    `stop_token_ids` (vLLM's): more tokens that end decoding as an end-of-sequence token does (kept, finish_reason
    "stop"), also with ignore_eos; kept as a sorted tuple. Ids must be below the vocabulary's size (checked by the
    engine); not with a grammar constraint. They change where decoding ends, never a distribution.

    `presence_penalty` and `frequency_penalty` (OpenAI's, vLLM's rule) subtract from a token's logit
    presence_penalty if it occurs among the tokens generated so far, plus frequency_penalty times its count there;
    `repetition_penalty` (transformers' and vLLM's; 1 is none) divides a positive logit of a token seen in the
    prompt or the output by it and multiplies a negative one. Applied after the logit bias, before the grammar's
    mask, temperature, top-k and top-p, to every row at the sequence it follows (a verification row's counts
    include the proposals before it), for the target and the draft alike: the output follows the penalized
    target's distribution exactly. Log-probabilities stay the raw model's.

    `min_tokens` (vLLM's): the tokens that end decoding (`ending_tokens`: end-of-sequence and stop_token_ids) are
    forbidden until this many tokens have been generated (for the target and the draft alike, as a grammar's mask
    is: the output follows the target's distribution with them masked there, exactly); at most max_new_tokens; not
    with a grammar constraint, which decides where the output ends. Log-probabilities stay the raw model's.
    """

    max_new_tokens: int = 64
    method: str = "google"
    gamma: int | None = 4
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    drafter: str = "model"
    verification: str = "token"
    draft_confidence_threshold: float = 0.0
    grammar_drafter: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_prompt: bool = True
    ignore_eos: bool = False
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: Sequence[int] | None = None
    min_tokens: int = 0

    def __post_init__(self):
        for name, allowed in (("method", METHODS), ("drafter", DRAFTERS), ("verification", VERIFICATIONS)):
            if getattr(self, name) not in allowed:
                raise SpecDecError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}",
                                   field=name)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(getattr(self, name), name, 0, MAX_LOGPROBS)
        _integer(self.max_new_tokens, "max_new_tokens", 0 if self.prompt_logprobs is not None else 1)
        if _integer(self.min_tokens, "min_tokens", 0) > self.max_new_tokens:
            raise SpecDecError(f"min_tokens ({self.min_tokens}) must not exceed max_new_tokens "
                               f"({self.max_new_tokens})", field="min_tokens")
        if self.gamma is not None:
            _integer(self.gamma, "gamma", 1, MAX_GAMMA)
        temperature = _finite(self.temperature, "temperature")
        if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
            raise SpecDecError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}",
                               field="temperature")
        _integer(self.top_k, "top_k", 0)
        top_p = _finite(self.top_p, "top_p")
        if not 0 < top_p <= 1:
            raise SpecDecError(f"top_p must be in (0, 1], got {top_p}", field="top_p")
        if self.seed is not None:
            _integer(self.seed, "seed", SEED_MIN, SEED_MAX)
        threshold = _finite(self.draft_confidence_threshold, "draft_confidence_threshold")
        if not 0 <= threshold <= 1:
            raise SpecDecError(f"draft_confidence_threshold must be between 0 and 1, got {threshold}",
                               field="draft_confidence_threshold")
        for name in ("cache_prompt", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise SpecDecError(f"{name} must be true or false, got {getattr(self, name)!r}", field=name)
        if not isinstance(self.grammar_drafter, bool):
            raise SpecDecError(f"grammar_drafter must be true or false, got {self.grammar_drafter!r}",
                               field="grammar_drafter")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            penalty = _finite(getattr(self, name), name)
            if abs(penalty) > MAX_PENALTY:
                raise SpecDecError(f"{name} must be between {-MAX_PENALTY:g} and {MAX_PENALTY:g}, got {penalty:g}",
                                   field=name)
            object.__setattr__(self, name, penalty)
        object.__setattr__(self, "stop_token_ids", token_ids(self.stop_token_ids, "stop_token_ids"))
        repetition = _finite(self.repetition_penalty, "repetition_penalty")
        low, high = REPETITION_PENALTY_BOUNDS
        if not low <= repetition <= high:
            raise SpecDecError(f"repetition_penalty must be between {low:g} and {high:g} (1 is none), got "
                               f"{repetition:g}", field="repetition_penalty")
        object.__setattr__(self, "repetition_penalty", repetition)
        object.__setattr__(self, "draft_confidence_threshold", threshold)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)

    @property
    def speculative(self) -> bool:
        return self.method in SPECULATIVE_METHODS

    def ending_tokens(self, eos) -> frozenset[int]:
        """The tokens that end this request's decoding: the model's end-of-sequence ones `eos` (none with
        ignore_eos) and stop_token_ids."""
        return frozenset(() if self.ignore_eos else eos) | frozenset(self.stop_token_ids or ())

    @property
    def penalized(self) -> bool:
        """Whether a penalty depends on the tokens so far (presence, frequency or repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def replace(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (and checked again)."""
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
CHOICE_SEEDS = 0x6E5F63686F696365  # "n_choice": keeps choice seeds apart from the engine's per-position ones


def splitmix64(z: int) -> int:
    """splitmix64's output function of a 64-bit integer: a well-mixed 64-bit seed from a structured one."""
    z %= 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's index-th choice (OpenAI's n): the request's own for the first (so n = 1 answers as
    before), for the others one derived from (seed, index), so the choices differ and the request repeats
    exactly; None (a random seed each) for a request without one."""
    if seed is None or index == 0:
        return seed
    return splitmix64((seed % 2**64 ^ CHOICE_SEEDS) + index * GOLDEN)


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecDecError(f"{name} must be an integer, got {value!r}", field=name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise SpecDecError(f"{name} must be {bound}, got {value}", field=name)
    return value


def token_ids(value, name: str) -> tuple[int, ...] | None:
    """Token ids as a sorted tuple without repeats, None for none (or an empty list); SpecDecError naming `name`."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise SpecDecError(f"{name} must be a list of token ids, got {value!r}", field=name)
    for token in value:
        _integer(token, name, 0)
    return tuple(sorted(set(value))) or None


def _logit_bias(value) -> tuple[tuple[int, float], ...] | None:
    """A logit bias as ((token id, bias), ...) sorted by id, None for none (or an empty one); SpecDecError naming
    `logit_bias` for anything else."""
    if value is None:
        return None
    try:
        pairs = list(value.items() if isinstance(value, Mapping) else value)
        if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
            raise TypeError
    except TypeError:
        raise SpecDecError(f"logit_bias must map token ids to numbers, got {value!r}", field="logit_bias") from None
    bias = {}
    for token, amount in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise SpecDecError(f"logit_bias: token ids must be integers >= 0, got {token!r}", field="logit_bias")
        amount = _finite(amount, "logit_bias")
        if abs(amount) > MAX_LOGIT_BIAS:
            raise SpecDecError(f"logit_bias: a bias must be between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got "
                               f"{amount:g} for token {token}", field="logit_bias")
        if token in bias:
            raise SpecDecError(f"logit_bias: token {token} is given twice", field="logit_bias")
        bias[token] = amount
    return tuple(sorted(bias.items())) or None


def _finite(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecDecError(f"{name} must be a finite number, got {value!r}", field=name)
    return float(value)


# LookupSettings' fields under the names the service configuration (config/default.toml, SPECDEC_*) and the
# command line (--lookup_max_ngram, ...) give them
LOOKUP_KEYS = {"max_ngram": "lookup_max_ngram", "max_tokens": "lookup_max_tokens", "min_match": "lookup_min_match",
               "hybrid_min_match": "hybrid_min_match", "extend": "hybrid_extend"}


HYBRID_MIN_MATCH = 3  # LookupSettings.hybrid_min_match's default


def _is_default_hybrid_min_match(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == HYBRID_MIN_MATCH


@dataclass(frozen=True)
class LookupSettings:
    """Prompt lookup's knobs. The defaults were chosen by measurement on the default pair. Replaying the greedy
    rounds of the 44 prompts of both sets with measured forward costs by width (bench/results/drafting/drafting.md,
    `python -m bench.drafting`) ranked matches of 8 tokens first (the longer the match, the surer its
    continuation: 95% of the lookup's proposals after an 8-token match were the target's on the grounded prompts,
    against 19% after a 1-token one). Measured with the rounds interleaved per prompt on the 20 grounded prompts
    (bench/results/extend-interleaved/): the hybrid on matches of 3 with `extend` against matches of 4 and no
    mixing gave 3.65-3.84 tokens per target forward against 3.31 and 1.07x model drafting's tokens/s against 1.04x
    (1.02x either way on the 24 default prompts; issue 18's floor is 0.97x). 6 proposals per round against 8:
    the same speed for that hybrid (1.00x, 3.65 against 3.84 tokens per target forward), and 1.07x for the lookup
    alone (the replay had ranked 8 first; the wider verifications cost more than it modelled)."""

    max_ngram: int = 8  # the longest suffix tried first; shorter ones down to min_match after it
    max_tokens: int = 6  # proposals per round at most
    min_match: int = 1  # LookupDrafter proposes on a match this long or longer
    # HybridDrafter hands a position to the lookup on a match this long or longer (the default, 3, is cut to
    # max_ngram where that is shorter: setting max_ngram alone never fails for a default left as it is)
    hybrid_min_match: int = HYBRID_MIN_MATCH
    extend: bool = True  # HybridDrafter: may a round mix the drafters (the lookup continuing the model's run)?

    def __post_init__(self):
        _integer(self.max_ngram, "max_ngram", 1, MAX_LOOKUP)
        _integer(self.max_tokens, "max_tokens", 1, MAX_LOOKUP)
        if _is_default_hybrid_min_match(self.hybrid_min_match) and self.max_ngram < HYBRID_MIN_MATCH:
            object.__setattr__(self, "hybrid_min_match", self.max_ngram)
        for name in ("min_match", "hybrid_min_match"):  # a match is at most max_ngram tokens long
            _integer(getattr(self, name), name, 1, self.max_ngram)
        if not isinstance(self.extend, bool):
            raise SpecDecError(f"extend must be true or false, got {self.extend!r}", field="extend")
