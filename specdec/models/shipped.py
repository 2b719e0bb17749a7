"""Weights as shipped: a model that comes from a GGUF file serves its linear layers in the GGUF's own low-bit
forms (specdec.cpu.grouped), not dequantized to float: about a fifth of the bytes per token.

    weights = resolve_weights("shipped")       # "shipped" | "float"
    count = use_shipped_weights(model, source) # in place; 0 where the model has no GGUF origin or runs elsewhere

The default pair's packed layers are kept in the cache as a ready form (keyed, hashed, checked, rebuilt when
stale), like the int8 draft; a GGUF file given by path is packed from the file at each start. Layers whose GGUF
type has no grouped form (float ones: norms, biases) stay as loaded; so does the token embedding (a lookup reads
one row per token, not the matrix).
"""

import contextlib
import hashlib
import inspect
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..errors import SpecDecError
from .cache import cache_root, in_cache, shipped_form_path
from .checkpoint import fingerprint
from .sources import ModelSource
from .weights import ReadyForm

logger = logging.getLogger(__name__)

WEIGHTS_CHOICES = ("shipped", "float")
READY_FORMAT = 1


def resolve_weights(value) -> str:
    """"shipped" or "float" (None is "float", the default: faster on our CPUs today, docs/cpu-kernels.md)."""
    name = "float" if value is None else str(value).strip().lower()
    if name not in WEIGHTS_CHOICES:
        raise SpecDecError(f"weights must be shipped or float, got {value!r}", field="weights")
    return name


QUANTIZATIONS = ("none", "int4", "int8")


def resolve_quantize(value) -> str:
    """"none" (None too), "int4" or "int8": whether float models are quantized for the grouped kernel."""
    name = "none" if value is None else str(value).strip().lower()
    if name not in QUANTIZATIONS:
        raise SpecDecError(f"quantize must be none, int4 or int8, got {value!r}", field="quantize")
    return name


def quantize_applies(quantize: str, device: torch.device, device_map) -> bool:
    """Whether `quantize` takes effect: models on one device, and either int4 or int8 on CPU with the grouped
    kernel built with AVX-512 VNNI or AVX2, or int4 on CUDA (torch's int4pack kernel, specdec.cuda.int4pack);
    otherwise the models stay as they are, with a warning where one was asked for."""
    if quantize == "none":
        return False
    if device_map is not None or device.type not in ("cpu", "cuda"):
        logger.warning("quantize = %s applies to models on one CPU or GPU; loading the models as they are", quantize)
        return False
    if device.type == "cuda":
        if quantize != "int4":
            logger.warning("quantize = %s applies to CPU models; on CUDA only int4 (loading the models as they "
                           "are)", quantize)
        return quantize == "int4"
    return _vector_kernel(f"quantize = {quantize}", "loading the models as they are")


def int4_draft_applies(device: torch.device) -> bool:
    """Whether `draft_quantization` = "int4" can quantize a float draft for the grouped kernel: a CPU draft, and the
    kernel built with AVX-512 VNNI or AVX2 (else a warning: torch's int8 draft instead)."""
    return device.type == "cpu" and _vector_kernel("draft_quantization = int4", "the draft runs int8 instead")


def _vector_kernel(setting: str, instead: str) -> bool:
    """Whether the grouped kernel is built here with AVX-512 VNNI or AVX2; if not, a warning that `setting` gives
    way to `instead`."""
    from ..cpu.grouped import fast_kernel

    if fast_kernel():
        return True
    logger.warning("%s: this CPU has neither AVX-512 VNNI nor AVX2 for the grouped kernel; %s", setting, instead)
    return False


def shipped_applies(weights: str, device: torch.device, device_map, sources) -> bool:
    """Whether `weights` = "shipped" takes effect: CPU models on one device, one of `sources` from a GGUF file, and
    the kernel built with AVX-512 VNNI or AVX2. Without either it computes lane by lane (exact, tens of times
    slower): float weights are used then, with a warning."""
    if weights != "shipped" or device.type != "cpu" or device_map is not None:
        return False
    if all(gguf_origin(source) is None for source in sources):
        return False  # nothing shipped in low-bit form: the models load as they are
    return _vector_kernel("weights = shipped", "serving float weights")


