"""adaptive.py: the Leviathan expected-speedup model and the per-request gamma choice."""

import random

import pytest

from specdec.adaptive import AdaptiveGamma, CostProfile, best_gamma, expected_speedup, expected_tokens, fit_alpha


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_expected_speedup_agrees_with_a_simulated_round():
    """Leviathan et al. eq. (1) against a Monte Carlo of the process it models: gamma proposals each accepted
    with probability alpha until the first rejection, one more token from the target, gamma * c + 1 cost."""
    rng = random.Random(0)
    for alpha, gamma, c in ((0.8, 5, 0.05), (0.5, 2, 0.3), (0.95, 8, 0.1)):
        rounds = 20_000
        tokens = 0
        for _ in range(rounds):
            accepted = 0
            while accepted < gamma and rng.random() < alpha:
                accepted += 1
            tokens += accepted + 1
        simulated = tokens / rounds / (gamma * c + 1)
        assert expected_speedup(alpha, gamma, c) == pytest.approx(simulated, rel=0.02)
    assert expected_speedup(0.8, 4, 0.1, verification=1.2) < expected_speedup(0.8, 4, 0.1)


def test_best_gamma_grows_with_acceptance_and_shrinks_with_cost():
    assert best_gamma(0.9, 0.05, 16) > best_gamma(0.5, 0.05, 16)
    assert best_gamma(0.8, 0.5, 16) < best_gamma(0.8, 0.05, 16)
    assert 1 <= best_gamma(0.0, 1.0, 8) <= 8


def test_adaptive_stays_in_bounds():
    policy = AdaptiveGamma(initial=4, max_gamma=6)
    assert policy.choose() == 4  # no cost measured yet
    policy.update(proposed=40, accepted=39)
    policy.costs.record(draft_seconds=0.1, draft_forwards=40, target_seconds=10.0, target_forwards=10)
    assert policy.choose() == 6
    for _ in range(100):
        policy.update(proposed=4, accepted=0)
        policy.costs.record(draft_seconds=0.5, draft_forwards=4, target_seconds=0.1, target_forwards=1)
    assert policy.choose() == 1


def test_fit_alpha_inverts_expected_tokens():
    for alpha in (0.1, 0.5, 0.8, 0.95):
        assert fit_alpha(expected_tokens(alpha, 4), 4) == pytest.approx(alpha, abs=1e-6)
    assert fit_alpha(1.0, 4) == pytest.approx(0.0, abs=1e-6)


def test_alpha_estimate_recovers_per_proposal_acceptance():
    """Simulated rounds with independent acceptances: accepted/proposed is biased low, the fitted alpha is not."""
    rng = random.Random(0)
    policy = AdaptiveGamma(max_gamma=8)
    for _ in range(4000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.85:
            accepted += 1
        policy.update(4, accepted)
    assert policy.accepted / policy.proposed < 0.75
    assert policy.alpha == pytest.approx(0.85, abs=0.01)


def test_a_wider_forward_that_costs_more_is_dropped():
    """The paper's model assumes any width costs the same; measured per-width costs overrule it."""
    def target_seconds(width):  # cheap up to 5 rows, then steep, as on our CPUs
        return 1.0 if width <= 5 else 1.0 + 0.6 * (width - 5)

    policy = AdaptiveGamma(initial=4, max_gamma=8)
    flat = AdaptiveGamma(initial=4, max_gamma=8)
    for _ in range(30):
        for p in (policy, flat):
            gamma = p.choose()
            p.update(gamma, gamma)
            p.costs.record(0.05 * gamma, gamma, target_seconds(gamma + 1), 1,
                           width=gamma + 1 if p is policy else None)
    assert flat.choose() == 8  # all accepted and cheap drafts: the width-blind model goes to the bound
    assert policy.choose() == 4  # width 5 is the last cheap one
    costs = policy.costs
    assert costs.target_cost(5) == 1.0 and costs.target_cost(7) >= costs.target_cost(6) > 1.0


def test_target_cost_extrapolates_from_measured_widths():
    profile = CostProfile()
    assert profile.target_cost(3) is None
    profile.record(0.1, 2, 1.0, 1, width=3)
    assert profile.target_cost(7) == 1.0  # one width seen: assume the same
    profile.record(0.1, 4, 2.0, 1, width=5)
    assert profile.target_cost(7) == pytest.approx(3.0)
    assert profile.target_cost(4) == pytest.approx(1.5)
    assert profile.target_cost(5) == 2.0
    assert profile.target_cost(2) == 1.0  # narrower than measured: not assumed cheaper


def test_costs_carry_over_between_requests_that_share_a_profile():
    profile = CostProfile()
    first = AdaptiveGamma(initial=4, max_gamma=8, costs=profile)
    assert first.choose() == 4  # nothing measured yet
    for width, seconds in ((3, 1.0), (9, 3.0)):
        first.update(width - 1, width - 1)
        profile.record(0.01 * (width - 1), width - 1, seconds, 1, width=width)
    second = AdaptiveGamma(initial=4, max_gamma=8, costs=profile)
    assert second.rounds == 0 and second.costs.target_cost(9) == 3.0
    # a fresh request already knows that forwards wider than 3 cost more: gamma 2, not the initial 4
    assert second.choose() == 2
    assert AdaptiveGamma(initial=4, max_gamma=8).choose() == 4  # a request without the profile starts blind


def test_profile_follows_a_drifting_machine():
    profile = CostProfile(floor=0.05)
    for _ in range(1000):
        profile.record(0.1, 1, 1.0, 1, width=5)
    for _ in range(200):
        profile.record(0.2, 1, 2.0, 1, width=5)
    assert profile.target_cost(5) == pytest.approx(2.0, rel=0.01)  # not stuck near the old 1.0
    assert profile.cost_ratio == pytest.approx(0.1, rel=0.01)
