"""The speculative verification rules as pure functions: token by token, and block verification.

Notation follows Leviathan et al. 2023: p is the target's distribution, q the draft's. (Chen et al. 2023 swap
the letters: their q is the target; Sun et al. write M_b for the target, M_s for the draft.) For a block of
k draft tokens, p_i and q_i are the distributions of the i-th token, after x_1..x_{i-1}; p_{k+1} is the bonus.

Token verification (Leviathan et al. Alg. 1, Chen et al. Alg. 2): each x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection the next token is drawn from norm(max(0, p_i - q_i)).

Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", ICLR 2025, Alg. 2)
judges the block jointly. Each prefix x_1..x_i gets a weight w_i (the paper's p_i), the running likelihood
ratio clipped at 1; the block is scanned from its end, and the first (longest) prefix to pass its test is
kept; the next token comes from a residual in which p is scaled by that prefix's weight. Both rules are exact;
block verification never accepts fewer tokens in expectation over the draft.

`token_verify` and `block_verify` take the same arguments and return (tau, next_probs): the number of
accepted draft tokens and the (V,) distribution to draw the next token from, so a caller can hold either.
Shapes, for k draft tokens over a vocabulary of V: draft_tokens x_1..x_k (k,) long; draft_probs (k, V), row
i - 1 is q_i; target_probs (k + 1, V), row i - 1 is p_i (the last row is p_{k+1}); uniforms (k,) float64 in
[0, 1), one per draft token.
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

    weight is 1 for token verification and the kept prefix's weight w_tau for block verification.
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
    """[w_0, .., w_k]: w_0 = 1, w_i = min(1, w_{i-1} * p_i(x_i) / q_i(x_i)) (Sun et al. Alg. 2, their p_i).

    Given x_1..x_i (averaged over the draft tokens after it), block verification keeps that prefix with
    probability w_i; token verification keeps it with prod_{j <= i} min(1, p_j(x_j) / q_j(x_j)), which is never
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


def block_residual_mass(weights: list[float], draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """(k,) row i: m_i = sum_x max(0, w_i * p_{i+1}(x) - q_{i+1}(x)), the residual's mass after x_1..x_i."""
    k = draft_probs.size(0)
    weight = torch.tensor(weights[:k], dtype=target_probs.dtype, device=target_probs.device).unsqueeze(-1)
    return (weight * target_probs[:k] - draft_probs).clamp_min_(0).sum(-1)


def block_accept_prob(weight: float, mass: float) -> float:
    """h_i = m_i / (m_i + 1 - w_i) (Sun et al. Alg. 2, for i < k): the chance that the backward scan, having
    reached prefix i, stops there, from its weight w_i and its residual mass m_i.

    Where both m_i and 1 - w_i are 0 the scan never reaches i (w_i = 1 and p_{i+1} = q_{i+1} make every later
    weight 1, so the scan stops above i); h_i is 1 there.
    """
    denominator = mass + (1 - weight)
    return mass / denominator if denominator > 0 else 1.0


def block_accept_probs(weights: list[float], residual_mass: torch.Tensor) -> torch.Tensor:
    """(k,) float64 h_1..h_k from the weights w_0..w_k and residual_mass m_0..m_{k-1} (m_0 is unused):
    h_i = block_accept_prob(w_i, m_i) for i < k, and h_k = w_k."""
    k = len(weights) - 1
    mass = residual_mass.detach().to("cpu", torch.float64).tolist()
    return torch.tensor([block_accept_prob(weights[i], mass[i]) for i in range(1, k)] + weights[k:],
                        dtype=torch.float64)


def block_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 uniforms: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Block verification (Sun et al. 2025, Alg. 2): (tau, next_probs).

    tau is the largest i in 1..k with eta_i < h_i, or 0 if there is none (eta_i = uniforms[i - 1]): the scan
    starts from the whole block and keeps the first prefix that passes, so h_i is computed only for the
    prefixes it reaches (one (V,) row each). next_probs is the block residual
    norm(max(0, w_tau * p_{tau+1} - q_{tau+1})) when tau < k, and p_{k+1} when the whole block is kept. With
    tau = 0 it is the token rule's residual, as w_0 = 1.
    """
    k = draft_tokens.numel()
    weights = block_weights(draft_tokens, draft_probs, target_probs)
    etas = uniforms.to("cpu", torch.float64).tolist()
    tau = 0
    for i in range(k, 0, -1):
        if i == k:
            accept = weights[k]
        elif weights[i] == 0:
            accept = 0.0  # a prefix the target cannot produce: m_i = 0, so h_i = 0 without a pass over V
        else:
            # m_i = sum max(0, w_i p - q), computed as -sum min(0, q - w_i p): one fused pass, no temporary
            mass = -float(torch.sub(draft_probs[i], target_probs[i], alpha=weights[i]).clamp_max_(0).sum())
            accept = block_accept_prob(weights[i], mass)
        if etas[i - 1] < accept:
            tau = i
            break
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
    passes = (1 - accept).flip(-1).cumprod(-1).flip(-1)  # entry i - 1: prod_{j >= i} (1 - h_j), the scan passes i
    return float((1 - passes).sum())


# the rules by name, each called as rule(draft_tokens, draft_probs, target_probs, uniforms) -> (tau, next_probs)
VERIFIERS = {"token": token_verify, "block": block_verify}
EXPECTED_ACCEPTED = {"token": token_expected_accepted, "block": block_expected_accepted}
