"""Where a model comes from and where it runs: model sources (hub id, local folder, GGUF file or an alias of the
default pair), devices, dtypes, whether the hub can be reached, and one sentence for a model that cannot be loaded."""

import logging
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass

import torch

from ..errors import SpecDecError

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
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's named ways to spread a model


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


def resolve_device_map(device_map):
    """None or "none": the target on `device`; one of accelerate's DEVICE_MAPS, its explicit map (a dict of module
    names to devices), or one device (a name torch knows, an index, a torch.device), as transformers takes them; a
    SpecDecError naming device_map otherwise (transformers' own came after the draft had loaded)."""
    if device_map is None or isinstance(device_map, (dict, torch.device)):
        return device_map
    if isinstance(device_map, int) and not isinstance(device_map, bool) and device_map >= 0:
        return device_map
    name = device_map.strip().lower() if isinstance(device_map, str) else None
    if name == "none":
        return None
    if name in DEVICE_MAPS:
        return name
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        raise SpecDecError(f"device_map must be none, {', '.join(DEVICE_MAPS)}, a device or a dict of module names "
                           f"to devices, got {device_map!r}", field="device_map") from None
    return name


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


def names_default_pair(name: str | None) -> bool:
    """Whether a model argument names a model of the default pair (None, "default" or an alias)."""
    return name is None or name == DEFAULT or name.lower() in ALIASES


def auto_confidence_threshold(draft: str | None, target: str | None) -> float:
    """draft_confidence_threshold "auto": the default pair's CONFIDENCE_THRESHOLD where both models name it, else 0."""
    from .default_pair import CONFIDENCE_THRESHOLD

    return CONFIDENCE_THRESHOLD if names_default_pair(draft) and names_default_pair(target) else 0.0


def resolve_source(name: str | None, role: str) -> ModelSource:
    """Turn a model argument into a ModelSource; the default pair is prepared (converted once) on first use."""
    field = f"{role}_model"
    if names_default_pair(name):
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


def pretrained_kwargs(source: ModelSource, trust_remote_code: bool) -> dict:
    kwargs = {"trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if source.offline:
        kwargs["local_files_only"] = True  # the libraries' offline mode, for this call only
    return kwargs


def load_error(source: ModelSource, role: str, what: str, error: Exception) -> SpecDecError:
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
