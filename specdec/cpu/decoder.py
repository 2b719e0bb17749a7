"""The draft's step in native code: each decoder layer of a Llama or Qwen2 model with grouped weights one call
(`torch.ops.specdec_decoder.decoder_layer`, csrc/decoder_layer.cpp) over the few new tokens of a draft's forward.

With the default pair's shipped weights, the grouped operator is about 60% of a draft step; the rest was about
thirty small operations per layer (norms, rotary embedding, cache update, attention, activation), each a Python
call and a dispatch: about 9 of 24 ms. One call per layer does them as loops over the rows, and calls the grouped
operator for the projections (q, k and v, gate and up, joined as the fused forward joins them).

Its values are the library forward's to float rounding, not bitwise (the sums run in another order), so only a
draft takes it (`use_native_step`, which `load_pair` applies to a CPU draft): proposals may come from anything,
since the rejection rule uses the probabilities the draft proposed with, and the output stays exactly the
target's (tests/test_native_step.py: greedy equivalence and the chi-square tests with a native draft). Each row is
computed alone, so a row's values do not depend on how many rows a call has. Wider forwards (a prompt's prefill)
keep the fused forward, on the same cache.

    use_native_step(draft)            # marks the draft; its FusedForward then takes the native layers
    layers = NativeLayers.build(fused.layers, model)   # None where they do not apply
    hidden = layers(hidden, cache, cos, sin)
"""

import functools
from pathlib import Path

import torch
from torch import nn

from .grouped import GroupedLinear, grouped_kernel

SOURCE = Path(__file__).resolve().parent / "csrc" / "decoder_layer.cpp"
MARK = "specdec_native_step"  # set in a model's __dict__ by use_native_step
# The widest forward taken natively: a draft's steps and catch-ups are a few tokens; a prefill keeps the fused
# forward (its attention over many rows is torch's SDPA)
NATIVE_ROWS = 33
TENSORS = ("q", "scale", "scale_unit", "minimum", "minimum_unit", "bias")  # per projection, as the operator reads


@functools.cache
def decoder_kernel() -> bool:
    """Whether `torch.ops.specdec_decoder.decoder_layer` is usable here (built and loaded on the first call)."""
    from .linear import build_kernel

    return grouped_kernel() and (hasattr(torch.ops.specdec_decoder, "decoder_layer") or build_kernel(SOURCE))


def use_native_step(model: nn.Module) -> bool:
    """Let a draft's forwards of a few tokens take the native layers, where they apply (a Llama or Qwen2 model
    whose decoder layers' linears are all grouped, silu, on CPU; checked when its fused forward is made). Returns
    whether it was marked (a model with no grouped layer is left alone, the kernel not built)."""
    if not any(type(module) is GroupedLinear for module in model.modules()) or not decoder_kernel():
        return False
    model.__dict__[MARK] = True
    model.__dict__.pop("specdec_forward", None)  # made again, with the native layers
    return True


def _projection(part) -> tuple[list, list[int]] | None:
    """A grouped projection (GroupedLinear, or the fused forward's joined ones) as the operator's six tensors and
    (bits, group, out_features); None for anything else."""
    if not (type(part) is GroupedLinear or hasattr(part, "modules") and hasattr(part, "q")):
        return None
    if part.bias is not None and part.bias.dtype != torch.float32:
        return None
    return [getattr(part, name) for name in TENSORS], [part.bits, part.group, part.out_features]


class _NativeLayer:
    def __init__(self, weights: list, meta: list[int], parts: list):
        self.weights, self.meta, self.parts = weights, meta, parts

    def current(self) -> bool:
        """Whether every projection still holds the weights listed (not if they were replaced since)."""
        return all(self.weights[2 + 6 * j] is part.q for j, part in enumerate(self.parts))


class NativeLayers:
    """A model's decoder layers as native calls (see the module's docstring)."""

    def __init__(self, layers: list[_NativeLayer], config, attention: nn.Module, norms: tuple[float, float]):
        self.layers = layers
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attention.head_dim, float(attention.scaling)
        self.input_eps, self.post_eps = norms

    @classmethod
    def build(cls, fused_layers: list, model: nn.Module) -> "NativeLayers | None":
        """The native layers for a fused forward's layers (fused_forward._Layer), or None where they do not apply:
        not marked (`use_native_step`), a projection not grouped, an activation other than silu, no kernel."""
        config = model.config
        if not model.__dict__.get(MARK) or getattr(config, "hidden_act", None) != "silu" or not decoder_kernel():
            return None
        layers, eps = [], set()
        for layer in fused_layers:
            if layer.rotary.__name__ != "apply_rotary_pos_emb":
                return None
            parts = [*layer.qkv.parts, layer.attention.o_proj, *layer.gate_up.parts, layer.mlp.down_proj]
            projections = [_projection(part) for part in parts]
            if any(p is None for p in projections):
                return None
            norms = (layer.input_norm, layer.post_attention_norm)
            if any(getattr(norm, "weight", None) is None or norm.weight.dtype != torch.float32 for norm in norms):
                return None
            eps.add(tuple(float(norm.variance_epsilon) for norm in norms))
            weights = [norm.weight for norm in norms] + [t for tensors, _ in projections for t in tensors]
            meta = [len(layer.qkv.parts), len(layer.gate_up.parts)] + [m for _, m in projections for m in m]
            layers.append(_NativeLayer(weights, meta, parts))
        if len(eps) != 1 or not layers:
            return None
        return cls(layers, config, fused_layers[0].attention, eps.pop())

    def current(self) -> bool:
        return all(layer.current() for layer in self.layers)

    def takes(self, hidden: torch.Tensor, cache) -> bool:
        """Whether this forward is one for the native layers: a few float32 rows over a cache whose layers make
        room for new positions in place (kv_cache.GrowingLayer's `reserve`)."""
        return hidden.shape[1] <= NATIVE_ROWS and hidden.dtype == torch.float32 and hidden.shape[0] == 1 and \
            len(cache.layers) >= len(self.layers) and \
            all(hasattr(layer, "reserve") for layer in cache.layers[: len(self.layers)])

    def __call__(self, hidden: torch.Tensor, cache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden (1, n, H) after the embedding -> after the last layer; each layer's new keys and values written
        into `cache`, after what it holds."""
        n = hidden.shape[1]
        rows = hidden[0].contiguous()
        cos, sin = cos.reshape(n, -1).float().contiguous(), sin.reshape(n, -1).float().contiguous()
        shape = rows.new_empty(1, self.kv_heads, n, self.head_dim)  # the new keys' shape, for the cache's room
        step = torch.ops.specdec_decoder.decoder_layer
        for index, layer in enumerate(self.layers):
            keys, values, held = cache.layers[index].reserve(shape, shape)
            rows = step(rows, layer.weights, layer.meta, keys, values, held, cos, sin, self.input_eps,
                        self.post_eps, self.scaling, self.heads)
        return rows.unsqueeze(0)
