"""Safetensors checkpoints as files, without torch: whether one is whole, its header, a folder's checkpoint files
and their fingerprint. `make serve` checks the cache with these before torch is imported."""

import hashlib
import json
import math
from pathlib import Path

SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                           "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit


class WeightsError(ValueError):
    """A checkpoint or ready form that cannot be used as it is (truncated, wrong hash, shapes or key)."""


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (no readable header, or a length other than the header says)."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors file"
        length = int.from_bytes(head, "little")
        if length > min(size - 8, MAX_SAFETENSORS_HEADER):
            return f"its header claims {length:,} bytes, but the file has {size:,} (truncated?)"
        try:
            header = json.loads(file.read(length))
            end = 0
            for name, tensor in header.items():
                if name == "__metadata__":
                    continue
                begin, stop = tensor["data_offsets"]
                itemsize = SAFETENSORS_DTYPE_BYTES.get(tensor["dtype"])
                if itemsize is not None and stop - begin != math.prod(tensor["shape"]) * itemsize:
                    return f"tensor {name} has {stop - begin:,} bytes for shape {tensor['shape']}"
                end = max(end, stop)
        except (ValueError, TypeError, KeyError, AttributeError):
            return "its header is not valid safetensors JSON"
    if 8 + length + end != size:
        return f"it has {size:,} bytes, but its header describes {8 + length + end:,} (truncated or overwritten?)"
    return None


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and the offset of its data; WeightsError unless the file is whole."""
    problem = safetensors_problem(path)
    if problem:
        raise WeightsError(f"{path.name}: {problem}")
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    return header, 8 + length


def checkpoint_files(folder) -> list[Path] | None:
    """The safetensors files of a model folder (one file, or the shards its index names); None if it has none."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else None


def fingerprint(folder) -> dict:
    """What a form computed from a model folder depends on, cheaply: config.json's sha256, and per checkpoint file
    its size, modification time and the sha256 of its header (names, dtypes, shapes, offsets)."""
    folder = Path(folder)
    config = folder / "config.json"
    prints = {"config.json": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None}
    for path in checkpoint_files(folder) or []:
        stat = path.stat()
        with open(path, "rb") as file:
            head = file.read(8)
            header = file.read(min(int.from_bytes(head, "little"), MAX_SAFETENSORS_HEADER)) if len(head) == 8 else b""
        prints[path.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                             "header_sha256": hashlib.sha256(header).hexdigest()}
    return prints
