"""Block verification (Sun et al. 2025) against the paper's example, its own invariants and the target distribution.

A toy target p and draft q are next-token tables over 3-5 tokens, each a function of the prefix. A small
decoding loop drafts k tokens from q, verifies them, draws the next token from the returned distribution and
repeats until n tokens exist. The distribution of those n tokens is computed exactly, by enumerating the drafts
and the rule's stopping probabilities, and must equal the target's to rounding (fast tests); and it is sampled
through the real `block_verify` and `token_verify` with uniforms, then compared with the target by a
chi-square test (statistical tests). Two deliberately wrong variants of block verification must fail both.
"""

import functools
import itertools
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from specdec import verification
from specdec.sampling import sample
from specdec.verification import (
    EXPECTED_ACCEPTED,
    VERIFIERS,
    block_accept_probs,
    block_expected_accepted,
    block_residual_mass,
    block_verify,
    block_weights,
    token_expected_accepted,
)

F64 = torch.float64


@dataclass(frozen=True)
class Setting:
    vocab: int
    k: int  # draft tokens per round
    n: int  # leading generated tokens whose distribution is compared
    sharpness: float  # scale of the target's random logits: larger is more peaked
    noise: float  # scale of the noise the draft adds to the target's logits: larger is a worse draft
    draft: str = "random"  # or "one_hot": the draft's argmax only, a deterministic proposal as prompt lookup makes
    zeros: bool = False  # target and draft each give one (random) token probability 0, as top-k filtering does
    seed: int = 0


SETTINGS = {
    "v3-k1": Setting(3, 1, 3, 1.0, 1.0, seed=0),
    "v3-k2": Setting(3, 2, 3, 1.5, 1.5, seed=1),
    "v4-k3": Setting(4, 3, 3, 2.0, 3.0, seed=10),
    "v5-k2-sharp": Setting(5, 2, 2, 3.0, 2.0, seed=3),
    "v3-k3-zeros": Setting(3, 3, 3, 1.0, 1.0, zeros=True, seed=5),
    "v4-k3-one-hot": Setting(4, 3, 3, 2.0, 1.0, draft="one_hot", seed=5),
}


