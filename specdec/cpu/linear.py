"""CPU linear layers for cheap multi-token verification, and an int8 draft.

On our CPUs `torch.nn.functional.linear` over 2-16 rows costs 2-3x one row, because its GEMM path repacks the
whole weight on every call; verifying gamma draft tokens in one target forward then saves nothing. Two fixes,
the first one that this machine can run is used (`pack_linears`):

- `FewRowsLinear`: our kernel (csrc/few_rows_linear.cpp, compiled once per machine with torch's JIT extension
  builder) reads each weight row from memory once for up to 16 input rows, straight from nn.Linear's own weight
  (shared, not copied). One row costs what MKL's matrix-vector product does, 5 rows little more, 12 rows about
  1.6x; each output is summed in
  the same order whatever the number of rows, so a verification forward's linear layers give bitwise the
  values of decoding its tokens one by one. Needs a C++ compiler and ninja.
- `PackedLinear`: a weight packed once at load time (`mkldnn._reorder_linear_weight`, what inductor does for
  dynamic batch sizes), where no compiler is at hand. A few rows cost about one row, but one row costs more than
  MKL's matrix-vector product (10-50% in our micro-benchmark).

Float32 and bfloat16 on CPU: CUDA and float16 models are untouched. A bfloat16 layer reads half the bytes of a
float32 one; its products are summed in float32 (AVX-512 BF16's pairwise dot product where the CPU has it) and the
result rounded to bfloat16 once, as torch's own bfloat16 linear does, so it matches that within bfloat16's rounding.
oneDNN's bfloat16 GEMM (AMX on recent Xeons) is fast, but its sums change with the number of rows (the MLP's down
projection from 6 rows on, on our CPUs), so without the kernel a bfloat16 target's verification would not give
bitwise its one-by-one values, and greedy speculative output could part from greedy target-only output on a near tie.

A float32 draft on CPU reads all its weights for every proposed token, so its cost is memory bandwidth. Int8
dynamic quantization (`quantize_linears`: per-channel int8 weights, activations quantized per call) makes it
2.5-3x cheaper. Exactness does not depend on the draft: the rejection rule uses the quantized draft's own
probabilities, so the output is still distributed exactly as the target's. The target is never quantized.
"""

import functools
import hashlib
import logging
import platform
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..threads import thread_map, unpatched

logger = logging.getLogger(__name__)

PACK_BATCH_HINT = 5  # typical verification width: gamma + 1
PACK_THREADS = 2  # int8 layers packed side by side when a draft is built from its kept form
FEW_ROWS_SOURCE = Path(__file__).resolve().parent / "csrc" / "few_rows_linear.cpp"
FEW_ROWS_MAX = 16  # beyond 16 rows (prefill) the library's GEMM wins
FEW_ROWS_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel computes


def packing_supported() -> bool:
    """Whether this torch build has the oneDNN ops we rely on."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _cpu_signature() -> str:
    """What a -march=native build depends on: the CPU model and its instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "".join(lines) + platform.machine()


@functools.cache
def few_rows_kernel() -> bool:
    """Whether `torch.ops.specdec.few_rows_linear` is usable here: built and loaded on the first call, with its
    shape function, so that torch.compile can trace a model that calls it (specdec.compiled)."""
    if not (hasattr(torch.ops.specdec, "few_rows_linear") or build_kernel(FEW_ROWS_SOURCE)):
        return False
    torch.library.register_fake("specdec::few_rows_linear", _few_rows_shape)
    return True


