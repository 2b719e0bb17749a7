"""The speculative verification rules as pure functions: token by token, and block verification.

Notation follows Leviathan et al. 2023: p is the target's distribution, q the draft's. (Chen et al. 2023 swap
the letters: their q is the target.)

Token verification (Leviathan et al. Alg. 1, Chen et al. Alg. 2): a draft token x drawn from q is accepted
with probability min(1, p(x) / q(x)); at the first rejection the next token is drawn from norm(max(0, p - q)).

Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025, Alg. 2)
judges the block jointly. It carries a weight p_i for each accepted prefix x_1..x_i and scans the block from the
end, stopping at the longest prefix that passes its test; it samples the next token from a residual scaled by
that prefix's weight. Both rules are exact; block verification never accepts fewer tokens in expectation.

Both `token_verify` and `block_verify` take the same arguments and return (tau, next_probs): the number of
accepted draft tokens and the (V,) distribution to draw the next token from, so a caller can hold either.
Throughout, k is the block length and V the vocabulary: draft_tokens x_1..x_k (k,) long; draft_probs (k, V),
row i the q that x_{i+1} was drawn from; target_probs (k + 1, V), row i the target's p after x_1..x_i (the last
row gives the bonus token); uniforms (k,) float64 in [0, 1), one per draft token.
"""

import torch


