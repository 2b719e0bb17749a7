"""Statistical exactness: speculative sampling draws exactly from the target's (warped) distribution.

With an 8-token vocabulary the target's distribution over 3-token continuations is enumerated exactly with
plain forwards and transformers' own warpers; 10,000 draws per variant and setting are then compared with it
by a chi-square goodness-of-fit test. Seeds are fixed, so the test is deterministic. A deliberately wrong
rule (resampling from p instead of the residual) must fail the same test: it has power.

Every drafter (model, lookup, hybrid) under both verification rules passes the same test under the six
settings, with fewer draws (DRAFTER_SAMPLES): the wrong rule still fails by a wide margin at that size, for
each drafter (tested), and a deliberately wrong block verification fails too. Lookup needs repeated n-grams,
so those tests start from a repetitive prompt, and assert from the stats that the lookup proposed and was
accepted. The hybrid with `extend` (rounds that mix the two drafters) passes it too, under both rules and the
six settings, on a prompt where most completions have such a round (counted). So does the draft model ending its
runs on an unsure token (draft_confidence_threshold), for the model and hybrid drafters, both rules, the six
settings and adaptive gamma, with the stop counted so that it demonstrably fired.

The many-sample tests use TinyCausalLM (a one-layer model on a real DynamicCache, ~10x cheaper per forward
than a library model); one test repeats the check on a transformers Llama with its own cache.

With a warm prompt cache (keys and values of the prompt left by earlier requests), the samples pass the same test
(`test_samples_follow_target_distribution_with_a_warm_prompt_cache`). So do samples with a logit bias, with
penalties, and with min_tokens (the ending token masked at the first positions), each against the target so
changed, where the unchanged target fails on the same counts.

Continuations of LONG (5) tokens, several rounds each (gamma 1, adaptive gamma, block verification with the
hybrid), pass the same test on the marginals of their last tokens, where the wrong rule fails it.
"""

import copy
import itertools
import random

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec import SpeculativeDecoder
from specdec.cpu.linear import pack_linears, quantization_supported, quantize_linears
from specdec.drafters import LookupSettings
from tests.support.models import make_model
from tests.support.spies import ended_early, hybrid_rounds, model_draws, model_runs
from tests.support.tiny_lm import TinyCausalLM

VOCAB = 8
LENGTH = 3
PROMPT = [1, 2]
# the lookup proposes 6, 7 here (the target gives them 0.46 and 0.35 at t1), and after a rejection matches only
# some n-grams, so the lookup, the draft model and the target alone each serve rounds
LOOKUP_PROMPT = [7, 4, 6, 7, 4]
# the hybrid hands a position to the lookup on a match of 4 tokens or more (LookupSettings.hybrid_min_match):
# here it proposes 1, 1, 4 (the target gives 1 0.42 at t1, then 1 0.33), and the draft model serves what
# follows a rejection
HYBRID_PROMPT = [1, 4, 5, 2, 1, 1, 4, 5, 2]
# LookupSettings.extend lets one round mix the drafters. A lookup round never runs out of matches before its
# cap (its own proposals copy earlier text), so the mixing starts with the draft model: this prompt ends with a
# token seen nowhere before, the draft model proposes, and its token, where it occurred before, hands the next
# position to the lookup (searched among random prompts for rounds that mix and lookup tokens accepted)
EXTEND = LookupSettings(max_ngram=2, max_tokens=2, hybrid_min_match=1, extend=True)
EXTEND_PROMPT = [2, 1, 7, 6, 1, 0, 4]
SAMPLES = 10_000  # twice the size at which the wrong rule fails far below 1e-6 (test_wrong_rule_fails_the_test)
DRAFTER_SAMPLES = 2_000  # the wrong rule's p-value is far below 1e-6 for every drafter at this size (tested)
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
def close_pair():
    """A draft close to the target (its weights plus noise): it is accepted 30-60% of the time under every
    setting, so block verification's inner prefixes and the hybrid's model rounds are exercised."""
    return make_close_pair()


def make_close_pair():
    """close_pair's models, made afresh (for a test that changes the draft)."""
    target = TinyCausalLM(VOCAB, seed=0, scale=0.5).eval()
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    return draft, target


@pytest.fixture(scope="module")
def llama_pair():
    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=1, hidden=16, initializer_range=0.3)
    draft = make_model("llama", seed=1, vocab_size=VOCAB, layers=1, hidden=16, initializer_range=0.3)
    return draft, target