def _few_rows_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def build_kernel(source: Path) -> bool:
    """Compile and load a C++ operator library with torch's JIT extension builder (cached by torch under
    ~/.cache/torch_extensions, one build per source file, its path and CPU). False, with one warning, if it cannot be built
    (no compiler or ninja): callers then fall back to oneDNN packing."""
    from torch.utils.cpp_extension import load

    # the build folder is named by what the build depends on, the source's path included: torch's builder
    # rebuilds whenever its build file changes, so two checkouts sharing one name would rebuild at each other's start
    digest = hashlib.sha256(source.read_bytes() + _cpu_signature().encode() + str(source).encode()).hexdigest()[:12]
    started = time.perf_counter()
    try:
        # torch's builder runs ninja and the compiler as subprocesses: gevent's (the service's worker) work only
        # on the main thread's event loop, and this may run on another thread (the engine's, loading the pair)
        with unpatched("os", "subprocess", "signal"):
            load(f"specdec_{source.stem}_{digest}", sources=[str(source)], is_python_module=False,
                 extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # any build or load failure means: use the fallback
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        logger.warning("the CPU kernel %s could not be built (%s); using oneDNN-packed weights", source.name, reason)
        return False
    seconds = time.perf_counter() - started
    # a build takes a while and says so; loading the one built before is part of the start-up's kernel step
    logger.log(logging.INFO if seconds > 1 else logging.DEBUG, "CPU kernel %s ready in %.1f s", source.name, seconds)
    return True


class FewRowsLinear(nn.Module):
    """A drop-in nn.Linear replacement sharing the layer's weight and bias, computed by the few-rows kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: tied weights stay tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > FEW_ROWS_MAX or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.specdec.few_rows_linear(rows.contiguous(), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def to_linear(self) -> nn.Linear:
        """The stock nn.Linear, with the same weight and bias."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear.eval()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=few-rows"


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


def pack_linears(model: nn.Module, few_rows: bool = True) -> int:
    """Replace every float32 or bfloat16 CPU nn.Linear of `model` by a FewRowsLinear (`few_rows` and the kernel
    builds here) or else, float32 only, a PackedLinear, in place. Returns how many were replaced.

    Models on CUDA, in float16, or with neither kernel available are returned unchanged (0); so is a bfloat16
    model without the kernel (oneDNN's bfloat16 GEMM is fast already, but its sums depend on the number of rows).
    """
    cpu = [(parent, name, linear) for parent, name, linear in _linears(model, nn.Linear)
           if linear.weight.device.type == "cpu"]
    if few_rows and any(linear.weight.dtype in FEW_ROWS_DTYPES for _, _, linear in cpu) and few_rows_kernel():
        count = 0
        for parent, name, linear in cpu:
            weight, bias = linear.weight, linear.bias
            if weight.dtype in FEW_ROWS_DTYPES and weight.is_contiguous() \
                    and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())):
                setattr(parent, name, FewRowsLinear(linear))
                count += 1
        logger.debug("%d linear layers of %s use the few-rows kernel", count, type(model).__name__)
        return count
    candidates = [(parent, name, linear) for parent, name, linear in cpu if linear.weight.dtype == torch.float32]
    del cpu
    if not candidates or not packing_supported():
        return 0
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    del param  # the loop left the last parameter (the output layer's weight) bound here
    places = [(parent, name) for parent, name, _ in candidates]
    del candidates  # layer by layer: each float weight goes as soon as its packed copy is made, not at the end
    for parent, name in places:
        linear = getattr(parent, name)
        setattr(parent, name, PackedLinear(linear, tied=uses[id(linear.weight)] > 1))
    del linear
    logger.debug("packed %d linear layers of %s for multi-token CPU forwards", len(places), type(model).__name__)
    return len(places)


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears`: stock nn.Linear layers again (what `from_pretrained` gives, tied weights tied again).
    Returns how many."""
    count = 0
    for kind in (FewRowsLinear, PackedLinear):
        for parent, name, layer in list(_linears(model, kind)):
            setattr(parent, name, layer.to_linear())
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
    logger.debug("quantized %d linear layers of %s to int8 (dynamic)", len(layers), type(model).__name__)
    return len(layers)


# An int8 layer as plain tensors (a ready form in the cache): its int8 weight, per-output-channel scales and zero
# points, and its float bias if any
INT8_PARTS = ("int8_weight", "int8_scales", "int8_zero_points", "int8_bias")


def _named_linears(model: nn.Module, kind):
    """(parent, attribute, qualified name, layer) of every `kind` layer, as a list (safe to replace them)."""
    return [(parent, name, f"{prefix}.{name}".lstrip("."), child) for prefix, parent in model.named_modules()
            for name, child in parent.named_children() if type(child) is kind]


def _float_state(model: nn.Module, skipped: set[int]):
    """(name, tensor) of the parameters and persistent buffers outside the modules in `skipped`, each tensor once."""
    seen = set()
    for prefix, module in model.named_modules():
        if id(module) in skipped:
            continue
        tensors = list(module.named_parameters(recurse=False))
        tensors += [(n, b) for n, b in module.named_buffers(recurse=False)
                    if b is not None and n not in module._non_persistent_buffers_set]
        for name, tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield f"{prefix}.{name}".lstrip("."), tensor


def int8_layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What `quantized_tensors` gives for `model` once `quantize_linears` has made all its linears int8, as name:
    (shape, dtype): each int8 layer's parts, then every other parameter and persistent buffer. `model` may be the
    float model or a skeleton of it on the meta device."""
    layout, layers = {}, set()
    for _, _, prefix, linear in _named_linears(model, nn.Linear):
        layout[f"{prefix}.int8_weight"] = ((linear.out_features, linear.in_features), torch.int8)
        layout[f"{prefix}.int8_scales"] = ((linear.out_features,), torch.float64)
        layout[f"{prefix}.int8_zero_points"] = ((linear.out_features,), torch.int64)
        if linear.bias is not None:
            layout[f"{prefix}.int8_bias"] = ((linear.out_features,), linear.bias.dtype)
        layers.add(id(linear))
    for name, tensor in _float_state(model, layers):
        layout[name] = (tuple(tensor.shape), tensor.dtype)
    return layout


def quantized_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model that `quantize_linears` made int8, as plain tensors (see `int8_layout`): what `load_quantized`
    builds the same model from, bitwise."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    tensors, layers = {}, set()
    for _, _, prefix, layer in _named_linears(model, DynamicQuantizedLinear):
        weight, bias = layer._packed_params._weight_bias()
        if weight.qscheme() != torch.per_channel_affine or weight.q_per_channel_axis() != 0:
            raise ValueError(f"{prefix}: only per-output-channel int8 weights can be kept, not {weight.qscheme()}")
        tensors[f"{prefix}.int8_weight"] = weight.int_repr()
        tensors[f"{prefix}.int8_scales"] = weight.q_per_channel_scales()
        tensors[f"{prefix}.int8_zero_points"] = weight.q_per_channel_zero_points()
        if bias is not None:
            tensors[f"{prefix}.int8_bias"] = bias.detach()
        layers.add(id(layer))
    for name, tensor in _float_state(model, layers):
        tensors[name] = tensor.detach()
    return tensors


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """torch's int8 linear layer over a quantized (out, in) weight, packed once: the constructor is given a 1x1
    placeholder, since it packs a zero weight of its full size, which takes as long as packing the real one
    (seconds for a vocabulary-sized output layer), only to throw it away."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    layer = DynamicQuantizedLinear(1, 1, bias_=bias is not None, dtype=torch.qint8)
    layer.out_features, layer.in_features = weight.shape
    layer.set_weight_bias(weight, bias)
    return layer


def load_quantized(model: nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """The inverse of `quantized_tensors`, in place: every other tensor loaded into `model`, then each nn.Linear
    replaced by the int8 layer built from its parts. `model` is normally a skeleton whose parameters are on the
    meta device, so no float weight of a quantized layer is ever allocated. Tensors are taken out of `tensors` as
    they are used. Returns how many layers were built; ValueError if `tensors` does not fit `model`."""
    parts = {name: tensors.pop(name) for name in [n for n in tensors if n.rsplit(".", 1)[-1] in INT8_PARTS]}
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tensors.clear()
    if result.unexpected_keys:
        raise ValueError(f"tensors this model does not have: {result.unexpected_keys[:3]}")
    jobs = []
    for parent, name, prefix, linear in _named_linears(model, nn.Linear):
        try:
            weight = (parts.pop(f"{prefix}.int8_weight"), parts.pop(f"{prefix}.int8_scales"),
                      parts.pop(f"{prefix}.int8_zero_points"))
        except KeyError:
            raise ValueError(f"no int8 form of the layer {prefix}") from None
        jobs.append({"parent": parent, "name": name, "in": linear.in_features, "out": linear.out_features,
                     "weight": weight, "bias": parts.pop(f"{prefix}.int8_bias", None)})
    if parts:
        raise ValueError(f"int8 layers this model does not have: {sorted(parts)[:3]}")

    def build(job: dict) -> None:
        weight = torch._make_per_channel_quantized_tensor(*job.pop("weight"), 0)
        job["layer"] = int8_linear(weight, job.pop("bias"))  # the int8 values are freed as soon as they are packed

    jobs.sort(key=lambda job: -job["in"] * job["out"])  # the largest first, so the others fill in beside it
    with warnings.catch_warnings():  # torch.ao's eager quantization warns that torchao will replace it
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        thread_map(build, jobs, PACK_THREADS)  # packing frees the GIL
    for job in jobs:
        setattr(job["parent"], job["name"], job.pop("layer"))
    on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if on_meta:
        raise ValueError(f"tensors missing for this model: {on_meta[:3]}")
    logger.debug("built %d int8 linear layers of %s from their kept form", len(jobs), type(model).__name__)
    return len(jobs)
