"""cpu/decoder.py: a grouped Llama or Qwen2 model's forwards of a few tokens after cached ones as one native call
per decoder layer, bitwise the fused forward's (so the library's): logits, keys and values through prefills,
steps, verification-wide forwards and rollbacks, for 4-, 8- and mixed-bit layers, draft or target. First forwards,
prefills and other models keep the fused forward. The exactness and greedy tests over grouped pairs
(tests/test_grouped.py) run through it."""

import pytest
import torch
from torch import nn

from specdec.cpu.attention import ROW_BY_ROW_MAX, use_gqa_attention
from specdec.cpu.decoder import NativeLayers, decoder_kernel
from specdec.cpu.grouped import GroupedLinear, grouped_kernel, quantize
from specdec.fused_forward import fused_forward
from specdec.kv_cache import CachedModel
from tests.support.models import make_model
from tests.test_fused_forward import STEPS, assert_bitwise, grouped, library_cached, run_steps

pytestmark = pytest.mark.skipif(not (grouped_kernel() and decoder_kernel()),
                                reason="the grouped and decoder kernels cannot be built here")


def tiny(arch: str, bits_of=lambda name: 8, **kwargs):
    model = grouped(make_model(arch, seed=6, hidden=64, tie_word_embeddings=False, **kwargs), bits_of)
    assert use_gqa_attention(model)
    return model


@pytest.fixture
def native_calls(monkeypatch) -> list[int]:
    """The number of rows of each native forward, as they happen."""
    calls = []
    original = NativeLayers.__call__
    monkeypatch.setattr(NativeLayers, "__call__",
                        lambda self, hidden, *args: calls.append(hidden.shape[1]) or original(self, hidden, *args))
    return calls


def run_through(model, ids: list[int], native: bool) -> tuple[list[torch.Tensor], CachedModel]:
    """STEPS through CachedModel, with the native layers or without (the fused forward's layers alone)."""
    cached = CachedModel(model)
    kept = cached._fused.native
    if not native:
        cached._fused.native = None
    try:
        return run_steps(cached, ids), cached
    finally:
        cached._fused.native = kept


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", ["4", "8", "mixed"])
def test_native_layers_give_the_fused_and_library_forwards_logits_bitwise(arch, bits, native_calls):
    bits_of = {"4": lambda name: 4, "8": lambda name: 8,
               "mixed": lambda name: 8 if name.endswith(("v_proj", "down_proj", "lm_head")) else 4}[bits]
    model = tiny(arch, bits_of, layers=3)
    assert isinstance(fused_forward(model).native, NativeLayers)
    ids = torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    fused, _ = run_through(model, ids, native=False)
    assert native_calls == []
    native, cached = run_through(model, ids, native=True)
    assert native_calls == [n for kind, n, _ in STEPS[1:] if kind == "forward"]  # all but the first forward
    assert_bitwise(fused, native)
    library = library_cached(model)
    library.forward(ids[:cached.length])  # the cache the native forwards left: the library's, bitwise
    for ours, theirs in zip(cached.cache.layers, library.cache.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Five tokens in one native forward give bitwise the logits of the same five fed one by one."""
    model = tiny("qwen2", lambda name: 4)
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    together, alone = CachedModel(model), CachedModel(model)
    together.forward(ids[:20])
    alone.forward(ids[:20])
    wide = together.forward(ids[20:25], keep=5)
    one_by_one = torch.cat([alone.forward([token]) for token in ids[20:25]])
    assert torch.equal(wide, one_by_one)


def test_first_forwards_and_prefills_keep_the_fused_forward(native_calls):
    cached = CachedModel(tiny("llama"))
    cached.forward(list(range(5)))  # a first forward: nothing cached
    cached.forward([i % 64 for i in range(ROW_BY_ROW_MAX + 1)])  # wider than verification: a prefill
    cached.forward([1])
    cached.forward([2, 3, 4])
    assert native_calls == [1, 3]


def test_other_models_keep_the_fused_forward():
    assert fused_forward(make_model("llama", seed=6, hidden=64)).native is None  # float linears
    assert fused_forward(grouped(make_model("llama", seed=6, hidden=64))).native is None  # the library's sdpa
    partly = tiny("qwen2")
    layer = partly.model.layers[0].mlp
    layer.down_proj = nn.Linear(layer.down_proj.in_features, layer.down_proj.out_features, bias=False)
    assert fused_forward(partly).native is None  # one projection in float


def test_weights_replaced_are_read_again():
    model = tiny("qwen2")
    before = fused_forward(model)
    assert before.native is not None
    down = model.model.layers[1].mlp.down_proj
    model.model.layers[1].mlp.down_proj = GroupedLinear(quantize(torch.randn(down.out_features, down.in_features), 8))
    after = fused_forward(model)
    assert after is not before and after.native is not None
    assert after.native.layers[1].weights[-6] is model.model.layers[1].mlp.down_proj.q
