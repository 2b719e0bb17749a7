"""Model loading: a draft and a target (hub id, local folder, GGUF file or alias) and the pair's one tokenizer.

    draft, target, tokenizer = load_pair()                      # the default pair, from the local cache
    draft, target, tokenizer = load_pair("org/small", "org/big", device_map="auto")

The tokenizer is the target's, checked against the draft's before anything runs. Local folders, GGUF files and
the default pair never touch the hub; a hub id that cannot be loaded is one SpecDecError sentence.
"""

import contextlib
import ctypes
import hashlib
import inspect
import logging
import os
import platform
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpecDecError
from .threads import Job

logger = logging.getLogger(__name__)

DEFAULT = "default"
# short names for the models of the default pair (None or "default" picks the role's model)
ALIASES = {
    "qwen2.5-coder-0.5b": "draft",
    "qwen2.5-coder-0.5b-instruct": "draft",
    "qwen2.5-coder-1.5b": "target",
    "qwen2.5-coder-1.5b-instruct": "target",
}
DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")
# every file a tokenizer may be read from, by the start of its name
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges",
                           "spiece", "sentencepiece")
DRAFT_QUANTIZATIONS = ("int8", "none")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class ModelSource:
    """Where one model comes from. `path` is a folder or hub id; `gguf_file` a file name inside that folder.

    `offline`: load without the hub (always for local sources; for a hub id when the hub cannot be reached, so
    that a model already in the Hugging Face cache still loads).
    """

    path: str
    gguf_file: str | None = None
    local: bool = True
    offline: bool = True

    def __str__(self) -> str:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto`: CUDA when available, else CPU. Anything else must be a device torch knows and this machine has."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpecDecError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}", field="device") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise SpecDecError(f"device {device} is not available on this machine ({count} CUDA devices)",
                               field="device")
    elif device.type != "cpu":
        backend = getattr(torch.backends, device.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise SpecDecError(f"device {device} is not available on this machine", field="device")
    return device


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """`auto`: float32 on CPU, bfloat16 on CUDA; or float32 / float16 / bfloat16 (fp32, fp16, bf16)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise SpecDecError(f"dtype must be float32, float16 or bfloat16, got {dtype}", field="dtype")
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise SpecDecError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}", field="dtype") from None


def resolve_source(name: str | None, role: str) -> ModelSource:
    """Turn a model argument into a ModelSource; the default pair is prepared (converted once) on first use."""
    field = f"{role}_model"
    if name is None or name == DEFAULT or name.lower() in ALIASES:
        from .default_pair import default_pair_paths

        alias_role = role if name is None or name == DEFAULT else ALIASES[name.lower()]
        draft_dir, target_dir = default_pair_paths()
        return ModelSource(draft_dir if alias_role == "draft" else target_dir)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            hint = f"; pass a GGUF file inside it, e.g. {os.path.join(path, ggufs[0])}" if ggufs else ""
            raise SpecDecError(f"the {role} model folder {name} has no config.json{hint}", field=field)
        return ModelSource(os.path.abspath(path))
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise SpecDecError(f"the {role} model GGUF file {name} does not exist", field=field)
        folder, filename = os.path.split(os.path.abspath(path))
        return ModelSource(folder, filename)
    if os.path.exists(path) or name.startswith((".", "/", "~")) or not HUB_ID.fullmatch(name):
        raise SpecDecError(f"the {role} model {name!r} is neither a model folder, a .gguf file nor a hub id",
                           field=field)
    return ModelSource(name, local=False, offline=not hub_reachable())


def hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub endpoint, so an unreachable hub fails in seconds instead of a minute of retries.

    With HF_HUB_OFFLINE set the hub is never tried; behind a proxy the probe is skipped (assumed reachable).
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    endpoint = urllib.parse.urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _pretrained_kwargs(source: ModelSource, trust_remote_code: bool) -> dict:
    kwargs = {"trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if source.offline:
        kwargs["local_files_only"] = True  # the libraries' offline mode, for this call only
    return kwargs


def _unreachable(source: ModelSource, role: str, what: str, error: Exception) -> SpecDecError:
    """One sentence for a failed load; for a hub id, say it is neither local nor reachable."""
    logger.debug("loading the %s %s from %s failed", role, what, source, exc_info=error)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if source.local:
        return SpecDecError(f"could not load the {role} {what} from {source}: {reason}", field=f"{role}_model")
    if source.offline:
        return SpecDecError(f"could not load the {role} {what} {source.path!r}: it is not a local folder or .gguf "
                            f"file, the Hugging Face hub cannot be reached, and it is not in the local Hugging Face "
                            f"cache", field=f"{role}_model")
    return SpecDecError(f"could not load the {role} {what} {source.path!r} from the Hugging Face hub: {reason}",
                        field=f"{role}_model")


@contextlib.contextmanager
def startup_step(what: str):
    """Time one step of a start-up and log it as one line, "start-up: <what> in <seconds> s (<detail>)". The
    step may set `note["detail"]` on the dict it is given."""
    note: dict = {}
    started = time.perf_counter()
    yield note
    log_step(what, time.perf_counter() - started, note.get("detail"))


def log_step(what: str, seconds: float, detail: str | None = None) -> None:
    """One start-up step's line (see `startup_step`)."""
    logger.info("start-up: %s in %.2f s%s", what, seconds, f" ({detail})" if detail else "")


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
    kwargs = _pretrained_kwargs(source, trust_remote_code)
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device.type == "cuda":
        kwargs["device_map"] = {"": device}  # each tensor straight to the GPU, not through the CPU first
    with startup_step(f"loaded the {role} model {source} ({str(dtype).removeprefix('torch.')}, "
                      f"{device_map if device_map is not None else device})"):
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **kwargs)
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
            raise _unreachable(source, role, "model", error) from None
        if "device_map" not in kwargs:
            model.to(device)
        model.eval()
    return model


def _causal_lm_class(source: ModelSource, trust_remote_code: bool):
    """(config, the transformers class) for a local folder of a model transformers itself implements; (None, None)
    for anything else (GGUF files, hub ids, remote code), which `from_pretrained` then loads as usual."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .weights import checkpoint_files

    if not source.local or source.gguf_file or checkpoint_files(source.path) is None:
        return None, None
    try:
        config = AutoConfig.from_pretrained(source.path, **_pretrained_kwargs(source, trust_remote_code))
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
    from .weights import checkpoint_files, read_safetensors

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
    from .weights import WeightsError

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
        raise _unreachable(source, role, "model", error) from None
    return _finish(model, source)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def quantizes_draft(device: torch.device, dtype: torch.dtype, draft_quantization: str) -> bool:
    """Whether a draft for a pair in `dtype` on `device` runs int8 (and is then loaded in float32, the int8
    layers' activations): on CPU, in float32 or bfloat16, where torch has an int8 engine."""
    from .cpu.linear import quantization_supported

    return draft_quantization == "int8" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) \
        and quantization_supported()


def load_draft(source: ModelSource, device: torch.device, dtype: torch.dtype, draft_quantization: str,
               trust_remote_code: bool = False, own_memory: bool = True):
    """The draft, int8 already where `draft_quantization` asks for it and it applies: a CPU draft in float32 or
    bfloat16, loaded in float32 whatever the target's dtype, since the int8 layers take float32 activations (a
    bfloat16 target with an int8 draft is the fastest pair on our CPUs; bench/README.md).

    An int8 draft from a folder in the cache (the default pair) is kept there, as a ready form: later starts read
    that form (verified: `weights.ReadyForm`) and never the float weights of its quantized layers. A missing,
    stale or damaged form is built again from the float draft, quantized layer by layer, and kept.
    """
    from .cpu.linear import load_quantized, quantize_linears, quantized_tensors

    if not quantizes_draft(device, dtype, draft_quantization):
        return load_model(source, "draft", device, dtype, None, trust_remote_code, own_memory)
    dtype = torch.float32
    form = int8_draft_form(source)
    config, model_class = _causal_lm_class(source, trust_remote_code) if form is not None else (None, None)
    if model_class is not None:
        from .cpu.linear import int8_layout

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
    from .cpu.linear import quantization_supported

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


READY_FORMAT = 1  # bump when a ready form's layout changes


def _int8_form_code() -> str:
    """A hash of the functions that quantize a draft and lay out its kept form: a change to any makes it stale."""
    from .cpu import linear

    functions = (linear.quantize_linears, linear._linears, linear.quantized_tensors, linear.load_quantized,
                 linear.int8_layout, linear._named_linears, linear._float_state)
    return hashlib.sha256("".join(inspect.getsource(f) for f in functions).encode()).hexdigest()[:16]


def int8_draft_form(source: ModelSource):
    """Where the int8 draft of `source` is kept (a `weights.ReadyForm`), for a folder in the cache; else None.

    Its key is what the int8 weights depend on: the source checkpoint (`weights.fingerprint`), the code that
    quantizes and lays them out (the source of those functions), the library versions and int8 engine, and the
    machine.
    """
    from .cpu import linear as cpu_linear
    from .default_pair import cache_root, int8_form_path
    from .weights import ReadyForm, fingerprint

    if not source.local or source.gguf_file:
        return None
    folder, root = Path(source.path).resolve(), cache_root().resolve()
    if root not in folder.parents:
        return None
    import transformers

    key = {"form": "int8-draft", "format": READY_FORMAT, "torch": torch.__version__,
           "transformers": transformers.__version__, "int8_engine": torch.backends.quantized.engine,
           "machine": platform.machine(),
           "cpu": hashlib.sha256(cpu_linear._cpu_signature().encode()).hexdigest()[:16],
           "code": _int8_form_code(),
           "source": fingerprint(folder)}
    return ReadyForm(int8_form_path(folder), key)


def has_tokenizer(source: ModelSource) -> bool:
    """Whether the source ships a tokenizer: GGUF files and hub ids do; a folder only with tokenizer files."""
    if source.gguf_file or not source.local:
        return True
    return any(os.path.isfile(os.path.join(source.path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(source: ModelSource, role: str = "target", trust_remote_code: bool = False):
    """The source's tokenizer (with its chat template, if any)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path, **_pretrained_kwargs(source, trust_remote_code))
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
        raise _unreachable(source, role, "tokenizer", error) from None


def _tokenizer_files(source: ModelSource) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(Path(source.path).iterdir())
            if path.is_file() and path.name.startswith(TOKENIZER_FILE_PREFIXES)}


def same_tokenizer_files(draft: ModelSource, target: ModelSource) -> bool:
    """Whether two local folders hold the same tokenizer files, byte for byte (then the tokenizers are one, and
    the draft's need not be loaded): the default pair's draft carries a verbatim copy of the target's."""
    if not (draft.local and target.local) or draft.gguf_file or target.gguf_file:
        return False
    files = _tokenizer_files(target)
    return bool(files) and any(name.startswith("tokenizer") for name in files) and files == _tokenizer_files(draft)


def check_tokenizers(draft_tokenizer, target_tokenizer) -> None:
    """Speculative decoding needs one vocabulary: the same token for the same id, specials and added tokens too."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for token, i in target_vocab.items() if draft_vocab.get(token) != i)
        raise SpecDecError(
            f"the draft and target tokenizers differ: the draft's vocabulary has {len(draft_vocab)} tokens, the "
            f"target's {len(target_vocab)}, and {differing} of the target's tokens have another id or none in the "
            f"draft", field="draft_model")


def load_and_check_tokenizers(draft_source: ModelSource, target_source: ModelSource, trust_remote_code: bool):
    """The pair's tokenizer: the target's, and the draft's too where its files differ, checked to be the same
    tokenizer (a mismatched pair fails here, before any model is built)."""
    with startup_step("loaded the target's tokenizer"):
        tokenizer = load_tokenizer(target_source, "target", trust_remote_code) \
            if has_tokenizer(target_source) else None
    if has_tokenizer(draft_source):
        with startup_step("compared the draft's tokenizer files with the target's") as note:
            same = tokenizer is not None and same_tokenizer_files(draft_source, target_source)
            note["detail"] = "the same bytes: one tokenizer, not loaded again" if same else "not the same"
        if not same:
            with startup_step("loaded the draft's tokenizer and checked it against the target's"):
                draft_tokenizer = load_tokenizer(draft_source, "draft", trust_remote_code)
                if tokenizer is None:
                    tokenizer = draft_tokenizer
                else:
                    check_tokenizers(draft_tokenizer, tokenizer)
    if tokenizer is None:
        raise SpecDecError(f"neither {target_source} nor {draft_source} has a tokenizer", field="target_model")
    return tokenizer


def load_pair(draft: str | None = None, target: str | None = None, device: str = "auto", dtype: str = "auto",
              device_map=None, trust_remote_code: bool = False, cpu_kernels: bool = True,
              draft_quantization: str | None = "int8"):
    """(draft_model, target_model, tokenizer) ready for SpeculativeDecoder; None or "default" is the default pair.

    `device_map` (e.g. "auto") spreads the target over several GPUs with accelerate; the draft stays on `device`.
    `cpu_kernels`: float32 and bfloat16 CPU linear layers computed by our few-rows kernel (float32 ones packed once
    by oneDNN where it cannot be built; specdec.cpu.linear), so verifying gamma tokens in one target forward costs
    about what one token does, CPU attention over grouped heads skips copying the cache per head (specdec.cpu.attention), and
    CPU weights are read straight into the process's memory, tensor by tensor, not memory-mapped (`load_model`);
    models elsewhere or in float16 keep the library's kernels.
    `draft_quantization`: "int8" (default) quantizes a CPU draft's linear layers to int8 (the draft loaded in
    float32 for it, beside a float32 or bfloat16 target; not float16), which makes proposing 2.5-3x cheaper;
    outputs stay exactly the target's, since the rejection rule uses the quantized draft's own probabilities.
    "none" (or None) keeps the draft as loaded. The target is never quantized. The default pair's int8 draft is
    kept in the cache and read from there at later starts (`load_draft`).

    Each step logs one line with its seconds ("start-up: ...").
    """
    from .engine import check_vocabularies

    with startup_step("checked the model sources"):
        draft_quantization = resolve_draft_quantization(draft_quantization)
        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        target_source = resolve_source(target, "target")
        draft_source = resolve_source(draft, "draft")

    # the target's weights start coming in at once, beside the tokenizers and the draft: reading waits on the disk
    # and on fresh memory, the others on one core; a pair that fails its checks drops them
    pending = read_soon(target_source, dtype, trust_remote_code) \
        if cpu_kernels and device.type == "cpu" and device_map is None else None
    try:
        tokenizer = load_and_check_tokenizers(draft_source, target_source, trust_remote_code)
        draft_model = load_draft(draft_source, device, dtype, draft_quantization, trust_remote_code, cpu_kernels)
    except BaseException:
        if pending is not None:
            pending.drop()
        raise
    target_model = load_model(target_source, "target", device, dtype, device_map, trust_remote_code, cpu_kernels,
                              pending)
    check_vocabularies(draft_model, target_model, tokenizer)
    vocab_size = target_model.config.get_text_config(decoder=True).vocab_size
    if len(tokenizer) > vocab_size:
        raise SpecDecError(f"the tokenizer has {len(tokenizer)} tokens but the models only {vocab_size} logits",
                           field="target_model")
    with startup_step("CPU kernels for the pair") as note:
        apply_cpu_kernels(draft_model, target_model, draft_quantization, cpu_kernels)
        release_free_memory()
        note["detail"] = f"draft: {layer_kinds(draft_model)}; target: {layer_kinds(target_model)}"
    return draft_model, target_model, tokenizer


def layer_kinds(model) -> str:
    """What computes a model's linear layers and attention, e.g. "169 DynamicQuantizedLinear, sdpa"."""
    from collections import Counter

    kinds = Counter(m._get_name() for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features"))
    linears = ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
    return f"{linears or 'no linear layers'}, attention {model.config._attn_implementation}"


def apply_cpu_kernels(draft_model, target_model, draft_quantization: str = "none", cpu_kernels: bool = True) -> bool:
    """What `load_pair` does to a loaded pair, in place: the int8 draft, few-rows (or packed) linears, grouped-head
    attention, CPU weights in the process's own memory.

    Each step touches float32 or bfloat16 (or sdpa) CPU layers only; models on CUDA or in float16 are left as
    loaded.
    Returns whether the target's forward changed (so its verification cost may have).
    """
    prepare_draft(draft_model, draft_quantization, cpu_kernels)
    if not cpu_kernels:
        return False
    changed = use_cpu_kernels(target_model)
    for model in (draft_model, target_model):
        use_own_memory(model)
    return changed


def prepare_draft(draft_model, draft_quantization: str = "none", cpu_kernels: bool = True) -> None:
    """The draft's half of `apply_cpu_kernels`: int8 if asked and it applies (`quantizes_draft`; a bfloat16 draft
    made float32 first, as `load_draft` loads one), then CPU kernels for what stays float."""
    from .cpu.linear import quantize_linears

    param = next(draft_model.parameters())
    if quantizes_draft(param.device, param.dtype, draft_quantization):
        if param.dtype != torch.float32:  # not one that load_draft gave, already float32
            draft_model.float()
        quantize_linears(draft_model)
    if cpu_kernels:
        use_cpu_kernels(draft_model)


def use_cpu_kernels(model) -> bool:
    """Few-rows (or packed) linears and grouped-head attention for one model, in place. Returns whether anything
    changed."""
    from .cpu.attention import use_gqa_attention
    from .cpu.linear import pack_linears

    return bool(pack_linears(model) + use_gqa_attention(model))


def use_stock_kernels(model) -> bool:
    """Undo `use_cpu_kernels`: the library's linear layers and attention again, on the same weights where the
    few-rows kernel was used (nothing copied). Returns whether anything changed."""
    from .cpu.attention import restore_attention
    from .cpu.linear import unpack_linears

    return bool(unpack_linears(model) + restore_attention(model))


def use_own_memory(model) -> int:
    """Copy a model's CPU parameters that are memory-mapped from a file into the process's own memory, one at a
    time, in place; returns the bytes copied.

    `from_pretrained` leaves safetensors weights memory-mapped from the checkpoint file, in the page cache (where
    `load_model` cannot read them straight into the process's memory: hub ids, remote code). On our CPUs a
    forward that streams all the weights runs about 20% faster from the process's own (anonymous) memory (see
    the README). Each tensor's mapped pages are released as soon as it is copied, so the mapped and the own copy
    of at most one tensor are resident together. A tied weight is one parameter, copied once, and stays tied.
    Without /proc (not Linux), every CPU parameter is copied.
    """
    mappings = _file_mappings()
    copied = 0
    for param in model.parameters():
        if param.device.type != "cpu" or param.numel() == 0:
            continue
        if mappings is not None and not any(low <= param.data_ptr() < high for low, high in mappings):
            continue  # already in the process's own memory
        mapped = param.data
        param.data = mapped.clone()
        if mappings is not None:
            _release_pages(mapped.data_ptr(), mapped.numel() * mapped.element_size())
        copied += param.numel() * param.element_size()
        del mapped
    return copied


def _file_mappings() -> list[tuple[int, int]] | None:
    """The address ranges this process maps from files (/proc/self/maps), or None where that cannot be read."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
            low, high = fields[0].split("-")
            ranges.append((int(low, 16), int(high, 16)))
    return ranges


MADV_DONTNEED = 4


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). Tensors below malloc's mmap
    threshold live in its heap arenas, and freeing them (a quantized layer's float weight) would otherwise leave
    their pages resident. Elsewhere than glibc, nothing."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _release_pages(address: int, length: int) -> None:
    """Drop the whole pages of a file-mapped range from the process's resident memory (madvise DONTNEED): they
    are read-only file pages, so a later access would only map them again from the page cache."""
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = -(-address // page) * page, (address + length) // page * page
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def resolve_draft_quantization(value: str | None) -> str:
    """"int8" or "none" (None is "none")."""
    name = "none" if value is None else str(value).strip().lower()
    if name not in DRAFT_QUANTIZATIONS:
        raise SpecDecError(f"draft_quantization must be int8 or none, got {value!r}", field="draft_quantization")
    return name