def gguf_origin(source: ModelSource):
    """What a model's GGUF is: a path (a GGUF file given by path), the default pair's GGUFSource (a folder the
    cache converted from one), or None (a float checkpoint)."""
    if source.gguf_file:
        return Path(source.path) / source.gguf_file
    if not source.local or not in_cache(source.path):
        return None
    from .default_pair import DRAFT, TARGET, model_dir

    folder = Path(source.path).resolve()
    return next((s for s in (TARGET, DRAFT) if model_dir(s).resolve() == folder), None)


def gguf_names(model: nn.Module) -> dict[str, str]:
    """Each linear layer's and the input embedding's module name, and its GGUF tensor's name, by gguf's own name
    map."""
    import gguf

    config = model.config.get_text_config(decoder=True)
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == config.model_type), None)
    if arch is None:
        return {}
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or hasattr(module, "in_features") and hasattr(
                module, "out_features"):
            mapped = names.get_name(module_name)
            if mapped is not None:
                out[module_name] = mapped + ".weight"
    return out


def pack_from_gguf(path: Path, names: dict[str, str], embeddings: frozenset[str] = frozenset(),
                   requantize: int | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """module name: the tensors of its GGUF weight, for every module whose type has a grouped form: in the kernel's
    layout (`tiled`) for a linear layer, grouped for an embedding (`embeddings`: their module names).

    `requantize` = 4: every linear layer of a wider type (Q5_0, Q6_K, Q8_0) is quantized again to 4-bit groups
    (`grouped.quantize`) from the GGUF's own dequantized values, where its width allows: a 4-bit draft
    (`draft_quantization`), which changes the draft, never the output's distribution. Q4_K layers stay as shipped."""
    import gguf
    from gguf.quants import dequantize

    from ..cpu.grouped import FOUR_BIT, SHIPPED_TYPES, pack, quantizable, quantize, tiled

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    packed = {}
    for module_name, tensor_name in names.items():
        tensor = tensors.get(tensor_name)
        if tensor is not None and tensor.tensor_type.name in SHIPPED_TYPES:
            qtype = tensor.tensor_type.name
            k = int(tensor.shape[0])  # GGUF's shapes run innermost first
            if requantize == 4 and module_name not in embeddings and qtype not in FOUR_BIT and quantizable(k, 4):
                weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(-1, k))
                packed[module_name] = tiled(quantize(weight, 4)).tensors()
                continue
            grouped = pack(tensor.data, qtype)
            packed[module_name] = ({**grouped.tensors(), "group": torch.tensor(grouped.group)}
                                   if module_name in embeddings else tiled(grouped).tensors())
    return packed


def four_bit_layers(model: nn.Module, source: ModelSource) -> dict:
    """The `model`'s linear layers that its GGUF ships as Q4_K, in grouped form (module name: `Grouped`) for the CUDA
    int4 kernel; {} for a model with no GGUF origin. Read from the file at each start (not kept in the cache)."""
    import gguf

    from ..cpu.grouped import FOUR_BIT, pack

    origin = gguf_origin(source)
    names = {module: tensor for module, tensor in gguf_names(model).items() if module not in _embeddings(model)}
    if origin is None or not names:
        return {}

    with gguf_file(origin) as path:
        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        return {module: pack(tensors[name].data, tensors[name].tensor_type.name) for module, name in names.items()
                if name in tensors and tensors[name].tensor_type.name in FOUR_BIT}


@contextlib.contextmanager
def gguf_file(origin):
    """A path to the GGUF file of `gguf_origin`'s answer: the file given by path, or the default pair's parts
    joined in a scratch folder of the cache for as long as the context lasts."""
    if isinstance(origin, Path):
        yield origin
        return
    from .default_pair import join_parts

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{SCRATCH_PREFIX}*"):  # a killed start's (its process gone): hundreds of MB, never used
        if not _alive(stale.name.removeprefix(SCRATCH_PREFIX).partition("-")[0]):
            shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root) as scratch:
        joined = Path(scratch) / origin.filename
        join_parts(origin, joined)
        yield joined


SCRATCH_PREFIX = ".gguf-join-"  # gguf_file's scratch folders in the cache: the prefix, the owner's pid, a dash


