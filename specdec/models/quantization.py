"""The int8 draft: when a draft is quantized (`quantizes_draft`), and the key of its ready form kept in the cache
(`int8_draft_form`), which changes with anything the int8 weights depend on."""

import hashlib
import inspect
import platform
from pathlib import Path

import torch

from ..errors import SpecDecError
from .cache import in_cache, int8_form_path
from .checkpoint import fingerprint
from .sources import ModelSource
from .weights import ReadyForm

DRAFT_QUANTIZATIONS = ("auto", "int8", "int4", "none")


def resolve_draft_quantization(value: str | None) -> str:
    """"auto", "int8", "int4" or "none" (None is "none"); load_pair decides what "auto" is for its draft."""
    name = "none" if value is None else str(value).strip().lower()
    if name not in DRAFT_QUANTIZATIONS:
        raise SpecDecError(f"draft_quantization must be auto, int8, int4 or none, got {value!r}",
                           field="draft_quantization")
    return name


def quantizes_draft(device: torch.device, dtype: torch.dtype, draft_quantization: str) -> bool:
    """Whether a draft for a pair in `dtype` on `device` runs int8 (and is then loaded in float32, the int8
    layers' activations): on CPU, in float32 or bfloat16, where torch has an int8 engine. "auto" is "int8" for a
    float draft."""
    from ..cpu.linear import quantization_supported

    return draft_quantization in ("int8", "auto") and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
        and quantization_supported()


READY_FORMAT = 1  # bump when a ready form's layout changes


def _int8_form_code() -> str:
    """A hash of the functions that quantize a draft and lay out its kept form: a change to any makes it stale."""
    from ..cpu import linear

    functions = (linear.quantize_linears, linear._linears, linear.quantized_tensors, linear.load_quantized,
                 linear.int8_layout, linear._named_linears, linear._float_state)
    return hashlib.sha256("".join(inspect.getsource(f) for f in functions).encode()).hexdigest()[:16]


def int8_draft_form(source: ModelSource):
    """Where the int8 draft of `source` is kept (a `ReadyForm`), for a folder in the cache; else None.

    Its key is what the int8 weights depend on: the source checkpoint (`checkpoint.fingerprint`), the code that
    quantizes and lays them out (the source of those functions), the library versions and int8 engine, and the
    machine.
    """
    import transformers

    from ..cpu import linear as cpu_linear

    if not source.local or source.gguf_file or not in_cache(source.path):
        return None
    folder = Path(source.path).resolve()

    key = {"form": "int8-draft", "format": READY_FORMAT, "torch": torch.__version__,
           "transformers": transformers.__version__, "int8_engine": torch.backends.quantized.engine,
           "machine": platform.machine(),
           "cpu": hashlib.sha256(cpu_linear._cpu_signature().encode()).hexdigest()[:16],
           "code": _int8_form_code(),
           "source": fingerprint(folder)}
    return ReadyForm(int8_form_path(folder), key)
