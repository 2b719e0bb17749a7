"""Statistical exactness under a grammar constraint: constrained speculative sampling draws exactly from the
target's distribution with the grammar's forbidden tokens removed at every position (then temperature, top-k and
top-p), the distribution constrained target-only decoding samples.

The constrained target distribution over 3-token continuations of the 8-token vocabulary is enumerated with plain
forwards, transformers' warpers and the grammar's language written out by hand (not by llguidance), then compared
with 2,000 draws per variant by test_exactness's chi-square test. The grammar allows a few tokens at some
positions and exactly one at others (forced, so the grammar drafter proposes it), and which it allows at the third
position depends on the first. Google and DeepMind, token and block verification, every drafter with and without
the grammar's forced proposals pass; a deliberately wrong variant (p masked at the first position only) fails.
"""

import llguidance
import pytest

from specdec import SpeculativeDecoder
from specdec.grammar import Constraint, GrammarCompiler
from specdec.params import SamplingParams
from tests.test_exactness import (
    DRAFTER_SAMPLES,
    LENGTH,
    PROMPT,
    SETTINGS,
    VOCAB,
    exact_distribution,
    goodness_of_fit,
)

CHARS = "abcdefgh"  # token i is CHARS[i]
REGEX = "[ab]d[ef]|cdg"  # a or b, then d (forced), then e or f; c, then d and g (both forced)
LANGUAGE = {(0, 3, 4), (0, 3, 5), (1, 3, 4), (1, 3, 5), (2, 3, 6)}
# the lookup (and the hybrid, on its 3-token match) proposes a (0) after the last 5 6 2 and, after the forced d,
# e (4): both allowed, so it serves rounds
LOOKUP_PROMPT = [5, 6, 2, 0, 3, 4, 5, 6, 2]


class _Chars:
    """llguidance's view of the 8-token vocabulary (and an end-of-sequence token the models never draw)."""

    eos_token_id, bos_token_id, special_token_ids = VOCAB, None, [VOCAB]
    tokens = [c.encode() for c in CHARS] + [b"<eos>"]

    def __call__(self, text):
        return [CHARS.index(c) for c in text.decode() if c in CHARS] if isinstance(text, bytes) \
            else [CHARS.index(c) for c in text if c in CHARS]


@pytest.fixture(scope="module")
def grammar():
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Chars()))
    return GrammarCompiler(tokenizer, VOCAB).compile(Constraint("regex", REGEX))


@pytest.fixture(scope="module")
def pair():
    from tests.test_exactness import TinyCausalLM
    return TinyCausalLM(VOCAB, seed=1, scale=0.5).eval(), TinyCausalLM(VOCAB, seed=0, scale=0.5).eval()


def allowed_after(prefix: tuple) -> set[int]:
    return {word[len(prefix)] for word in LANGUAGE if word[: len(prefix)] == prefix}


def constrained_distribution(target, temperature, top_k, top_p, prompt=PROMPT, penalties=None) -> dict[tuple, float]:
    """P(x1 x2 x3 | prompt) under the target with the grammar's mask, then transformers' warpers (after the
    penalties on the tokens so far, where given)."""
    return exact_distribution(target, temperature, top_k, top_p, prompt=prompt, allowed=allowed_after,
                              penalties=penalties)


def draw(decoder, grammar, method, settings, n, seed=0, prompt=PROMPT, totals=None, **kwargs) -> dict[tuple, int]:
    temperature, top_k, top_p = settings
    counts: dict[tuple, int] = {}
    for i in range(n):
        params = SamplingParams(max_new_tokens=LENGTH, method=method, gamma=2, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed * 1_000_003 + i, **kwargs)
        result = decoder.generate(prompt, params=params, grammar=grammar)
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        if totals is not None:
            for drafter, count in result.stats.accepted_by_drafter.items():
                totals[drafter] = totals.get(drafter, 0) + count
    return counts


def test_the_enumerated_language_is_the_grammars(grammar):
    """The hand-written language and llguidance's masks agree at every prefix (the reference is independent)."""
    for prefix in [(), (0,), (1,), (2,), (0, 3), (2, 3)]:
        state = grammar.start(set())
        for token in prefix:
            state.advance(token)
        assert set(state.allowed().nonzero().flatten().tolist()) == allowed_after(prefix)


@pytest.mark.statistical
@pytest.mark.parametrize("setting", ["t1", "t0.8-topk5-topp0.9"])
def test_constrained_target_only_is_the_reference(pair, grammar, setting):
    _, target = pair
    counts = draw(SpeculativeDecoder(target, target), grammar, "target", SETTINGS[setting], DRAFTER_SAMPLES)
    assert set(counts) <= LANGUAGE
    assert goodness_of_fit(counts, constrained_distribution(target, *SETTINGS[setting]), DRAFTER_SAMPLES) > 1e-3


