"""The prompt cache: both models' KV caches kept across requests with the token ids they hold, so that a request
prefills only what follows the longest prefix it shares with an earlier request's prompt and output.

Entries are whole DynamicCaches, one per model role ("target", "draft"), each holding keys and values for a
prefix of the entry's token ids. A request `take`s the entry sharing its longest prefix: all of it when its whole
sequence is the request's prefix (the next turn of a chat, the next step of an agent), else a copy of the shared
part, so that an entry another conversation still extends stays whole. The engine `put`s the caches back when the
request ends cleanly. At most `budget` bytes are held between requests, least recently used entries going first;
the check is made before an entry is stored, never after. The caches stay on the models' devices (GPU memory on
CUDA): nothing is moved to the host.

State (the entries and the counters) lives in one PromptCache per decoder, touched from the engine's thread only.
"""

import copy
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .errors import SpecDecError

ROLES = ("target", "draft")
# the default budget: at most the weights' own size, and at most this share of the memory the weights leave
SHARE_OF_FREE_MEMORY = 0.25


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token-id lists (compared in slices: C speed, not a loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


def default_budget(weights_bytes: int, memory_bytes: int | None) -> int:
    """The prompt cache's default byte budget: the weights' size, or a quarter of the memory they leave free if that
    is less (the rest stays for the request being decoded, the allocator and the system). 0 when the memory is not
    known."""
    if not memory_bytes:
        return 0
    return max(0, min(int(weights_bytes), int((memory_bytes - weights_bytes) * SHARE_OF_FREE_MEMORY)))


def memory_bytes(device: torch.device) -> int | None:
    """The memory the weights and caches share: a CUDA device's total, else the machine's RAM (or the cgroup's
    limit, in a container, where lower); None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as limit:
            text = limit.read().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total


def weights_bytes(*models) -> int:
    """The bytes of the models' parameters and buffers."""
    return sum(t.numel() * t.element_size() for model in models
               for t in (*model.parameters(), *model.buffers()))


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def cache_bytes(cache: DynamicCache) -> int:
    """The memory a cache holds: its tensors' storages (a crop keeps its storage until the next forward)."""
    seen, total = set(), 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is None:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def reusable(cache) -> bool:
    """Whether a cache can be kept and cropped to any prefix: a DynamicCache of full-attention layers only (a
    sliding-window layer drops what left its window, so it cannot go back that far)."""
    return isinstance(cache, DynamicCache) and all(
        getattr(layer, "is_croppable", True) and not getattr(layer, "is_sliding", False) for layer in cache.layers)


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions (nothing happens if fewer are cached)."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


def prefix_copy(cache: DynamicCache, length: int) -> DynamicCache:
    """A new cache holding copies of the first `length` positions; `cache` is left as it was."""
    copied = copy.copy(cache)
    copied.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        if getattr(layer, "is_initialized", False) and layer.keys is not None:
            new.keys = layer.keys[..., :length, :].clone()
            new.values = layer.values[..., :length, :].clone()
        copied.layers.append(new)
    return copied


@dataclass
class Entry:
    """One kept sequence: `token_ids`, and per role a cache holding keys and values of a prefix of them."""

    token_ids: list[int]
    caches: dict[str, DynamicCache]
    nbytes: int

    def lengths(self) -> dict[str, int]:
        return {role: cache_length(cache) for role, cache in self.caches.items()}


@dataclass(frozen=True)
class Held:
    """What the prompt cache holds now, and its budget."""

    entries: int
    nbytes: int
    budget: int


class PromptCache:
    """Entries in least-recently-used order within `budget` bytes; 0 turns the cache off."""

    def __init__(self, budget: int = 0):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise SpecDecError(f"the prompt cache's budget must be a byte count >= 0, got {budget!r}",
                               field="prompt_cache_bytes")
        self.budget = budget
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # the most recently used last
        self._next_key = 0
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> Held:
        return Held(len(self._entries), self.nbytes, self.budget)

    def entries(self) -> list[Entry]:
        """The entries, least recently used first (for tests and reports; do not mutate)."""
        return list(self._entries.values())

    def take(self, prompt: list[int]) -> dict[str, DynamicCache]:
        """The caches to start `prompt` from: per role, a cache holding a prefix of `prompt` of at most
        len(prompt) - 1 tokens (one is left to prefill, whose logits predict the first new token). Empty when no
        entry shares a token with it.

        The entry sharing the longest prefix serves (the most recently used, among equals). When its whole
        sequence is a prefix of the prompt it leaves the cache: the request extends it and puts it back. Otherwise
        the request gets copies of the shared part and the entry stays, for the sequence it continues."""
        best, best_key, shared = None, None, 0
        for key, entry in self._entries.items():  # oldest first: a later one of the same length wins
            n = common_prefix(entry.token_ids, prompt)
            if n and n >= shared:
                best, best_key, shared = entry, key, n
        usable = min(shared, len(prompt) - 1)
        if best is None or usable <= 0:
            return {}
        if shared >= len(best.token_ids):  # all of it: the request continues this sequence
            del self._entries[best_key]
            self.nbytes -= best.nbytes
            for cache in best.caches.values():
                crop(cache, usable)
            return dict(best.caches)
        self._entries.move_to_end(best_key)
        return {role: prefix_copy(cache, min(usable, cache_length(cache))) for role, cache in best.caches.items()}

    def put(self, token_ids: list[int], caches: dict[str, DynamicCache]) -> bool:
        """Keep `caches` (each holding keys and values of a prefix of `token_ids`) as the most recent entry,
        evicting the least recently used ones until it fits the budget; False (nothing kept, nothing evicted) when
        it cannot fit at all. Entries whose sequence is a prefix of this one, with no cache longer than its, go:
        every prompt they would serve, it serves as well."""
        caches = {role: cache for role, cache in caches.items() if cache_length(cache) > 0}
        if not self.enabled or not token_ids or not caches:
            return False
        if any(cache_length(cache) > len(token_ids) or not reusable(cache) for cache in caches.values()):
            raise ValueError("a prompt cache entry must hold a prefix of its token ids, in full-attention caches")
        for cache in caches.values():  # a kept cache holds its positions only: a growing layer's room goes
            for layer in cache.layers:
                if hasattr(layer, "compact"):
                    layer.compact()
        entry = Entry(list(token_ids), caches, sum(cache_bytes(cache) for cache in caches.values()))
        if entry.nbytes > self.budget:
            return False
        lengths = entry.lengths()
        for key, old in list(self._entries.items()):
            if (len(old.token_ids) <= len(token_ids) and token_ids[: len(old.token_ids)] == old.token_ids
                    and all(n <= lengths.get(role, 0) for role, n in old.lengths().items())):
                self._drop(key)
        while self.nbytes + entry.nbytes > self.budget:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_key] = entry
        self._next_key += 1
        self.nbytes += entry.nbytes
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