def exact_distribution(target, temperature, top_k, top_p, prompt=PROMPT, allowed=None, bias=None, penalties=None,
                       length=LENGTH) -> dict[tuple, float]:
    """P(x1 x2 x3 | prompt) under the target with transformers' warpers, by enumeration (no cache). With
    `allowed` (a prefix's allowed next tokens), the tokens outside it are masked first, as a grammar does; with
    `bias` ({token: amount}, OpenAI's logit_bias), the amounts are added to the logits before anything else; with
    `penalties` ({"presence_penalty": ..., ...}), after the bias: transformers' repetition penalty over prompt and
    prefix, then OpenAI's frequency and presence penalties over the prefix, written out token by token."""
    penalties = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, **(penalties or {})}
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))

    def next_probs(prefix):
        ids = torch.tensor([prompt + list(prefix)])
        with torch.no_grad():
            scores = target(input_ids=ids).logits[:, -1].float()
        for token, amount in (bias or {}).items():
            scores[:, token] += amount
        if penalties["repetition_penalty"] != 1:
            scores = RepetitionPenaltyLogitsProcessor(penalties["repetition_penalty"])(ids, scores)
        for token in set(prefix):
            scores[:, token] -= (penalties["frequency_penalty"] * prefix.count(token)
                                 + penalties["presence_penalty"])
        if allowed is not None:
            forbidden = torch.ones(scores.shape[-1], dtype=torch.bool)
            forbidden[sorted(allowed(prefix))] = False
            scores = scores.masked_fill(forbidden, float("-inf"))
        for warper in warpers:
            scores = warper(ids, scores)
        return scores.softmax(-1)[0]

    table = {(): 1.0}
    for _ in range(length):
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


def marginal_fit(counts: dict[tuple, int], expected: dict[tuple, float], n: int, positions: slice) -> float:
    """Chi-square p-value of the tokens at `positions` of the continuations (cells with expected count < 5
    pooled), for continuations longer than LENGTH, whose joint cells would be too many."""
    observed, predicted = {}, {}
    for seq, count in counts.items():
        observed[seq[positions]] = observed.get(seq[positions], 0) + count
    for seq, mass in expected.items():
        predicted[seq[positions]] = predicted.get(seq[positions], 0.0) + mass * n
    assert set(observed) <= {cell for cell, exp in predicted.items() if exp > 0}, "drew what the target cannot"
    kept = [cell for cell in predicted if predicted[cell] >= 5]
    obs = [observed.get(cell, 0) for cell in kept] + [sum(observed.get(c, 0) for c in predicted if c not in kept)]
    exp = [predicted[cell] for cell in kept] + [sum(predicted[c] for c in predicted if c not in kept)]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue


def draw(decoder, method, settings, n, gamma=2, seed=0, prompt=PROMPT, totals=None, length=LENGTH, **kwargs
         ) -> dict[tuple, int]:
    """Counts of the n completions; `totals`, if given, sums the per-drafter stats of the runs into it."""
    temperature, top_k, top_p = settings
    counts: dict[tuple, int] = {}
    for i in range(n):
        result = decoder.generate(prompt, max_new_tokens=length, method=method, gamma=gamma, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed * 1_000_003 + i, **kwargs)
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        if totals is not None:
            for name in ("proposed_by_drafter", "accepted_by_drafter", "rounds_by_drafter"):
                for drafter, count in result.stats[name].items():
                    totals[name, drafter] = totals.get((name, drafter), 0) + count
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
@pytest.mark.skipif(not quantization_supported(), reason="this torch build has no int8 engine")
def test_int8_draft_beside_a_bfloat16_target_samples_follow_its_distribution(llama_pair):
    """What load_pair does on CPU with dtype bfloat16: the draft in float32 with int8 linears, the target in
    bfloat16 (on the few-rows kernel where it is built). Samples follow the bfloat16 target's distribution."""
    draft, target = llama_pair
    quantized, bf16_target = copy.deepcopy(draft), copy.deepcopy(target).to(torch.bfloat16)
    assert quantize_linears(quantized) > 0
    pack_linears(bf16_target)
    expected = exact_distribution(bf16_target, *SETTINGS["t1"])
    counts = draw(SpeculativeDecoder(quantized, bf16_target), "google", SETTINGS["t1"], 5_000, seed=7)
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
def test_adaptive_gamma_with_the_plain_residual_fails_the_test(pair, monkeypatch):
    """The same deliberately wrong rule as below, on the adaptive path: the test has power there too."""
    draft, target = pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    decoder = SpeculativeDecoder(draft, target)
    counts = draw(decoder, "google", SETTINGS["t1"], 5_000, gamma=None, seed=7)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) < 1e-6


def plain_p(target_probs, draft_probs, weight=1.0):
    """The deliberately wrong residual: p itself instead of norm(max(0, weight * p - q))."""
    return target_probs


