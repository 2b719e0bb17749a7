"""cpu/attention.py: grouped-query SDPA without repeated heads, row by row after cached tokens, matches the
library's attention."""

import copy

import pytest
import torch
from transformers import DynamicCache

from specdec import SpeculativeDecoder
from specdec.cpu.attention import GQA_ATTENTION, is_causal_mask, restore_attention, use_gqa_attention
from tests.support.models import make_model, perturbed_copy


def _logits_with_cache(model, ids, context, new, attention_mask=None):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        if context:
            model(input_ids=ids[:, :context], cache=cache, use_cache=True,
                  attention_mask=None if attention_mask is None else attention_mask[:, :context])
        return model(input_ids=ids[:, context:context + new], cache=cache, use_cache=True,
                     attention_mask=None if attention_mask is None else attention_mask[:, :context + new]).logits


def _recording_sdpa(monkeypatch):
    """(query rows, whether grouped and masked) of every SDPA call from here on."""
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recording(*args, **kwargs):
        calls.append((tuple(args[0].shape[1:3]),
                      kwargs.get("enable_gqa", False) and kwargs.get("attn_mask") is not None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def _stock_and_grouped(arch):
    stock = make_model(arch, seed=0, hidden=64, initializer_range=0.1)
    assert stock.config._attn_implementation == "sdpa"
    grouped = copy.deepcopy(stock)
    assert use_gqa_attention(grouped)
    assert grouped.config._attn_implementation == GQA_ATTENTION
    assert stock.config._attn_implementation == "sdpa"  # other models are untouched
    return stock, grouped


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_multi_token_forward_with_cache_matches_sdpa_row_by_row(arch, monkeypatch):
    calls = _recording_sdpa(monkeypatch)
    stock, grouped = _stock_and_grouped(arch)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    config = grouped.config
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    one_token = (kv_heads, config.num_attention_heads // kv_heads)  # a token's query heads as rows, per kv head
    assert one_token[1] > 1
    for context, new in ((0, 30), (12, 1), (12, 2), (12, 5), (25, 5)):
        expected = _logits_with_cache(stock, ids, context, new)
        calls.clear()
        torch.testing.assert_close(_logits_with_cache(grouped, ids, context, new), expected, atol=1e-5, rtol=1e-5)
        if context:  # the context's prefill, then one call per new token (decoded or verified) and layer
            assert [shape for shape, _ in calls[layers:]] == [one_token] * layers * new


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_padded_forward_takes_the_grouped_path_and_matches_sdpa(arch, monkeypatch):
    calls = _recording_sdpa(monkeypatch)
    stock, grouped = _stock_and_grouped(arch)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    padded = torch.ones(1, 20, dtype=torch.long)
    padded[0, :3] = 0  # left padding: not the plain causal mask
    for context, new in ((0, 20), (12, 5)):
        expected = _logits_with_cache(stock, ids, context, new, padded)
        calls.clear()
        torch.testing.assert_close(_logits_with_cache(grouped, ids, context, new, padded), expected,
                                   atol=1e-5, rtol=1e-5)
        assert all(grouped_masked for _, grouped_masked in calls[-grouped.config.num_hidden_layers:])


def test_causal_mask_recognised_only_when_plain():
    causal = torch.ones(3, 7, dtype=torch.bool).tril(4)[None, None]
    assert is_causal_mask(causal, 3, 7)
    assert not is_causal_mask(None, 3, 7)
    assert not is_causal_mask(causal.float(), 3, 7)
    assert not is_causal_mask(causal.expand(2, 1, 3, 7), 3, 7)  # two sequences
    padded = causal.clone()
    padded[..., 0] = False
    assert not is_causal_mask(padded, 3, 7)
    assert not is_causal_mask(torch.ones(1, 1, 3, 7, dtype=torch.bool), 3, 7)  # sees the future


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
