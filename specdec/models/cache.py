"""Where specdec keeps what it computes once: converted models and ready forms, under `$SPECDEC_CACHE`."""

import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted models live: $SPECDEC_CACHE, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec").expanduser()


def in_cache(folder) -> bool:
    """Whether a model folder lies inside the cache (a converted model, whose ready forms are kept beside it)."""
    return cache_root().resolve() in Path(folder).resolve().parents


def int8_form_path(folder: Path) -> Path:
    """Where the int8 form of the draft converted in `folder` is kept (`quantization.int8_draft_form`'s file)."""
    return cache_root() / "ready" / f"{Path(folder).name}.int8.safetensors"


def shipped_form_path(folder: Path, requantize: int | None = None) -> Path:
    """Where the packed GGUF weights of the model converted in `folder` are kept (`shipped.shipped_form`'s file;
    `requantize`: those requantized to that many bits, a file of their own)."""
    suffix = "shipped" if requantize is None else f"shipped-int{requantize}"
    return cache_root() / "ready" / f"{Path(folder).name}.{suffix}.safetensors"