@pytest.mark.statistical
@pytest.mark.parametrize("pair_name", ["pair", "close_pair"])
def test_draft_distribution_differs_so_the_test_is_meaningful(request, pair_name):
    draft, target = request.getfixturevalue(pair_name)
    assert max(abs(a - b) for a, b in zip(exact_distribution(draft, 1.0, 0, 1.0).values(),
                                           exact_distribution(target, 1.0, 0, 1.0).values())) > 0.01
    counts = draw(SpeculativeDecoder(draft, draft), "draft", SETTINGS["t1"], 5_000)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) < 1e-6


@pytest.mark.statistical
def test_wrong_rule_fails_the_test(pair, monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection is a classic bug: it must be caught."""
    draft, target = pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    decoder = SpeculativeDecoder(draft, target)
    counts = draw(decoder, "google", SETTINGS["t1"], 5_000)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) < 1e-6


# --- a warm prompt cache ----------------------------------------------------------------------------------------

WARM_SAMPLES = 4_000


@pytest.mark.statistical
@pytest.mark.parametrize("variant, drafter, setting, gamma", [("google", "model", "t1", 2),
                                                              ("deepmind", "hybrid", "t0.8-topk5-topp0.9", 2),
                                                              ("google", "hybrid", "topp0.8", None)])
def test_samples_follow_target_distribution_with_a_warm_prompt_cache(close_pair, variant, drafter, setting,
                                                                      gamma):
    """Each draw starts from keys and values an earlier request left: every other draw from a copy of the
    previous draw's prefix (its entry continues past the prompt), the others from an entry holding the prompt
    alone, which it takes whole (left by a one-token request just before it). Either way all but the prompt's
    last token come from the cache, counted."""
    draft, target = close_pair
    decoder = SpeculativeDecoder(draft, target, prompt_cache_bytes=200_000)
    counts = draw_warm(decoder, HYBRID_PROMPT, WARM_SAMPLES, every_other(HYBRID_PROMPT), seed=17, method=variant,
                       setting=setting, gamma=gamma, drafter=drafter)
    expected = exact_distribution(target, *SETTINGS[setting], prompt=HYBRID_PROMPT)
    assert goodness_of_fit(counts, expected, WARM_SAMPLES) > 1e-3


def every_other(prompt: list[int]):
    """draw_warm's `before`: every other draw, a one-token request for the prompt, whose entry the draw takes whole
    (the others start from the previous draw's sequence, of which they share the prompt)."""
    return lambda i: ([prompt, 1] if i % 2 else None)


def draw_warm(decoder, prompt: list[int], n: int, before, seed: int, method: str, setting: str, gamma=2,
              **kwargs) -> dict[tuple, int]:
    """Counts of n completions of `prompt`, each after `before(i)` (a request's [prompt, max_new_tokens], or
    None), with the same settings and a seed of its own. Every draw but the first must start with all but the
    prompt's last token cached (asserted)."""
    temperature, top_k, top_p = SETTINGS[setting]
    counts, warm = {}, 0
    for i in range(n):
        if (request := before(i)) is not None:
            decoder.generate(request[0], max_new_tokens=request[1], method=method, gamma=gamma,
                             temperature=temperature, seed=10_000_019 + i, **kwargs)
        result = decoder.generate(prompt, max_new_tokens=LENGTH, method=method, gamma=gamma, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seed=seed * 1_000_003 + i, **kwargs)
        warm += result.stats.cached_tokens == len(prompt) - 1
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    assert warm >= n - 1  # the first draw found nothing
    return counts


# --- a logit bias ----------------------------------------------------------------------------------------------

BIAS = {3: 1.5, 6: -2.0, 0: -100.0}  # a token favoured, one disfavoured, one banned (the target gives 0 up to 0.2)
BIAS_RULES = [("model", "token", "google"), ("model", "token", "deepmind"), ("model", "block", "google"),
              ("hybrid", "token", "deepmind")]


@pytest.mark.statistical
@pytest.mark.parametrize("setting", ["t1", "t0.8-topk5-topp0.9"])
@pytest.mark.parametrize("drafter, rule, variant", BIAS_RULES)
def test_samples_with_a_logit_bias_follow_the_biased_target(close_pair, drafter, rule, variant, setting):
    """logit_bias: the samples follow the target's distribution with the bias added to its logits before the
    warpers, for both rules and variants and a drafter that mixes lookup and model proposals; the unbiased
    target's distribution fails the same test on the same counts (the bias matters here), and the banned token
    never appears."""
    draft, target = close_pair
    prompt, totals = prompt_for(drafter), {}
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS[setting], DRAFTER_SAMPLES, seed=19,
                  prompt=prompt, totals=totals, drafter=drafter, verification=rule, logit_bias=BIAS)
    expected = exact_distribution(target, *SETTINGS[setting], prompt=prompt, bias=BIAS)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    unbiased = exact_distribution(target, *SETTINGS[setting], prompt=prompt)
    assert fails_the_test(counts, unbiased, DRAFTER_SAMPLES)
    assert not any(0 in key for key in counts)
    assert_drafters_served(drafter, totals, DRAFTER_SAMPLES)


@pytest.mark.statistical
def test_a_logit_bias_on_the_draft_alone_fails_the_test(close_pair, monkeypatch):
    """The test has power against the bias reaching only the draft: with the target's rows left unbiased (the
    warper biases the draft's logits, not the target's), the samples are the unbiased target's and fail."""
    draft, target = close_pair
    from specdec.engine import _Warper

    masked = _Warper._masked

    def draft_only(self, logits, allowed, context=None, proposed=()):  # the target's rows: (k + 1, V); the draft's: (V,)
        return masked(self, logits, allowed, context, proposed) if logits.dim() == 1 else masked(
            _Warper(self.temperature, self.top_k, self.top_p, self.vocab_size), logits, allowed, context, proposed)

    monkeypatch.setattr(_Warper, "_masked", draft_only)
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], DRAFTER_SAMPLES, seed=19,
                  logit_bias=BIAS)
    assert fails_the_test(counts, exact_distribution(target, *SETTINGS["t1"], bias=BIAS), DRAFTER_SAMPLES)


