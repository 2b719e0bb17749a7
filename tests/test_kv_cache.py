"""kv_cache.py: rollback through the Cache API gives the same logits as a fresh forward, for each architecture."""

import pytest
import torch

from specdec.kv_cache import CachedModel, context_length
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
