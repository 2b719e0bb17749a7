"""cpu_linear.py: packed linears reproduce the stock forward and keep greedy outputs unchanged."""

import copy

import pytest
import torch

from conftest import ARCHITECTURES, make_model, perturbed_copy
from specdec import SpeculativeDecoder
from specdec.cpu_linear import (PackedLinear, pack_linears, packing_supported, quantization_supported,
                                 quantize_linears, unpack_linears)

pytestmark = pytest.mark.skipif(not packing_supported(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_packed_forward_matches_stock(arch):
    stock = make_model(arch, seed=0, hidden=64, initializer_range=0.1)
    packed = copy.deepcopy(stock)
    assert pack_linears(packed) > 0
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    ids = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (1, 2, 5, 17):
            torch.testing.assert_close(packed(input_ids=ids[:, :rows]).logits, stock(input_ids=ids[:, :rows]).logits,
                                       atol=1e-4, rtol=1e-4)


def test_greedy_unchanged_and_reversible():
    stock = make_model("qwen2", seed=0, hidden=64, initializer_range=0.1)
    draft = perturbed_copy(stock, noise=0.3)
    reference = SpeculativeDecoder(draft, stock).generate([1, 2, 3], max_new_tokens=30, method="target",
                                                          temperature=0).token_ids
    packed = copy.deepcopy(stock)
    pack_linears(packed)
    for method in ("google", "deepmind", "target"):
        assert SpeculativeDecoder(draft, packed).generate([1, 2, 3], max_new_tokens=30, method=method,
                                                          temperature=0).token_ids == reference
    assert unpack_linears(packed) > 0
    assert not any(isinstance(m, PackedLinear) for m in packed.modules())
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids).logits, stock(input_ids=ids).logits)


def test_unpacking_ties_a_tied_output_layer_again():
    model = make_model("qwen2", seed=0, hidden=64, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        pack_linears(model)
        assert isinstance(model.lm_head, PackedLinear)
        assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})  # no second copy
        unpack_linears(model)
        assert model.lm_head.weight is model.get_input_embeddings().weight
        assert torch.equal(model(input_ids=ids).logits, reference)


def test_half_precision_is_left_alone():
    model = make_model("llama").to(torch.bfloat16)
    assert pack_linears(model) == 0


def _float_linears(model):
    return [m for m in model.modules() if type(m) in (torch.nn.Linear, PackedLinear)]


@pytest.mark.skipif(not quantization_supported(), reason="this torch build has no int8 engine")
@pytest.mark.parametrize("packed_first", [False, True])
def test_int8_draft_is_close_and_keeps_greedy_equivalence(packed_first):
    target = make_model("qwen2", seed=0, hidden=64, initializer_range=0.1)
    draft = perturbed_copy(target, noise=0.3)
    quantized = copy.deepcopy(draft)
    if packed_first:
        pack_linears(quantized)
    assert quantize_linears(quantized) == len(_float_linears(draft)) > 0
    assert not _float_linears(quantized)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference, approx = draft(input_ids=ids).logits, quantized(input_ids=ids).logits
    assert not torch.equal(reference, approx)  # it really is another model
    assert (reference - approx).abs().max() < 0.1 * reference.abs().max()
    greedy = SpeculativeDecoder(draft, target).generate([1, 2, 3], max_new_tokens=30, method="target",
                                                        temperature=0).token_ids
    for method in ("google", "deepmind"):
        assert SpeculativeDecoder(quantized, target).generate([1, 2, 3], max_new_tokens=30, method=method,
                                                              temperature=0, gamma=3).token_ids == greedy


def test_int8_leaves_half_precision_alone():
    model = make_model("llama").to(torch.bfloat16)
    assert quantize_linears(model) == 0
    assert len(_float_linears(model)) > 0