# --- penalties on the tokens so far -----------------------------------------------------------------------------

# strong enough that the unpenalized target fails on the same counts; each penalty alone, then all three
PENALTIES = {"presence": {"presence_penalty": 1.2}, "frequency": {"frequency_penalty": 0.9},
             "repetition": {"repetition_penalty": 1.8},
             "all": {"presence_penalty": -0.6, "frequency_penalty": 1.1, "repetition_penalty": 0.7},
             "strongest": {"presence_penalty": 2.0, "frequency_penalty": 2.0}}  # OpenAI's bound: repeats all but banned
# (penalties, drafter, rule, variant, setting, gamma): both rules and variants, every drafter, adaptive gamma
PENALTY_RULES = [("presence", "model", "token", "google", "t1", 2),
                 ("frequency", "model", "token", "deepmind", "t0.8-topk5-topp0.9", 2),
                 ("repetition", "model", "block", "google", "t1", 2),
                 ("all", "hybrid", "token", "deepmind", "t1", 2), ("all", "lookup", "block", "google", "t1", 2),
                 ("all", "model", "token", "google", "t0.8-topk5-topp0.9", None),
                 ("all", "hybrid", "block", "google", "t1", None), ("strongest", "model", "token", "google", "t1", 2)]


@pytest.mark.statistical
@pytest.mark.parametrize("penalties, drafter, rule, variant, setting, gamma", PENALTY_RULES)
def test_samples_with_penalties_follow_the_penalized_target(close_pair, monkeypatch, penalties, drafter, rule, variant,
                                                            setting, gamma):
    """presence, frequency and repetition penalties: the samples follow the target's distribution with each
    position's logits penalized by the sequence before it (a verification row's by the proposals before it too),
    for both rules and variants, every drafter and adaptive gamma (its lengths forced to change at random); the
    unpenalized target fails the test on the same counts."""
    draft, target = close_pair
    if gamma is None:
        lengths = random.Random(23)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(0, 3))
    prompt, totals, chosen = prompt_for(drafter), {}, PENALTIES[penalties]
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS[setting], DRAFTER_SAMPLES, gamma=gamma,
                  seed=29, prompt=prompt, totals=totals, drafter=drafter, verification=rule, **chosen)
    expected = exact_distribution(target, *SETTINGS[setting], prompt=prompt, penalties=chosen)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert fails_the_test(counts, exact_distribution(target, *SETTINGS[setting], prompt=prompt), DRAFTER_SAMPLES)
    assert_drafters_served(drafter, totals, DRAFTER_SAMPLES)


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, gamma", [("model", 2), ("lookup", 2), ("model", None)])
def test_penalties_blind_to_the_proposals_fail_the_test(close_pair, monkeypatch, drafter, gamma):
    """The test has power against the classic mistake: every verification row penalized by the committed
    sequence alone, blind to the proposals before it (the draft's rows stay right)."""
    draft, target = close_pair
    from specdec.engine import _Warper

    masked = _Warper._masked

    def blind(self, logits, allowed, context=None, proposed=()):  # each row as if it followed `context` alone
        if not proposed:
            return masked(self, logits, allowed, context)
        return torch.cat([masked(self, logits[i:i + 1], None if allowed is None else allowed[i:i + 1], context)
                          for i in range(len(logits))])

    monkeypatch.setattr(_Warper, "_masked", blind)
    if gamma is None:
        lengths = random.Random(23)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(0, 3))
    chosen = PENALTIES["strongest"]
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], DRAFTER_SAMPLES, gamma=gamma, seed=29,
                  prompt=prompt_for(drafter), drafter=drafter, **chosen)
    expected = exact_distribution(target, *SETTINGS["t1"], prompt=prompt_for(drafter), penalties=chosen)
    assert fails_the_test(counts, expected, DRAFTER_SAMPLES)


