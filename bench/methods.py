"""The benchmark's methods, one run each: ours on a SpeculativeDecoder (named drafter-verification, see
bench/benchmark.py) and Hugging Face's `generate`, each on its own form of the pair."""

import contextlib
import copy
import dataclasses
import hashlib
import json
import time

import torch

from specdec.engine import LookupSettings, SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.kv_cache import input_device
from specdec.models.kernels import prepare_draft, use_cpu_kernels, use_stock_kernels
from specdec.params import DRAFTERS, VERIFICATIONS, SamplingParams
from specdec.verification import EXPECTED_ACCEPTED

SPECULATIVE = tuple(f"{drafter}-{rule}" for drafter in DRAFTERS for rule in VERIFICATIONS)
OUR_METHODS = ("target", "draft") + SPECULATIVE
HF_METHODS = ("hf_lookup", "hf_assisted")
EXTRA_METHODS = ("google", "deepmind", "adaptive", "hf_target", "hf_assisted_own_memory",
                 "hf_assisted_fixed_threshold")  # on request
HF_ALL = ("hf_lookup", "hf_assisted", "hf_target", "hf_assisted_own_memory", "hf_assisted_fixed_threshold")
HF_PROMPT_LOOKUP_TOKENS = 10
MODES = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
         "sampling": dict(temperature=0.7, top_k=0, top_p=0.9),
         "t0.7": dict(temperature=0.7, top_k=0, top_p=1.0)}  # on request: T=0.7 over the whole vocabulary


def ours_draft(draft, draft_quantization: str):
    """Our methods' draft, as load_pair gives it: a copy of the stock draft (int8, few-rows or packed linears,
    grouped-head attention on CPU), so that the stock one stays for Hugging Face's assisted generation. On CUDA:
    the stock draft."""
    if input_device(draft).type != "cpu":
        return draft
    ours = copy.deepcopy(draft)
    prepare_draft(ours, draft_quantization)
    return ours


def ours_target(target):
    """Our methods' target, as load_pair gives it: a copy of the stock target (so in the process's own memory,
    not the checkpoint's mapped pages) with the CPU kernels. Hugging Face's baselines keep the stock one, as
    `from_pretrained` loads it. On CUDA: the stock target."""
    if input_device(target).type != "cpu":
        return target
    ours = copy.deepcopy(target)
    use_cpu_kernels(ours)
    return ours


@contextlib.contextmanager
def stock_layers(model):
    """`model` with the library's own linear layers and attention for the duration, on the same weights (nothing
    copied on this machine: few-rows layers share nn.Linear's weight), then our kernels again."""
    changed = use_stock_kernels(model)
    try:
        yield model
    finally:
        if changed:
            use_cpu_kernels(model)


