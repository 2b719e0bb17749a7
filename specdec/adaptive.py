"""Adaptive draft length from the Leviathan et al. (2023) expected-speedup model.

With acceptance rate alpha and draft/target cost ratio c, one round of gamma proposals yields on average
(1 - alpha^(gamma+1)) / (1 - alpha) tokens for a cost of gamma * c + 1 target forwards. We pick the gamma in
[1, max_gamma] that maximises that ratio, re-estimating alpha and c from the request as it decodes.

alpha is the probability that a single proposal is accepted. The acceptance *rate* (accepted / proposed)
understates it, because proposals after the first rejection are discarded unexamined; so alpha is fitted to the
tokens committed per round instead (the alpha for which the model predicts the observed mean).

The paper assumes a target forward costs the same whatever its width; on CPUs it grows past a few rows. When
rounds report their verification width, the target's cost is tracked per width and a width not yet seen is
extrapolated linearly from those that were, so a gamma whose wider forward turned out expensive is dropped.
Costs belong to the models and the machine, so a decoder keeps them across requests (CostProfile); alpha
belongs to the prompt, so each request estimates its own.
"""

import math


def expected_tokens(alpha: float, gamma: float) -> float:
    """Expected tokens committed per round: (1 - alpha^(gamma+1)) / (1 - alpha) (gamma + 1 when alpha == 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float, verification: float = 1.0) -> float:
    """Leviathan et al. eq. (1): speedup over target-only decoding for acceptance alpha and cost ratio c.

    `verification`: a target forward over gamma + 1 tokens relative to one token (1 in the paper's model)."""
    return expected_tokens(alpha, gamma) / (gamma * c + verification)


def fit_alpha(tokens_per_round: float, gamma: float) -> float:
    """The alpha whose expected tokens per round at this gamma equals the observed mean (bisection)."""
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if expected_tokens(mid, gamma) < tokens_per_round:
            low = mid
        else:
            high = mid
    return low


def best_gamma(alpha: float, c: float, max_gamma: int, extra_draft_forwards: int = 0) -> int:
    """The gamma in [1, max_gamma] with the largest expected speedup (the smallest one on ties).

    `extra_draft_forwards`: draft forwards a round takes beyond gamma (1 when the last proposal replaces the
    bonus token)."""
    def speedup(g: int) -> float:
        return expected_tokens(alpha, g) / ((g + extra_draft_forwards) * c + 1)

    return max(range(1, max_gamma + 1), key=lambda g: (speedup(g), -g))


class CostProfile:
    """Measured seconds per draft forward and per target forward by width: a property of the models and the
    machine, not of a request, so a decoder keeps one across requests and each request starts from it.

    Each figure is a running mean whose weight never falls below `floor`, so it follows a machine whose speed
    drifts (a shared CPU) instead of freezing on its first hours.
    """

    def __init__(self, floor: float = 0.05):
        self.floor = floor
        self.draft = [0.0, 0]  # mean seconds per forward, forwards seen
        self.target = [0.0, 0]  # over every width
        self.target_by_width: dict[int, list] = {}

    def _add(self, entry: list, seconds: float, forwards: int) -> None:
        if forwards <= 0:
            return
        entry[1] += forwards
        weight = max(forwards / entry[1], self.floor)
        entry[0] += weight * (seconds / forwards - entry[0])

    def record(self, draft_seconds: float, draft_forwards: int, target_seconds: float, target_forwards: int,
               width: int | None = None) -> None:
        self._add(self.draft, draft_seconds, draft_forwards)
        self._add(self.target, target_seconds, target_forwards)
        if width is not None and target_forwards:
            self._add(self.target_by_width.setdefault(width, [0.0, 0]), target_seconds, target_forwards)

    @property
    def cost_ratio(self) -> float | None:
        """Draft forward time / target forward time, None until both were seen."""
        if not self.draft[1] or not self.target[1] or self.target[0] <= 0:
            return None
        return self.draft[0] / self.target[0]

    def target_cost(self, width: int) -> float | None:
        """Seconds of one target forward over `width` tokens: measured; between measured widths, interpolated;
        beyond the widest, extrapolated along the least-squares slope (never downwards); below the narrowest, the
        narrowest's cost (narrower forwards are not assumed cheaper). None until a width was measured."""
        means = {w: mean for w, (mean, n) in self.target_by_width.items() if n}
        if not means:
            return None
        widths = sorted(means)
        if width in means:
            return means[width]
        if width < widths[0]:
            return means[widths[0]]
        if width < widths[-1]:
            low = max(w for w in widths if w < width)
            high = min(w for w in widths if w > width)
            return means[low] + (means[high] - means[low]) * (width - low) / (high - low)
        if len(widths) == 1:
            return means[widths[0]]
        mean_w, mean_t = sum(widths) / len(widths), sum(means.values()) / len(means)
        slope = (sum((w - mean_w) * (means[w] - mean_t) for w in widths)
                 / sum((w - mean_w) ** 2 for w in widths))
        return means[widths[-1]] + max(slope, 0.0) * (width - widths[-1])


class AdaptiveGamma:
    """Per-request estimate of alpha, with costs from a CostProfile (shared when given); `choose()` gives the next
    round's gamma."""

    def __init__(self, initial: int = 4, max_gamma: int = 8, prior_alpha: float = 0.7, prior_weight: float = 4.0,
                 costs: CostProfile | None = None, bonus: bool = True):
        self.initial = initial
        # bonus=False: a round of gamma takes gamma + 1 draft forwards (its last proposal replaces the bonus token)
        self.draft_forwards_extra = 0 if bonus else 1
        self.max_gamma = max_gamma
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.costs = costs if costs is not None else CostProfile()
        self.proposed = 0
        self.accepted = 0
        self.rounds = 0
        self.committed = 0

    @property
    def alpha(self) -> float:
        """Acceptance fitted to the committed tokens per round, shrunk towards the prior over the first rounds."""
        if not self.rounds:
            return self.prior_alpha
        fitted = fit_alpha(self.committed / self.rounds, self.proposed / self.rounds)
        weight = self.proposed / (self.proposed + self.prior_weight)
        return weight * fitted + (1 - weight) * self.prior_alpha

    def update(self, proposed: int, accepted: int) -> None:
        """Record one round (it committed accepted + 1 tokens); its costs go to the CostProfile, by its owner."""
        self.proposed += proposed
        self.accepted += accepted
        self.rounds += 1
        self.committed += accepted + 1

    def choose(self) -> int:
        """The next round's gamma."""
        c = self.costs.cost_ratio
        if c is None or not math.isfinite(c):
            return min(self.initial, self.max_gamma)
        alpha = min(self.alpha, 0.999)
        if not self.costs.target_by_width:
            return best_gamma(alpha, c, self.max_gamma, self.draft_forwards_extra)
        draft = self.costs.draft[0]

        def tokens_per_second(gamma: int) -> float:
            draft_forwards = gamma + self.draft_forwards_extra
            return expected_tokens(alpha, gamma) / (draft_forwards * draft + self.costs.target_cost(gamma + 1))

        return max(range(1, self.max_gamma + 1), key=lambda g: (tokens_per_second(g), -g))
