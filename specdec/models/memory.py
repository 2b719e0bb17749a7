"""The process's memory: CPU weights in the process's own (anonymous) memory rather than memory-mapped from their
files, and freed pages handed back to the system."""

import ctypes
import os


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