class ToyPair:
    """The target's p and the draft's q after a prefix: (V,) float64 tables, fixed by the setting's seed."""

    def __init__(self, setting: Setting):
        self.setting = setting
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def target(self, prefix: tuple) -> torch.Tensor:
        return self._table(prefix)[0]

    def draft(self, prefix: tuple) -> torch.Tensor:
        return self._table(prefix)[1]

    def _table(self, prefix: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if prefix not in self._tables:
            s, code = self.setting, 0
            for token in prefix:
                code = code * (s.vocab + 1) + token + 1
            generator = torch.Generator().manual_seed(s.seed * 1_000_003 + code)
            logits = torch.randn(s.vocab, generator=generator, dtype=F64) * s.sharpness
            draft_logits = logits + torch.randn(s.vocab, generator=generator, dtype=F64) * s.noise
            if s.zeros:
                logits[int(torch.randint(s.vocab, (), generator=generator))] = float("-inf")
                draft_logits[int(torch.randint(s.vocab, (), generator=generator))] = float("-inf")
            if s.draft == "one_hot":
                q = torch.zeros(s.vocab, dtype=F64).index_fill_(0, draft_logits.argmax(), 1.0)
            else:
                q = draft_logits.softmax(-1)
            self._tables[prefix] = logits.softmax(-1), q
        return self._tables[prefix]

    def round_inputs(self, prefix: tuple, draft_tokens: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """draft_tokens (k,), draft_probs (k, V) and target_probs (k + 1, V) of one round after prefix."""
        k = len(draft_tokens)
        q = torch.stack([self.draft(prefix + draft_tokens[:i]) for i in range(k)])
        p = torch.stack([self.target(prefix + draft_tokens[:i]) for i in range(k + 1)])
        return torch.tensor(draft_tokens), q, p


def target_distribution(pair: ToyPair) -> dict[tuple, float]:
    """P(x_1..x_n) under the target alone."""
    table = {(): 1.0}
    for _ in range(pair.setting.n):
        table = {seq + (x,): mass * float(p) for seq, mass in table.items()
                 for x, p in enumerate(pair.target(seq))}
    return table


def round_outcomes(rule: str, x: torch.Tensor, q: torch.Tensor,
                   p: torch.Tensor) -> list[tuple[int, float, torch.Tensor]]:
    """[(tau, P(tau | draft block), next_probs)] of one round, from the rule's own acceptance probabilities.

    Reads the rule's pieces through the module, so a patched (deliberately wrong) piece changes this too.
    """
    k = len(x)
    if rule == "token":
        index = x.unsqueeze(-1)
        accept = (p[:k].gather(-1, index) / q.gather(-1, index)).clamp(max=1).squeeze(-1).tolist()
        reach = [1.0]
        for a in accept:
            reach.append(reach[-1] * a)
        stop = [reach[i] * (1 - accept[i]) for i in range(k)] + [reach[k]]
        nexts = [verification.residual_probs(p[i], q[i]) for i in range(k)] + [p[k]]
    else:
        weights = verification.block_weights(x, q, p)
        h = [1.0] + verification.block_accept_probs(weights, verification.block_residual_mass(weights, q, p)).tolist()
        stop = [h[i] * torch.tensor([1 - a for a in h[i + 1:]], dtype=F64).prod().item() for i in range(k + 1)]
        nexts = [verification.residual_probs(p[i], q[i], weights[i]) for i in range(k)] + [p[k]]
    return [(tau, stop[tau], nexts[tau]) for tau in range(k + 1) if stop[tau] > 0]


def decoded_distribution(pair: ToyPair, rule: str) -> dict[tuple, float]:
    """P(x_1..x_n) under the decoding loop with `rule`, exactly: drafts enumerated, uniforms integrated out.

    A round depends only on the committed prefix, so the distribution of the next m tokens is memoised on it.
    """
    s = pair.setting

    @functools.cache
    def continuation(prefix: tuple, m: int) -> dict[tuple, float]:
        out: dict[tuple, float] = {}
        for block in itertools.product(range(s.vocab), repeat=s.k):
            x, q, p = pair.round_inputs(prefix, block)
            drawn = float(q.gather(-1, x.unsqueeze(-1)).prod())  # P(draft block) = prod q_i(x_i)
            if drawn == 0:
                continue
            for tau, chance, next_probs in round_outcomes(rule, x, q, p):
                for y, p_y in enumerate(next_probs.tolist()):
                    committed, mass = block[:tau] + (y,), drawn * chance * p_y
                    if mass == 0:
                        continue
                    rests = {(): 1.0} if len(committed) >= m else continuation(prefix + committed, m - len(committed))
                    for rest, p_rest in rests.items():
                        seq = (committed + rest)[:m]
                        out[seq] = out.get(seq, 0.0) + mass * p_rest
        return out

    return continuation((), s.n)


def expected_first_round(pair: ToyPair, rule: str, prefix: tuple = ()) -> float:
    """E[tau] of one round after prefix, the draft block enumerated: sum of P(block) E[tau | block]."""
    total = 0.0
    for block in itertools.product(range(pair.setting.vocab), repeat=pair.setting.k):
        x, q, p = pair.round_inputs(prefix, block)
        total += float(q.gather(-1, x.unsqueeze(-1)).prod()) * EXPECTED_ACCEPTED[rule](x, q, p)
    return total


def plain_residual(monkeypatch):
    """Wrong: after tau accepted tokens, resample from norm(max(0, p - q)), not norm(max(0, w_tau * p - q))."""
    original = verification.residual_probs
    monkeypatch.setattr(verification, "residual_probs", lambda target_probs, draft_probs, weight=1.0:
                        original(target_probs, draft_probs))


def weight_as_acceptance(monkeypatch):
    """Wrong: stop the backward scan at prefix i with probability w_i itself, not h_i."""
    monkeypatch.setattr(verification, "block_accept_prob", lambda weight, mass: weight)


WRONG_VARIANTS = {"plain_residual": plain_residual, "weight_as_acceptance": weight_as_acceptance}


# --- the definitions and the paper's example ------------------------------------------------------------------

def test_weights_are_the_running_clipped_likelihood_ratio():
    # ratios p/q of the three tokens: 0.5, 3, 0.8 -> w_1 = 0.5, w_2 = min(1, 1.5) = 1, w_3 = 0.8
    q = torch.tensor([[0.8, 0.2], [0.1, 0.9], [0.5, 0.5]], dtype=F64)
    p = torch.tensor([[0.4, 0.6], [0.3, 0.7], [0.4, 0.6], [0.5, 0.5]], dtype=F64)
    assert block_weights(torch.tensor([0, 0, 0]), q, p) == pytest.approx([1.0, 0.5, 1.0, 0.8])


def test_accept_probabilities_follow_the_paper():
    # h_i = m_i / (m_i + 1 - w_i) for i < k and h_k = w_k, with m_i = sum max(0, w_i * p_{i+1} - q_{i+1})
    q = torch.tensor([[0.8, 0.2], [0.6, 0.4]], dtype=F64)
    p = torch.tensor([[0.4, 0.6], [0.2, 0.8], [0.5, 0.5]], dtype=F64)
    x = torch.tensor([0, 1])
    weights = block_weights(x, q, p)  # 1, 0.5, min(1, 0.5 * 0.8 / 0.4) = 1
    mass = block_residual_mass(weights, q, p)  # row 1: max(0, 0.1 - 0.6) + max(0, 0.4 - 0.4) = 0
    assert weights == pytest.approx([1.0, 0.5, 1.0])
    torch.testing.assert_close(mass, torch.tensor([0.4, 0.0], dtype=F64))
    torch.testing.assert_close(block_accept_probs(weights, mass), torch.tensor([0.0, 1.0], dtype=F64))
    # a positive mass: w_1 = 0.5 with p_2 = (0.9, 0.1), q_2 = (0.2, 0.8): m_1 = 0.25, h_1 = 0.25 / 0.75
    p2 = torch.tensor([[0.4, 0.6], [0.9, 0.1], [0.5, 0.5]], dtype=F64)
    q2 = torch.tensor([[0.8, 0.2], [0.2, 0.8]], dtype=F64)
    weights2 = block_weights(x, q2, p2)  # 1, 0.5, 0.5 * 0.1 / 0.8
    h = block_accept_probs(weights2, block_residual_mass(weights2, q2, p2))
    torch.testing.assert_close(h, torch.tensor([0.25 / 0.75, 0.0625], dtype=F64))


def test_paper_example_accepts_11_ninths_against_10_ninths():
    # Sun et al. Sec. 1: context-free p = (1/3, 2/3), q = (2/3, 1/3), blocks of 2; token verification accepts
    # 10/9 tokens per round in expectation, block verification 11/9
    p = torch.tensor([1 / 3, 2 / 3], dtype=F64).repeat(3, 1)
    q = torch.tensor([2 / 3, 1 / 3], dtype=F64).repeat(2, 1)
    expected = {"token": 0.0, "block": 0.0}
    for block in itertools.product(range(2), repeat=2):
        x = torch.tensor(block)
        drawn = float(q.gather(-1, x.unsqueeze(-1)).prod())
        for rule in expected:
            expected[rule] += drawn * EXPECTED_ACCEPTED[rule](x, q, p)
    assert expected["token"] == pytest.approx(10 / 9, abs=1e-12)
    assert expected["block"] == pytest.approx(11 / 9, abs=1e-12)


def test_block_verify_returns_largest_passing_prefix_and_its_residual():
    q = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.2, 0.6]], dtype=F64)
    p = torch.tensor([[0.4, 0.3, 0.3], [0.6, 0.3, 0.1], [0.5, 0.25, 0.25]], dtype=F64)
    x = torch.tensor([0, 2])  # w_1 = 0.5, w_2 = 1/12; m_1 = 0.1, so h_1 = 0.1 / 0.6 and h_2 = 1/12
    tau, next_probs = block_verify(x, q, p, torch.tensor([0.5, 0.5], dtype=F64))
    assert tau == 0  # the token rule's residual: w_0 = 1
    torch.testing.assert_close(next_probs, torch.tensor([0.0, 0.5, 0.5], dtype=F64))
    tau, next_probs = block_verify(x, q, p, torch.tensor([0.1, 0.5], dtype=F64))
    assert tau == 1  # norm(max(0, 0.5 * (0.6, 0.3, 0.1) - (0.2, 0.2, 0.6))); the plain residual is (0.8, 0.2, 0)
    torch.testing.assert_close(next_probs, torch.tensor([1.0, 0.0, 0.0], dtype=F64))
    tau, next_probs = block_verify(x, q, p, torch.tensor([0.9, 0.05], dtype=F64))
    assert tau == 2  # eta_2 < h_2 keeps the whole block although eta_1 fails: the scan runs from the end
    torch.testing.assert_close(next_probs, p[2])