def accept_mask(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor:
    """(k,) bool: draft token i passes the test r_i < min(1, p_i(x_i) / q_i(x_i)).

    draft_tokens (k,) long, draft_probs q and target_probs p (k, V), uniforms r (k,) in [0, 1).
    Written as r * q(x) < p(x): no division, and q(x) > 0 because x was drawn from q.
    """
    index = draft_tokens.unsqueeze(-1)
    p_x = target_probs.gather(-1, index).squeeze(-1).double()
    q_x = draft_probs.gather(-1, index).squeeze(-1).double()
    return uniforms.to(p_x.device, torch.float64) * q_x < p_x


def num_accepted(mask: torch.Tensor) -> int:
    """Length of the leading run of accepted tokens (everything after the first rejection is discarded)."""
    return int(mask.long().cumprod(-1).sum().item())


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """norm(max(0, weight * p - q)), the distribution to resample from after a rejection.

    weight is 1 for token verification and the accepted prefix's weight p_tau for block verification.
    If the difference has no positive mass (a rejection there had probability ~0), fall back to p.
    """
    residual = (target_probs * weight if weight != 1.0 else target_probs) - draft_probs
    residual = residual.clamp_min_(0)
    total = residual.sum(-1, keepdim=True)
    if float(total) <= 0:
        return target_probs
    return residual / total


def token_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 uniforms: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Token verification: (tau, next_probs), tau the leading run of tokens passing r_i < min(1, p/q).

    next_probs is norm(max(0, p - q)) at the first rejection, or p_{k+1} when all k tokens are accepted.
    """
    k = draft_tokens.numel()
    tau = num_accepted(accept_mask(draft_tokens, draft_probs, target_probs[:k], uniforms)) if k else 0
    if tau == k:
        return k, target_probs[k]
    return tau, residual_probs(target_probs[tau], draft_probs[tau])


def token_expected_accepted(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                            target_probs: torch.Tensor) -> float:
    """E[tau | x_1..x_k] under token verification: sum over i of prod_{j <= i} min(1, p_j(x_j) / q_j(x_j))."""
    k = draft_tokens.numel()
    index = draft_tokens.reshape(k, 1)
    p_x = target_probs[:k].gather(-1, index).squeeze(-1).double()
    q_x = draft_probs.gather(-1, index).squeeze(-1).double()
    ratio = torch.where(p_x >= q_x, 1.0, p_x / q_x.clamp_min(torch.finfo(torch.float64).tiny))
    return float(ratio.cumprod(-1).sum()) if k else 0.0


def block_weights(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor) -> list[float]:
    """[p_0, .., p_k]: p_0 = 1, p_i = min(1, p_{i-1} * p_i(x_i) / q_i(x_i)) (Sun et al. Alg. 2).

    Given x_1..x_i (averaging over the draft tokens after it), block verification keeps that prefix with
    probability p_i; token verification keeps it with prod_{j <= i} min(1, p_j(x_j) / q_j(x_j)), which is never
    larger. Hence the expected tau is never smaller, though for one drawn block it can be. target_probs needs
    only its first k rows. Written as a comparison first, so a weight never divides by a q(x) of 0.
    """
    k = draft_tokens.numel()
    index = draft_tokens.reshape(k, 1)
    p_x = target_probs[:k].gather(-1, index).squeeze(-1).double().tolist()
    q_x = draft_probs.gather(-1, index).squeeze(-1).double().tolist()
    weights = [1.0]
    for p, q in zip(p_x, q_x):
        scaled = weights[-1] * p
        weights.append(1.0 if scaled >= q else scaled / q)
    return weights


def block_accept_probs(weights: list[float], residual_mass: torch.Tensor) -> torch.Tensor:
    """(k,) float64 h_1..h_k: the probability of stopping the backward scan at prefix i, once it reaches i.

    residual_mass (k,): row i is sum_x max(0, p_i * p_{i+1}(x) - q_{i+1}(x)), the weighted residual's mass
    after x_1..x_i (row 0 is unused). Sun et al. Alg. 2:
        h_i = mass_i / (mass_i + 1 - p_i) for i < k,   h_k = p_k.
    Where both mass_i and 1 - p_i are 0 the scan can never reach i (p_i = 1 and p_{i+1} = q_{i+1} force a
    stop above i); h_i is set to 1 there.
    """
    k = len(weights) - 1
    mass = residual_mass.detach().to("cpu", torch.float64).tolist()
    accept = []
    for i in range(1, k):
        denominator = mass[i] + (1 - weights[i])
        accept.append(mass[i] / denominator if denominator > 0 else 1.0)
    return torch.tensor(accept + weights[k:], dtype=torch.float64)


def block_residual_mass(weights: list[float], draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """(k,) row i: sum_x max(0, p_i * p_{i+1}(x) - q_{i+1}(x)), the weighted residual's mass after x_1..x_i."""
    k = draft_probs.size(0)
    weight = torch.tensor(weights[:k], dtype=target_probs.dtype, device=target_probs.device).unsqueeze(-1)
    return (weight * target_probs[:k] - draft_probs).clamp_min_(0).sum(-1)


def block_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 uniforms: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Block verification (Sun et al. 2025, Alg. 2): (tau, next_probs).

    tau is the largest i in 1..k with eta_i < h_i (0 if none), eta_i = uniforms[i - 1]: the scan runs from the
    whole block backwards and keeps the first prefix that passes. next_probs is the block residual
    norm(max(0, p_tau * p_{tau+1} - q_{tau+1})) when tau < k, and p_{k+1} when the whole block is accepted.
    With tau = 0 the residual is the token rule's, since p_0 = 1.
    """
    k = draft_tokens.numel()
    if not k:
        return 0, target_probs[0]
    weights = block_weights(draft_tokens, draft_probs, target_probs)
    accept = block_accept_probs(weights, block_residual_mass(weights, draft_probs, target_probs))
    passed = (uniforms.to("cpu", torch.float64) < accept).nonzero()
    tau = int(passed[-1]) + 1 if len(passed) else 0
    if tau == k:
        return k, target_probs[k]
    return tau, residual_probs(target_probs[tau], draft_probs[tau], weights[tau])


def block_expected_accepted(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                            target_probs: torch.Tensor) -> float:
    """E[tau | x_1..x_k] under block verification: sum over i of P(tau >= i) = 1 - prod_{j >= i} (1 - h_j)."""
    k = draft_tokens.numel()
    if not k:
        return 0.0
    weights = block_weights(draft_tokens, draft_probs, target_probs)
    accept = block_accept_probs(weights, block_residual_mass(weights, draft_probs, target_probs))
    below = (1 - accept).flip(-1).cumprod(-1).flip(-1)  # row i - 1: prod_{j >= i} (1 - h_j), the scan passes i
    return float((1 - below).sum())


# the rules by name, each called as rule(draft_tokens, draft_probs, target_probs, uniforms) -> (tau, next_probs)
VERIFIERS = {"token": token_verify, "block": block_verify}
EXPECTED_ACCEPTED = {"token": token_expected_accepted, "block": block_expected_accepted}