def _alive(pid: str) -> bool:
    """Whether the process `pid` (text) runs; False for text that is no pid."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _embeddings(model: nn.Module) -> frozenset[str]:
    return frozenset(name for name, module in model.named_modules() if isinstance(module, nn.Embedding))


def _code() -> str:
    from ..cpu import grouped

    functions = (grouped.pack, grouped.compact, grouped.storage_bits, grouped.bit_planes, grouped.tiled, grouped.Tiled,
                 grouped.quantize, grouped._half, pack_from_gguf, gguf_names)
    return hashlib.sha256("".join(inspect.getsource(f) for f in functions).encode()).hexdigest()[:16]


def shipped_form(source: ModelSource, requantize: int | None = None) -> ReadyForm | None:
    """Where the default pair's packed layers are kept (`requantize`: as `pack_from_gguf`'s, a form of its own),
    keyed by what they depend on."""
    import gguf

    folder = Path(source.path).resolve()
    key = {"form": "shipped", "requantize": requantize, "format": READY_FORMAT, "gguf": getattr(gguf, "__version__", "?"),
           "code": _code(), "source": fingerprint(folder), "machine": platform.machine()}
    return ReadyForm(shipped_form_path(folder, requantize), key)


def _flatten(packed: dict) -> dict[str, torch.Tensor]:
    return {f"{module}/{name}": tensor for module, tensors in packed.items() for name, tensor in tensors.items()}


def _unflatten(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, name = key.rsplit("/", 1)
        packed.setdefault(module, {})[name] = tensor
    return packed


def packed_layers(model: nn.Module, source: ModelSource, requantize: int | None = None
                  ) -> dict[str, dict[str, torch.Tensor]]:
    """The grouped tensors of `model`'s linear layers, from the ready form or packed from the GGUF (`requantize`:
    as `pack_from_gguf`'s)."""
    origin = gguf_origin(source)
    names = gguf_names(model)
    if origin is None or not names:
        return {}
    if isinstance(origin, Path):
        return pack_from_gguf(origin, names, _embeddings(model), requantize)
    form = shipped_form(source, requantize)
    if form.looks_current():
        from .checkpoint import read_header

        header, _ = read_header(form.path)
        expected = {name: (tuple(entry["shape"]), _dtype(entry["dtype"]))
                    for name, entry in header.items() if name != "__metadata__"}
        tensors = form.load(expected)
        if tensors is not None:
            return _unflatten(tensors)
    with gguf_file(origin) as joined:
        packed = pack_from_gguf(joined, names, _embeddings(model), requantize)
    form.save(_flatten(packed))
    return packed


def _dtype(name: str) -> torch.dtype:
    from .weights import SAFETENSORS_DTYPES

    return SAFETENSORS_DTYPES[name]


def keep_shipped(source: ModelSource, requantize: int | None = None, rebuild: bool = False) -> str | None:
    """Where a default-pair model's packed GGUF weights are kept, packed first unless a current form is there, or
    (`rebuild`) unless the form there verifies (`make models` runs this, so that the first start does not pack);
    None for other models. Packing reads the GGUF alone, into a model with no weights: never the float model."""
    from .load import _causal_lm_class, _skeleton

    origin = gguf_origin(source)
    if origin is None or isinstance(origin, Path):
        return None
    form = shipped_form(source, requantize)
    if rebuild or not form.looks_current():
        config, model_class = _causal_lm_class(source, False)
        if model_class is None:
            return None
        packed_layers(_skeleton(config, torch.float32), source, requantize)
    return str(form.path)


def keeps_shipped(source: ModelSource) -> bool:
    """Whether `source` is a default-pair model, whose packed layers are kept in the cache (cheap: nothing read)."""
    origin = gguf_origin(source)
    return origin is not None and not isinstance(origin, Path)


def load_kept(source: ModelSource, role: str, dtype: torch.dtype, trust_remote_code: bool = False,
              requantize: int | None = None):
    """A default-pair model from its kept packed layers (load_shipped), which are packed from the GGUF and kept
    first where they are missing, made under another key (a library upgrade) or found damaged: a start then takes
    the memory `make models` takes, never that of the float model packed in place (7 GB read, 12.9 GB at peak for
    the target, found by an audit). None where the grouped kernel is missing or the form still cannot be used."""
    from ..cpu.grouped import grouped_kernel
    from .startup import startup_step

    if not keeps_shipped(source) or not grouped_kernel():
        return None
    for damaged in (False, True):
        if damaged or not shipped_form(source, requantize).looks_current():
            with startup_step(f"packed the {role}'s GGUF weights and kept them (`make models` does it beforehand)"):
                keep_shipped(source, requantize, rebuild=damaged)
        model = load_shipped(source, role, dtype, trust_remote_code, requantize)
        if model is not None:
            return model
    return None


