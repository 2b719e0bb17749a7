"""The benchmark behind `make bench`: generated tokens/s of every method on the committed prompt sets.

Prompt sets: `default` (bench/prompts.jsonl: completion, instructions, chat, summaries) and `grounded`
(bench/prompts_grounded.jsonl: rewriting given code, fixing a bug and returning the file, quoting a passage,
extending a repetitive structure), each greedy and sampled (T=0.7, top-p 0.9).

Our methods are named drafter-verification: `model-token` (Google speculative sampling with the draft model),
`model-block`, `lookup-token`, `lookup-block`, `hybrid-token`, `hybrid-block`; an `-adaptive` suffix picks the
draft length adaptively, `-deepmind` the DeepMind variant (`google`, `deepmind` and `adaptive` are the
model-token ones), `-g8` sets gamma to 8 for this method alone, and `-c0.5` the draft model's confidence stop
(draft_confidence_threshold) to 0.5, where the methods without it take SamplingParams' default; for lookup and
hybrid, `-k8` sets the lookup's max_tokens to 8, and for hybrid `-h3` its hybrid_min_match to 3 and `-x` turns
on extend, over the run's `--lookup` settings (so one run can interleave lookup settings per prompt); `target` and
`draft` decode with one model alone. Hugging Face baselines run `generate` on the models exactly as
`from_pretrained` loads them: `hf_lookup` (its prompt lookup, prompt_lookup_num_tokens=10), `hf_assisted`
(assisted generation with the draft), and on request `hf_target` and `hf_assisted_own_memory`
(assisted generation with the library's layers on weights copied into the process's memory, as ours are).
For every speculative run, the blocks it drafted are also scored under both verification rules
(EXPECTED_ACCEPTED): block verification's gain in accepted tokens per round on the same proposals.
Only generated tokens count, never prompt tokens. Results go to JSON, a Markdown table and a PNG plot, with
the command, the machine, the date and prompt lookup's settings (`--lookup KEY=VALUE,...` changes them);
`--from-runs` rebuilds them from the runs of earlier reports.
"""

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from specdec.adaptive import expected_speedup, fit_alpha
from specdec.engine import LookupSettings, SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.kv_cache import input_device
from specdec.loading import DRAFT_QUANTIZATIONS, load_pair, prepare_draft, use_cpu_kernels, use_stock_kernels
from specdec.params import DRAFTERS, VERIFICATIONS, SamplingParams
from specdec.text import encode_prompt
from specdec.verification import EXPECTED_ACCEPTED

SPECULATIVE = tuple(f"{drafter}-{rule}" for drafter in DRAFTERS for rule in VERIFICATIONS)
OUR_METHODS = ("target", "draft") + SPECULATIVE
HF_METHODS = ("hf_lookup", "hf_assisted")
EXTRA_METHODS = ("google", "deepmind", "adaptive", "hf_target", "hf_assisted_own_memory")  # on request
HF_ALL = ("hf_lookup", "hf_assisted", "hf_target", "hf_assisted_own_memory")
HF_PROMPT_LOOKUP_TOKENS = 10
PAIRED_BASELINES = ("target", "hf_lookup", "model-token")  # issue 18 set its targets against these three
MODES = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
         "sampling": dict(temperature=0.7, top_k=0, top_p=0.9),
         "t0.7": dict(temperature=0.7, top_k=0, top_p=1.0)}  # on request: T=0.7 over the whole vocabulary
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"
GROUNDED_PROMPTS = Path(__file__).resolve().parent / "prompts_grounded.jsonl"
PROMPT_SETS = {"default": DEFAULT_PROMPTS, "grounded": GROUNDED_PROMPTS}


def load_prompts(path, limit: int | None = None) -> list[dict]:
    """The prompt set: one JSON object per line with `id`, `category`, `prompt` and `chat`."""
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line) for line in f if line.strip()]
    return prompts[:limit] if limit else prompts


def encode(tokenizer, item: dict) -> list[int]:
    return encode_prompt(tokenizer, item["prompt"], chat=bool(item.get("chat")) and bool(tokenizer.chat_template))


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def forward_ms(model, context: int, new: int, device, repeats: int) -> float:
    """Median ms of one forward over `new` tokens after `context` cached tokens (the cache is cropped back)."""
    return forward_ms_by_width(model, context, [new], device, repeats)[new]


