"""Pure sampling math: logits to the probability distribution actually sampled from, and one draw from it; and
the log-probabilities a request may ask for (`token_logprobs`).

The warpers follow transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, in that
order, so draft and target are shaped exactly as `generate` would shape them. temperature == 0 is greedy and
is expressed as a one-hot distribution, which lets the rejection rule treat greedy like any other case.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TOP_P_CANDIDATES = 1024  # top-p's candidates at most, before it sorts everything
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Apply temperature, top-k and top-p to (..., V) logits; removed entries become -inf. temperature must be > 0."""
    # a temperature past float32's range would become inf, and a masked logit (-inf) over inf is NaN; below it every
    # finite logit over T is already within float32's smallest values, so the distribution is the same: uniform
    scores = logits.float() / min(temperature, FLOAT32_MAX)
    if top_k and top_k < scores.size(-1):
        # keep every entry tied with the k-th largest, as TopKLogitsWarper does
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        scores = scores.masked_fill(top_p_removed(scores, top_p), float("-inf"))
    return scores


def top_p_removed(scores: torch.Tensor, top_p: float, shortcut: bool = True) -> torch.Tensor:
    """TopPLogitsWarper's rule as a mask: in ascending order, a token whose cumulative probability is <= 1 - top_p
    is removed; the most likely token always stays.

    Sorting a 150k vocabulary costs milliseconds per row (18 ms on our CPUs; torch.topk of the 1,024 most likely
    1.4 ms), so with `shortcut` the rule is applied to the candidates alone: the tokens within log((1 - top_p) / V)
    of the most likely one (a median of 7 to 76 for the default pair's target at T 0.7 to 1, top-p 0.9 to 0.95),
    or where those are more than TOP_P_CANDIDATES, the TOP_P_CANDIDATES most likely. When the tokens outside have
    a mass <= 1 - top_p, the rule removes them all whatever their order (each cumulative sum among them is at most
    that mass), and the candidates' cumulative sums only need that mass added; otherwise: the full sort. Row by row.
    A vocabulary of at most TOP_P_CANDIDATES is sorted whole, all rows at once (the shortcut's dozen small
    operations a row cost more than the sort there).
    """
    size = scores.size(-1)
    flat = scores.reshape(-1, size)
    if not shortcut or size <= TOP_P_CANDIDATES:
        sorted_scores, ascending_idx = torch.sort(flat, dim=-1, descending=False)
        remove_sorted = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove_sorted[:, -1:] = False  # always keep the most likely token
        return remove_sorted.scatter(-1, ascending_idx, remove_sorted).reshape(scores.shape)
    removed = torch.ones_like(flat, dtype=torch.bool)
    margin = math.log((1 - top_p) / size)
    for row, out in zip(flat, removed):
        cumulative = None
        probs = row.softmax(-1)  # not exp(row - logsumexp(row)): exp is 10x slower on the -inf of masked rows
        chosen = row >= row.max() + margin
        candidates = chosen.nonzero().squeeze(-1)
        if len(candidates) > TOP_P_CANDIDATES:  # a flat distribution: the most likely ones may do
            candidates = torch.topk(row, TOP_P_CANDIDATES).indices
            chosen = torch.zeros_like(chosen).index_fill_(0, candidates, True)
        order = row[candidates].argsort()
        outside = probs.masked_fill(chosen, 0).sum()
        if bool(outside <= 1 - top_p):
            ascending_idx = candidates[order]
            cumulative = outside + probs[ascending_idx].cumsum(-1)
        if cumulative is None:
            sorted_scores, ascending_idx = torch.sort(row, descending=False)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[-1:] = False  # always keep the most likely token
        out.scatter_(-1, ascending_idx, remove_sorted)  # tokens outside the candidates stay removed
    return removed.reshape(scores.shape)


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities; temperature 0 gives a one-hot argmax."""
    if temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, greedy, 1.0)
    return warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


def logit_bias_vector(bias: Sequence[tuple[int, float]], size: int, device=None) -> torch.Tensor:
    """OpenAI's logit_bias ((token id, amount), ...) as a (size,) float32 vector to add to logits: the amounts at
    their ids, 0 elsewhere (adding 0 leaves a logit's bits as they are); ids at or past `size` are left out (a
    draft with fewer logits)."""
    vector = torch.zeros(size, dtype=torch.float32, device=device)
    kept = [(token, amount) for token, amount in bias if token < size]
    if kept:
        ids, amounts = zip(*kept)
        vector[list(ids)] = torch.tensor(amounts, dtype=torch.float32, device=device)
    return vector


def penalize(logits: torch.Tensor, context: Sequence[int], prompt_len: int, presence: float = 0.0,
             frequency: float = 0.0, repetition: float = 1.0) -> torch.Tensor:
    """The penalties that depend on the tokens so far, on (n, V') logits whose row i is the distribution after
    context[: len(context) - n + 1 + i] (the last row's after the whole context; the rows before it after one
    token fewer each, as a verification's rows follow the proposals), context[:prompt_len] being the prompt.
    Returns float32 logits.

    vLLM's rules, in its order: repetition (transformers' RepetitionPenaltyLogitsProcessor: a token seen in the
    prompt or the output has a positive logit divided by `repetition`, a negative one multiplied), then
    `frequency` times the token's count in the output and `presence` if it occurs there at all, subtracted
    (OpenAI's). Only the tokens seen are touched, each row's by elementwise operations on its own logits, so a row
    comes out the same to the bit whatever rows are computed with it; ids at or past V' (a draft with fewer
    logits) are left out."""
    rows, size = logits.shape
    first = len(context) - rows + 1  # the length of what row 0 follows
    if first < prompt_len:
        raise ValueError(f"{rows} rows after {len(context)} tokens would start inside the {prompt_len}-token prompt")
    start = 0 if repetition != 1 else prompt_len  # the prompt's tokens matter to the repetition penalty only
    out = logits.float()
    if len(context) <= start:
        return out
    ids, inverse = torch.unique(torch.tensor(context[start:], dtype=torch.long), return_inverse=True)
    width = len(ids)
    # each row's occurrences: those in what row 0 follows, then one more per row for the token before it
    steps = torch.nn.functional.one_hot(inverse[first - start:], width).cumsum(0)
    later = torch.cat((steps.new_zeros(1, width), steps))  # (rows, width)
    generated = torch.bincount(inverse[prompt_len - start: first - start], minlength=width) + later
    kept = ids < size
    index = ids[kept].to(out.device).expand(rows, -1)
    values = out.gather(1, index)
    if repetition != 1:
        seen = (torch.bincount(inverse[: first - start], minlength=width) + later)[:, kept] > 0
        values = torch.where(seen.to(out.device),
                             torch.where(values > 0, values / repetition, values * repetition), values)
    if presence or frequency:
        counts = generated[:, kept].to(out.device, torch.float32)
        values = values - (counts * frequency + (counts > 0).float() * presence)
    return out.scatter(1, index, values)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A grammar's mask on (..., V') logits: (..., V) with every token `allowed` ((..., V) bool, V <= V') does not
    allow at -inf, so the warpers and the softmax after it see the allowed tokens only."""
    return logits[..., : allowed.size(-1)].masked_fill(~allowed.to(logits.device), float("-inf"))


def token_probability(logits: torch.Tensor, token: int) -> float:
    """softmax(logits)[token], the model's own probability of `token` (no temperature, top-k or top-p), from the
    (V,) logits. Through the softmax, not exp(logits[token] - logsumexp(logits)): torch's exp takes a slow path on
    -inf and underflowing inputs, and a draft over part of its vocabulary (models/draft_vocab.py) or a grammar's
    mask leaves most logits -inf (0.7 ms against 0.1 for 151,936 logits on our CPUs)."""
    return float(logits.float().softmax(-1)[token])


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (V,) distribution by inverse CDF, with a uniform from the (CPU) request generator.

    Drawing the uniform on the CPU keeps one generator per request whatever device the probabilities are on.
    A token with zero probability can never be drawn.
    """
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    point = (u * cdf[-1]).to(cdf.device)
    index = torch.searchsorted(cdf, point.reshape(1), right=True)
    return int(index.clamp_(max=probs.size(-1) - 1).item())


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability under the model's raw distribution (log-softmax of its logits: no temperature,
    top-k or top-p), with the `top` most likely tokens and theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int = 0) -> list[TokenLogprobs]:
    """(n, V) logits, row i the distribution tokens[i] came from -> each token's TokenLogprobs with `top`
    alternatives. One log-softmax over the n rows: what a request that asks for logprobs pays per token."""
    if not tokens:
        return []
    logprobs = logits[: len(tokens)].float().log_softmax(dim=-1)  # (n, V)
    index = torch.tensor(tokens, device=logprobs.device).unsqueeze(-1)
    chosen = logprobs.gather(-1, index).squeeze(-1).tolist()
    if not top:
        return [TokenLogprobs(token, logprob) for token, logprob in zip(tokens, chosen)]
    values, indices = logprobs.topk(min(top, logprobs.size(-1)), dim=-1)
    return [TokenLogprobs(token, logprob, tuple(zip(ids, row)))
            for token, logprob, ids, row in zip(tokens, chosen, indices.tolist(), values.tolist())]