def test_deterministic_proposal_keeps_each_prefix_with_its_target_probability():
    # q one-hot: w_i = prod p_j(x_j), and the weighted residual is the plain one (the block's gain is 0)
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=F64)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], dtype=F64)
    x = torch.tensor([0, 1])
    assert block_weights(x, q, p) == pytest.approx([1.0, 0.5, 0.3])
    assert block_expected_accepted(x, q, p) == pytest.approx(token_expected_accepted(x, q, p)) == pytest.approx(0.8)
    for uniforms in ([0.6, 0.9], [0.1, 0.9], [0.9, 0.1]):
        tau, next_probs = block_verify(x, q, p, torch.tensor(uniforms, dtype=F64))
        if tau < 2:
            torch.testing.assert_close(next_probs, verification.residual_probs(p[tau], q[tau]))


def test_greedy_keeps_the_matching_prefix_whatever_the_uniforms():
    # temperature 0: p and q one-hot; both rules keep exactly the run of draft tokens equal to the target's
    # argmax and then give the target's argmax, as target-only greedy decoding would
    vocab = 5
    target_argmax = [3, 1, 4, 0]
    for draft_argmax in ([3, 1, 4], [3, 1, 2], [3, 0, 4], [2, 1, 4]):
        p = torch.eye(vocab, dtype=F64)[target_argmax]
        q = torch.eye(vocab, dtype=F64)[draft_argmax]
        x = torch.tensor(draft_argmax)
        matching = next((i for i, (a, b) in enumerate(zip(draft_argmax, target_argmax)) if a != b), 3)
        for uniforms in ([0.0, 0.0, 0.0], [0.999, 0.5, 0.999], [0.3, 0.999, 0.0]):
            for verify in VERIFIERS.values():
                tau, next_probs = verify(x, q, p, torch.tensor(uniforms, dtype=F64))
                assert tau == matching
                assert int(next_probs.argmax()) == target_argmax[tau] and float(next_probs.max()) == 1.0