def fails_the_test(counts: dict, expected: dict, n: int) -> bool:
    """Whether the counts fail the goodness-of-fit test: p below 1e-6, or a draw the distribution rules out."""
    try:
        return goodness_of_fit(counts, expected, n) < 1e-6
    except AssertionError:  # drew a continuation of probability 0
        return True


# --- min_tokens: the ending tokens masked until then -------------------------------------------------------------

ENDING = 2  # these draws' end-of-sequence token: the close pair's target gives it 0.02-0.19 first and 0.16-0.29 third
# (drafter, rule, variant, setting, gamma, min_tokens): both rules and variants, every drafter, adaptive gamma; with
# min_tokens 2 the ending token may come last (and ends the draw there), with 3 never
MIN_TOKENS_RULES = [("model", "token", "google", "t1", 2, 2), ("model", "token", "deepmind", "t0.8-topk5-topp0.9", 2, 2),
                    ("model", "block", "google", "t1", 2, 2), ("hybrid", "token", "deepmind", "t1", 2, 2),
                    ("lookup", "block", "google", "t1", 2, 2), ("model", "token", "google", "topp0.8", 2, 3),
                    ("hybrid", "block", "google", "t1", None, 2)]


def draw_min_tokens(decoder, drafter, rule, variant, setting, gamma, min_tokens, totals=None) -> dict[tuple, int]:
    return draw(decoder, variant, SETTINGS[setting], DRAFTER_SAMPLES, gamma=gamma, seed=31, prompt=prompt_for(drafter),
                totals=totals, drafter=drafter, verification=rule, eos_token_id=ENDING, min_tokens=min_tokens)


def follows_unending(counts: dict, target, drafter: str, setting: str, min_tokens: int) -> bool:
    """Whether the counts pass the test against the target with ENDING masked at the first min_tokens positions:
    every draw LENGTH tokens long (ENDING never came before), the goodness of fit above 1e-3."""
    everything = set(range(VOCAB))
    expected = exact_distribution(target, *SETTINGS[setting], prompt=prompt_for(drafter),
                                  allowed=lambda prefix: everything - {ENDING} if len(prefix) < min_tokens
                                  else everything)
    return all(len(key) == LENGTH for key in counts) and goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, variant, setting, gamma, min_tokens", MIN_TOKENS_RULES)
def test_samples_with_min_tokens_follow_the_target_with_its_ending_token_masked(close_pair, monkeypatch, drafter, rule,
                                                                               variant, setting, gamma, min_tokens):
    """min_tokens (vLLM's): the samples follow the target's distribution with the ending token at -inf at the
    positions before min_tokens, for both rules and variants, every drafter and adaptive gamma (its lengths forced
    to change at random); the unmasked target fails the test on the same counts, and where min_tokens allows it
    the ending token is drawn last."""
    draft, target = close_pair
    if gamma is None:
        lengths = random.Random(37)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(0, 3))
    totals = {}
    counts = draw_min_tokens(SpeculativeDecoder(draft, target), drafter, rule, variant, setting, gamma, min_tokens,
                             totals)
    assert follows_unending(counts, target, drafter, setting, min_tokens)
    assert fails_the_test(counts, exact_distribution(target, *SETTINGS[setting], prompt=prompt_for(drafter)),
                          DRAFTER_SAMPLES)
    ended = sum(n for key, n in counts.items() if key[-1] == ENDING)
    assert ended > 0.05 * DRAFTER_SAMPLES if min_tokens < LENGTH else ended == 0
    assert_drafters_served(drafter, totals, DRAFTER_SAMPLES)


@pytest.mark.statistical
@pytest.mark.parametrize("mistake", ["draft_only", "one_late"])
def test_min_tokens_on_the_draft_alone_or_one_position_late_fails_the_test(close_pair, monkeypatch, mistake):
    """The test has power against the ending token masked in the draft's rows only (the target's verification
    rows left as they are), and against counting the generated tokens one too many (the mask kept a position
    longer)."""
    draft, target = close_pair
    from specdec.engine import _Warper

    unending = _Warper._unending

    def wrong(self, logits, generated):  # the target's rows: (k + 1, V); the draft's: (V,)
        if mistake == "draft_only":
            return unending(self, logits, generated) if logits.dim() == 1 else logits
        return unending(self, logits, generated - 1)

    monkeypatch.setattr(_Warper, "_unending", wrong)
    counts = draw_min_tokens(SpeculativeDecoder(draft, target), "model", "token", "google", "t1", 2, 2)
    assert not follows_unending(counts, target, "model", "t1", 2)