@torch.inference_mode()
def forward_ms_by_width(model, context: int, widths: list[int], device, repeats: int) -> dict[int, float]:
    """Median ms of one forward over each number of new tokens in `widths`, after `context` cached tokens. The
    widths take turns within each repeat, so a burst of load on a shared machine lands on all of them alike
    instead of on whichever was being measured."""
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(widths)),
                        generator=torch.Generator().manual_seed(0)).to(device)
    model(input_ids=ids[:, :context], cache=cache, use_cache=True)
    times: dict[int, list[float]] = {n: [] for n in widths}
    for _ in range(repeats + 2):  # the first two rounds warm up
        for n in widths:
            _sync(ids.device)
            start = time.perf_counter()
            model(input_ids=ids[:, context:context + n], cache=cache, use_cache=True, logits_to_keep=n)
            _sync(ids.device)
            times[n].append((time.perf_counter() - start) * 1e3)
            cache.crop(-n)
    return {n: statistics.median(ms[2:]) for n, ms in times.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verification_cost(model, max_new: int, context: int = 128, repeats: int = 5) -> dict:
    """Target forward ms over 1..max_new new tokens, and each relative to one token."""
    device = model.get_input_embeddings().weight.device
    ms = forward_ms_by_width(model, context, list(range(1, max_new + 1)), device, repeats)
    return {"context": context, "ms": ms, "relative": {n: v / ms[1] for n, v in ms.items()}}


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


def run_hf(method: str, draft, target, ids: list[int], max_new_tokens: int, mode: dict, seed: int) -> dict:
    """One Hugging Face generate call; returns generated tokens and seconds."""
    device = target.get_input_embeddings().weight.device
    input_ids = torch.tensor([ids], device=device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=mode["temperature"] > 0, repetition_penalty=1.0,
                  pad_token_id=target.generation_config.pad_token_id or 0)
    if kwargs["do_sample"]:
        kwargs.update(temperature=mode["temperature"], top_k=mode["top_k"], top_p=mode["top_p"])
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if method in ("hf_assisted", "hf_assisted_own_memory"):
        kwargs["assistant_model"] = draft
    elif method == "hf_lookup":
        kwargs["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_TOKENS
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
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
    """The generate keywords of one of our method names (see the module docstring). Lookup suffixes come back as
    `lookup`, the LookupSettings fields that this method changes from the decoder's (run_ours applies them)."""
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


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def leviathan_bound(alpha: float, mean_gamma: float, c: float, verification: float = 1.0) -> float:
    """Expected speedup for acceptance alpha and cost ratio c at a (possibly fractional, adaptive) mean gamma,
    interpolated between the integers around it; `verification` as in `expected_speedup`."""
    alpha = min(alpha, 0.999999)
    low = max(int(mean_gamma), 1)
    frac = max(mean_gamma - low, 0.0)
    return sum(weight * expected_speedup(alpha, g, c, verification)
               for weight, g in ((1 - frac, low), (frac, low + 1)) if weight)


def per_forward_ms(runs: list[dict], role: str) -> float | None:
    """Mean ms of a draft or target forward after the first (the prompt prefill) over these runs (those that
    report their prefill)."""
    runs = [r for r in runs if f"{role}_prefill_seconds" in r and r[f"{role}_forwards"] > 1]
    seconds = sum(r[f"{role}_seconds"] - r[f"{role}_prefill_seconds"] for r in runs)
    forwards = sum(r[f"{role}_forwards"] - 1 for r in runs)
    return 1e3 * seconds / forwards if forwards else None


def runs_by_prompt(by_method: dict, method: str) -> dict:
    """(prompt, repeat) -> that method's run, for runs that generated something in measurable time."""
    return {(r.get("prompt"), r.get("repeat")): r for r in by_method.get(method, [])
            if r["new_tokens"] and r["total_seconds"] > 0}


def per_prompt(rows: dict, by_method: dict, c: float | None) -> None:
    """Medians over prompts (and repeats) of each method's own ratios: speedup over our target-only and over HF
    assisted on the same prompt, and efficiency against the bound for that prompt's alpha and gamma (with the
    run's c). The headline efficiency instead sets a median speedup against the bound for the alpha pooled over
    all prompts, where prompts with low acceptance weigh more (they run more rounds); when acceptance varies from
    prompt to prompt, the two can differ either way."""
    def rate(r):
        return r["new_tokens"] / r["total_seconds"]

    target, hf_assisted, hf_lookup = (runs_by_prompt(by_method, m) for m in ("target", "hf_assisted", "hf_lookup"))
    for method, row in rows.items():
        runs = runs_by_prompt(by_method, method)
        speedups = [rate(r) / rate(target[k]) for k, r in runs.items() if k in target]
        if speedups:
            row["prompt_speedup_vs_target"] = statistics.median(speedups)
            row["prompt_speedups_vs_target"] = sorted(speedups)  # the spread over prompts
        over_hf = [rate(r) / rate(hf_assisted[k]) for k, r in runs.items() if k in hf_assisted]
        if over_hf:
            row["prompt_speedup_vs_hf_assisted"] = statistics.median(over_hf)
        over_lookup = [rate(r) / rate(hf_lookup[k]) for k, r in runs.items() if k in hf_lookup]
        if over_lookup:
            row["prompt_speedup_vs_hf_lookup"] = statistics.median(over_lookup)
        if c is None or row.get("alpha") is None or not row.get("model_drafter"):
            continue
        efficiencies = []
        for k, r in runs.items():
            if k in target and r.get("rounds") and r.get("proposed"):
                mean_gamma = r["proposed"] / r["rounds"]
                alpha = fit_alpha(r["new_tokens"] / r["rounds"], mean_gamma)
                efficiencies.append(rate(r) / rate(target[k]) / leviathan_bound(alpha, mean_gamma, c))
        if efficiencies:
            row["prompt_efficiency"] = statistics.median(efficiencies)


def same_as_target(rows: dict, by_method: dict) -> None:
    """Greedy runs only: on how many prompts each method generated exactly our target-only's tokens (greedy
    speculative decoding must; Hugging Face's methods are shown for comparison). Runs without a digest (older
    results) are left out."""
    reference = {(r.get("prompt"), r.get("repeat")): r["token_digest"] for r in by_method.get("target", [])
                 if r.get("token_digest")}
    for method, row in rows.items():
        pairs = [(r["token_digest"], reference[key]) for r in by_method[method]
                 if r.get("token_digest") and (key := (r.get("prompt"), r.get("repeat"))) in reference]
        if pairs and method != "target":
            row["same_tokens_as_target"] = {"prompts": len(pairs), "same": sum(a == b for a, b in pairs)}


def block_gains(scored: list[dict]) -> tuple[float | None, float]:
    """Block over token verification on the same drafted blocks, pooled over runs (each run's
    `expected_accepted`: summed expected accepted tokens under each rule, and its number of blocks): the gain in
    accepted tokens per round (None where token verification expects none), and in tokens per round (accepted
    + 1)."""
    token, block = sum(e["token"] for e in scored), sum(e["block"] for e in scored)
    blocks = sum(e["blocks"] for e in scored)
    return (block / token - 1 if token > 0 else None), (blocks + block) / (blocks + token) - 1


def bootstrap_interval(by_prompt: list[list], statistic, level: float = 0.9, draws: int = 2000,
                       seed: int = 0) -> list[float]:
    """The `level` interval of statistic(items) over `draws` resamples of the prompts with replacement, each
    prompt with all its items (its runs, or their scored blocks): prompts are the unit, since one prompt's items
    are alike and prompts differ more."""
    rng = random.Random(seed)
    values = sorted(statistic([item for prompt in rng.choices(by_prompt, k=len(by_prompt)) for item in prompt])
                    for _ in range(draws))
    tail = (1 - level) / 2
    return [values[int(tail * (draws - 1))], values[int((1 - tail) * (draws - 1))]]


def block_gain_interval(by_prompt: list[list[dict]], **options) -> list[float]:
    """A bootstrap interval over prompts for the gain in tokens per round (block_gains' second figure). The gain
    of one drawn block varies a lot, and blocks of one prompt are alike; the interval shows how far one run's
    figure can be from another's on other prompts or seeds."""
    return bootstrap_interval(by_prompt, lambda scored: block_gains(scored)[1], **options)


def _pooled(pairs: list[tuple[float, float, float, float]]) -> float:
    """(tokens_a, seconds_a, tokens_b, seconds_b) runs: a's tokens/s over b's, all tokens over all seconds."""
    tokens_a, seconds_a, tokens_b, seconds_b = (sum(column) for column in zip(*pairs))
    return (tokens_a / seconds_a) / (tokens_b / seconds_b)


def paired_speedup(by_prompt: list[list[tuple[float, float, float, float]]],
                   **options) -> tuple[float, list[float]]:
    """Method a against baseline b on the same prompts: the pooled ratio of tokens/s, and its bootstrap interval
    over prompts (each with all its repeats' pairs). A ratio whose interval holds 1.0 (or a target) is not shown
    to beat it by this run."""
    return _pooled([pair for prompt in by_prompt for pair in prompt]), bootstrap_interval(by_prompt, _pooled,
                                                                                           **options)


def _decode_part(run: dict) -> tuple[float, float] | None:
    """A run's tokens and seconds after its first round (the prompt's prefill), where it reports that round."""
    if run.get("first_chunk_seconds") is None or run.get("first_chunk_tokens") is None:
        return None
    tokens, seconds = run["new_tokens"] - run["first_chunk_tokens"], run["total_seconds"] - run["first_chunk_seconds"]
    return (tokens, seconds) if tokens > 0 and seconds > 0 else None


def paired(rows: dict, by_method: dict) -> None:
    """Each method (draft-only aside) against each of PAIRED_BASELINES run on the same prompts and repeats:
    pooled ratio and 90% interval over prompts (paired_speedup), over whole requests and past the first round."""
    for i, baseline in enumerate(PAIRED_BASELINES):
        base = runs_by_prompt(by_method, baseline)
        for method, row in rows.items():
            # draft-only does not sample the target's distribution; an earlier baseline has its own table
            if method in ("draft", *PAIRED_BASELINES[:i + 1]) or not base:
                continue
            whole: dict = {}
            decode: dict = {}
            for key, run in runs_by_prompt(by_method, method).items():
                if key not in base:
                    continue
                other = base[key]
                whole.setdefault(key[0], []).append((run["new_tokens"], run["total_seconds"], other["new_tokens"],
                                                     other["total_seconds"]))
                if (a := _decode_part(run)) and (b := _decode_part(other)):
                    decode.setdefault(key[0], []).append(a + b)
            if not whole:
                continue
            pooled, interval = paired_speedup(list(whole.values()))
            entry = {"prompts": len(whole), "pooled": pooled, "interval": interval}
            # past the first round only where every paired run reports it: the same runs as the whole figure
            if sum(map(len, decode.values())) == sum(map(len, whole.values())):
                entry["decode_pooled"], entry["decode_interval"] = paired_speedup(list(decode.values()))
            row.setdefault("paired", {})[baseline] = entry


def summarise(runs: list[dict], gamma: int) -> dict:
    """Per mode and method: median tokens/s, speedups, acceptance, tokens per target forward, c, bound."""
    summary = {}
    for mode in sorted({r["mode"] for r in runs}):
        rows = {}
        by_method = {}
        for r in runs:
            if r["mode"] == mode and r["sweep_gamma"] is None:
                by_method.setdefault(r["method"], []).append(r)
        seconds_per_token = {m: _median([r["total_seconds"] / r["new_tokens"] for r in rs if r["new_tokens"]])
                             for m, rs in by_method.items()}
        c = (seconds_per_token["draft"] / seconds_per_token["target"]
             if seconds_per_token.get("draft") and seconds_per_token.get("target") else None)
        for method, rs in by_method.items():
            tps = _median([r["new_tokens"] / r["total_seconds"] for r in rs if r["total_seconds"] > 0])
            row = {"runs": len(rs), "tokens_per_second": tps,
                   "new_tokens": sum(r["new_tokens"] for r in rs),
                   # the first round carries the prompt prefill; the rounds after it are the steady state
                   "first_chunk_seconds": _median([r.get("first_chunk_seconds") for r in rs]),
                   "decode_tokens_per_second": _median([r.get("decode_tokens_per_second") for r in rs])}
            proposed = sum(r.get("proposed") or 0 for r in rs)
            if sum(r.get("target_forwards") or 0 for r in rs):
                row["tokens_per_target_forward"] = row["new_tokens"] / sum(r["target_forwards"] for r in rs)
            if proposed:
                rounds = sum(r["rounds"] for r in rs)
                row["acceptance_rate"] = sum(r["accepted"] for r in rs) / proposed
                row["mean_gamma"] = proposed / rounds
                # Leviathan's alpha (per proposal), fitted to tokens per round: accepted/proposed understates it
                row["alpha"] = fit_alpha(row["new_tokens"] / rounds, row["mean_gamma"])
                # the Leviathan bound describes one chain from the draft model: model drafting only
                row["model_drafter"] = all(r.get("drafter") in (None, "model") for r in rs)
                if c is not None and row["model_drafter"]:  # the bound at the measured alpha, c and gamma
                    row["leviathan_bound"] = leviathan_bound(row["alpha"], row["mean_gamma"], c)
                for name in ("rounds_by_drafter", "proposed_by_drafter", "accepted_by_drafter"):
                    totals: dict[str, int] = {}
                    for r in rs:
                        for drafter, n in (r.get(name) or {}).items():
                            totals[drafter] = totals.get(drafter, 0) + n
                    row[name] = totals
                row["round_share_by_drafter"] = {d: n / rounds for d, n in row["rounds_by_drafter"].items()}
                by_prompt: dict = {}  # each prompt's runs' scored blocks
                for r in rs:
                    if r.get("expected_accepted"):
                        by_prompt.setdefault(r.get("prompt"), []).append(r["expected_accepted"])
                scored = [e for prompt in by_prompt.values() for e in prompt]
                if scored and sum(e["token"] for e in scored) > 0:
                    row["block_gain_accepted"], row["block_gain_tokens_per_round"] = block_gains(scored)
                    row["block_gain_tokens_per_round_interval"] = block_gain_interval(list(by_prompt.values()))
            for role in ("draft", "target"):
                ms = per_forward_ms(rs, role)
                if ms is not None:
                    row[f"{role}_ms_per_forward"] = ms
            if "other_seconds" in rs[0]:
                row["outside_forward_share"] = (sum(r["other_seconds"] for r in rs)
                                                / sum(r["total_seconds"] for r in rs))
            rows[method] = row
        base, hf_assisted = rows.get("target", {}).get("tokens_per_second"), rows.get("hf_assisted", {})
        hf_lookup = rows.get("hf_lookup", {})
        hf_own = rows.get("hf_assisted_own_memory", {})
        decode_base = rows.get("target", {}).get("decode_tokens_per_second")
        # what each forward costs inside the speculative loop, against the same model decoding alone: on a CPU
        # whose cache holds one model but not both, alternating draft and target makes each dearer
        target_ms = rows.get("target", {}).get("target_ms_per_forward")
        for row in rows.values():
            if target_ms and row.get("alpha") is not None and row.get("model_drafter") \
                    and row.get("draft_ms_per_forward") and row.get("target_ms_per_forward"):
                row["in_loop_cost_ratio"] = row["draft_ms_per_forward"] / target_ms
                row["in_loop_verification_cost"] = row["target_ms_per_forward"] / target_ms
                row["in_loop_bound"] = leviathan_bound(row["alpha"], row["mean_gamma"], row["in_loop_cost_ratio"],
                                                       row["in_loop_verification_cost"])
        for row in rows.values():
            if base and row["tokens_per_second"]:
                row["speedup_vs_target"] = row["tokens_per_second"] / base
            if decode_base and row["decode_tokens_per_second"]:
                row["decode_speedup_vs_target"] = row["decode_tokens_per_second"] / decode_base
                if row.get("leviathan_bound"):
                    row["decode_efficiency"] = row["decode_speedup_vs_target"] / row["leviathan_bound"]
                if row.get("in_loop_bound"):
                    row["decode_efficiency_in_loop"] = row["decode_speedup_vs_target"] / row["in_loop_bound"]
            if hf_assisted.get("tokens_per_second") and row["tokens_per_second"]:
                row["speedup_vs_hf_assisted"] = row["tokens_per_second"] / hf_assisted["tokens_per_second"]
            if hf_lookup.get("tokens_per_second") and row["tokens_per_second"]:
                row["speedup_vs_hf_lookup"] = row["tokens_per_second"] / hf_lookup["tokens_per_second"]
            if hf_own.get("tokens_per_second") and row["tokens_per_second"]:
                row["speedup_vs_hf_assisted_own_memory"] = row["tokens_per_second"] / hf_own["tokens_per_second"]
            if row.get("leviathan_bound") and row.get("speedup_vs_target"):
                row["efficiency"] = row["speedup_vs_target"] / row["leviathan_bound"]
        per_prompt(rows, by_method, c)
        paired(rows, by_method)
        if mode == "greedy":
            same_as_target(rows, by_method)
        sweep = {}
        for r in runs:
            if r["mode"] == mode and r["sweep_gamma"] is not None:
                sweep.setdefault(r["sweep_gamma"], []).append(r["new_tokens"] / r["total_seconds"])
        summary[mode] = {"cost_ratio_c": c, "gamma": gamma, "methods": rows,
                         "gamma_sweep": {g: (_median(v) / base if base else None) for g, v in sorted(sweep.items())}}
    return summary


def markdown(report: dict) -> str:
    def fmt(value, spec=".2f"):
        return "-" if value is None else format(value, spec)

    def times(value):
        return "-" if value is None else f"{value:.2f}x"

    def pct(value):
        return "-" if value is None else f"{100 * value:+.1f}%"

    def interval(bounds):
        return "-" if not bounds else f"{pct(bounds[0])} to {pct(bounds[1])}"

    def ratio_interval(bounds):
        return "-" if not bounds else f"{bounds[0]:.2f}x to {bounds[1]:.2f}x"

    def shares(row):
        share = row.get("round_share_by_drafter") or {}
        return " / ".join(f"{share.get(d, 0):.2f}" for d in ("model", "lookup", "none")) if share else "-"

    sizes = report["prompts"] if isinstance(report["prompts"], dict) else {"default": report["prompts"]}
    lines = [f"# specdec benchmark, {report['date']}", "",
             f"Command: `{report['command']}`", ""]
    if report.get("runs_from"):
        lines += ["Runs from: " + "; ".join(report["runs_from"]), ""]
    lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items() if v is not None), "",
             f"Models: draft `{report['draft']}` (ours: quantization {report.get('draft_quantization', 'none')}), "
             f"target `{report['target']}`" + (f", {report['dtype']}" if report.get("dtype") else "")
             + "; prompts per set: "
             + ", ".join(f"{name} {n}" for name, n in sizes.items())
             + f"; max_new_tokens {report['max_new_tokens']}, repeats {report['repeats']}, gamma {report['gamma']}"
             + ("; lookup " + ", ".join(f"{k} {v}" for k, v in report["lookup"].items()) if report.get("lookup") else "")
             + ".",
             "", "Methods are drafter-verification (model-token is Google speculative sampling with the draft model); "
             f"hf_lookup is Hugging Face's prompt lookup (prompt_lookup_num_tokens={HF_PROMPT_LOOKUP_TOKENS}), "
             "hf_assisted its assisted generation. Rounds: the share served by the draft model / the lookup / "
             "nobody (the target alone). Block gain: on the blocks the run drafted, expected accepted tokens per "
             "round under block verification over token verification (EXPECTED_ACCEPTED); the Leviathan bound and "
             "efficiency are for model drafting, one chain from the draft model.", ""]
    startup = report.get("startup")
    if startup:
        gb = 1e9
        lines += [f"Start-up (a fresh process, `{startup['command_line']}`): load_pair "
                  f"{startup['load_pair_seconds']:.1f} s, ready after the warm-up {startup['ready_seconds']:.1f} s; "
                  f"resident memory {startup['steady_rss'] / gb:.2f} GB steady "
                  f"({startup['steady_over_weights']:.2f}x the {startup['weights_bytes'] / gb:.2f} GB of weights as "
                  f"used), {startup['peak_rss'] / gb:.2f} GB at the peak ({startup['peak_over_steady']:.2f}x steady).",
                  ""]
    for kernels, block in report.get("verification_cost", {}).items():
        lines.append(f"Target forward over n new tokens ({kernels} kernels, {block['context']} cached): "
                     + ", ".join(f"n={n}: {fmt(ms, '.0f')} ms ({times(block['relative'][n])})"
                                 for n, ms in block["ms"].items()))
        lines.append("")
    for set_name, modes in report["summary"].items():
        for mode, block in modes.items():
            rows = block["methods"]
            own = any("speedup_vs_hf_assisted_own_memory" in row for row in rows.values()) \
                and "hf_assisted_own_memory" in rows
            lines += [f"## {set_name} prompts, {mode} ({', '.join(f'{k}={v}' for k, v in MODES[mode].items())})", "",
                      f"Measured cost ratio c (draft/target time per token): {fmt(block['cost_ratio_c'], '.3f')}", "",
                      "| method | tokens/s | vs target | vs HF lookup | vs HF assisted "
                      + ("| vs HF assisted, own memory " if own else "")
                      + "| tokens/target fwd | acceptance rate | rounds model / lookup / none | block gain "
                      "| alpha | mean gamma | Leviathan bound | efficiency | outside forwards |",
                      "|---|---|---|---|---" + ("|---" if own else "") + "|---|---|---|---|---|---|---|---|---|"]
            for method, row in rows.items():
                lines.append(
                    f"| {method} | {fmt(row['tokens_per_second'])} | {times(row.get('speedup_vs_target'))} "
                    f"| {times(row.get('speedup_vs_hf_lookup'))} | {times(row.get('speedup_vs_hf_assisted'))} "
                    + (f"| {times(row.get('speedup_vs_hf_assisted_own_memory'))} " if own else "")
                    + f"| {fmt(row.get('tokens_per_target_forward'))} | {fmt(row.get('acceptance_rate'))} "
                    f"| {shares(row)} | {pct(row.get('block_gain_accepted'))} | {fmt(row.get('alpha'))} "
                    f"| {fmt(row.get('mean_gamma'))} | {fmt(row.get('leviathan_bound'))} | {fmt(row.get('efficiency'))} "
                    f"| {fmt(100 * row['outside_forward_share'] if 'outside_forward_share' in row else None, '.1f')}% |")
            paired = {m: row for m, row in rows.items() if row.get("prompt_speedup_vs_target")}
            if paired:
                lines += ["", "Per prompt: the median over prompts of each prompt's own ratio (speedup on that "
                          "prompt; the range over prompts; efficiency against the bound for that prompt's alpha, with "
                          "the run's c). The efficiency above uses the alpha pooled over all prompts instead.", "",
                          "| method | vs target | range over prompts | vs HF lookup | vs HF assisted | efficiency |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {m} | {times(row['prompt_speedup_vs_target'])} "
                          f"| {fmt(min(row['prompt_speedups_vs_target']))}-{times(max(row['prompt_speedups_vs_target']))} "
                          f"| {times(row.get('prompt_speedup_vs_hf_lookup'))} "
                          f"| {times(row.get('prompt_speedup_vs_hf_assisted'))} | {fmt(row.get('prompt_efficiency'))} |"
                          for m, row in paired.items()]
            for baseline in PAIRED_BASELINES:
                against = {m: row["paired"][baseline] for m, row in rows.items() if baseline in row.get("paired", {})}
                if not against:
                    continue
                lines += ["", f"Paired with {baseline} on the same prompts and repeats: tokens/s over {baseline}'s, "
                          "pooled (all tokens over all seconds), with a 90% interval that resamples the prompts "
                          "(bootstrap); the same past the first round (the prompt's prefill).", "",
                          "| method | prompts | pooled | 90% interval | past the first round | 90% interval |",
                          "|---|---|---|---|---|---|"]
                lines += [f"| {m} | {p['prompts']} | {times(p['pooled'])} | {ratio_interval(p['interval'])} "
                          f"| {times(p.get('decode_pooled'))} | {ratio_interval(p.get('decode_interval'))} |"
                          for m, p in against.items()]
            scored = {m: row for m, row in rows.items() if row.get("block_gain_accepted") is not None}
            if scored:
                lines += ["", "Block verification on the same proposals: expected accepted tokens per round, and "
                          "tokens per round (accepted + 1), under block over token verification, on the blocks each "
                          "run drafted; the 90% interval resamples the prompts (bootstrap).", "",
                          "| method | accepted per round | tokens per round | 90% interval over prompts |",
                          "|---|---|---|---|"]
                lines += [f"| {m} | {pct(row['block_gain_accepted'])} | {pct(row['block_gain_tokens_per_round'])} "
                          f"| {interval(row.get('block_gain_tokens_per_round_interval'))} |" for m, row in scored.items()]
            agreeing = {m: row["same_tokens_as_target"] for m, row in rows.items() if row.get("same_tokens_as_target")}
            if agreeing:
                lines += ["", "Greedy outputs: prompts on which each method generated exactly the tokens of our "
                          "target-only decoding (what greedy speculative decoding promises).", "",
                          "| method | same tokens as target-only |", "|---|---|"]
                lines += [f"| {m} | {a['same']}/{a['prompts']} |" for m, a in agreeing.items()]
            steady = {m: row for m, row in rows.items() if row.get("decode_tokens_per_second")}
            if steady:
                lines += ["", "Steady state: the first round (prompt prefill and first proposals, or the first token) "
                          "apart, the rate of the tokens after it, which is what the Leviathan bound describes.", "",
                          "| method | first round (s) | decode tokens/s | vs target | decode efficiency |",
                          "|---|---|---|---|---|"]
                lines += [f"| {m} | {fmt(row['first_chunk_seconds'])} | {fmt(row['decode_tokens_per_second'])} "
                          f"| {times(row.get('decode_speedup_vs_target'))} | {fmt(row.get('decode_efficiency'))} |"
                          for m, row in steady.items()]
            loop = {m: row for m, row in rows.items() if row.get("in_loop_bound")}
            if loop:
                lines += ["", "Where the time goes (model drafting): ms per forward after each model's first (the "
                          "prompt prefill), in the speculative loop against each model decoding alone; the in-loop "
                          "bound is the Leviathan bound with the in-loop c and the verification forward's in-loop cost "
                          "relative to a target-only forward.", "",
                          "| method | draft ms/forward | target ms/forward | in-loop c | verification cost | "
                          "in-loop bound | decode efficiency vs in-loop bound |",
                          "|---|---|---|---|---|---|---|"]
                lines += [f"| {m} | {fmt(row.get('draft_ms_per_forward'), '.1f')} "
                          f"| {fmt(row.get('target_ms_per_forward'), '.1f')} "
                          f"| {fmt(row.get('in_loop_cost_ratio'), '.3f')} "
                          f"| {times(row.get('in_loop_verification_cost'))} | {fmt(row.get('in_loop_bound'))} "
                          f"| {fmt(row.get('decode_efficiency_in_loop'))} |" for m, row in loop.items()]
            if block["gamma_sweep"]:
                lines += ["", "Speedup of model-token over our target-only by gamma (greedy sweep): "
                          + ", ".join(f"gamma {g}: {times(s)}" for g, s in block["gamma_sweep"].items())]
            lines.append("")
    return "\n".join(lines)


