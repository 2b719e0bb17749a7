"""Decoder layers in native code: each decoder layer of a Llama or Qwen2 model with grouped weights one call
(`torch.ops.specdec_decoder.decoder_layer`, csrc/decoder_layer.cpp) over the few new tokens of a forward after
cached ones: a draft's step, the target's step and its verification.

With the default pair's shipped weights the grouped operator was about 80% of a target step and 70% of a draft
step; most of the rest was some thirty small operations per layer (norms, rotary embedding, cache update,
attention, activation), each a Python call and a dispatch. One call per layer does the elementwise ones as loops,
the reduction, the exponentials and the attention as ATen's own calls on tensors of the fused forward's shapes, and
the projections as the grouped operator (q, k and v, gate and up, joined as the fused forward joins them). The
arithmetic is the fused forward's, so the logits are bitwise the library's (tests/test_native_step.py), and
greedy equivalence and the exactness tests hold as they did.

It applies where the fused forward would attend row by row (cpu/attention.py's grouped-head attention, a few rows
after cached ones): a request's first forward, wider forwards (a prefill) and models of other forms keep the fused
forward.

    layers = NativeLayers.build(fused.layers, model)   # None where they do not apply
    if layers.takes(hidden, cache): hidden = layers(hidden, cache, cos, sin)
"""

import functools
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .grouped import GroupedLinear, grouped_kernel

SOURCE = Path(__file__).resolve().parent / "csrc" / "decoder_layer.cpp"
TENSORS = ("q", "scale", "scale_unit", "minimum", "minimum_unit", "bias")  # per projection, as the operator reads


@functools.cache
def decoder_kernel() -> bool:
    """Whether `torch.ops.specdec_decoder.decoder_layer` is usable here (built and loaded on the first call)."""
    from .linear import build_kernel

    return grouped_kernel() and (hasattr(torch.ops.specdec_decoder, "decoder_layer") or build_kernel(SOURCE))


def _projection(part) -> tuple[list, list[int]] | None:
    """A grouped projection (GroupedLinear, or the fused forward's joined ones) as the operator's six tensors and
    (bits, group, out_features); None for anything else."""
    if not (type(part) is GroupedLinear or isinstance(getattr(part, "modules", None), list) and hasattr(part, "q")):
        return None
    if part.bias is not None and part.bias.dtype != torch.float32:
        return None
    return [getattr(part, name) for name in TENSORS], [part.bits, part.group, part.out_features]


class _NativeLayer:
    def __init__(self, layer, weights: list, meta: list[int], parts: list):
        self.layer, self.weights, self.meta, self.parts = layer, weights, meta, parts

    def current(self) -> bool:
        """Whether the layer still has these output and down projections, and every projection the weights listed
        (not if either was replaced since)."""
        return self.layer.attention.o_proj is self.parts[self.meta[0]] and \
            self.layer.mlp.down_proj is self.parts[-1] and \
            all(self.weights[2 + len(TENSORS) * j] is part.q for j, part in enumerate(self.parts))


class NativeLayers:
    """A model's decoder layers as native calls (see the module's docstring)."""

    def __init__(self, layers: list[_NativeLayer], config, attention: nn.Module, norms: tuple[float, float],
                 max_rows: int):
        self.layers, self.max_rows = layers, max_rows
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attention.head_dim, float(attention.scaling)
        self.input_eps, self.post_eps = norms

    @classmethod
    def build(cls, fused_layers: list, model: nn.Module) -> "NativeLayers | None":
        """The native layers for a fused forward's layers (fused_forward._Layer), or None where they do not apply:
        attention other than the grouped-head one row by row, a projection not grouped, an activation other than
        silu, a norm not float32, no kernel (built at the first model that has everything else)."""
        config = model.config
        # the attention function says up to how many rows it attends to one by one (cpu/attention.py's
        # gqa_sdpa_forward: each row the call a decoded token gets, which the native layers make too)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
        rows = getattr(attend, "row_by_row", 0)
        if not rows or getattr(config, "hidden_act", None) != "silu":
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
            layers.append(_NativeLayer(layer, weights, meta, parts))
        if len(eps) != 1 or not layers or not decoder_kernel():
            return None
        return cls(layers, config, fused_layers[0].attention, eps.pop(), rows)

    def current(self) -> bool:
        return all(layer.current() for layer in self.layers)

    def takes(self, hidden: torch.Tensor, cache) -> bool:
        """Whether this forward is one for the native layers: a few float32 rows after cached ones (which the
        fused forward attends to row by row), over a cache whose layers make room for new positions in place
        (kv_cache.GrowingLayer's `reserve`)."""
        return hidden.shape[1] <= self.max_rows and hidden.dtype == torch.float32 and hidden.shape[0] == 1 and \
            len(cache.layers) >= len(self.layers) and cache.get_seq_length() > 0 and \
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
