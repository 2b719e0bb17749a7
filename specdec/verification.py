"""The speculative rejection rule, written once and used by both the Google and the DeepMind variant.

Notation follows Leviathan et al. 2023: p is the target's distribution, q the draft's. (Chen et al. 2023 swap
the letters: their q is the target.) A draft token x drawn from q is accepted with probability
min(1, p(x) / q(x)); at the first rejection the next token is drawn from norm(max(0, p - q)).
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


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)), the distribution to resample from after a rejection.

    If p - q has no positive mass (p == q up to rounding, so a rejection had probability ~0), fall back to p.
    """
    residual = (target_probs - draft_probs).clamp_min_(0)
    total = residual.sum(-1, keepdim=True)
    if float(total) <= 0:
        return target_probs
    return residual / total