# --- the other drafters and block verification ------------------------------------------------------------------

# (drafter, verification, variant): every drafter under both rules, the variants spread over them
DRAFTER_RULES = [("model", "block", "google"), ("lookup", "token", "deepmind"), ("lookup", "block", "google"),
                 ("hybrid", "token", "google"), ("hybrid", "block", "deepmind")]


def prompt_for(drafter: str) -> list[int]:
    return {"model": PROMPT, "lookup": LOOKUP_PROMPT, "hybrid": HYBRID_PROMPT}[drafter]


def assert_drafters_served(drafter: str, totals: dict, n: int) -> None:
    """The stats show the drafters under test at work: lookup tokens proposed and accepted (and model tokens,
    for the hybrid), so a lookup that silently never fires cannot pass for an exact one."""
    if drafter in ("lookup", "hybrid"):
        assert totals.get(("accepted_by_drafter", "lookup"), 0) > 0.2 * n
        assert totals.get(("rounds_by_drafter", "lookup"), 0) >= n  # at least the first round of every run
    if drafter in ("model", "hybrid"):
        assert totals.get(("accepted_by_drafter", "model"), 0) > 0.1 * n
    if drafter == "lookup":
        assert set(name for (kind, name) in totals if kind == "proposed_by_drafter") == {"lookup"}


@pytest.mark.statistical
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter, rule, variant", DRAFTER_RULES)
def test_drafter_samples_follow_target_distribution(close_pair, drafter, rule, variant, setting):
    draft, target = close_pair
    prompt, totals = prompt_for(drafter), {}
    expected = exact_distribution(target, *SETTINGS[setting], prompt=prompt)
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS[setting], DRAFTER_SAMPLES, seed=13,
                  prompt=prompt, totals=totals, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert_drafters_served(drafter, totals, DRAFTER_SAMPLES)


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, setting", [("lookup", "token", "t1"), ("hybrid", "token", "topp0.8"),
                                                    ("model", "block", "t1.5"),
                                                    ("hybrid", "block", "t0.8-topk5-topp0.9")])
def test_adaptive_drafter_samples_follow_target_distribution(close_pair, monkeypatch, drafter, rule, setting):
    """Adaptive gamma with the lengths forced to change at random (blocks of up to 3 here, the whole
    continuation), for the new drafters and block verification."""
    draft, target = close_pair
    lengths = random.Random(9)
    monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(0, 3))
    prompt, totals = prompt_for(drafter), {}
    expected = exact_distribution(target, *SETTINGS[setting], prompt=prompt)
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS[setting], DRAFTER_SAMPLES, gamma=None,
                  seed=17, prompt=prompt, totals=totals, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert_drafters_served(drafter, totals, DRAFTER_SAMPLES)


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, variant", DRAFTER_RULES)
def test_wrong_rule_fails_the_test_for_every_drafter(close_pair, monkeypatch, drafter, rule, variant):
    """The plain residual, under each drafter and rule at DRAFTER_SAMPLES: those tests have power."""
    draft, target = close_pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    prompt = prompt_for(drafter)
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS["t1"], DRAFTER_SAMPLES, seed=13,
                  prompt=prompt, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"], prompt=prompt),
                           DRAFTER_SAMPLES) < 1e-6


FIRST_ALONE = [("model", "token", "google", "t0.7", 2), ("model", "block", "deepmind", "topk3", 2),
               ("lookup", "token", "deepmind", "t1.5", 2), ("hybrid", "block", "google", "topp0.8", 2),
               ("model", "token", "google", "t0.8-topk5-topp0.9", None), ("hybrid", "block", "google", "t1", None)]


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, variant, setting, gamma", FIRST_ALONE)
def test_first_token_from_the_targets_prefill_alone_follows_target_distribution(close_pair, monkeypatch, drafter,
                                                                                rule, variant, setting, gamma):
    """Prompts of `first_token_alone_from` tokens or more (32 by default) draw their first token from the
    target's prefill alone, then speculate: with the threshold at 0, the 3-token continuations (1 from the
    prefill, 2 speculated) pass the same test, for each drafter, rule and variant, fixed and adaptive gamma
    (random lengths). Every run's first round is the target's alone (counted)."""
    draft, target = close_pair
    prompt, totals = prompt_for(drafter), {}
    if gamma is None:
        lengths = random.Random(5)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(0, 2))
    counts = draw(SpeculativeDecoder(draft, target, first_token_alone_from=0), variant, SETTINGS[setting],
                  DRAFTER_SAMPLES, gamma=gamma, seed=23, prompt=prompt, totals=totals, drafter=drafter,
                  verification=rule)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS[setting], prompt=prompt),
                           DRAFTER_SAMPLES) > 1e-3
    assert totals[("rounds_by_drafter", "none")] >= DRAFTER_SAMPLES  # the first round of every run
    accepted = sum(n for (kind, _), n in totals.items() if kind == "accepted_by_drafter")
    # and the drafters' proposals were accepted after it (the lookup at t1.5: 180-205 of 2,000 runs, by seed)
    assert accepted > 0.05 * DRAFTER_SAMPLES


