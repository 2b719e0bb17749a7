"""One model loaded: a causal LM in eval mode on its device, its safetensors weights read straight into the
process's memory on CPU (`read_soon` starts that in the background), and the int8 draft read from its ready form
in the cache or built and kept there."""

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from ..threads import Job
from .checkpoint import WeightsError, checkpoint_files
from .memory import release_free_memory
from .quantization import int8_draft_form, quantizes_draft
from .sources import ModelSource, load_error, pretrained_kwargs
from .startup import log_step, startup_step
from .weights import read_safetensors

logger = logging.getLogger(__name__)


def load_model(source: ModelSource, role: str, device: torch.device, dtype: torch.dtype, device_map=None,
               trust_remote_code: bool = False, own_memory: bool = False, pending: "PendingWeights | None" = None):
    """A causal LM in eval mode on `device` (or spread by accelerate's `device_map`) in `dtype`.

    `own_memory`: on CPU, read a local safetensors checkpoint straight into the process's memory, tensor by
    tensor (`weights.read_safetensors`), instead of leaving it memory-mapped as `from_pretrained` does; `pending`:
    that reading, started earlier (`read_soon`). On CUDA the weights go from the file to the GPU once, in
    `dtype`, with no copy in the process's memory.
    """
    from transformers import AutoModelForCausalLM

    if (own_memory and device.type == "cpu" and device_map is None) or pending is not None:
        model = _load_into_own_memory(source, role, dtype, trust_remote_code, pending)
        if model is not None:
            return model
    kwargs = pretrained_kwargs(source, trust_remote_code)
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device.type == "cuda":
        kwargs["device_map"] = {"": device}  # each tensor straight to the GPU, not through the CPU first
    with startup_step(f"loaded the {role} model {source} ({str(dtype).removeprefix('torch.')}, "
                      f"{device_map if device_map is not None else device})"):
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **kwargs)
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
            raise load_error(source, role, "model", error) from None
        if "device_map" not in kwargs:
            model.to(device)
        model.eval()
    return model


def _causal_lm_class(source: ModelSource, trust_remote_code: bool):
    """(config, the transformers class) for a local folder of a model transformers itself implements; (None, None)
    for anything else (GGUF files, hub ids, remote code), which `from_pretrained` then loads as usual."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if not source.local or source.gguf_file or checkpoint_files(source.path) is None:
        return None, None
    try:
        config = AutoConfig.from_pretrained(source.path, **pretrained_kwargs(source, trust_remote_code))
    except (OSError, ValueError, KeyError, ImportError, RuntimeError):
        return None, None  # from_pretrained says what is wrong
    if getattr(config, "auto_map", None):
        return None, None
    return config, MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


def _finish(model, source: ModelSource):
    """What `from_pretrained` gives a model from a folder besides its weights: its name, its generation config,
    eval mode."""
    from transformers import GenerationConfig

    model.name_or_path = model.config.name_or_path = source.path
    if os.path.isfile(os.path.join(source.path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(source.path, local_files_only=True)
    return model.eval()


@dataclass
class PendingWeights:
    """A local safetensors checkpoint being read into the process's memory in the background (`read_soon`)."""

    config: object
    model_class: type
    job: Job
    cancel: threading.Event

    def result(self) -> tuple[dict, float]:
        """(name: tensor, the seconds the reading took), once it is done."""
        return self.job.result()

    def drop(self) -> None:
        """Stop reading (at the next tensor) and let the tensors go."""
        self.cancel.set()


def read_soon(source: ModelSource, dtype: torch.dtype, trust_remote_code: bool = False) -> PendingWeights | None:
    """Start reading a local safetensors folder's weights into the process's memory, in a background thread; None
    where `load_model` could not use them (not a local folder transformers implements). The reading starts before
    the config and the model's code are looked up (importing that code takes seconds, on one core)."""
    files = checkpoint_files(source.path) if source.local and not source.gguf_file else None
    if files is None:
        return None
    cancel = threading.Event()

    def read():
        started = time.perf_counter()
        state = {}
        for path in files:
            state.update(read_safetensors(path, dtype=dtype, cancel=cancel))
        return state, time.perf_counter() - started

    # an OS thread even under the service's gevent worker, where a threading.Thread would not overlap the draft
    job = Job(read)
    config, model_class = _causal_lm_class(source, trust_remote_code)
    if model_class is None:
        cancel.set()  # from_pretrained loads it as usual
        return None
    return PendingWeights(config, model_class, job, cancel)


