"""4-bit groups on torch's own int4 kernel: `_weight_int4pack_mm` on CUDA (tinygemm, gpt-fast's int4 path), with
bfloat16 activations. Its CPU twin (`_weight_int4pack_mm_for_cpu`) runs the same layers where there is no GPU, for
the tests; CPU serving uses the grouped kernel (specdec.cpu.grouped), which keeps more rows at the cost of one.

The layer holds a `Grouped` 4-bit form (GGUF's Q4_K, or `grouped.quantize`'s) as the kernel reads it:

    w[n, k] = scale[n, g] * v[n, k] - minimum[n, g] = (v[n, k] - 8) * scale[n, g] + zero[n, g],
    zero = 8 * scale - minimum,   g = k // 32

with scale and zero in the activations' dtype (bfloat16 on CUDA, which tinygemm requires): on CUDA the served
weights are the GGUF's up to that rounding of each group's scale and minimum (`dequantize` says what they are).

    layer = Int4PackLinear(grouped, bias, device)    # a drop-in nn.Linear
    count = int4pack_model(model, grouped_layers)    # in place: the given forms, else each layer quantized
"""

import torch
from torch import nn

from ..cpu.grouped import Grouped, quantizable, quantize, values

GROUP = 32  # values per group along K: Q4_K's and quantize's


def inner_k_tiles(k: int) -> int | None:
    """The kernel's inner K tiles for a weight K wide: 8, 4 or 2 (16 values each), the most that divide K."""
    return next((tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0), None)


def packable(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight [N, K]: whole 4-bit groups in pairs along K, N a multiple of 16 (the CPU
    twin's need; CUDA's is 8)."""
    return quantizable(in_features, 4) and out_features % 16 == 0 and inner_k_tiles(in_features) is not None


def activation_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """bfloat16 on CUDA (the only dtype tinygemm takes); on CPU the model's own float32 or bfloat16."""
    return torch.bfloat16 if device.type == "cuda" or dtype not in (torch.float32, torch.bfloat16) else dtype


class Int4PackLinear(nn.Module):
    """y = x W^T + b with W in 4-bit groups of 32, computed by torch's int4pack kernel."""

    def __init__(self, grouped: Grouped, bias: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if grouped.bits != 4 or grouped.group != GROUP:
            raise ValueError(f"int4pack takes 4-bit groups of {GROUP}, got {grouped.bits}-bit groups of "
                             f"{grouped.group}")
        self.out_features, self.in_features = grouped.shape
        if not packable(self.out_features, self.in_features):
            raise ValueError(f"int4pack cannot take a weight of shape {grouped.shape}")
        device = torch.device(device)
        self.compute_dtype = activation_dtype(device, dtype)
        v = values(grouped).to(device=device, dtype=torch.int32)
        tiles = inner_k_tiles(self.in_features)
        if device.type == "cuda":  # two values a byte, the even k in the high nibble
            pairs = (v[:, ::2] << 4 | v[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(v, tiles)
        scale = grouped.scale.to(device=device, dtype=torch.float32)
        minimum = grouped.minimum.to(device=device, dtype=torch.float32)
        scales_and_zeros = torch.stack([scale.t(), (8 * scale - minimum).t()], dim=-1)  # [K / 32, N, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(self.compute_dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the kernel computes with, [N, K] (scales and zeros as held, after rounding)."""
        n, k = self.out_features, self.in_features
        eye = torch.eye(k, device=self.packed.device, dtype=self.compute_dtype)
        return self._mm(eye).float().t().reshape(n, k)

    def _mm(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x2d, self.packed, GROUP, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, GROUP, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._mm(x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous())
        y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit groups of {GROUP}, " \
               f"{str(self.compute_dtype).removeprefix('torch.')} activations"


def int4pack_model(model: nn.Module, grouped_layers: dict[str, Grouped] | None = None,
                   quantize_rest: bool = True) -> int:
    """Swap `model`'s nn.Linear layers for Int4PackLinear ones, in place, on the model's device: a layer named in
    `grouped_layers` takes that 4-bit form (a GGUF's Q4_K layer as shipped); any other, where `quantize_rest` and
    its shape allows, is quantized to 4-bit groups (`grouped.quantize`: this changes the model). The others stay.
    Returns how many were swapped."""
    grouped_layers = grouped_layers or {}
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    swapped = 0
    for module_name, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear or not packable(child.out_features, child.in_features):
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            grouped = grouped_layers.get(full_name)
            if grouped is None and not quantize_rest:
                continue
            if grouped is None:
                grouped = quantize(child.weight, 4)
            setattr(module, name, Int4PackLinear(grouped, child.bias, device, dtype))
            swapped += 1
    return swapped