def plottable(report: dict) -> bool:
    """Whether the plot has anything to show: some method's speedup over our target-only, which a run without
    target-only (a block-gain run of model-token alone, say) does not have."""
    return any(row.get("speedup_vs_target") for modes in report["summary"].values() for block in modes.values()
               for row in block["methods"].values())


def plot(report: dict, path: Path) -> None:
    """One panel per prompt set: each method's median speedup over our target-only (bars, one per mode), every
    prompt's own (dots), and the Leviathan bound of model drafting (dashed, per mode)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["summary"])
    fig, axes = plt.subplots(1, len(sets), figsize=(7 * len(sets), 5.6), squeeze=False)
    colours = {"greedy": "tab:blue", "sampling": "tab:orange", "t0.7": "tab:green"}
    for ax, set_name in zip(axes[0], sets):
        modes = list(report["summary"][set_name])
        methods = [m for m in dict.fromkeys(m for mode in modes for m in report["summary"][set_name][mode]["methods"])
                   if m not in ("target", "draft")]
        width = 0.8 / max(len(modes), 1)
        for i, mode in enumerate(modes):
            rows = report["summary"][set_name][mode]["methods"]
            xs = [x + (i - (len(modes) - 1) / 2) * width for x in range(len(methods))]
            medians = [rows.get(m, {}).get("prompt_speedup_vs_target") or rows.get(m, {}).get("speedup_vs_target")
                       or 0 for m in methods]
            ax.bar(xs, medians, width, color=colours.get(mode), alpha=0.75, label=f"{mode} (median)")
            for x, m in zip(xs, methods):
                spread = rows.get(m, {}).get("prompt_speedups_vs_target") or []
                ax.scatter([x] * len(spread), spread, s=8, color="black", alpha=0.5, zorder=3)
            bound = next((row["leviathan_bound"] for m, row in rows.items() if row.get("leviathan_bound")), None)
            if bound:
                ax.axhline(bound, color=colours.get(mode), linestyle="--", linewidth=1.2,
                           label=f"Leviathan bound, model drafting ({mode}): {bound:.2f}x")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right")
        ax.set_ylabel("speedup over our target-only (per prompt)")
        ax.set_title(f"{set_name} prompts ({report['prompts'][set_name] if isinstance(report['prompts'], dict) else report['prompts']}"
                     f", {report['max_new_tokens']} tokens)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)  # below: bars reach the top
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def startup_profile(args) -> dict:
    """load_pair and the service's warm-up in a fresh process (bench/startup.py): load seconds, the weights'
    bytes, steady and peak resident memory, and each step's seconds. The benchmark's own process holds more (the
    stock pair for Hugging Face's baselines and our copies), so its memory says nothing about a start."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "startup.json"
        command = [sys.executable, "-m", "bench.startup", "--json", str(out), "--device", args.device,
                   "--dtype", args.dtype, "--draft-quantization", args.draft_quantization]
        command += [flag for name, flag in (("draft", "--draft"), ("target", "--target")) if getattr(args, name)
                    for flag in (flag, getattr(args, name))]
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def mode_list(text: str) -> list[str]:
    """--modes: names from MODES, comma-separated."""
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(unknown) or '(none)'}; use {', '.join(MODES)}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=None, help="draft model (default: the default pair)")
    parser.add_argument("--target", default=None, help="target model (default: the default pair)")
    parser.add_argument("--prompt-sets", default=",".join(PROMPT_SETS),
                        help=f"comma-separated, of {', '.join(PROMPT_SETS)}, or NAME=PATH for another JSONL file")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts of each set")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="as the service's default max_new_tokens")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--modes", default="greedy,sampling", type=mode_list,
                        help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--methods", default=",".join(OUR_METHODS + HF_METHODS),
                        help=f"comma-separated; also available: {', '.join(EXTRA_METHODS)}, and any of ours with "
                             "the suffixes -adaptive, -deepmind, -g<gamma>, -c<threshold>, and for lookup and hybrid "
                             "-k<max_tokens>, -h<hybrid_min_match>, -x (extend)")
    parser.add_argument("--sweep-gammas", default="", help="gammas for a greedy sweep of model-token ('' for none)")
    parser.add_argument("--sweep-prompts", type=int, default=4, help="prompts of each set used by the gamma sweep")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-quantization", default="int8", choices=DRAFT_QUANTIZATIONS,
                        help="our methods' draft, as load_pair gives it (HF baselines always use the stock draft)")
    parser.add_argument("--lookup", type=lookup_settings, default=LookupSettings(),
                        help="prompt lookup's settings, as KEY=VALUE,... of specdec.drafters.LookupSettings "
                             "(e.g. hybrid_min_match=3,extend=true); unnamed ones keep their defaults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-runs", default=None,
                        help="comma-separated results.json files: summarise their runs instead of running")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--no-startup", dest="startup", action="store_false",
                        help="skip the start-up profile (load time and resident memory, in a fresh process)")
    return parser