def load_shipped(source: ModelSource, role: str, dtype: torch.dtype, trust_remote_code: bool = False,
                 requantize: int | None = None):
    """A default-pair model from its kept packed layers (`requantize`: as `pack_from_gguf`'s) and, of its float
    checkpoint, only the other tensors (embedding, norms, biases): the float weights of its linear layers are never
    read. None where the kept form turns out unusable (the caller then loads the float model and packs it again)."""
    from ..cpu.grouped import grouped_kernel
    from .checkpoint import checkpoint_files, read_header
    from .load import _causal_lm_class, _finish, _skeleton
    from .startup import startup_step
    from .weights import read_safetensors

    config, model_class = _causal_lm_class(source, trust_remote_code)
    if model_class is None or not grouped_kernel():
        return None
    form = shipped_form(source, requantize)
    with startup_step(f"read the {role}'s GGUF weights, kept") as note:
        header, _ = read_header(form.path)
        expected = {name: (tuple(entry["shape"]), _dtype(entry["dtype"]))
                    for name, entry in header.items() if name != "__metadata__"}
        tensors = form.load(expected)
        note["detail"] = "unusable: packing them again" if tensors is None else f"verified, from {form.path}"
    if tensors is None:
        return None
    packed = _unflatten(tensors)
    del tensors  # `_swap` lets each layer's packed tensors go once it holds them tiled
    with startup_step(f"read the {role}'s other weights") as note:
        state = {}
        for path in checkpoint_files(source.path):
            state.update(read_safetensors(path, dtype=dtype, skip=frozenset(f"{m}.weight" for m in packed)))
        note["detail"] = f"{len(state)} tensors"
    model = _skeleton(config, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    del state
    _swap(model, packed)
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        logger.warning("the kept GGUF weights of %s leave %s unloaded; packing them again", source, missing[0])
        return None
    return _finish(model, source)


def _swap(model: nn.Module, packed: dict[str, dict[str, torch.Tensor]]) -> None:
    """Put each module of `packed` in grouped form, emptying `packed` as it goes (each layer's packed tensors go
    once it holds them tiled)."""
    from ..cpu.grouped import Grouped, GroupedEmbedding, GroupedLinear, Tiled

    for module_name in list(packed):
        tensors = dict(packed.pop(module_name))
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = getattr(parent, child)
        weight = Tiled.from_tensors(tensors) if "layout" in tensors else Grouped.from_tensors(
            tensors, int(tensors.pop("group")))
        expected = tuple(layer.weight.shape)
        if tuple(weight.shape) != expected:
            raise SpecDecError(f"the GGUF weight of {module_name} has shape {tuple(weight.shape)}, the model's "
                               f"layer {expected}")
        if isinstance(layer, nn.Embedding):
            setattr(parent, child, GroupedEmbedding(weight))
        else:
            setattr(parent, child, GroupedLinear(weight, layer.bias))


def use_shipped_weights(model: nn.Module, source: ModelSource, requantize: int | None = None) -> int:
    """Swap `model`'s linear layers and input embedding for grouped ones packed from its GGUF (`requantize`: as
    `pack_from_gguf`'s), in place (CPU models only). Returns how many; a layer's bias moves with it, its float
    weight is dropped."""
    from ..cpu.grouped import GroupedLinear, grouped_kernel

    if any(isinstance(m, GroupedLinear) for m in model.modules()):
        return 0  # loaded so already (load_shipped)
    param = next(model.parameters())
    if param.device.type != "cpu" or not grouped_kernel():
        return 0
    packed = packed_layers(model, source, requantize)
    swapped = len(packed)
    _swap(model, packed)
    if swapped:
        logger.debug("%d layers of %s use the GGUF's own weights", swapped, type(model).__name__)
    return swapped