@pytest.mark.statistical
def test_wrong_rule_fails_the_test_with_the_first_token_alone(close_pair, monkeypatch):
    """The plain residual fails the same test after a first token from the prefill alone: it has power."""
    draft, target = close_pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    counts = draw(SpeculativeDecoder(draft, target, first_token_alone_from=0), "google", SETTINGS["t1"],
                  DRAFTER_SAMPLES, seed=23)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), DRAFTER_SAMPLES) < 1e-4


@pytest.mark.statistical
def test_block_verification_stopping_at_the_weight_fails_the_test(close_pair, monkeypatch):
    """A deliberately wrong block verification: the backward scan stops at prefix i with probability w_i
    instead of h_i = m_i / (m_i + 1 - w_i). Blocks of 3 (the whole continuation: adaptive gamma held at 3
    proposals, no bonus) let the scan reach an inner prefix."""
    draft, target = close_pair
    monkeypatch.setattr("specdec.verification.block_accept_prob", lambda weight, mass: weight)
    monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: 2)
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], DRAFTER_SAMPLES, gamma=None,
                  seed=17, verification="block")
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), DRAFTER_SAMPLES) < 1e-6


@pytest.mark.statistical
@pytest.mark.parametrize("setting, rule, variant", [
    ("t0.7", "token", "google"), ("t1", "block", "deepmind"), ("t1.5", "token", "deepmind"),
    ("topk3", "block", "google"), ("topp0.8", "token", "google"), ("t0.8-topk5-topp0.9", "block", "deepmind")])
def test_hybrid_rounds_mixing_drafters_follow_target_distribution(close_pair, monkeypatch, setting, rule, variant):
    """LookupSettings.extend: rounds that mix lookup and model proposals, under both rules and six settings."""
    draft, target = close_pair
    rounds, totals = hybrid_rounds(monkeypatch), {}
    expected = exact_distribution(target, *SETTINGS[setting], prompt=EXTEND_PROMPT)
    counts = draw(SpeculativeDecoder(draft, target, lookup=EXTEND), variant, SETTINGS[setting], DRAFTER_SAMPLES,
                  gamma=3, seed=19, prompt=EXTEND_PROMPT, totals=totals, drafter="hybrid", verification=rule)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert sum(len(set(drafters)) > 1 for drafters in rounds) > 0.2 * DRAFTER_SAMPLES  # rounds that mixed
    assert totals[("accepted_by_drafter", "lookup")] > 0.1 * DRAFTER_SAMPLES
    assert totals[("accepted_by_drafter", "model")] > 0.3 * DRAFTER_SAMPLES


@pytest.mark.statistical
def test_wrong_rule_fails_the_test_on_mixed_rounds(close_pair, monkeypatch):
    draft, target = close_pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    counts = draw(SpeculativeDecoder(draft, target, lookup=EXTEND), "google", SETTINGS["t1"], DRAFTER_SAMPLES,
                  gamma=3, seed=19, prompt=EXTEND_PROMPT, drafter="hybrid")
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"], prompt=EXTEND_PROMPT),
                           DRAFTER_SAMPLES) < 1e-6


# --- the draft model ending its run after an unsure token (draft_confidence_threshold) -----------------------------

# the close pair's draft gives its own tokens 0.1-0.9 here, so at 0.4 it goes on after some and stops after others
# (after 93% of them at t1.5, where it samples less likely tokens)
CONFIDENCE = 0.4


@pytest.mark.statistical
@pytest.mark.parametrize("setting, drafter, rule, variant, gamma", [
    ("t0.7", "model", "token", "google", 3), ("t1", "model", "block", "deepmind", 3),
    ("t1.5", "model", "token", "deepmind", 3), ("topk3", "model", "block", "google", 3),
    ("topp0.8", "hybrid", "token", "google", 3), ("t0.8-topk5-topp0.9", "hybrid", "block", "deepmind", 3),
    ("t1", "model", "token", "google", None)])
