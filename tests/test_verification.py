"""verification.py: the token rule and the residual, checked against their definitions.

Block verification has its own file, test_block_verification.py, with the exactness checks of both rules.
"""

import pytest
import torch

from specdec.verification import (
    EXPECTED_ACCEPTED,
    VERIFIERS,
    accept_mask,
    num_accepted,
    residual_probs,
    token_expected_accepted,
    token_verify,
)

F64 = torch.float64


def test_accept_probability_is_min_one_p_over_q():
    # q(x) = 0.5, p(x) = 0.2: accepted with probability 0.4; p(y) >= q(y): always accepted
    q = torch.tensor([[0.5, 0.5], [0.3, 0.7]])
    p = torch.tensor([[0.2, 0.8], [0.6, 0.4]])
    tokens = torch.tensor([0, 0])
    uniforms = torch.linspace(0, 1, 10001, dtype=torch.float64)[:-1]
    rate0 = accept_mask(tokens[:1].repeat(10000), q[:1].repeat(10000, 1), p[:1].repeat(10000, 1), uniforms)
    rate1 = accept_mask(tokens[1:].repeat(10000), q[1:].repeat(10000, 1), p[1:].repeat(10000, 1), uniforms)
    assert abs(rate0.double().mean().item() - 0.4) < 1e-3
    assert rate1.all()


def test_rejects_token_the_target_filtered_out():
    q = torch.tensor([[0.5, 0.5]])
    p = torch.tensor([[0.0, 1.0]])
    assert not accept_mask(torch.tensor([0]), q, p, torch.zeros(1, dtype=torch.float64)).item()


def test_num_accepted_counts_leading_run():
    assert num_accepted(torch.tensor([True, True, False, True])) == 2
    assert num_accepted(torch.tensor([False, True])) == 0
    assert num_accepted(torch.tensor([True, True])) == 2


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual_probs(p, q), torch.tensor([1.0, 0.0, 0.0]))


def test_residual_with_zero_mass_falls_back_to_target():
    p = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(residual_probs(p, p.clone()), p)


def test_rule_preserves_target_distribution_exactly():
    # one step, enumerated: P(token) = q(x) min(1, p/q) + P(reject) residual(x) must equal p(x)
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.5, 0.25, 0.25])
    accept = torch.minimum(torch.ones(3), p / q)
    reject_mass = (q * (1 - accept)).sum()
    torch.testing.assert_close(q * accept + reject_mass * residual_probs(p, q), p)


def test_weighted_residual_scales_the_target_first():
    # norm(max(0, 0.5 * (0.6, 0.3, 0.1) - (0.2, 0.2, 0.6))) = (1, 0, 0), where the plain one is (0.8, 0.2, 0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.2, 0.6])
    torch.testing.assert_close(residual_probs(p, q, 0.5), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_probs(p, q), torch.tensor([0.8, 0.2, 0.0]))
    # no positive mass: fall back to p
    torch.testing.assert_close(residual_probs(p, q, 0.1), p)


def test_token_verify_is_the_token_rule():
    q = torch.tensor([[0.5, 0.5], [0.3, 0.7]], dtype=F64)
    p = torch.tensor([[0.2, 0.8], [0.6, 0.4], [0.1, 0.9]], dtype=F64)
    x = torch.tensor([0, 0])  # accepted with probability 0.4, then always
    tau, next_probs = token_verify(x, q, p, torch.tensor([0.5, 0.0], dtype=F64))
    assert tau == 0
    torch.testing.assert_close(next_probs, torch.tensor([0.0, 1.0], dtype=F64))
    tau, next_probs = token_verify(x, q, p, torch.tensor([0.3, 0.99], dtype=F64))
    assert tau == 2
    torch.testing.assert_close(next_probs, p[2])
    assert token_expected_accepted(x, q, p) == pytest.approx(0.4 + 0.4)
    assert set(VERIFIERS) == set(EXPECTED_ACCEPTED) == {"token", "block"}
