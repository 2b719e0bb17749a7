"""kv_cache.py: rollback through the Cache API gives the same logits as a fresh forward, for each architecture;
growing layers give the library cache's logits bitwise, append in place and share nothing with their copies."""

import pytest
import torch

from specdec.kv_cache import CachedModel, GrowingLayer, context_length
from tests.support.models import ARCHITECTURES, make_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_crop_then_forward_equals_fresh_forward(arch):
    model = make_model(arch, seed=3)
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    cached = CachedModel(model)
    cached.forward(ids[:6])
    cached.forward(ids[6:10] + [5, 7, 9], keep=7)  # speculative tokens beyond the committed prefix
    cached.rollback(10)
    assert cached.length == 10
    logits = cached.forward(ids[10:], keep=2)
    with torch.no_grad():
        fresh = model(input_ids=torch.tensor([ids])).logits[0, -2:]
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=1e-4)
    assert cached.length == 12


def test_rollback_beyond_length_is_noop():
    cached = CachedModel(make_model("llama"))
    cached.forward([1, 2, 3])
    cached.rollback(10)
    assert cached.length == 3


def test_context_length():
    assert context_length(make_model("gpt2", context=32)) == 32
    assert context_length(make_model("llama", context=48)) == 48
    assert context_length(make_model("bloom")) is None


def plain_cached(model) -> CachedModel:
    """The same model over the library's own DynamicCache (DynamicLayer: every update a torch.cat)."""
    from transformers import DynamicCache

    return CachedModel(model, DynamicCache(config=model.config))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_growing_layers_give_the_plain_caches_logits_bitwise_through_growth_and_rollbacks(arch, monkeypatch):
    """Prefill, decode, verify several tokens, roll back (across a growth of the buffers too) and go on: every
    logit is bitwise what the library's DynamicCache gives, and the cache holds the same keys and values."""
    monkeypatch.setattr("specdec.kv_cache.GROWTH_MIN", 4)  # grow often on a short sequence
    model = make_model(arch, seed=5)
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    growing, plain = CachedModel(model), plain_cached(model)
    assert any(isinstance(layer, GrowingLayer) for layer in growing.cache.layers)
    steps = [("forward", ids[:7], 1), ("forward", ids[7:8], 1), ("forward", ids[8:13], 5), ("rollback", 10, 0),
             ("forward", ids[10:11], 1), ("forward", ids[11:20], 9), ("rollback", 12, 0), ("rollback", 12, 0),
             *(("forward", [token], 1) for token in ids[12:30]), ("rollback", 3, 0), ("forward", ids[3:9], 6)]
    for kind, arg, keep in steps:
        if kind == "rollback":
            growing.rollback(arg)
            plain.rollback(arg)
            continue
        assert torch.equal(growing.forward(arg, keep=keep), plain.forward(arg, keep=keep))
        assert growing.length == plain.length
    for mine, theirs in zip(growing.cache.layers, plain.cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_a_growing_layer_appends_in_place_and_grows_by_a_quarter():
    """Room for a quarter more (at least GROWTH_MIN positions): appending within it writes in place, one more
    position moves everything into a buffer a quarter longer than it needs."""
    layer = GrowingLayer()
    keys = torch.randn(1, 2, 100, 4)
    layer.update(keys, keys + 1)
    assert layer._storage[0].shape[-2] == 100 + 256  # at least GROWTH_MIN
    layer.update(torch.randn(1, 2, 1000, 4), torch.randn(1, 2, 1000, 4))  # 1,100 held: a quarter is 275
    storage = layer._storage[0]
    assert storage.shape[-2] == 1100 + 275 and layer.keys.data_ptr() == storage.data_ptr()
    for _ in range(275):  # fills the room: no copy
        layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        assert layer._storage[0] is storage
    layer.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    assert layer._storage[0].shape[-2] == 1376 + 1376 // 4 and layer.get_seq_length() == 1376
    assert torch.equal(layer.keys[..., :100, :], keys) and torch.equal(layer.values[..., :100, :], keys + 1)


def test_a_prefix_copy_of_a_growing_cache_shares_nothing_with_it():
    """The prompt cache's copies: extending (or rolling back and extending) the copy leaves the original's keys as
    they were, and the other way round, also for a copy of the whole length."""
    from specdec.prompt_cache import prefix_copy

    model = make_model("qwen2", seed=2)
    source = CachedModel(model)
    source.forward(list(range(1, 12)))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in source.cache.layers]
    for length in (5, 11):
        copy = CachedModel(model, prefix_copy(source.cache, length))
        copy.forward([40, 41, 42])
        copy.rollback(length - 2)
        copy.forward([50, 51])
        for layer, (keys, values) in zip(source.cache.layers, before):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    source.rollback(4)
    source.forward([60, 61, 62, 63])
    assert torch.equal(copy.cache.layers[0].keys[..., :4, :], before[0][0][..., :4, :])


def test_a_kept_cache_holds_its_positions_only_and_grows_again_when_extended():
    """The prompt cache keeps a growing cache without its room (its byte count is the positions' bytes), and a
    request that takes it back extends it with the same logits as the library's cache."""
    from specdec.prompt_cache import PromptCache, cache_bytes

    model = make_model("llama", seed=4)
    ids = list(range(3, 23))
    growing, plain = CachedModel(model), plain_cached(model)
    growing.forward(ids[:15])
    plain.forward(ids[:15])
    assert cache_bytes(growing.cache) > cache_bytes(plain.cache)  # the room
    store = PromptCache(budget=10**9)
    assert store.put(ids[:15], {"target": growing.cache})
    assert cache_bytes(growing.cache) == cache_bytes(plain.cache)
    taken = store.take(ids)["target"]
    assert taken is growing.cache and growing.length == 15
    assert torch.equal(growing.forward(ids[15:], keep=5), plain.forward(ids[15:], keep=5))
