"""Weights read straight into the process's own memory, and ready forms of models kept in the cache.

`read_safetensors` reads a checkpoint tensor by tensor into anonymous memory with positional reads, in a few
threads: no memory map, so no file-backed copy of a tensor ever sits beside its own-memory copy, and each byte is
copied once, from the page cache into the tensor that the model keeps.

A ready form is what loading computes from a checkpoint and can keep (the int8 draft). It is one safetensors
file, written to a temporary name and renamed into place, whose header records the key it was made under (the
library versions, the machine, the source checkpoint, the code that made it) and a sha256 per tensor.
`ReadyForm.load` uses it only when the key matches, the file is whole, every tensor has the expected name, shape
and dtype, and every hash matches; otherwise it says why and returns None, and the caller builds the form again.
"""

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..threads import thread_map
from .checkpoint import WeightsError, read_header

logger = logging.getLogger(__name__)

READ_THREADS = 2  # two readers nearly halve the time to fill fresh memory on our 2-core machines
READ_CHUNK = 64 << 20
STALE_TEMPORARY_SECONDS = 3600  # a temporary file older than this was left by a killed writer
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}
READY_METADATA = "specdec_ready"  # the header's __metadata__ entry holding the key and the hashes


def _read_into(fd: int, tensor: torch.Tensor, offset: int) -> memoryview:
    """Fill `tensor` (contiguous) from the file at `offset`; returns its bytes."""
    buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:done + READ_CHUNK]], offset + done)
        if count <= 0:
            raise WeightsError(f"the file ended {len(buffer) - done} bytes early")
        done += count
    return buffer


def read_safetensors(path, dtype: torch.dtype | None = None, digests: dict[str, str] | None = None,
                     threads: int = READ_THREADS, cancel: threading.Event | None = None,
                     skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file but those named in `skip`, in the process's own memory (floating-point
    ones cast to `dtype` if given, one tensor at a time). With `digests` (name: sha256 hex), each tensor is hashed as it is read and a
    mismatch, or a tensor without a digest, is a WeightsError. Setting `cancel` stops the reading (WeightsError)."""
    path = Path(path)
    header, data_start = read_header(path)
    entries = sorted(((name, entry) for name, entry in header.items() if name != "__metadata__" and name not in skip),
                     key=lambda item: item[1]["data_offsets"][0])
    for name, entry in entries:
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise WeightsError(f"{path.name}: tensor {name} has the unsupported dtype {entry['dtype']}")
        if digests is not None and name not in digests:
            raise WeightsError(f"{path.name}: tensor {name} has no recorded hash")

    fd = os.open(path, os.O_RDONLY)
    try:
        def read(item):
            name, entry = item
            if cancel is not None and cancel.is_set():
                raise WeightsError(f"{path.name}: reading cancelled")
            tensor = torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
            data = _read_into(fd, tensor, data_start + entry["data_offsets"][0])
            if digests is not None and hashlib.sha256(data).hexdigest() != digests[name]:
                raise WeightsError(f"{path.name}: tensor {name} does not match its recorded sha256")
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            return name, tensor

        return dict(thread_map(read, entries, threads))
    finally:
        os.close(fd)


class ReadyForm:
    """One ready form of one model: a safetensors file at `path`, valid only under `key` (a JSON-able dict)."""

    def __init__(self, path, key: dict):
        self.path = Path(path)
        self.key = json.loads(json.dumps(key, sort_keys=True))  # as it reads back from the header

    def looks_current(self) -> bool:
        """Whether the form exists, is whole and was made under this key: the cheap part of `load`'s checks (no
        tensor is read or hashed)."""
        try:
            header, _ = read_header(self.path)
            record = json.loads(header.get("__metadata__", {}).get(READY_METADATA, "null"))
        except (WeightsError, OSError, ValueError, AttributeError):
            return False
        return isinstance(record, dict) and record.get("key") == self.key

    def load(self, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor] | None:
        """The form's tensors, if it exists, was made under this key, holds exactly `expected` (name: (shape,
        dtype)) and every tensor matches its hash; else None, with one log line saying why it is not used."""
        if not self.path.is_file():
            logger.debug("no ready form at %s yet", self.path)
            return None
        try:
            header, _ = read_header(self.path)
            record = json.loads(header.get("__metadata__", {}).get(READY_METADATA, "null"))
            key = record.get("key") if isinstance(record, dict) else None
            if key != self.key:
                changed = [name for name in self.key if not isinstance(key, dict) or key.get(name) != self.key[name]]
                raise WeightsError(f"it was made under another key (differs in: {', '.join(changed) or 'extra entries'})")
            found = {name: (tuple(entry["shape"]), SAFETENSORS_DTYPES.get(entry["dtype"]))
                     for name, entry in header.items() if name != "__metadata__"}
            wanted = {name: (tuple(shape), dtype) for name, (shape, dtype) in expected.items()}
            if found != wanted:
                different = sorted(set(found) ^ set(wanted)) or sorted(n for n in wanted if found[n] != wanted[n])
                raise WeightsError(f"its tensors are not the expected ones (first difference: {different[0]})")
            return read_safetensors(self.path, digests=record.get("sha256", {}))
        except (WeightsError, OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            logger.warning("not using the ready form %s: %s; building it again", self.path, error)
            return None

    def save(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write the form atomically (a temporary file renamed into place), with the key and a sha256 per tensor."""
        from safetensors.torch import save_file

        started = time.perf_counter()
        tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
        digests = {name: hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).hexdigest()
                   for name, t in tensors.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.path.parent.glob(f".{self.path.name}.tmp-*"):
            if time.time() - stale.stat().st_mtime > STALE_TEMPORARY_SECONDS:
                stale.unlink(missing_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent)
        os.close(fd)
        try:
            save_file(tensors, temporary,
                      metadata={READY_METADATA: json.dumps({"key": self.key, "sha256": digests}, sort_keys=True)})
            with open(temporary, "rb") as file:
                os.fsync(file.fileno())
            os.chmod(temporary, 0o644)
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        logger.debug("saved the ready form %s (%.2f GB) in %.1f s", self.path, self.path.stat().st_size / 1e9,
                     time.perf_counter() - started)
