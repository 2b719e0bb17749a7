"""Weights as GGUF ships them: grouped low-bit forms, unpacked inside a few-rows CPU kernel, never into float.

    w[n, k] = scale[n, k // G] * v[n, k] - minimum[n, k // G]

Q4_K keeps its 4-bit quants byte for byte (two groups of 32 per 32 bytes: low nibbles, then high ones), with
scale = d * sc and minimum = dmin * m; Q6_K (groups of 16), Q5_0 and Q8_0 (groups of 32) become int8 values
(q - 32, q - 16, q) with scale = d * scale or d, and no minimum. Each scale and minimum is the float32 product the
GGUF's own dequantization takes, so `dequantize(pack(t))` is bitwise `gguf.quants.dequantize(t)`.

    grouped = pack(tensor.data, tensor.tensor_type)   # a GGUF tensor's blocks, [N, bytes per row]
    layer = GroupedLinear(grouped, bias)              # a drop-in nn.Linear: torch.ops.specdec_grouped.grouped_linear
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

FOUR_BIT = ("Q4_K",)
EIGHT_BIT = {"Q6_K": 16, "Q5_0": 32, "Q8_0": 32}  # type: group size
SHIPPED_TYPES = (*FOUR_BIT, *EIGHT_BIT)
SOURCE = Path(__file__).resolve().parent / "csrc" / "grouped_linear.cpp"
ONE = np.array([1.0], dtype=np.float16).view(np.uint8)  # fp16 1.0 as its two bytes


@dataclass
class Grouped:
    """One weight matrix in grouped form: q [N, K * bits / 8] (uint8 for 4-bit, int8 for 8-bit), scale and
    minimum [N, K / group] float32 (minimum for 4-bit only)."""

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"q": self.q, "scale": self.scale}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], group: int) -> "Grouped":
        bits = 4 if "minimum" in tensors else 8
        return cls(tensors["q"], tensors["scale"], tensors.get("minimum"), bits, group)


def _blocks(data: np.ndarray, qtype: str) -> tuple[np.ndarray, int, int]:
    """A GGUF tensor's rows as blocks: ([N * blocks per row, block bytes], N, block values)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rows = data.reshape(data.shape[0], -1).view(np.uint8)
    return rows.reshape(-1, type_size), rows.shape[0], size


def pack(data: np.ndarray, qtype: str) -> Grouped:
    """A GGUF tensor's raw blocks ([N, bytes per row], as gguf's reader gives them) in grouped form."""
    from gguf import GGMLQuantizationType
    from gguf.quants import Q4_K, dequantize

    if qtype not in SHIPPED_TYPES:
        raise ValueError(f"{qtype} has no grouped form (shipped forms: {', '.join(SHIPPED_TYPES)})")
    blocks, n, _ = _blocks(data, qtype)
    if qtype == "Q4_K":
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scale = d * sc.astype(np.float32)
        minimum = dmin * m.astype(np.float32)
        q = np.ascontiguousarray(blocks[:, 16:]).reshape(n, -1)
        return Grouped(torch.from_numpy(q), torch.from_numpy(scale.reshape(n, -1)),
                       torch.from_numpy(minimum.reshape(n, -1)), 4, 32)
    group = EIGHT_BIT[qtype]
    ones = blocks.copy()  # the values alone: the library's own dequantization with every scale set to one
    if qtype == "Q6_K":
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        scale = d * blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        ones[:, 192:208] = 1
        ones[:, 208:210] = ONE
    else:
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        ones[:, 0:2] = ONE
    values = dequantize(ones, GGMLQuantizationType[qtype]).astype(np.int8)
    return Grouped(torch.from_numpy(values.reshape(n, -1)), torch.from_numpy(scale.reshape(n, -1)), None, 8,
                   group)


def values(grouped: Grouped) -> torch.Tensor:
    """v[n, k] as float32 ([N, K])."""
    if grouped.bits == 8:
        return grouped.q.float()
    n, k = grouped.shape
    pairs = grouped.q.reshape(n, k // 64, 1, 32)
    nibbles = torch.cat([pairs & 15, pairs >> 4], dim=2)  # group 2p, then 2p + 1
    return nibbles.reshape(n, k).float()


def dequantize(grouped: Grouped) -> torch.Tensor:
    """The float32 weight, [N, K]: scale * v - minimum, as GGUF's dequantization computes it."""
    n, k = grouped.shape
    v = values(grouped).reshape(n, k // grouped.group, grouped.group)
    w = grouped.scale.unsqueeze(-1) * v
    if grouped.minimum is not None:
        w = w - grouped.minimum.unsqueeze(-1)
    return w.reshape(n, k)


@functools.cache
def grouped_kernel() -> bool:
    """Whether `torch.ops.specdec_grouped.grouped_linear` is usable here (built and loaded on the first call)."""
    from .linear import build_kernel

    if not (hasattr(torch.ops.specdec_grouped, "grouped_linear") or build_kernel(SOURCE)):
        return False
    torch.library.register_fake("specdec_grouped::grouped_linear", _shape)
    return True


def _shape(x, q, scale, minimum, bits, group):
    return x.new_empty(x.shape[0], q.shape[0] * TILE)


TILE = 16  # weight rows the kernel interleaves (csrc/grouped_linear.cpp)


def tiled(grouped: Grouped) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel's layout of a grouped weight: rows padded to a multiple of 16 (zero weights), every 16 rows
    interleaved 4 bytes at a time (q [N / 16, 16 * bytes per row]; 8-bit values stored as v + 128, unsigned), and
    scales and minimums 16 rows side by side ([N / 16, groups * 16])."""
    n, _ = grouped.shape
    pad = -n % TILE
    q = grouped.q if grouped.bits == 4 else (grouped.q.to(torch.int16) + 128).to(torch.uint8)
    q = torch.nn.functional.pad(q.contiguous(), (0, 0, 0, pad))
    tiles = q.shape[0] // TILE
    words = q.view(torch.int32).reshape(tiles, TILE, -1).transpose(1, 2).contiguous()
    q = words.view(torch.uint8).reshape(tiles, -1)

    def side_by_side(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = torch.nn.functional.pad(t.float().contiguous(), (0, 0, 0, pad))
        return t.reshape(tiles, TILE, -1).transpose(1, 2).contiguous().reshape(tiles, -1)

    return q, side_by_side(grouped.scale), side_by_side(grouped.minimum)


class GroupedLinear(nn.Module):
    """A drop-in nn.Linear over a grouped weight: float32 activations in and out, the weight never in float (held
    tiled, as the kernel reads it)."""

    def __init__(self, grouped: Grouped, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = grouped.shape
        self.bits, self.group = grouped.bits, grouped.group
        q, scale, minimum = tiled(grouped)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.ops.specdec_grouped.grouped_linear(rows, self.q, self.scale, self.minimum, self.bits,
                                                       self.group)
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit groups of " \
               f"{self.group}"


class GroupedEmbedding(nn.Module):
    """A drop-in nn.Embedding over a grouped weight (GGUF's token_embd): each looked-up row dequantized, bitwise as
    `dequantize` gives it, so the float table is never held."""

    def __init__(self, grouped: Grouped):
        super().__init__()
        self.num_embeddings, self.embedding_dim = grouped.shape
        self.bits, self.group = grouped.bits, grouped.group
        self.register_buffer("q", grouped.q)
        self.register_buffer("scale", grouped.scale)
        self.register_buffer("minimum", grouped.minimum)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = Grouped(self.q[flat], self.scale[flat], None if self.minimum is None else self.minimum[flat],
                       self.bits, self.group)
        return dequantize(rows).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.bits}-bit groups of {self.group}"