@pytest.mark.statistical
@pytest.mark.parametrize("forced", [True, False], ids=["grammar-drafter", "masked-only"])
@pytest.mark.parametrize("drafter", ["model", "lookup", "hybrid"])
@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("method", ["google", "deepmind"])
def test_constrained_speculative_samples_follow_the_constrained_target(pair, grammar, method, verification,
                                                                       drafter, forced):
    draft, target = pair
    setting = SETTINGS["t0.8-topk5-topp0.9" if verification == "block" and drafter == "model" else "t1"]
    prompt = PROMPT if drafter == "model" else LOOKUP_PROMPT
    totals = {}
    counts = draw(SpeculativeDecoder(draft, target), grammar, method, setting, DRAFTER_SAMPLES, seed=3,
                  prompt=prompt, totals=totals, drafter=drafter, verification=verification, grammar_drafter=forced)
    assert set(counts) <= LANGUAGE
    assert goodness_of_fit(counts, constrained_distribution(target, *setting, prompt=prompt), DRAFTER_SAMPLES) > 1e-3
    assert bool(totals.get("grammar")) == forced  # the forced d (and g) were proposed and accepted, or never
    if drafter != "model":
        assert totals.get("lookup", 0) > 0


@pytest.mark.statistical
@pytest.mark.parametrize("method, verification, drafter", [("google", "token", "hybrid"),
                                                           ("deepmind", "block", "model")])
def test_constrained_samples_with_penalties_follow_the_penalized_constrained_target(pair, grammar, method,
                                                                                    verification, drafter):
    """Penalties on the tokens so far under a constraint, the grammar's forced tokens proposed: the samples follow
    the target penalized, then masked, then warped; the unpenalized constrained target fails on the same counts."""
    from tests.test_exactness import PENALTIES, fails_the_test

    draft, target = pair
    prompt, penalties = LOOKUP_PROMPT, PENALTIES["all"]
    # twice the samples: at 2,000 the unpenalized target's p-value spread 1e-6 to 1e-16 over seeds, too near the
    # 1e-6 that counts as failing
    n = 2 * DRAFTER_SAMPLES
    counts = draw(SpeculativeDecoder(draft, target), grammar, method, SETTINGS["t1"], n, seed=5,
                  prompt=prompt, drafter=drafter, verification=verification, **penalties)
    assert set(counts) <= LANGUAGE
    expected = constrained_distribution(target, *SETTINGS["t1"], prompt=prompt, penalties=penalties)
    assert goodness_of_fit(counts, expected, n) > 1e-3
    assert fails_the_test(counts, constrained_distribution(target, *SETTINGS["t1"], prompt=prompt), n)


@pytest.mark.statistical
def test_adaptive_gamma_under_a_constraint(pair, grammar, monkeypatch):
    import random
    lengths = random.Random(5)
    monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(1, 4))
    draft, target = pair
    setting = SETTINGS["t1"]
    counts: dict[tuple, int] = {}
    decoder = SpeculativeDecoder(draft, target)
    for i in range(DRAFTER_SAMPLES):
        result = decoder.generate(PROMPT, max_new_tokens=LENGTH, method="google", gamma=None, temperature=1.0,
                                  seed=i, grammar=grammar)
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    assert goodness_of_fit(counts, constrained_distribution(target, *setting), DRAFTER_SAMPLES) > 1e-3


@pytest.mark.statistical
def test_masking_p_at_the_first_position_only_fails_the_test(pair, grammar, monkeypatch):
    """The deliberately wrong variant: the target's p masked at the first verified position only (the draft's q
    still masked everywhere). Forbidden tokens get through, or the distribution is off: either is caught."""
    from specdec.engine import SpeculativeDecoder as Decoder
    masks = Decoder._masks

    def first_only(req, proposal, rows):
        stacked = masks(req, proposal, rows)
        if stacked is not None:
            stacked = stacked.clone()
            stacked[1:] = True
        return stacked

    monkeypatch.setattr(Decoder, "_masks", staticmethod(first_only))
    draft, target = pair
    try:
        counts = draw(SpeculativeDecoder(draft, target), grammar, "google", SETTINGS["t1"], DRAFTER_SAMPLES,
                      grammar_drafter=False)
    except Exception:  # a forbidden token reached the grammar: the wrong variant is caught
        return
    assert goodness_of_fit(counts, constrained_distribution(target, *SETTINGS["t1"]), DRAFTER_SAMPLES) < 1e-6


# LOOKUP_PROMPT's draft gives its own token 2 (c) 0.59 at the first position and a or b under 0.04: at 0.5 its run
# goes on after c (then d and g forced) and ends after a or b, which it draws about 6% of the time
STOP = 0.5


@pytest.mark.statistical
@pytest.mark.parametrize("method, verification", [("google", "token"), ("deepmind", "block")])
def test_constrained_samples_with_the_draft_confidence_stop(pair, grammar, monkeypatch, method, verification):
    """The draft's confidence stop (the service's default for the default pair) under a constraint with forced
    proposals: where a run ends reads the draft's own outputs only, so the completions keep the constrained target's
    distribution. The spy shows the stop at work: runs ending after an unsure token, and going on after sure ones."""
    from tests.support.spies import model_draws

    draws = model_draws(monkeypatch)
    draft, target = pair
    setting = SETTINGS["t1"]
    counts = draw(SpeculativeDecoder(draft, target), grammar, method, setting, DRAFTER_SAMPLES, seed=7,
                  prompt=LOOKUP_PROMPT, verification=verification, grammar_drafter=True,
                  draft_confidence_threshold=STOP)
    assert set(counts) <= LANGUAGE
    expected = constrained_distribution(target, *setting, prompt=LOOKUP_PROMPT)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert 0.02 * len(draws) < draws.count(False) < 0.95 * len(draws)  # unsure tokens, and sure ones
