"""cpu/attention.py: grouped-query SDPA without repeated heads matches the library's attention exactly."""

import copy

import pytest
import torch
from transformers import DynamicCache

from specdec import SpeculativeDecoder
from specdec.cpu.attention import GQA_ATTENTION, restore_attention, use_gqa_attention
from tests.support.models import make_model, perturbed_copy


def _logits_with_cache(model, ids, context, new):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        if context:
            model(input_ids=ids[:, :context], cache=cache, use_cache=True)
        return model(input_ids=ids[:, context:context + new], cache=cache, use_cache=True).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_multi_token_forward_with_cache_matches_sdpa(arch, monkeypatch):
    sdpa, grouped_calls = torch.nn.functional.scaled_dot_product_attention, []

    def counting_sdpa(*args, **kwargs):
        query, mask = args[0], kwargs.get("attn_mask")
        grouped_calls.append(kwargs.get("enable_gqa", False) and mask is not None and query.shape[2] > 1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    stock = make_model(arch, seed=0, hidden=64, initializer_range=0.1)
    assert stock.config._attn_implementation == "sdpa"
    grouped = copy.deepcopy(stock)
    assert use_gqa_attention(grouped)
    assert grouped.config._attn_implementation == GQA_ATTENTION
    assert stock.config._attn_implementation == "sdpa"  # other models are untouched
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    for context, new in ((0, 30), (12, 1), (12, 2), (12, 5), (25, 5)):
        torch.testing.assert_close(_logits_with_cache(grouped, ids, context, new),
                                   _logits_with_cache(stock, ids, context, new), atol=1e-5, rtol=1e-5)
    assert any(grouped_calls)  # masked multi-token forwards took the grouped path (the library's sdpa never does)


def test_greedy_unchanged_and_reversible():
    stock = make_model("qwen2", seed=0, hidden=64, initializer_range=0.1)
    draft = perturbed_copy(stock, noise=0.3)
    reference = SpeculativeDecoder(draft, stock).generate([1, 2, 3], max_new_tokens=30, method="target",
                                                          temperature=0).token_ids
    grouped, grouped_draft = copy.deepcopy(stock), copy.deepcopy(draft)
    assert use_gqa_attention(grouped) and use_gqa_attention(grouped_draft)
    for method in ("google", "deepmind", "target"):
        assert SpeculativeDecoder(grouped_draft, grouped).generate(
            [1, 2, 3], max_new_tokens=30, method=method, gamma=4, temperature=0).token_ids == reference
    assert restore_attention(grouped)
    assert grouped.config._attn_implementation == "sdpa"
    assert not restore_attention(grouped)


def test_models_without_grouped_heads_or_sdpa_are_left_alone():
    assert not use_gqa_attention(make_model("gpt2"))  # no grouped heads
    eager = make_model("llama")
    eager.set_attn_implementation("eager")
    assert not use_gqa_attention(eager)
    assert eager.config._attn_implementation == "eager"
