"""Weights as GGUF ships them: grouped low-bit forms, unpacked inside a few-rows CPU kernel, never into float.

    w[n, k] = scale[n, k // G] * v[n, k] - minimum[n, k // G]

Q4_K keeps its 4-bit quants byte for byte (two groups of 32 per 32 bytes: low nibbles, then high ones), with
scale = d * sc and minimum = dmin * m; Q6_K (groups of 16), Q5_0 and Q8_0 (groups of 32) become int8 values
(q - 32, q - 16, q) with scale = d * scale or d, and no minimum, which the kernel holds in 6, 5 and 8 bits
(`tiled`: the fewest that hold them, so it reads about the bytes the GGUF file has). Each scale and minimum is the
float32 product the GGUF's own dequantization takes, so `dequantize(pack(t))` is bitwise
`gguf.quants.dequantize(t)`.

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
TILE = 16  # weight rows the kernel interleaves (csrc/grouped_linear.cpp)


@dataclass
class Grouped:
    """One weight matrix in grouped form: q [N, K * bits / 8] (uint8 for 4-bit, int8 for 8-bit), scale and
    minimum [N, K / group] float32 (minimum for 4-bit only). Where the GGUF type builds each scale as a float unit
    per 256 values times a small integer (Q4_K, Q6_K), scale_unit and minimum_unit [N, K / 256] hold the units:
    the kernel then reads the integers and the units, a quarter of the bytes (`tiled`)."""

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bits: int
    group: int
    scale_unit: torch.Tensor | None = None
    minimum_unit: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.bits

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"q": self.q, "scale": self.scale, "minimum": self.minimum, "scale_unit": self.scale_unit,
               "minimum_unit": self.minimum_unit}
        return {name: tensor for name, tensor in out.items() if tensor is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], group: int) -> "Grouped":
        bits = 4 if "minimum" in tensors else 8
        return cls(tensors["q"], tensors["scale"], tensors.get("minimum"), bits, group, tensors.get("scale_unit"),
                   tensors.get("minimum_unit"))


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
                       torch.from_numpy(minimum.reshape(n, -1)), 4, 32, torch.from_numpy(d.reshape(n, -1)),
                       torch.from_numpy(dmin.reshape(n, -1)))
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
    unit = torch.from_numpy(d.reshape(n, -1)) if qtype == "Q6_K" else None
    return Grouped(torch.from_numpy(values.reshape(n, -1)), torch.from_numpy(scale.reshape(n, -1)), None, 8,
                   group, unit)


QUANTIZE_GROUP = 32  # values per group along K, as GGUF's Q4_K and Q8_0 groups


def quantizable(k: int, bits: int) -> bool:
    """Whether `quantize` makes `bits`-bit groups of a weight K wide: 4-bit groups go in pairs (64 values)."""
    return bits in (4, 8) and k % (64 if bits == 4 else QUANTIZE_GROUP) == 0


def quantize(weight: torch.Tensor, bits: int) -> Grouped:
    """A float weight [N, K] quantized per group of 32 along K: this changes the model (for models not shipped in
    low-bit form, `quantize` in the configuration; a 4-bit draft, `draft_quantization`).

    4 bits: a scale and a minimum per group, w ~ scale * v - minimum with v in 0..15 (the form of Q4_1's groups, in
    the nibble order of Q4_K's; K a multiple of 64). It starts from the group's range, then refits the two by least
    squares on the levels chosen and rounds to the nearest level again, four times (as llama.cpp's k-quants
    search): each round can only lower the group's squared error, so it ends no worse than the range's levels
    (but for rounding the two to float16).
    8 bits: symmetric, w ~ scale * v with v in -127..127 (Q8_0's; K a multiple of 32), to the nearest level, every
    value within half a step. Scales and minimums are float16 values, read in two bytes by the kernel: 5 or 8.5
    bits a weight."""
    w = weight.detach().float()
    n, k = w.shape
    if not quantizable(k, bits):
        raise ValueError(f"no {bits}-bit groups for K = {k}")
    groups = w.reshape(n, k // QUANTIZE_GROUP, QUANTIZE_GROUP)

    def step(scale: torch.Tensor) -> torch.Tensor:  # a flat group's scale is 0: its every v is then 0
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    if bits == 4:
        low = groups.amin(-1, keepdim=True)
        scale, offset = (groups.amax(-1, keepdim=True) - low) / 15, low  # w ~ scale * v + offset
        for _ in range(4):
            v = ((groups - offset) / step(scale)).round().clamp(0, 15)
            v_mean, w_mean = v.mean(-1, keepdim=True), groups.mean(-1, keepdim=True)
            spread = (v - v_mean).square().mean(-1, keepdim=True)
            fits = spread > 0  # else one level: keep the range's (a flat group is exact)
            fitted = ((v - v_mean) * (groups - w_mean)).mean(-1, keepdim=True) / torch.where(fits, spread, 1)
            scale = torch.where(fits & (fitted > 0), fitted, scale)
            offset = torch.where(fits & (fitted > 0), w_mean - scale * v_mean, offset)
        scale, minimum = _half(scale.squeeze(-1)), _half(-offset.squeeze(-1))
        v = ((groups + minimum.unsqueeze(-1)) / step(scale).unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        pairs = v.reshape(n, k // 64, 2, 32)  # GGUF's nibble order: group 2p low, group 2p + 1 high
        q = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2)
        return Grouped(q.contiguous(), scale.contiguous(), minimum.contiguous(), 4, QUANTIZE_GROUP)
    scale = _half(groups.abs().amax(-1) / 127, up=True)  # up: the levels still reach the largest value
    v = (groups / step(scale).unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return Grouped(v.reshape(n, k).contiguous(), scale.contiguous(), None, 8, QUANTIZE_GROUP)


def _half(x: torch.Tensor, up: bool = False) -> torch.Tensor:
    """Each value as the nearest float16 (`up`: the nearest not below it), as float32, so that the kernel keeps it
    in two bytes (`compact`); a value beyond float16's range stays as it is (its weight's scales then stay
    float32)."""
    half = x.half()
    if up:
        half = torch.where(half.float() < x, torch.nextafter(half, torch.full_like(half, torch.inf)), half)
    return torch.where(half.isfinite(), half.float(), x)


def quantize_model(model: nn.Module, bits: int) -> int:
    """Swap `model`'s nn.Linear layers for GroupedLinear ones quantized to `bits` (`quantize`), in place, where K
    allows the groups; the others stay as they are. Returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and quantizable(child.in_features, bits):
                setattr(parent, name, GroupedLinear(quantize(child.weight, bits), child.bias))
                swapped += 1
    return swapped


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


@functools.cache
def fast_kernel() -> bool:
    """Whether the grouped kernel is built here with vector instructions (AVX-512 VNNI, or AVX2): without them it
    computes the same sums lane by lane, exactly but tens of times slower, so float weights serve better."""
    return grouped_kernel() and kernel_isa() != "scalar"


def kernel_isa() -> str:
    """The instructions the grouped kernel was built with here: "avx512_vnni", "avx2" or "scalar" (one result
    whichever: the same bits)."""
    return str(torch.ops.specdec_grouped.isa())


def _shape(x, q, scale, scale_unit, minimum, minimum_unit, bits, group):
    return x.new_empty(x.shape[0], q.shape[0] * TILE)



def compact(scale: torch.Tensor, unit: torch.Tensor | None, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A group's scales (or minimums) in the fewest bytes that give them back bitwise in the kernel: integers times
    a float32 unit per 256 values (uint8 or int8, with the unit), else float16, else float32 as they are."""
    groups = scale.shape[1]
    if unit is not None and unit.shape[1] * (256 // group) == groups:
        units = unit.float().repeat_interleave(256 // group, dim=1)
        multiple = torch.where(units != 0, scale / units, torch.zeros_like(scale)).round()
        for dtype in (torch.uint8, torch.int8):
            info = torch.iinfo(dtype)
            if multiple.min() >= info.min and multiple.max() <= info.max and torch.equal(
                    (units * multiple).view(torch.int32), scale.contiguous().view(torch.int32)):
                return multiple.to(dtype), unit.float()
    half = scale.half()
    if torch.equal(half.float().view(torch.int32), scale.view(torch.int32)):
        return half, None
    return scale.float(), None


@dataclass
class Tiled:
    """A grouped weight as the kernel reads it (`tiled`): q [N' / 16, 16 * bytes per row] with N' the rows padded
    to a multiple of 16, every 16 rows interleaved 4 bytes at a time (values in `bits`: 4-bit nibbles as GGUF has
    them, 8-bit as v + 128, 5- and 6-bit as v + 2^(bits - 1) in a plane of nibbles and one of top bits); scales,
    minimums and their units (`compact`) 16 rows side by side ([N' / 16, groups * 16])."""

    q: torch.Tensor
    scale: torch.Tensor
    scale_unit: torch.Tensor | None
    minimum: torch.Tensor | None
    minimum_unit: torch.Tensor | None
    bits: int
    group: int
    shape: tuple[int, int]  # the weight's (N, K)

    BUFFERS = ("q", "scale", "scale_unit", "minimum", "minimum_unit")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything, the sizes included, as tensors (to keep in a safetensors file)."""
        out = {name: getattr(self, name) for name in self.BUFFERS if getattr(self, name) is not None}
        return {**out, "layout": torch.tensor([self.bits, self.group, *self.shape])}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "Tiled":
        bits, group, n, k = (int(v) for v in tensors["layout"])
        return cls(*(tensors.get(name) for name in cls.BUFFERS), bits, group, (n, k))


def storage_bits(grouped: Grouped) -> int:
    """The fewest bits the kernel holds a grouped weight's values in: 4 (Q4_K's nibbles); for int8 values, 5 where
    they lie in -16..15 (Q5_0's), 6 in -32..31 (Q6_K's), else 8 (Q8_0's)."""
    if grouped.bits == 4:
        return 4
    if grouped.shape[1] % 64:
        return 8  # the 5- and 6-bit planes cover 64 values of K at a time
    low, high = int(grouped.q.min()), int(grouped.q.max())
    return next(bits for bits in (5, 6, 8) if -(1 << (bits - 1)) <= low and high < 1 << (bits - 1))


def bit_planes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned 5- or 6-bit bytes in the kernel's tiled order, [tiles, K / 4 chunks, 64], as two planes per 64
    values of K (csrc/grouped_linear.cpp): chunks 2i and 2i + 1's low nibbles in one byte, then each chunk's top
    bits, 8 / (bits - 4) chunks to a byte."""
    tiles = u.shape[0]
    supers = u.reshape(tiles, -1, 16, 64)
    low = (supers[:, :, 0::2] & 15) | ((supers[:, :, 1::2] & 15) << 4)
    per = 8 // (bits - 4)
    top = (supers >> 4).reshape(tiles, supers.shape[1], 16 // per, per, 64)
    high = sum(top[:, :, :, e] << ((bits - 4) * e) for e in range(per))
    return torch.cat((low, high.to(torch.uint8)), dim=2).reshape(tiles, -1)


def tiled(grouped: Grouped, bits: int | None = None) -> Tiled:
    """The kernel's layout of a grouped weight (`Tiled`): rows padded with zero weights, values in `bits` (default:
    the fewest that hold them, `storage_bits`). Every form of the same values gives the same integer sums, so the
    same output bits."""
    n, _ = grouped.shape
    fewest = storage_bits(grouped)
    bits = fewest if bits is None else bits
    if bits not in ((4,) if grouped.bits == 4 else (5, 6, 8)) or bits < fewest:
        raise ValueError(f"{bits} bits cannot hold this weight's values ({grouped.bits}-bit grouped)")
    pad = -n % TILE
    # unsigned: the nibbles as they are, else v + 2^(bits - 1) (modulo 256 for 8 bits)
    q = grouped.q if grouped.bits == 4 else (grouped.q.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)
    if pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    tiles = q.shape[0] // TILE
    words = q.contiguous().view(torch.int32).reshape(tiles, TILE, -1).transpose(1, 2).contiguous()
    q = words.view(torch.uint8).reshape(tiles, -1)
    if bits in (5, 6):
        q = bit_planes(q, bits)

    def side_by_side(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if pad:
            t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape(tiles, TILE, -1).transpose(1, 2).contiguous().reshape(tiles, -1)

    scale, scale_unit = compact(grouped.scale, grouped.scale_unit, grouped.group)
    minimum, minimum_unit = (None, None) if grouped.minimum is None else compact(grouped.minimum,
                                                                                 grouped.minimum_unit, grouped.group)
    return Tiled(q, side_by_side(scale), side_by_side(scale_unit), side_by_side(minimum), side_by_side(minimum_unit),
                 bits, grouped.group, grouped.shape)


def grouped_rows(layer, rows: torch.Tensor) -> torch.Tensor:
    """The operator over (n, K) contiguous float32 rows: (n, out_features), padding rows cut, bias added. `layer`:
    a GroupedLinear, or anything holding the same buffers, bits, group, out_features and bias (the fused forward's
    joined projections)."""
    out = torch.ops.specdec_grouped.grouped_linear(rows, layer.q, layer.scale, layer.scale_unit, layer.minimum,
                                                   layer.minimum_unit, layer.bits, layer.group)
    if out.shape[1] != layer.out_features:
        out = out[:, :layer.out_features]
    if layer.bias is not None:
        out = out + layer.bias
    return out


class GroupedLinear(nn.Module):
    """A drop-in nn.Linear over a grouped weight: float32 activations in and out, the weight never in float (held
    tiled, as the kernel reads it)."""

    def __init__(self, weight: Grouped | Tiled, bias: torch.Tensor | None = None):
        super().__init__()
        layout = weight if isinstance(weight, Tiled) else tiled(weight)
        self.out_features, self.in_features = layout.shape
        self.bits, self.group = layout.bits, layout.group
        for name in Tiled.BUFFERS:
            self.register_buffer(name, getattr(layout, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = grouped_rows(self, x.reshape(-1, self.in_features).float().contiguous())
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
