"""Sampling parameters: the one frozen, validated type that the engine, CLI, HTTP API, config and benchmark share.

Method names and every bound live here; the HTTP request models and the settings take theirs from these names.
"""

import math
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
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # seeds are taken modulo 2**64


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. Checked when built: a bad value raises SpecDecError naming the field.

    gamma None chooses the draft length adaptively; temperature 0 is greedy; top_k 0 and top_p 1 cut nothing;
    seed None draws a random seed (the stats report the one used). `drafter` and `verification` matter to the
    speculative methods only: who proposes (drafters.py) and which rule verifies (verification.py).
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

    def __post_init__(self):
        for name, allowed in (("method", METHODS), ("drafter", DRAFTERS), ("verification", VERIFICATIONS)):
            if getattr(self, name) not in allowed:
                raise SpecDecError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}",
                                   field=name)
        _integer(self.max_new_tokens, "max_new_tokens", 1)
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
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)

    @property
    def speculative(self) -> bool:
        return self.method in SPECULATIVE_METHODS

    def replace(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (and checked again)."""
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecDecError(f"{name} must be an integer, got {value!r}", field=name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise SpecDecError(f"{name} must be {bound}, got {value}", field=name)
    return value


def _finite(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecDecError(f"{name} must be a finite number, got {value!r}", field=name)
    return float(value)