def measured_models(target, our_draft) -> dict:
    """What the run measured, read off the models: the target's dtype, and our draft's form: "int8" (torch's int8
    layers: load_pair quantizes a float32 or bfloat16 CPU draft only), "int4" (every linear layer in 4-bit groups),
    "shipped" (the GGUF's own groups), or "none" (as loaded; also when no method of ours ran, `our_draft` None)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    from specdec.cpu.grouped import GroupedLinear

    modules = list(our_draft.modules()) if our_draft is not None else []
    bits = {m.bits for m in modules if isinstance(m, GroupedLinear)}
    form = "int8" if any(isinstance(m, DynamicQuantizedLinear) for m in modules) else \
        ("int4" if bits == {4} else "shipped") if bits else "none"
    return {"dtype": str(target.dtype).removeprefix("torch."), "draft_quantization": form}


@contextlib.contextmanager
def fixed_confidence_threshold():
    """Hugging Face's assisted generation as it runs where scikit-learn is not installed: the assistant's
    confidence threshold stays at its default (0.4). Where scikit-learn imports (our dev environment has it, for
    lm-eval), `generate` refits the threshold from a ROC curve after every round (`AssistedCandidateGenerator.
    update_candidate_strategy`), which cost it 1.45-4.4x on the tiny pair in our runs; the benchmark measures both."""
    from transformers.generation import candidate_generator

    saved = candidate_generator.is_sklearn_available
    candidate_generator.is_sklearn_available = lambda: False
    try:
        yield
    finally:
        candidate_generator.is_sklearn_available = saved


def run_hf(method: str, draft, target, ids: list[int], max_new_tokens: int, mode: dict, seed: int) -> dict:
    """One Hugging Face generate call; returns generated tokens and seconds. `hf_assisted_fixed_threshold` is
    assisted generation without the threshold's refitting (fixed_confidence_threshold)."""
    device = input_device(target)
    input_ids = torch.tensor([ids], device=device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=mode["temperature"] > 0, repetition_penalty=1.0,
                  pad_token_id=target.generation_config.pad_token_id or 0)
    if kwargs["do_sample"]:
        kwargs.update(temperature=mode["temperature"], top_k=mode["top_k"], top_p=mode["top_p"])
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if method in ("hf_assisted", "hf_assisted_own_memory", "hf_assisted_fixed_threshold"):
        kwargs["assistant_model"] = draft
    elif method == "hf_lookup":
        kwargs["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_TOKENS
    torch.manual_seed(seed)
    fixed = fixed_confidence_threshold() if method == "hf_assisted_fixed_threshold" else contextlib.nullcontext()
    start = time.perf_counter()
    with torch.inference_mode(), fixed:
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    seconds = time.perf_counter() - start
    return {"new_tokens": out.shape[1] - len(ids), "total_seconds": seconds,
            "token_digest": token_digest(out[0, len(ids):].tolist())}


def token_digest(token_ids: list[int]) -> str:
    """A short fingerprint of a run's generated tokens: greedy runs of one prompt compare by it."""
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


# a method's suffixes (after drafter-verification), each at most once: its keyword and how its value reads
SUFFIXES = {"c": ("draft_confidence_threshold", float), "g": ("gamma", int), "k": ("lookup_max_tokens", int),
            "h": ("lookup_hybrid_min_match", int)}


def our_method(method: str, gamma: int) -> dict:
    """The generate keywords of one of our method names (see bench/benchmark.py's docstring). Lookup suffixes
    come back as `lookup`, the LookupSettings fields that this method changes from the decoder's (run_ours applies
    them)."""
    aliases = {"google": "model-token", "deepmind": "model-token-deepmind", "adaptive": "model-token-adaptive"}
    if method in ("target", "draft"):
        return {"method": method}
    unknown = ValueError(f"unknown method {method!r}")
    parts = aliases.get(method, method).split("-")
    if len(parts) < 2 or parts[0] not in DRAFTERS or parts[1] not in VERIFICATIONS:
        raise unknown
    suffixes = parts[2:]
    keys = [suffix[0] if suffix[:1] in SUFFIXES else suffix for suffix in suffixes]
    if len(set(keys)) < len(keys):
        raise unknown
    keywords = {"method": "deepmind" if "deepmind" in suffixes else "google", "drafter": parts[0],
                "verification": parts[1], "gamma": None if "adaptive" in suffixes else gamma}
    lookup = {}
    for suffix in suffixes:
        if suffix in ("adaptive", "deepmind"):
            continue
        if suffix == "x" and parts[0] == "hybrid":
            lookup["extend"] = True
            continue
        if suffix[:1] not in SUFFIXES:
            raise unknown
        name, kind = SUFFIXES[suffix[0]]
        try:
            value = kind(suffix[1:])
        except ValueError:
            raise ValueError(f"unknown method {method!r}: {suffix[0]} must be followed by a number") from None
        if name == "gamma" and "adaptive" in suffixes or name.startswith("lookup") and parts[0] == "model" \
                or name == "lookup_hybrid_min_match" and parts[0] != "hybrid":
            raise unknown
        if name.startswith("lookup_"):
            lookup[name.removeprefix("lookup_")] = value
        else:
            keywords[name] = value
    try:  # the values' own checks: the threshold's range, gamma's, the lookup's
        SamplingParams(**{k: keywords[k] for k in ("draft_confidence_threshold", "gamma") if k in keywords
                          and keywords[k] is not None})
        dataclasses.replace(LookupSettings(), **lookup)
    except (ValueError, SpecDecError) as error:
        raise ValueError(f"unknown method {method!r}: {error}") from None
    if lookup:
        keywords["lookup"] = lookup
    return keywords


class BlockScorer:
    """A round observer: each drafted block's expected accepted tokens under both rules (EXPECTED_ACCEPTED), and
    the seconds spent scoring, which the run's timings then leave out."""

    def __init__(self):
        self.expected = {rule: 0.0 for rule in EXPECTED_ACCEPTED}
        self.blocks = 0
        self.seconds = 0.0

    def __call__(self, draft_tokens, draft_probs, target_probs) -> None:
        start = time.perf_counter()
        for rule, expected in EXPECTED_ACCEPTED.items():
            self.expected[rule] += expected(draft_tokens, draft_probs, target_probs)
        self.blocks += 1
        self.seconds += time.perf_counter() - start


def run_ours(method: str, decoder: SpeculativeDecoder, ids: list[int], max_new_tokens: int, mode: dict, seed: int,
             gamma: int) -> dict:
    scorer = BlockScorer()
    keywords = our_method(method, gamma)
    settings = decoder.lookup
    decoder.round_observer = scorer
    decoder.lookup = dataclasses.replace(settings, **keywords.pop("lookup", {}))
    try:
        result = decoder.generate(ids, max_new_tokens=max_new_tokens, seed=seed, **keywords, **mode)
    finally:
        decoder.round_observer = None
        decoder.lookup = settings
    stats = dict(result.stats.as_dict(), token_digest=token_digest(result.token_ids))
    if scorer.blocks:
        stats["expected_accepted"] = dict(scorer.expected, blocks=scorer.blocks)
        # the scoring is the benchmark's, not the method's: its time leaves the run's
        for name in ("total_seconds", "other_seconds"):
            stats[name] = max(stats[name] - scorer.seconds, 1e-9)
        stats["tokens_per_second"] = stats["new_tokens"] / stats["total_seconds"]
        later = stats["total_seconds"] - stats["first_chunk_seconds"]
        if stats.get("decode_tokens_per_second") and later > 0:
            stats["decode_tokens_per_second"] = (stats["new_tokens"] - stats["first_chunk_tokens"]) / later
    return stats
