"""A Llama or Qwen2 causal LM's forward over a KV cache, the library's operations in the library's order without
its per-module machinery, and with the projections that read the same input fused where their weights allow.

transformers runs each decoder layer through a dozen module calls, keyword plumbing and an attention dispatch:
on our CPUs a tenth of a draft step outside any kernel. This forward calls the same modules for the embedding,
the norms, the rotary embedding and the activation, the same attention function (the model's own,
`config._attn_implementation`) with the same masks, and the same cache `update`; only the linear layers are
called differently:
- a grouped linear (specdec.cpu.grouped, GGUF's weights) is its operator called directly;
- q, k and v, and gate and up, whose grouped weights share a layout, are one operator call over their rows
  joined, then split. The operator computes each output row alone, in the same order whatever the other rows,
  so every output has the bits the separate calls give (the modules then hold views of the joined weights: no
  byte is held twice).
So the logits are bitwise the library's forward's (tests/test_fused_forward.py), and everything built on
them (greedy equivalence, the exactness tests) holds unchanged. Where every projection is grouped and attention
is cpu/attention.py's row by row, a forward of a few tokens after cached ones runs each layer as one native call
instead (cpu/decoder.py), with the same arithmetic: the same bits, without the Python of some thirty small
operations per layer.

    forward = fused_forward(model)      # None for other architectures, or a model spread by accelerate's hooks
    logits = forward(ids, cache, keep)  # (keep, V): the last `keep` positions of ids (1, n) after the cache
"""

import sys

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cpu.decoder import NativeLayers
from .cpu.grouped import TILE, GroupedLinear, Tiled, grouped_rows

# The decoder layers whose forward this one reproduces operation by operation (their modeling files read alike).
LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer"}


def _same_layout(a: GroupedLinear, b: GroupedLinear) -> bool:
    """Whether two grouped linears' weights can be held as one: the same bits, groups, input width, the same
    kinds of scales, and whole tiles of rows (b may end in padding: it comes last)."""
    if (a.bits, a.group, a.in_features) != (b.bits, b.group, b.in_features) or a.out_features % TILE:
        return False
    if (a.bias is None) != (b.bias is None):
        return False
    for name in Tiled.BUFFERS:  # each [rows / 16, ...]
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and (x.dtype != y.dtype or x.shape[1:] != y.shape[1:]
                                                             or x.device != y.device)):
            return False
    return True


