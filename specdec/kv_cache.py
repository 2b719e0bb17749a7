"""A causal LM paired with its KV cache: feed only unseen tokens, roll back through the Cache API (`crop`).

Works for any architecture transformers gives a DynamicCache (Llama, Qwen2, GPT-2, Bloom, ...): the cache is
never sliced by hand.
"""

import inspect
import itertools

import torch
from transformers import DynamicCache


def input_device(model) -> torch.device:
    """Where the model wants its input ids (the embedding's device; with accelerate's device_map, the first shard).
    An embedding may hold its weight as a buffer (grouped GGUF weights)."""
    embedding = model.get_input_embeddings()
    return next(itertools.chain(embedding.parameters(), embedding.buffers())).device


def context_length(model) -> int | None:
    """The model's maximum number of positions, or None when it has no fixed limit (ALiBi models like Bloom)."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


class CachedModel:
    """One model's KV cache for one request. `length` tokens of the sequence are cached: none, or with `cache` (a
    DynamicCache of this model's, from the prompt cache), the prefix it holds."""

    def __init__(self, model, cache: DynamicCache | None = None):
        self.model = model
        self.device = input_device(model)
        if cache is None:
            cache = DynamicCache(config=model.config)
            if hasattr(cache, "activate_past_recording"):
                cache.activate_past_recording()  # sliding-window layers must be able to roll back
        self.cache = cache
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def length(self) -> int:
        """Number of tokens whose keys and values are cached."""
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, tokens: list[int], keep: int = 1) -> torch.Tensor:
        """Feed `tokens` (not yet cached) and return the logits of the last `keep` positions, (keep, V)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, **kwargs)
        return out.logits[0, -keep:]

    def rollback(self, length: int) -> None:
        """Drop cached positions beyond `length` (a no-op if fewer are cached)."""
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)
