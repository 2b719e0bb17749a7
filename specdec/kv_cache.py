"""A causal LM paired with its KV cache: feed only unseen tokens, roll back through the Cache API (`crop`).

Works for any architecture transformers gives a DynamicCache (Llama, Qwen2, GPT-2, Bloom, ...): the cache is
never sliced by hand. Its full-attention layers are `GrowingLayer`s, which append in place.
"""

import inspect
import itertools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .fused_forward import fused_forward

GROWTH_MIN = 256  # positions a GrowingLayer's buffers gain at least when they grow


def input_device(model) -> torch.device:
    """Where the model wants its input ids (the embedding's device; with accelerate's device_map, the first shard).
    An embedding may hold its weight as a buffer (grouped GGUF weights)."""
    embedding = model.get_input_embeddings()
    return next(itertools.chain(embedding.parameters(), embedding.buffers())).device


def context_length(model) -> int | None:
    """The model's maximum number of positions, or None when it has no fixed limit (ALiBi models like Bloom)."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with room ahead: a forward writes its new positions
    in place, where DynamicLayer copies the whole cache into a new tensor (torch.cat) in every layer, every step
    (at 3,072 cached tokens a fifth of the default draft's step). Full buffers grow by a quarter, at least
    `GROWTH_MIN` positions. `crop` narrows the views (inherited), so the next forward overwrites what a rollback
    dropped. Keys or values set from outside (a prompt-cache copy) are copied into new buffers at the next update;
    no other cache ever sees these buffers. The values attended to are those DynamicLayer holds: only where they
    live differs (and SDPA's results do not depend on it: verification already attends to slices of the cache)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._storage = None  # (keys, values) buffers, or None until the next update makes them

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values, held = self.reserve(key_states, value_states)
        keys[..., held:held + key_states.shape[-2], :] = key_states
        values[..., held:held + key_states.shape[-2], :] = value_states
        return self.keys, self.values

    def reserve(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for key_states' positions after the `held` ones: (keys buffer, values buffer, held), the views
        already extended over the new positions, whose values the caller writes (`update`, or the native decoder layers,
        cpu/decoder.py). key_states and value_states only give the shapes, dtype and device."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys.numel() else 0
        length = held + key_states.shape[-2]
        if not self._in_storage(key_states, value_states, held, length):
            room = length + max(GROWTH_MIN, length // 4)
            keys = key_states.new_empty(*key_states.shape[:-2], room, key_states.shape[-1])
            values = value_states.new_empty(*value_states.shape[:-2], room, value_states.shape[-1])
            if held:
                keys[..., :held, :] = self.keys
                values[..., :held, :] = self.values
            self._storage = keys, values
        keys, values = self._storage
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]
        return keys, values, held

    def _in_storage(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, length: int) -> bool:
        """Whether the held keys and values are the leading views of this layer's buffers and `length` fits."""
        storage = self._storage
        if storage is None or length > storage[0].shape[-2]:
            return False
        return all(t.shape[:-2] == new.shape[:-2] and t.shape[-1] == new.shape[-1] and t.dtype == new.dtype
                   and t.device == new.device and (held == 0 or (
                       held_view.data_ptr() == t.data_ptr() and held_view.stride() == t.stride()))
                   for t, new, held_view in zip(storage, (key_states, value_states), (self.keys, self.values)))

    def reset(self) -> None:
        self._storage = None
        super().reset()

    def compact(self) -> None:
        """Keys and values of exactly the positions held, the room released (a cache kept between requests,
        `PromptCache.put`); the next update makes room again."""
        if self._storage is not None:
            self.keys, self.values = self.keys.clone(), self.values.clone()
            self._storage = None

    def __copy__(self) -> "GrowingLayer":
        """A shallow copy (the prompt cache's `prefix_copy`) shares no buffers: its first update copies what it holds
        into its own."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied._storage = None
        return copied


def growing_cache(config) -> DynamicCache:
    """A DynamicCache for a model of `config`, its full-attention layers `GrowingLayer`s (sliding-window ones, and
    any other kind, as the library makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class CachedModel:
    """One model's KV cache for one request. `length` tokens of the sequence are cached: none, or with `cache` (a
    DynamicCache of this model's, from the prompt cache), the prefix it holds."""

    def __init__(self, model, cache: DynamicCache | None = None):
        self.model = model
        self.device = input_device(model)
        if cache is None:
            cache = growing_cache(model.config)
            if hasattr(cache, "activate_past_recording"):
                cache.activate_past_recording()  # sliding-window layers must be able to roll back
        self.cache = cache
        self._fused = fused_forward(model)  # Llama and Qwen2: the library's forward, fused (fused_forward.py)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def length(self) -> int:
        """Number of tokens whose keys and values are cached."""
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, tokens: list[int], keep: int = 1) -> torch.Tensor:
        """Feed `tokens` (not yet cached) and return the logits of the last `keep` positions, (keep, V)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        if self._fused is not None:
            return self._fused(ids, self.cache, keep)
        kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, **kwargs)
        return out.logits[0, -keep:]

    def rollback(self, length: int) -> None:
        """Drop cached positions beyond `length` (a no-op if fewer are cached)."""
        extra = self.length - length
        if extra > 0:
            self.cache.crop(-extra)
