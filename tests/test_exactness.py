"""Statistical exactness: speculative sampling draws exactly from the target's (warped) distribution.

With an 8-token vocabulary the target's distribution over 3-token continuations is enumerated exactly with
plain forwards and transformers' own warpers; 20,000 draws per variant and setting are then compared with it
by a chi-square goodness-of-fit test. Seeds are fixed, so the test is deterministic. A deliberately wrong
rule (resampling from p instead of the residual) must fail the same test: it has power.

The many-sample tests use TinyCausalLM (a one-layer model on a real DynamicCache, ~10x cheaper per forward
than a library model); one test repeats the check on a transformers Llama with its own cache.
"""

import copy
import itertools
import random

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec import SpeculativeDecoder
from specdec.cpu.linear import pack_linears, quantization_supported, quantize_linears
from tests.support.models import make_model
from tests.support.tiny_lm import TinyCausalLM

VOCAB = 8
LENGTH = 3
PROMPT = [1, 2]
SAMPLES = 20_000
SETTINGS = {  # name: (temperature, top_k, top_p)
    "t0.7": (0.7, 0, 1.0),
    "t1": (1.0, 0, 1.0),
    "t1.5": (1.5, 0, 1.0),
    "topk3": (1.0, 3, 1.0),
    "topp0.8": (1.0, 0, 0.8),
    "t0.8-topk5-topp0.9": (0.8, 5, 0.9),
}


@pytest.fixture(scope="module")
def pair():
    return TinyCausalLM(VOCAB, seed=1, scale=0.5).eval(), TinyCausalLM(VOCAB, seed=0, scale=0.5).eval()


@pytest.fixture(scope="module")
def llama_pair():
    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=1, hidden=16, initializer_range=0.3)
    draft = make_model("llama", seed=1, vocab_size=VOCAB, layers=1, hidden=16, initializer_range=0.3)
    return draft, target


def exact_distribution(target, temperature, top_k, top_p) -> dict[tuple, float]:
    """P(x1 x2 x3 | prompt) under the target with transformers' warpers, by enumeration (no cache)."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))

    def next_probs(prefix):
        ids = torch.tensor([PROMPT + list(prefix)])
        with torch.no_grad():
            scores = target(input_ids=ids).logits[:, -1].float()
        for warper in warpers:
            scores = warper(ids, scores)
        return scores.softmax(-1)[0]

    table = {(): 1.0}
    for _ in range(LENGTH):
        table = {prefix + (x,): mass * float(p)
                 for prefix, mass in table.items() if mass > 0
                 for x, p in enumerate(next_probs(prefix))}
    return table


def goodness_of_fit(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """Chi-square p-value, pooling cells with expected count < 5 into one."""
    observed, predicted, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        obs, exp = counts.get(seq, 0), expected.get(seq, 0.0) * n
        if exp == 0:
            assert obs == 0, f"drew {seq}, which the target gives probability 0"
        elif exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
        else:
            observed.append(obs)
            predicted.append(exp)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        predicted.append(pooled_exp)
    predicted = [p * sum(observed) / sum(predicted) for p in predicted]  # remove float rounding of the total
    return chisquare(observed, predicted).pvalue


def draw(decoder, method, settings, n, gamma=2, seed=0) -> dict[tuple, int]:
    temperature, top_k, top_p = settings
    counts: dict[tuple, int] = {}
    for i in range(n):
        result = decoder.generate(PROMPT, max_new_tokens=LENGTH, method=method, gamma=gamma, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed * 1_000_003 + i)
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.statistical
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("method", ["google", "deepmind"])
def test_speculative_samples_follow_target_distribution(pair, method, setting):
    draft, target = pair
    decoder = SpeculativeDecoder(draft, target)
    expected = exact_distribution(target, *SETTINGS[setting])
    counts = draw(decoder, method, SETTINGS[setting], SAMPLES)
    assert goodness_of_fit(counts, expected, SAMPLES) > 1e-3


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["google", "deepmind"])
def test_library_model_samples_follow_target_distribution(llama_pair, method):
    draft, target = llama_pair
    expected = exact_distribution(target, *SETTINGS["t1"])
    counts = draw(SpeculativeDecoder(draft, target), method, SETTINGS["t1"], 5_000, seed=3)
    assert goodness_of_fit(counts, expected, 5_000) > 1e-3


@pytest.mark.statistical
@pytest.mark.skipif(not quantization_supported(), reason="this torch build has no int8 engine")
def test_int8_draft_samples_follow_target_distribution(llama_pair):
    """What load_pair does on CPU by default: the draft's linears in int8. Its own probabilities drive the rule."""
    draft, target = llama_pair
    quantized = copy.deepcopy(draft)
    assert quantize_linears(quantized) > 0
    expected = exact_distribution(target, *SETTINGS["t1"])
    counts = draw(SpeculativeDecoder(quantized, target), "google", SETTINGS["t1"], 5_000, seed=5)
    assert goodness_of_fit(counts, expected, 5_000) > 1e-3


@pytest.mark.statistical
def test_cpu_kernel_pair_samples_follow_target_distribution(llama_pair):
    """What load_pair does on CPU: both models' float32 linears on the few-rows kernel (or oneDNN packing where
    it cannot be built), the draft in int8. Speculative samples follow the stock target's distribution."""
    draft, target = llama_pair
    fast_draft, fast_target = copy.deepcopy(draft), copy.deepcopy(target)
    assert pack_linears(fast_target) > 0
    if quantization_supported():
        quantize_linears(fast_draft)
    pack_linears(fast_draft)
    expected = exact_distribution(target, *SETTINGS["t1"])
    counts = draw(SpeculativeDecoder(fast_draft, fast_target), "deepmind", SETTINGS["t1"], 5_000, seed=11)
    assert goodness_of_fit(counts, expected, 5_000) > 1e-3


@pytest.mark.statistical
@pytest.mark.parametrize("variant, setting", [("google", "t1"), ("deepmind", "t0.8-topk5-topp0.9")])
def test_adaptive_gamma_samples_follow_target_distribution(pair, monkeypatch, variant, setting):
    """Adaptive gamma draws each position's randomness from (seed, position); the draft lengths are forced to
    change at random here (as timings would make them), and the samples must still be the target's."""
    draft, target = pair
    lengths = random.Random(5)
    monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(1, 4))
    decoder = SpeculativeDecoder(draft, target)
    expected = exact_distribution(target, *SETTINGS[setting])
    counts = draw(decoder, variant, SETTINGS[setting], 10_000, gamma=None, seed=7)
    assert goodness_of_fit(counts, expected, 10_000) > 1e-3


@pytest.mark.statistical
def test_draft_distribution_differs_so_the_test_is_meaningful(pair):
    draft, target = pair
    assert max(abs(a - b) for a, b in zip(exact_distribution(draft, 1.0, 0, 1.0).values(),
                                           exact_distribution(target, 1.0, 0, 1.0).values())) > 0.01
    counts = draw(SpeculativeDecoder(draft, draft), "draft", SETTINGS["t1"], 5_000)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) < 1e-6


@pytest.mark.statistical
@pytest.mark.parametrize("gamma", [2, None])
def test_wrong_rule_fails_the_test(pair, monkeypatch, gamma):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection is a classic bug: it must be caught,
    on the fixed-gamma and on the adaptive path."""
    draft, target = pair
    monkeypatch.setattr("specdec.engine.residual_probs", lambda target_probs, draft_probs: target_probs)
    decoder = SpeculativeDecoder(draft, target)
    counts = draw(decoder, "google", SETTINGS["t1"], 5_000, gamma=gamma)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) < 1e-6