def test_draft_confidence_stop_samples_follow_target_distribution(close_pair, monkeypatch, setting, drafter, rule,
                                                                  variant, gamma):
    """Where a run ends reads the draft's own outputs only, so every completion keeps the target's distribution;
    the stats and spies show the stop at work (runs ending early, and runs going on after a token)."""
    draft, target = close_pair
    draws, runs, totals, prompt = model_draws(monkeypatch), model_runs(monkeypatch), {}, prompt_for(drafter)
    if gamma is None:  # adaptive gamma with random lengths of up to 3, as in the adaptive tests above
        lengths = random.Random(9)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(0, 3))
    expected = exact_distribution(target, *SETTINGS[setting], prompt=prompt)
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS[setting], DRAFTER_SAMPLES, gamma=gamma,
                  seed=23, prompt=prompt, totals=totals, drafter=drafter, verification=rule,
                  draft_confidence_threshold=CONFIDENCE)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert_drafters_served(drafter, totals, DRAFTER_SAMPLES)
    assert 0.05 * len(draws) < draws.count(False) < 0.95 * len(draws)  # unsure tokens, and sure ones
    if drafter == "model":
        assert ended_early(runs) > 0.1 * len(runs)


@pytest.mark.statistical
def test_wrong_rule_fails_the_test_with_the_draft_confidence_stop(close_pair, monkeypatch):
    draft, target = close_pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], DRAFTER_SAMPLES, gamma=3, seed=23,
                  draft_confidence_threshold=CONFIDENCE)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), DRAFTER_SAMPLES) < 1e-6


# Continuations of LONG tokens take several rounds (gamma 1: one or two tokens a round), so a round's outcome and
# the next round's start (the draft's cache catching up after a bonus token, the caches cropped after a rejection,
# adaptive gamma's per-position draws used again after a rejection) shape the last tokens: their marginal is
# compared with the target's, enumerated as above (the fifth audit: the tests above stop after about two rounds).
LONG = 5
LONG_SAMPLES = 4_000
LONG_CASES = {  # name: (method, gamma, drafter, verification, setting, prompt)
    "google-gamma1-model": ("google", 1, "model", "token", "t1", PROMPT),
    "deepmind-gamma1-model-topk3": ("deepmind", 1, "model", "token", "topk3", PROMPT),
    "deepmind-gamma3-hybrid-block-topp": ("deepmind", 3, "hybrid", "block", "topp0.8", HYBRID_PROMPT),
    "google-adaptive-model": ("google", None, "model", "token", "t0.8-topk5-topp0.9", PROMPT),
}


def long_draw(close_pair, monkeypatch, case: str, seed: int) -> tuple[dict, dict, dict]:
    """(counts, exact distribution, summed stats) of LONG_SAMPLES continuations of LONG tokens under `case`."""
    method, gamma, drafter, rule, setting, prompt = LONG_CASES[case]
    if gamma is None:  # lengths forced to change at random, as timings would make them
        lengths = random.Random(seed)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(1, 3))
    draft, target = close_pair
    totals = {}
    counts = draw(SpeculativeDecoder(draft, target), method, SETTINGS[setting], LONG_SAMPLES, gamma=gamma, seed=seed,
                  prompt=prompt, totals=totals, length=LONG, drafter=drafter, verification=rule)
    return counts, exact_distribution(target, *SETTINGS[setting], prompt=prompt, length=LONG), totals


@pytest.mark.statistical
@pytest.mark.parametrize("case", LONG_CASES)
def test_the_last_tokens_of_a_many_round_continuation_follow_the_target(close_pair, monkeypatch, case):
    counts, expected, totals = long_draw(close_pair, monkeypatch, case, seed=41)
    rounds = sum(count for (name, _), count in totals.items() if name == "rounds_by_drafter")
    assert rounds >= 2.5 * LONG_SAMPLES  # several rounds a continuation
    for positions in (slice(LONG - 2, LONG), slice(LONG - 1, LONG), slice(0, 2)):
        assert marginal_fit(counts, expected, LONG_SAMPLES, positions) > 1e-3, positions


@pytest.mark.statistical
@pytest.mark.parametrize("case", ["google-gamma1-model", "google-adaptive-model"])
def test_the_plain_residual_fails_the_many_round_test(close_pair, monkeypatch, case):
    """The deliberately wrong rule fails the same test at the same size: it has power there."""
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    counts, expected, _ = long_draw(close_pair, monkeypatch, case, seed=41)
    assert marginal_fit(counts, expected, LONG_SAMPLES, slice(LONG - 2, LONG)) < 1e-6
