"""The decoding engine: draft proposes gamma tokens, target verifies them in one forward, caches roll back.

Batch size 1. The engine knows nothing about text: token ids in, token ids with their provenance and stats
out. Nothing here prints; per-round detail goes to the DEBUG log.
"""

import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .adaptive import AdaptiveGamma, CostProfile
from .errors import SpecDecError
from .kv_cache import CachedModel, context_length
from .sampling import logits_to_probs, sample
from .verification import accept_mask, num_accepted, residual_probs

logger = logging.getLogger(__name__)

METHODS = ("google", "deepmind", "target", "draft")
SPECULATIVE_METHODS = ("google", "deepmind")
MAX_GAMMA = 64  # a hard bound on proposals per round; adaptive gamma stays far below it
ADAPTIVE_MAX_GAMMA = 8
MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32; 0 means greedy


@dataclass
class Chunk:
    """Tokens committed by one round (one target forward, or one baseline step)."""

    token_ids: list[int]
    sources: list[str]


@dataclass
class GenerationResult:
    """What one `generate` call produced. `token_ids` are generated tokens only (EOS included, if hit)."""

    token_ids: list[int]
    sources: list[str]
    finish_reason: str  # "length" | "stop"
    stats: dict = field(default_factory=dict)


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


def _int_param(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecDecError(f"{name} must be an integer, got {value!r}", field=name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise SpecDecError(f"{name} must be {bound}, got {value}", field=name)
    return value


def _float_param(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecDecError(f"{name} must be a finite number, got {value!r}", field=name)
    return float(value)


def _eos_ids(eos_token_id, target_model) -> set[int]:
    if eos_token_id is None:
        config = getattr(target_model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(target_model.config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    return {int(t) for t in ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)}


class _Request:
    """All mutable state of one generate call: sequence, caches, RNG, counters and timers."""

    def __init__(self, prompt: list[int], max_new_tokens: int, limit: int | None, seed: int, eos: set[int]):
        self.ids = list(prompt)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.limit = limit
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.eos = eos
        self.sources: list[str] = []
        self.finish_reason: str | None = None
        self.proposed = 0
        self.accepted = 0
        self.rounds = 0
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

    def forward(self, role: str, model: CachedModel, tokens: list[int], keep: int = 1) -> torch.Tensor:
        """A timed forward of the draft or target model."""
        start = time.perf_counter()
        logits = model.forward(tokens, keep)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        seconds = time.perf_counter() - start
        if not self.forwards[role]:
            self.prefill_seconds[role] = seconds
        self.seconds[role] += seconds
        self.forwards[role] += 1
        return logits

    def commit(self, tokens: list[int], sources: list[str]) -> Chunk:
        """Append tokens, cut at the first EOS or at the budget, and set finish_reason when done."""
        tokens = tokens[: self.budget()]
        for i, token in enumerate(tokens):
            if token in self.eos:
                tokens = tokens[: i + 1]
                self.finish_reason = "stop"
                break
        sources = sources[: len(tokens)]
        if self.first_chunk is None:
            self.first_chunk = (time.perf_counter() - self.started, len(tokens))
        self.ids.extend(tokens)
        self.sources.extend(sources)
        if self.finish_reason is None and self.budget() <= 0:
            self.finish_reason = "length"
        return Chunk(tokens, sources)

    def stats(self, method: str, gamma) -> dict:
        total = time.perf_counter() - self.started
        new = self.generated
        other = max(0.0, total - self.seconds["draft"] - self.seconds["target"])
        target_forwards = self.forwards["target"]
        first_seconds, first_tokens = self.first_chunk or (total, new)
        later = total - first_seconds
        return {
            "method": method,
            "gamma": gamma,
            "seed": self.seed,
            "prompt_tokens": self.prompt_len,
            "new_tokens": new,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "tokens_per_target_forward": new / target_forwards if target_forwards else None,
            "rounds": self.rounds,
            "draft_forwards": self.forwards["draft"],
            "target_forwards": target_forwards,
            "draft_seconds": self.seconds["draft"],
            "target_seconds": self.seconds["target"],
            # each model's first forward (the prompt prefill, with the first proposal or token): the forwards
            # after it are the per-token costs that the Leviathan model's c describes
            "draft_prefill_seconds": self.prefill_seconds["draft"],
            "target_prefill_seconds": self.prefill_seconds["target"],
            "other_seconds": other,
            "total_seconds": total,
            "tokens_per_second": new / total if total > 0 else None,
            # the first round includes the prompt prefill (time to first token); the rounds after it are the
            # steady state that Leviathan et al.'s expected speedup describes
            "first_chunk_seconds": first_seconds,
            "first_chunk_tokens": first_tokens,
            "decode_tokens_per_second": (new - first_tokens) / later if new > first_tokens and later > 0 else None,
        }


class SpeculativeDecoder:
    """Exact speculative decoding for a draft/target pair of Hugging Face causal LMs sharing a vocabulary."""

    def __init__(self, draft_model, target_model, tokenizer=None):
        self.draft_model = draft_model.eval()
        self.target_model = target_model.eval()
        self.vocab_size = check_vocabularies(draft_model, target_model, tokenizer)
        limits = [n for n in (context_length(draft_model), context_length(target_model)) if n]
        self.context_length = min(limits) if limits else None
        # measured forward costs of this pair on this machine, kept across requests for adaptive gamma
        self.cost_profile = CostProfile()

    def generate(self, input_ids, max_new_tokens: int = 64, method: str = "google", gamma: int | None = 4,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_id=None) -> GenerationResult:
        """Decode up to max_new_tokens after input_ids. gamma=None chooses the draft length adaptively."""
        stream = self.stream(input_ids, max_new_tokens=max_new_tokens, method=method, gamma=gamma,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    def stream(self, input_ids, max_new_tokens: int = 64, method: str = "google", gamma: int | None = 4,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               eos_token_id=None) -> Iterator[Chunk]:
        """Like `generate`, but yields each round's committed tokens as a Chunk and returns the GenerationResult.

        Arguments are checked here, before decoding starts. `send("stop")` ends decoding with finish_reason
        "stop" (a caller's stop string) and raises StopIteration carrying the result; `close()` just abandons it.
        """
        prompt = self._prompt(input_ids)
        if method not in METHODS:
            raise SpecDecError(f"method must be one of {', '.join(METHODS)}, got {method!r}", field="method")
        max_new_tokens = _int_param(max_new_tokens, "max_new_tokens", 1)
        if gamma is not None:
            gamma = _int_param(gamma, "gamma", 1, MAX_GAMMA)
        temperature = _float_param(temperature, "temperature")
        if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
            raise SpecDecError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}",
                               field="temperature")
        top_k = _int_param(top_k, "top_k", 0)
        top_p = _float_param(top_p, "top_p")
        if not 0 < top_p <= 1:
            raise SpecDecError(f"top_p must be in (0, 1], got {top_p}", field="top_p")
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        seed = _int_param(seed, "seed", -(2**63), 2**64 - 1) % 2**64
        if self.context_length is not None and len(prompt) >= self.context_length:
            raise SpecDecError(
                f"the prompt has {len(prompt)} tokens and leaves no room in the model context of "
                f"{self.context_length} tokens", field="input_ids")

        req = _Request(prompt, max_new_tokens, self.context_length, seed, _eos_ids(eos_token_id, self.target_model))
        return self._run(req, _Warper(temperature, top_k, top_p, self.vocab_size), method, gamma)

    def _run(self, req: "_Request", probs: "_Warper", method: str, gamma: int | None):
        if method in SPECULATIVE_METHODS:
            yield from self._speculate(req, probs, method, gamma)
        else:
            yield from self._autoregress(req, probs, method)
        result = GenerationResult(req.ids[req.prompt_len:], req.sources, req.finish_reason or "length",
                                  req.stats(method, gamma if method in SPECULATIVE_METHODS else None))
        logger.debug("generate done: %s", result.stats)
        return result

    def _prompt(self, input_ids) -> list[int]:
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 2 and input_ids.size(0) != 1:
                raise SpecDecError("only batch size 1 is supported", field="input_ids")
            input_ids = input_ids.reshape(-1).tolist()
        if not isinstance(input_ids, (list, tuple)) or not input_ids:
            raise SpecDecError("input_ids must be a non-empty list of token ids or a 1 x n tensor", field="input_ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in input_ids):
            raise SpecDecError(f"input_ids must be integers in [0, {self.vocab_size})", field="input_ids")
        return list(input_ids)

    def _autoregress(self, req: _Request, probs: "_Warper", method: str) -> Iterator[Chunk]:
        """Target-only or draft-only decoding with a KV cache: one forward, one token."""
        model = CachedModel(self.target_model if method == "target" else self.draft_model)
        role = "target" if method == "target" else "draft"
        while req.finish_reason is None:
            logits = req.forward(role, model, req.ids[model.length:])
            token = sample(probs(logits[-1]), req.generator)
            req.rounds += 1
            if (yield req.commit([token], ["target"])) == "stop":
                req.finish_reason = "stop"

    def _speculate(self, req: _Request, probs: "_Warper", variant: str, gamma: int | None) -> Iterator[Chunk]:
        """Google (Leviathan et al. Alg. 1) or DeepMind (Chen et al. Alg. 2) speculative sampling."""
        draft, target = CachedModel(self.draft_model), CachedModel(self.target_model)
        adaptive = AdaptiveGamma(max_gamma=ADAPTIVE_MAX_GAMMA, costs=self.cost_profile) if gamma is None else None
        while req.finish_reason is None:
            wanted = adaptive.choose() if adaptive else gamma
            k_max = min(wanted, req.budget() - 1)  # never propose past max_new_tokens or the context
            before = dict(req.seconds), dict(req.forwards)

            # 1. the draft proposes k_max tokens autoregressively (its first forward catches up on new tokens)
            draft_tokens, draft_dists = [], []
            feed = req.ids[draft.length:]
            for _ in range(k_max):
                q = probs(req.forward("draft", draft, feed)[-1])
                token = sample(q, req.generator)
                draft_tokens.append(token)
                draft_dists.append(q)
                feed = [token]

            # 2. the target scores all k_max + 1 positions in one forward: p_1 .. p_{k+1}
            p = probs(req.forward("target", target, req.ids[target.length:] + draft_tokens, keep=k_max + 1))

            # 3. accept a prefix of the proposals, then resample at the first rejection or take the bonus token
            accepted = 0
            if k_max:
                q = torch.stack(draft_dists).to(p.device)
                x = torch.tensor(draft_tokens, device=p.device)
                accepted = self._verify(variant, x, q, p[:k_max], req.generator)
            if accepted < k_max:
                token, source = sample(residual_probs(p[accepted], q[accepted]), req.generator), "resampled"
            else:
                token, source = sample(p[k_max], req.generator), "bonus"

            chunk = req.commit(draft_tokens[:accepted] + [token], ["draft"] * accepted + [source])
            req.proposed += k_max
            req.accepted += accepted
            req.rounds += 1
            # 4. both caches roll back to the committed prefix; the newest token is fed next round
            target.rollback(len(req.ids) - 1)
            draft.rollback(len(req.ids) - 1)
            # every round's costs feed the decoder's profile (fixed gamma too), except the first: its forwards
            # include both prompt prefills and say nothing about per-token cost
            spent = {role: (req.seconds[role] - before[0][role], req.forwards[role] - before[1][role])
                     if req.rounds > 1 else (0.0, 0) for role in ("draft", "target")}
            self.cost_profile.record(*spent["draft"], *spent["target"], width=k_max + 1)
            if adaptive:
                adaptive.update(k_max, accepted)
            logger.debug("round %d: gamma=%d accepted=%d committed=%d", req.rounds, k_max, accepted,
                         len(chunk.token_ids))
            if (yield chunk) == "stop":
                req.finish_reason = "stop"

    @staticmethod
    def _verify(variant: str, x: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator) -> int:
        """Number of accepted proposals under the shared rejection rule.

        Google draws all gamma uniforms at once and finds the first rejection with one tensor op; DeepMind
        walks the proposals in order, one uniform each, and stops at the first rejection (Chen et al. Alg. 2).
        """
        if variant == "google":
            uniforms = torch.rand(len(x), generator=generator, dtype=torch.float64)
            return num_accepted(accept_mask(x, q, p, uniforms))
        for t in range(len(x)):
            uniform = torch.rand(1, generator=generator, dtype=torch.float64)
            if not bool(accept_mask(x[t:t + 1], q[t:t + 1], p[t:t + 1], uniform)[0]):
                return t
        return len(x)


class _Warper:
    """Logits -> the distribution sampled from, identical for draft and target (and the baselines)."""

    def __init__(self, temperature: float, top_k: int, top_p: float, vocab_size: int):
        self.temperature, self.top_k, self.top_p, self.vocab_size = temperature, top_k, top_p, vocab_size

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits[..., : self.vocab_size], self.temperature, self.top_k, self.top_p)
