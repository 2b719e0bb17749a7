"""CPU linear layers: weights packed once for cheap multi-token verification, and an int8 draft.

On our CPUs `torch.nn.functional.linear` over 2-16 rows costs 2-3x one row, because its GEMM path repacks the
whole weight on every call; verifying gamma draft tokens in one target forward then saves nothing. A weight
packed once at load time (`mkldnn._reorder_linear_weight`, what inductor does for dynamic batch sizes) makes
a few rows cost about what one row does. Float32 on CPU only: CUDA and half-precision models are untouched.

A float32 draft on CPU reads all its weights for every proposed token, so its cost is memory bandwidth. Int8
dynamic quantization (`quantize_linears`: per-channel int8 weights, activations quantized per call) makes it
2.5-3x cheaper. Exactness does not depend on the draft: the rejection rule uses the quantized draft's own
probabilities, so the output is still distributed exactly as the target's. The target is never quantized.
"""

import logging
import warnings

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 5  # typical verification width: gamma + 1


def packing_supported() -> bool:
    """Whether this torch build has the oneDNN ops we rely on."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """A drop-in nn.Linear replacement holding its weight only in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear, tied: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # a weight shared with another module (an output layer tied to the embedding) stays alive there anyway;
        # remembering it lets to_linear tie it again instead of copying it (in a tuple: not a second parameter)
        self.tied_weight = (linear.weight,) if tied else ()
        weight = linear.weight.detach().contiguous()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT),
                             persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def to_linear(self) -> nn.Linear:
        """The equivalent stock nn.Linear (weights unpacked, or the shared weight if it was tied)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = self.tied_weight[0] if self.tied_weight else nn.Parameter(self.packed_weight.to_dense())
        linear.bias = self.bias
        return linear.eval()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def _linears(model: nn.Module, kind):
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is kind:
                yield parent, name, child


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU nn.Linear of `model` by a PackedLinear, in place. Returns how many were packed.

    Models on CUDA, in half precision, or on a torch without oneDNN are returned unchanged (0).
    """
    if not packing_supported():
        return 0
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    count = 0
    for parent, name, linear in list(_linears(model, nn.Linear)):
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            continue
        setattr(parent, name, PackedLinear(linear, tied=uses[id(linear.weight)] > 1))
        count += 1
    if count:
        logger.info("packed %d linear layers of %s for multi-token CPU forwards", count, type(model).__name__)
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears`: stock nn.Linear layers again (what `from_pretrained` gives, tied weights tied again).
    Returns how many."""
    count = 0
    for parent, name, packed in list(_linears(model, PackedLinear)):
        setattr(parent, name, packed.to_linear())
        count += 1
    return count


def quantization_supported() -> bool:
    """Whether this torch build has a CPU int8 engine (fbgemm/x86 on x86, qnnpack on ARM)."""
    return bool(set(torch.backends.quantized.supported_engines) - {"none"})


def quantize_linears(model: nn.Module) -> int:
    """Int8 dynamic quantization of every float32 CPU nn.Linear of `model`, in place (per-channel weights).

    Returns how many layers were quantized; models on CUDA or in half precision are returned unchanged (0).
    Packed layers (PackedLinear) are quantized from their weights too. Not reversible: quantize a copy if the
    float model is still needed.
    """
    if not quantization_supported():
        return 0
    unpack_linears(model)
    layers = [(parent, name) for parent, name, linear in _linears(model, nn.Linear)
              if linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32]
    if not layers:
        return 0
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    with warnings.catch_warnings():  # torch.ao's eager quantization warns that torchao will replace it
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        for parent, name in layers:
            linear = getattr(parent, name)
            linear.qconfig = per_channel_dynamic_qconfig
            setattr(parent, name, DynamicQuantizedLinear.from_float(linear))
    logger.info("quantized %d linear layers of %s to int8 (dynamic)", len(layers), type(model).__name__)
    return len(layers)