def test_float32_rows_of_a_large_vocabulary_agree_with_float64():
    generator = torch.Generator().manual_seed(3)
    vocab, k = 50_000, 6
    logits = torch.randn(k + 1, vocab, generator=generator, dtype=F64) * 3
    p = logits.softmax(-1)
    q = (logits[:k] + torch.randn(k, vocab, generator=generator, dtype=F64)).softmax(-1)
    for trial in range(20):
        x = torch.multinomial(q, 1, generator=generator).squeeze(-1)
        uniforms = torch.rand(k, generator=generator, dtype=F64)
        tau64, next64 = block_verify(x, q, p, uniforms)
        tau32, next32 = block_verify(x, q.float(), p.float(), uniforms)
        assert tau32 == tau64
        assert next32.dtype == torch.float32
        torch.testing.assert_close(next32.double(), next64, atol=1e-6, rtol=1e-4)


def test_empty_block_samples_from_the_target():
    p = torch.tensor([[0.3, 0.7]], dtype=F64)
    empty_q = torch.zeros(0, 2, dtype=F64)
    for verify in VERIFIERS.values():
        tau, next_probs = verify(torch.zeros(0, dtype=torch.long), empty_q, p, torch.zeros(0, dtype=F64))
        assert tau == 0
        torch.testing.assert_close(next_probs, p[0])


