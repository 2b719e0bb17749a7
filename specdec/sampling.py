"""Pure sampling math: logits to the probability distribution actually sampled from, and one draw from it.

The warpers follow transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, in that
order, so draft and target are shaped exactly as `generate` would shape them. temperature == 0 is greedy and
is expressed as a one-hot distribution, which lets the rejection rule treat greedy like any other case.
"""

import torch


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Apply temperature, top-k and top-p to (..., V) logits; removed entries become -inf. temperature must be > 0."""
    scores = logits.float() / temperature
    if top_k and top_k < scores.size(-1):
        # keep every entry tied with the k-th largest, as TopKLogitsWarper does
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities; temperature 0 gives a one-hot argmax."""
    if temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, greedy, 1.0)
    return warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


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
