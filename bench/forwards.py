"""Forward costs: median milliseconds of one model forward by the number of new tokens after a cached context."""

import statistics
import time

import torch
from transformers import DynamicCache

from specdec.kv_cache import input_device


def forward_ms(model, context: int, new: int, device, repeats: int) -> float:
    """Median ms of one forward over `new` tokens after `context` cached tokens (the cache is cropped back)."""
    return forward_ms_by_width(model, context, [new], device, repeats)[new]


@torch.inference_mode()
def forward_ms_by_width(model, context: int, widths: list[int], device, repeats: int) -> dict[int, float]:
    """Median ms of one forward over each number of new tokens in `widths`, after `context` cached tokens. The
    widths take turns within each repeat, so a burst of load on a shared machine lands on all of them alike
    instead of on whichever was being measured."""
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, context + max(widths)),
                        generator=torch.Generator().manual_seed(0)).to(device)
    model(input_ids=ids[:, :context], cache=cache, use_cache=True)
    times: dict[int, list[float]] = {n: [] for n in widths}
    for _ in range(repeats + 2):  # the first two rounds warm up
        for n in widths:
            _sync(ids.device)
            start = time.perf_counter()
            model(input_ids=ids[:, context:context + n], cache=cache, use_cache=True, logits_to_keep=n)
            _sync(ids.device)
            times[n].append((time.perf_counter() - start) * 1e3)
            cache.crop(-n)
    return {n: statistics.median(ms[2:]) for n, ms in times.items()}


@torch.inference_mode()
def forward_ms_by_path(forwards: dict, configs: dict, paths: dict, widths, repeats: int, cached: int = 300) -> dict:
    """{"<role>-<path>-<n>": median ms} of each model's own forward (`forwards[role](ids, cache, n)`: the fused or
    native one CachedModel runs, not the library's) over n new tokens after `cached` ones, under each of `paths`
    (name -> a function of the role that switches the path on). Paths and widths take turns within each repeat, as
    in `forward_ms_by_width`; the first two repeats warm up."""
    from specdec.kv_cache import growing_cache

    times: dict[str, list[float]] = {}
    for role, forward in forwards.items():
        ids = torch.randint(0, min(configs[role].vocab_size, 30000), (1, cached + max(widths)),
                            generator=torch.Generator().manual_seed(0))
        cache = growing_cache(configs[role])
        forward(ids[:, :cached], cache, 1)
        for _ in range(repeats + 2):
            for path, switch in paths.items():
                switch(role)
                for n in widths:
                    start = time.perf_counter()
                    forward(ids[:, cached:cached + n], cache, n)
                    times.setdefault(f"{role}-{path}-{n}", []).append((time.perf_counter() - start) * 1e3)
                    cache.crop(-n)
    return {key: statistics.median(values[2:]) for key, values in times.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verification_cost(model, max_new: int, context: int = 128, repeats: int = 5) -> dict:
    """Target forward ms over 1..max_new new tokens, and each relative to one token."""
    device = input_device(model)
    ms = forward_ms_by_width(model, context, list(range(1, max_new + 1)), device, repeats)
    return {"context": context, "ms": ms, "relative": {n: v / ms[1] for n, v in ms.items()}}