def _load_into_own_memory(source: ModelSource, role: str, dtype: torch.dtype, trust_remote_code: bool,
                          pending: PendingWeights | None = None):
    """`load_model` for a local safetensors folder on CPU: each tensor read once, straight into the process's
    memory, and handed to the model as it is (no copy). None where that does not apply."""
    try:
        if pending is None:
            pending = read_soon(source, dtype, trust_remote_code)
            if pending is None:
                return None
            state, seconds = pending.result()
            beside = ""
        else:
            waited = time.perf_counter()
            state, seconds = pending.result()
            beside = f"beside the draft, waited {time.perf_counter() - waited:.2f} s for it; "
        log_step(f"read the {role}'s weights into the process's memory", seconds,
                 f"{beside}{_bytes(state.values()) / 1e9:.2f} GB, {len(state)} tensors, from {source}")
        with startup_step(f"built the {role} model"):
            model = pending.model_class.from_pretrained(None, config=pending.config, state_dict=state, dtype=dtype)
            del state  # the model holds the only references: no tensor was copied
    except (OSError, ValueError, KeyError, RuntimeError, WeightsError) as error:
        raise load_error(source, role, "model", error) from None
    return _finish(model, source)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load_draft(source: ModelSource, device: torch.device, dtype: torch.dtype, draft_quantization: str,
               trust_remote_code: bool = False, own_memory: bool = True):
    """The draft, int8 already where `draft_quantization` asks for it and it applies: a CPU draft in float32 or
    bfloat16, loaded in float32 whatever the target's dtype, since the int8 layers take float32 activations (a
    bfloat16 target with an int8 draft is the fastest pair on our CPUs; bench/README.md).

    An int8 draft from a folder in the cache (the default pair) is kept there, as a ready form: later starts read
    that form (verified: `weights.ReadyForm`) and never the float weights of its quantized layers. A missing,
    stale or damaged form is built again from the float draft, quantized layer by layer, and kept.
    """
    from ..cpu.linear import load_quantized, quantize_linears, quantized_tensors

    if not quantizes_draft(device, dtype, draft_quantization):
        return load_model(source, "draft", device, dtype, None, trust_remote_code, own_memory)
    dtype = torch.float32
    form = int8_draft_form(source)
    config, model_class = _causal_lm_class(source, trust_remote_code) if form is not None else (None, None)
    if model_class is not None:
        from ..cpu.linear import int8_layout

        skeleton = _skeleton(config, dtype)
        with startup_step("read the int8 draft's kept form") as note:
            tensors = form.load(int8_layout(skeleton))
            note["detail"] = f"none usable in {form.path}: building it" if tensors is None else \
                f"{_bytes(tensors.values()) / 1e9:.2f} GB, verified, from {form.path}"
        if tensors is not None:
            try:
                with startup_step("built the int8 draft") as note:
                    note["detail"] = f"{load_quantized(skeleton, tensors)} int8 linear layers packed"
                return _finish(skeleton, source)
            except (ValueError, RuntimeError) as error:  # checked, yet not this model's: build it again
                logger.warning("the kept int8 draft %s does not fit the draft: %s; building it again", form.path,
                               error)
    draft = load_model(source, "draft", device, dtype, None, trust_remote_code, own_memory)
    with startup_step("quantized the draft to int8") as note:
        note["detail"] = f"{quantize_linears(draft)} linear layers"
        release_free_memory()  # the pages of the float weights just freed
    if model_class is not None:  # a form this start could have used
        with startup_step("kept the int8 draft for later starts") as note:
            try:
                form.save(quantized_tensors(draft))
                note["detail"] = str(form.path)
            except (OSError, ValueError) as error:  # a read-only cache costs the next start time, nothing else
                logger.warning("could not keep the int8 draft in %s: %s", form.path, error)
    return draft


def keep_int8_draft(source: ModelSource) -> str | None:
    """Where the int8 draft of a folder in the cache is kept, built first unless a current one is there already
    (`make models` runs this, so that the first start does not quantize); None where no form is kept."""
    from ..cpu.linear import quantization_supported

    form = int8_draft_form(source)
    if form is None or not quantization_supported():
        return None
    if not form.looks_current():
        load_draft(source, torch.device("cpu"), torch.float32, "int8")
        release_free_memory()
    return str(form.path)


def _skeleton(config, dtype: torch.dtype):
    """The model with its parameters on the meta device (nothing allocated) and its buffers computed on CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