# --- exactness, computed exactly ------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("name", SETTINGS)
def test_decoding_loop_follows_target_exactly(name, rule):
    pair = ToyPair(SETTINGS[name])
    expected, decoded = target_distribution(pair), decoded_distribution(pair, rule)
    assert set(decoded) <= set(expected)
    assert max(abs(decoded.get(seq, 0.0) - mass) for seq, mass in expected.items()) < 1e-12


def variant_is_harmless(variant: str, setting: Setting) -> bool:
    """Where a wrong variant happens to be right: with k = 1 block verification is the token rule (h_1 = w_1,
    and the residual's weight is w_0 = 1); with a one-hot q the plain residual equals the weighted one
    (max(0, w_tau * p - e_x) is w_tau * p off x and 0 at x, as max(0, p - e_x) is p off x)."""
    return setting.k == 1 or (variant == "plain_residual" and setting.draft == "one_hot")


@pytest.mark.parametrize("variant", WRONG_VARIANTS)
def test_wrong_variants_miss_the_target(variant, monkeypatch):
    WRONG_VARIANTS[variant](monkeypatch)
    for name, setting in SETTINGS.items():
        pair = ToyPair(setting)
        expected, decoded = target_distribution(pair), decoded_distribution(pair, "block")
        error = max(abs(decoded.get(seq, 0.0) - mass) for seq, mass in expected.items())
        if variant_is_harmless(variant, setting):
            assert error < 1e-12, name
        else:
            assert error > 1e-3, name


def test_prefix_weight_is_the_probability_of_keeping_it():
    # averaged over the draft tokens after x_1..x_i, P(tau >= i | x_1..x_i) = w_i (the paper's key identity)
    pair = ToyPair(SETTINGS["v4-k3"])
    k, vocab = pair.setting.k, pair.setting.vocab
    for i in range(1, k + 1):
        for prefix_block in itertools.product(range(vocab), repeat=i):
            kept = 0.0
            for rest in itertools.product(range(vocab), repeat=k - i):
                x, q, p = pair.round_inputs((), prefix_block + rest)
                weights = block_weights(x, q, p)
                h = block_accept_probs(weights, block_residual_mass(weights, q, p))
                p_rest = float(q[i:].gather(-1, x[i:].unsqueeze(-1)).prod())
                kept += p_rest * (1 - float((1 - h[i - 1:]).prod()))
            assert kept == pytest.approx(weights[i], abs=1e-12)


@pytest.mark.parametrize("name", SETTINGS)
def test_block_accepts_at_least_as_many_tokens_in_expectation(name):
    """Exact E[tau] of a round, after every prefix shorter than n: never below the token rule's, and above it
    somewhere, except where the rules accept alike: k = 1 (h_1 = w_1 = min(1, p/q)) and a one-hot proposal
    (each prefix kept with probability prod p(x) under both)."""
    pair = ToyPair(SETTINGS[name])
    gains = []
    for length in range(pair.setting.n):
        for prefix in itertools.product(range(pair.setting.vocab), repeat=length):
            block, token = expected_first_round(pair, "block", prefix), expected_first_round(pair, "token", prefix)
            assert block >= token - 1e-12
            gains.append(block - token)
    if SETTINGS[name].k == 1 or SETTINGS[name].draft == "one_hot":
        assert max(gains) < 1e-12
    else:
        assert max(gains) > 0.01