def prompt_sets(spec: str) -> dict[str, Path]:
    sets = {}
    for item in (part for part in spec.split(",") if part):
        name, _, path = item.partition("=")
        sets[name] = Path(path) if path else PROMPT_SETS[name]
    return sets


def lookup_settings(text: str) -> LookupSettings:
    """`--lookup`'s KEY=VALUE,... as LookupSettings; an unknown key or a bad value is an argparse error."""
    fields = {field.name: field for field in dataclasses.fields(LookupSettings)}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in fields:
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        key, value = key.strip(), value.strip().lower()
        if fields[key].type in (bool, "bool"):
            if value not in ("true", "false", "1", "0"):
                raise argparse.ArgumentTypeError(f"{key}: expected true or false, got {value!r}")
            values[key] = value in ("true", "1")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{key}: expected an integer, got {value!r}") from None
    try:
        return LookupSettings(**values)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def measured_models(target, our_draft) -> dict:
    """What the run measured, read off the models: the target's dtype, and whether our draft is int8 (load_pair
    quantizes a float32 or bfloat16 CPU draft only; "none" too when no method of ours ran, `our_draft` None)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    int8 = our_draft is not None and any(isinstance(m, DynamicQuantizedLinear) for m in our_draft.modules())
    return {"dtype": str(target.dtype).removeprefix("torch."), "draft_quantization": "int8" if int8 else "none"}


def measure(args, methods: list[str], modes: list[str],
            sets: dict[str, Path]) -> tuple[list[dict], dict, dict, dict]:
    """Run the plan; (runs, the verification cost by width, {set: number of prompts}, `measured_models`)."""
    sweep_gammas = [int(g) for g in args.sweep_gammas.split(",") if g]
    prompts = {name: load_prompts(path, args.limit) for name, path in sets.items()}
    # prompt-major: every method, Hugging Face's included, runs on a prompt before the next prompt, so a shared
    # machine's drift in speed lands on all methods alike instead of on whichever ran last
    plan = [(name, mode, method, i, rep, None) for name in prompts for mode in modes
            for i in range(len(prompts[name])) for rep in range(args.repeats) for method in methods]
    plan += [(name, "greedy", "model-token", i, 0, g) for name in prompts
             for i in range(min(args.sweep_prompts, len(prompts[name]))) for g in sweep_gammas if "greedy" in modes]
    planned = {step[2] for step in plan}
    verify_width = max([args.gamma] + sweep_gammas + [HF_PROMPT_LOOKUP_TOKENS, 10]) + 1
    decoder = None
    if planned & set(HF_ALL):
        # the stock pair for Hugging Face's baselines, and copies of it for ours
        draft, target, tokenizer = load_pair(args.draft, args.target, device=args.device, dtype=args.dtype,
                                             cpu_kernels=False, draft_quantization="none")
        cost = {"stock": verification_cost(target, verify_width)}
        if planned - set(HF_ALL):
            decoder = SpeculativeDecoder(ours_draft(draft, args.draft_quantization), ours_target(target),
                                         tokenizer, lookup=args.lookup)
            if decoder.target_model is not target:
                cost["ours"] = verification_cost(decoder.target_model, verify_width)
    else:  # ours alone: the pair as load_pair gives it to the service, with no stock pair held beside it
        draft, target, tokenizer = load_pair(args.draft, args.target, device=args.device, dtype=args.dtype,
                                             draft_quantization=args.draft_quantization)
        decoder = SpeculativeDecoder(draft, target, tokenizer, lookup=args.lookup)
        with stock_layers(target) as stock:
            cost = {"stock": verification_cost(stock, verify_width)}
        if input_device(target).type == "cpu":
            cost["ours"] = verification_cost(target, verify_width)
    encoded = {name: [encode(tokenizer, item) for item in items] for name, items in prompts.items()}
    # HF on weights in the process's memory: our target's copy with stock layers, and a float copy of the draft
    own_draft = copy.deepcopy(draft) if "hf_assisted_own_memory" in planned and input_device(draft).type == "cpu" \
        else draft

    runs = []
    for name, mode, method, i, rep, sweep_gamma in tqdm(plan, desc="bench", unit="run", file=sys.stderr):
        seed = args.seed + 1000 * rep + i
        ids = encoded[name][i]
        if method == "hf_assisted_own_memory":
            with stock_layers(decoder.target_model) as own_target:
                stats = run_hf(method, own_draft, own_target, ids, args.max_new_tokens, MODES[mode], seed)
        elif method in HF_ALL:  # both models as from_pretrained loads them
            stats = run_hf(method, draft, target, ids, args.max_new_tokens, MODES[mode], seed)
        else:
            stats = run_ours(method, decoder, ids, args.max_new_tokens, MODES[mode], seed, sweep_gamma or args.gamma)
        runs.append({"set": name, "mode": mode, "method": method, "prompt": prompts[name][i]["id"], "repeat": rep,
                     "sweep_gamma": sweep_gamma, **{k: v for k, v in stats.items() if k != "method"}})
    return runs, cost, {name: len(items) for name, items in prompts.items()}, \
        measured_models(target, decoder.draft_model if decoder else None)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        if method not in HF_ALL:
            our_method(method, args.gamma)  # an unknown name fails here, before any model loads
    modes = args.modes
    settings = {name: getattr(args, name) for name in ("max_new_tokens", "repeats", "gamma")}
    if args.from_runs:
        earlier = [json.loads(Path(path).read_text(encoding="utf-8")) for path in args.from_runs.split(",")]
        runs = [run for report in earlier for run in report["runs"]]
        runs_from = [f"`{report['command']}` ({report['date']})" for report in earlier]
        lookup = earlier[0].get("lookup")
        cost = earlier[0].get("verification_cost", {})
        startup = earlier[0].get("startup")
        models = {"dtype": earlier[0].get("dtype"),
                  "draft_quantization": earlier[0].get("draft_quantization", args.draft_quantization)}
        # what the runs were measured with, not this command's defaults
        settings = {name: earlier[0].get(name, value) for name, value in settings.items()}
        sizes: dict[str, int] = {}
        for run in runs:
            run.setdefault("set", "default")
            sizes.setdefault(run["set"], len({r["prompt"] for r in runs if r.get("set", "default") == run["set"]}))
    else:
        startup = startup_profile(args) if args.startup else None  # first, while nothing else is resident
        runs, cost, sizes, models = measure(args, methods, modes, prompt_sets(args.prompt_sets))
        runs_from, lookup = None, dataclasses.asdict(args.lookup)  # the decoder's, as measure() makes it

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m bench.benchmark"] + (argv if argv is not None else sys.argv[1:])),
              "machine": machine_info(), "draft": args.draft or "default", "target": args.target or "default",
              **models, "prompts": sizes,
              **settings, "runs_from": runs_from, "lookup": lookup, "startup": startup, "verification_cost": cost,
              "summary": {name: summarise([r for r in runs if r["set"] == name], settings["gamma"]) for name in sizes},
              "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "results.md").write_text(markdown(report), encoding="utf-8")
    written = [out / "results.json", out / "results.md"]
    (out / "results.png").unlink(missing_ok=True)  # an earlier run's plot would pass for this one's
    drawn = plottable(report)
    if drawn:
        plot(report, out / "results.png")
        written.append(out / "results.png")
    print(markdown(report))
    print("wrote " + ", ".join(map(str, written))
          + ("" if drawn else " (no plot: without our target-only there is no speedup to draw)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
