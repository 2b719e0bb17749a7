"""Model loading: a draft and a target (hub id, local folder, GGUF file or alias) and the pair's one tokenizer.

    draft, target, tokenizer = load_pair()                      # the default pair, from the local cache
    draft, target, tokenizer = load_pair("org/small", "org/big", device_map="auto")

The tokenizer is the target's, checked against the draft's before anything runs. Local folders, GGUF files and
the default pair never touch the hub; a hub id that cannot be loaded is one SpecDecError sentence.
"""

import logging
import os
import re
import socket
import time
import urllib.parse
from dataclasses import dataclass

import torch

from .errors import SpecDecError

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


def load_model(source: ModelSource, role: str, device: torch.device, dtype: torch.dtype, device_map=None,
               trust_remote_code: bool = False):
    """A causal LM in eval mode on `device` (or spread by accelerate's `device_map`) in `dtype`."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    kwargs = _pretrained_kwargs(source, trust_remote_code)
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **kwargs)
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
        raise _unreachable(source, role, "model", error) from None
    if device_map is None:
        model.to(device)
    model.eval()
    logger.info("loaded the %s model %s (%s, %s) in %.1f s", role, source, dtype,
                device_map if device_map is not None else device, time.perf_counter() - started)
    return model


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


def check_tokenizers(draft_tokenizer, target_tokenizer) -> None:
    """Speculative decoding needs one vocabulary: the same token for the same id, specials and added tokens too."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for token, i in target_vocab.items() if draft_vocab.get(token) != i)
        raise SpecDecError(
            f"the draft and target tokenizers differ: the draft's vocabulary has {len(draft_vocab)} tokens, the "
            f"target's {len(target_vocab)}, and {differing} of the target's tokens have another id or none in the "
            f"draft", field="draft_model")


def load_pair(draft: str | None = None, target: str | None = None, device: str = "auto", dtype: str = "auto",
              device_map=None, trust_remote_code: bool = False, cpu_kernels: bool = True,
              draft_quantization: str | None = "int8"):
    """(draft_model, target_model, tokenizer) ready for SpeculativeDecoder; None or "default" is the default pair.

    `device_map` (e.g. "auto") spreads the target over several GPUs with accelerate; the draft stays on `device`.
    `cpu_kernels`: float32 CPU linear layers computed by our few-rows kernel (or packed once by oneDNN where it
    cannot be built; specdec.cpu.linear), so verifying gamma tokens in one target forward costs about what one
    token does, CPU attention over grouped heads skips copying the cache per head (specdec.cpu.attention), and
    CPU weights are copied out of the memory-mapped checkpoint into the process's memory (`use_own_memory`);
    models elsewhere or in half precision keep the library's kernels.
    `draft_quantization`: "int8" (default) quantizes a float32 CPU draft's linear layers to int8, which makes
    proposing 2.5-3x cheaper; outputs stay exactly the target's, since the rejection rule uses the quantized
    draft's own probabilities. "none" (or None) keeps the draft as loaded. The target is never quantized.
    """
    from .engine import check_vocabularies

    draft_quantization = resolve_draft_quantization(draft_quantization)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    target_source = resolve_source(target, "target")
    draft_source = resolve_source(draft, "draft")

    # tokenizers first: a mismatched pair fails before any weights are read
    tokenizer = load_tokenizer(target_source, "target", trust_remote_code) if has_tokenizer(target_source) else None
    if has_tokenizer(draft_source):
        draft_tokenizer = load_tokenizer(draft_source, "draft", trust_remote_code)
        if tokenizer is None:
            tokenizer = draft_tokenizer
        else:
            check_tokenizers(draft_tokenizer, tokenizer)
    if tokenizer is None:
        raise SpecDecError(f"neither {target_source} nor {draft_source} has a tokenizer", field="target_model")

    target_model = load_model(target_source, "target", device, dtype, device_map, trust_remote_code)
    draft_model = load_model(draft_source, "draft", device, dtype, None, trust_remote_code)
    check_vocabularies(draft_model, target_model, tokenizer)
    vocab_size = target_model.config.get_text_config(decoder=True).vocab_size
    if len(tokenizer) > vocab_size:
        raise SpecDecError(f"the tokenizer has {len(tokenizer)} tokens but the models only {vocab_size} logits",
                           field="target_model")
    apply_cpu_kernels(draft_model, target_model, draft_quantization, cpu_kernels)
    return draft_model, target_model, tokenizer


def apply_cpu_kernels(draft_model, target_model, draft_quantization: str = "none", cpu_kernels: bool = True) -> bool:
    """What `load_pair` does to a loaded pair, in place: the int8 draft, few-rows (or packed) linears, grouped-head
    attention, CPU weights in the process's own memory.

    Each step touches float32 (or sdpa) CPU layers only; models on CUDA or in half precision are left as loaded.
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
    """The draft's half of `apply_cpu_kernels`: int8 if asked, then CPU kernels for what stays float32."""
    from .cpu.linear import quantize_linears

    if draft_quantization == "int8":
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
    """Copy a model's CPU parameters into the process's own memory, in place; returns the bytes copied.

    `from_pretrained` leaves safetensors weights memory-mapped from the checkpoint file, in the page cache. On our
    CPUs a forward that streams all the weights runs about 20% faster from the process's own (anonymous) memory
    (the target: 336-350 ms against 413-515 for one new token; see the README). A tied weight is one parameter,
    copied once, and stays tied.
    """
    copied = 0
    for param in model.parameters():
        if param.device.type == "cpu":
            param.data = param.data.clone()
            copied += param.numel() * param.element_size()
    return copied


def resolve_draft_quantization(value: str | None) -> str:
    """"int8" or "none" (None is "none")."""
    name = "none" if value is None else str(value).strip().lower()
    if name not in DRAFT_QUANTIZATIONS:
        raise SpecDecError(f"draft_quantization must be int8 or none, got {value!r}", field="draft_quantization")
    return name