def test_block_can_accept_fewer_for_one_drawn_block():
    # only the expectation is ordered: in the paper's example the drawn block (a, a) keeps 3/4 of a token on
    # average under the token rule (1/2 + 1/4) and 1/2 under block verification (w_1 = 1/2 but h_1 = 0)
    p = torch.tensor([1 / 3, 2 / 3], dtype=F64).repeat(3, 1)
    q = torch.tensor([2 / 3, 1 / 3], dtype=F64).repeat(2, 1)
    x = torch.tensor([0, 0])
    assert token_expected_accepted(x, q, p) == pytest.approx(0.75)
    assert block_expected_accepted(x, q, p) == pytest.approx(0.5)


# --- exactness, sampled ---------------------------------------------------------------------------------------

SAMPLES = 10_000  # the plain-residual variant's chi-square noncentrality on v4-k3 is then ~170


def decode(pair: ToyPair, verify, generator: torch.Generator) -> tuple[tuple, list[int]]:
    """One run of the decoding loop: (its first n tokens, tau of each round)."""
    s = pair.setting
    seq: list[int] = []
    taus: list[int] = []
    while len(seq) < s.n:
        prefix, block = tuple(seq), ()
        for _ in range(s.k):  # the draft proposes k tokens, each from q after the ones before it
            block += (sample(pair.draft(prefix + block), generator),)
        x, q, p = pair.round_inputs(prefix, block)
        tau, next_probs = verify(x, q, p, torch.rand(s.k, generator=generator, dtype=F64))
        seq += list(block[:tau]) + [sample(next_probs, generator)]
        taus.append(tau)
    return tuple(seq[: s.n]), taus


def draw(pair: ToyPair, verify, samples: int, seed: int) -> tuple[dict[tuple, int], list[int]]:
    generator = torch.Generator().manual_seed(seed)
    counts: dict[tuple, int] = {}
    first_taus = []
    for _ in range(samples):
        seq, taus = decode(pair, verify, generator)
        counts[seq] = counts.get(seq, 0) + 1
        first_taus.append(taus[0])
    return counts, first_taus


def goodness_of_fit(counts: dict[tuple, int], expected: dict[tuple, float], samples: int) -> float:
    """Chi-square p-value, cells with expected count < 5 pooled into one; 0 if an impossible sequence occurs."""
    if any(expected.get(seq, 0.0) == 0 for seq in counts):
        return 0.0
    observed, predicted, pooled_obs, pooled_exp = [], [], 0, 0.0
    for seq, mass in expected.items():
        if mass * samples < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(seq, 0), pooled_exp + mass * samples
        else:
            observed.append(counts.get(seq, 0))
            predicted.append(mass * samples)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        predicted.append(pooled_exp)
    return float(chisquare(observed, predicted).pvalue)


@pytest.mark.statistical
@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("name", SETTINGS)
def test_sampled_decoding_follows_target(name, rule):
    pair = ToyPair(SETTINGS[name])
    counts, taus = draw(pair, VERIFIERS[rule], SAMPLES, seed=17)
    assert goodness_of_fit(counts, target_distribution(pair), SAMPLES) > 1e-3
    # the sampled rule accepts what its expectation says: mean first-round tau within 5 standard errors
    mean = sum(taus) / len(taus)
    spread = (sum((t - mean) ** 2 for t in taus) / len(taus)) ** 0.5
    assert abs(mean - expected_first_round(pair, rule)) < 5 * spread / len(taus) ** 0.5 + 1e-9


@pytest.mark.statistical
@pytest.mark.parametrize("variant", WRONG_VARIANTS)
def test_sampled_wrong_variant_fails(variant, monkeypatch):
    WRONG_VARIANTS[variant](monkeypatch)
    pair = ToyPair(SETTINGS["v4-k3"])
    counts, _ = draw(pair, block_verify, SAMPLES, seed=17)
    assert goodness_of_fit(counts, target_distribution(pair), SAMPLES) < 1e-6