class _Joined:
    """Grouped linears over the same input computed as one operator call: their rows joined (each module then
    holds views of the joined buffers), the output split back."""

    def __init__(self, modules: list[GroupedLinear]):
        first = modules[0]
        self.modules = modules
        self.sizes = [m.out_features for m in modules]
        self.out_features = sum(self.sizes)
        self.bits, self.group = first.bits, first.group
        self.bias = None if first.bias is None else torch.cat([m.bias for m in modules])
        for name in Tiled.BUFFERS:
            if getattr(first, name) is None:
                setattr(self, name, None)
                continue
            joined = torch.cat([getattr(m, name) for m in modules])
            setattr(self, name, joined)
            start = 0
            for m in modules:  # the module's own buffer becomes its rows of the joined one
                tiles = getattr(m, name).shape[0]
                m._buffers[name] = joined[start:start + tiles]
                start += tiles

    def __call__(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return list(grouped_rows(self, rows).split(self.sizes, dim=1))

    def current(self) -> bool:
        """Whether the modules still hold views of the joined weights (not if the model was moved or its buffers
        replaced since: the joined ones would be stale)."""
        start = self.q.data_ptr()
        for module in self.modules:
            if module.q.data_ptr() != start:
                return False
            start += module.q.numel() * module.q.element_size()
        return True


class _Projections:
    """Linear layers that read the same input, in order: runs of grouped ones with one layout joined (`_Joined`),
    others called one by one; each output as the module alone gives it."""

    def __init__(self, modules: list[nn.Module]):
        self.parts: list = []  # _Joined, or a single module
        run: list[GroupedLinear] = []
        for module in modules:
            if type(module) is GroupedLinear and run and _same_layout(run[-1], module):
                run.append(module)
                continue
            self._close(run)
            run = [module] if type(module) is GroupedLinear else []
            if not run:
                self.parts.append(module)
        self._close(run)

    def _close(self, run: list[GroupedLinear]) -> None:
        if len(run) > 1:
            self.parts.append(_Joined(run))
        elif run:
            self.parts.append(run[0])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x (1, n, K) -> each projection's (1, n, out)."""
        n, rows = x.shape[1], _rows(x)
        outputs = []
        for part in self.parts:
            if isinstance(part, _Joined) and rows is not None:
                outputs += [out.view(1, n, -1) for out in part(rows)]
            elif isinstance(part, _Joined):
                outputs += [module(x) for module in part.modules]
            else:
                outputs.append(_linear(part, x, rows))
        return outputs


def _linear(module: nn.Module, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """module(x) for x (1, n, K); a grouped one's operator called directly where x's rows are float32."""
    if type(module) is GroupedLinear and rows is not None:
        return grouped_rows(module, rows).view(1, rows.shape[0], -1)
    return module(x)


class _Layer:
    """One decoder layer's modules and its fused projections."""

    def __init__(self, layer: nn.Module):
        attention, mlp = layer.self_attn, layer.mlp
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_attention_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _Projections([attention.q_proj, attention.k_proj, attention.v_proj])
        self.gate_up = _Projections([mlp.gate_proj, mlp.up_proj])
        # the modeling file's own apply_rotary_pos_emb, as the library's attention calls it
        self.rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        # Qwen2 passes its layer's sliding window (None here) to the attention function; Llama passes nothing
        self.attention_kwargs = {"sliding_window": attention.sliding_window} \
            if hasattr(attention, "sliding_window") else {}


class FusedForward:
    """A Llama or Qwen2 causal LM's forward over a DynamicCache (see the module's docstring)."""

    def __init__(self, model: nn.Module):
        self.model, self.inner = model, model.model
        self.config = self.inner.config
        self.layers = [_Layer(layer) for layer in self.inner.layers[: self.config.num_hidden_layers]]
        # forwards of a few tokens after cached ones as one native call per layer (cpu/decoder.py), where it applies
        self.native = NativeLayers.build(self.layers, model)

    def current(self) -> bool:
        """Whether every joined projection still matches its modules' weights (`_Joined.current`), and the native
        layers theirs."""
        return all(part.current() for layer in self.layers for projections in (layer.qkv, layer.gate_up)
                   for part in projections.parts if isinstance(part, _Joined)) and \
            (self.native is None or self.native.current())

    def __call__(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        """The logits (keep, V) of the last `keep` of ids (1, n), fed after what `cache` holds (it takes their
        keys and values)."""
        inner, config = self.inner, self.config
        hidden = inner.embed_tokens(ids)
        n = hidden.shape[1]
        position_ids = (torch.arange(n, device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
        position_embeddings = inner.rotary_emb(hidden, position_ids)
        if self.native is not None and self.native.takes(hidden, cache):
            hidden = self.native(hidden, cache, *position_embeddings)
        else:
            mask_kwargs = {"config": config, "inputs_embeds": hidden, "attention_mask": None, "cache": cache,
                           "position_ids": position_ids}
            mask = create_causal_mask(**mask_kwargs)
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, None)
            for index, layer in enumerate(self.layers):
                hidden = self._layer(layer, index, hidden, mask, position_embeddings, cache, attend)
        hidden = inner.norm(hidden)
        last = hidden[:, -keep:, :]
        lm_head = self.model.lm_head
        if type(lm_head) is GroupedLinear and last.dtype == torch.float32:
            return grouped_rows(lm_head, last.reshape(keep, -1).contiguous())
        return lm_head(last)[0]

    @staticmethod
    def _layer(layer: _Layer, index: int, hidden: torch.Tensor, mask, position_embeddings, cache, attend):
        """The library's decoder layer: attention and MLP, each after its norm and with its residual."""
        attention = layer.attention
        residual = hidden
        x = layer.input_norm(hidden)
        shape = (*x.shape[:-1], -1, attention.head_dim)
        query, key, value = (out.view(shape).transpose(1, 2) for out in layer.qkv(x))
        cos, sin = position_embeddings
        query, key = layer.rotary(query, key, cos, sin)
        key, value = cache.update(key, value, index)
        out, _ = attend(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling,
                        **layer.attention_kwargs)
        out = out.reshape(*x.shape[:-1], -1).contiguous()
        hidden = residual + _linear(attention.o_proj, out, _rows(out))
        residual = hidden
        x = layer.post_attention_norm(hidden)
        gate, up = layer.gate_up(x)
        mlp = layer.mlp
        inner = mlp.act_fn(gate) * up
        return residual + _linear(mlp.down_proj, inner, _rows(inner))


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x (1, n, K) as (n, K) float32 rows for the grouped operator, or None where it is not such."""
    return x.reshape(x.shape[1], -1) if x.dtype == torch.float32 and x.is_contiguous() else None


def supports(model: nn.Module) -> bool:
    """Whether `fused_forward` reproduces this model's forward: a Llama or Qwen2 causal LM (their decoder layers,
    nothing put between them, no sliding-window layers), on one device without accelerate's hooks, in inference."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or model.training:
        return False
    if type(model).__name__ not in {"LlamaForCausalLM", "Qwen2ForCausalLM"}:
        return False
    if any(type(layer).__name__ not in LAYERS for layer in layers):
        return False
    if getattr(inner, "has_sliding_layers", False):  # sliding-window layers: not reproduced here (untested)
        return False
    return not _hooked(model)


def _hooked(model: nn.Module) -> bool:
    """Whether any module has hooks (accelerate's, or a caller's forward hooks), which only module calls run.
    accelerate sets `_hf_hook` as a plain attribute: looked up in the module's __dict__, not with hasattr, which
    goes through nn.Module.__getattr__ and an exception for every module without one (1.4 against 0.35 ms for
    a 28-layer model, once per request and model)."""
    return any("_hf_hook" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks
               for module in model.modules())


def fused_forward(model: nn.Module) -> FusedForward | None:
    """The model's FusedForward (made once, then kept on the model as `specdec_forward`, made again if the model's
    weights were moved or replaced since), or None where the model is not one it reproduces (`supports`), also once
    hooks have been added since."""
    forward = model.__dict__.get("specdec_forward")
    if forward is not None and not forward.current():  # moved, or its weights replaced: join them again
        forward = None
    if forward is None and supports(model):
        forward = FusedForward(model)
        model.__dict__["specdec_forward"] = forward
    return None if forward is None or _hooked(model) else forward
