"""cpu/decoder.py: a grouped draft's few-token forwards as one native call per decoder layer. Its layers give the
library's values to float rounding (the sums run in another order), each row alone (bitwise the same whatever the
rows beside it); its keys and values go into the request's cache, which rolls back as before; prefills keep the
fused forward. Speculative decoding with such a draft stays exact: chi-square tests and greedy equivalence."""

import copy

import pytest
import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdec import SpeculativeDecoder
from specdec.cpu.attention import use_gqa_attention
from specdec.cpu.decoder import MARK, NATIVE_ROWS, NativeLayers, decoder_kernel, use_native_step
from specdec.cpu.grouped import grouped_kernel
from specdec.fused_forward import fused_forward
from specdec.kv_cache import CachedModel, growing_cache
from specdec.models.kernels import prepare_draft
from tests.support.models import make_model
from tests.test_exactness import DRAFTER_SAMPLES, SETTINGS, draw, exact_distribution, goodness_of_fit
from tests.test_fused_forward import STEPS, grouped
from tests.test_grouped import HYBRID_PROMPT, grouped_model, perturbed_copy

pytestmark = pytest.mark.skipif(not (grouped_kernel() and decoder_kernel()),
                                reason="the grouped and decoder kernels cannot be built here")


def native(model):
    """A copy of a grouped model whose few-token forwards take the native layers."""
    model = copy.deepcopy(model)
    assert use_native_step(model)
    assert isinstance(fused_forward(model).native, NativeLayers)
    return model


def tiny(arch: str, bits: int, **kwargs):
    model = grouped(make_model(arch, seed=6, hidden=64, tie_word_embeddings=False, **kwargs), lambda name: bits)
    use_gqa_attention(model)
    return model


def layer_by_layer(model, ids: torch.Tensor, cached: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each decoder layer's output for the tokens of ids after its first `cached` (fed before, by the library's
    forward), through the library's layer and through the native one, each layer given the library's input (so
    that one layer's rounding does not move the next one's int8 steps): [(library, native)]; each layer's keys
    and values compared on the way."""
    forward = fused_forward(model)
    caches = [growing_cache(model.config), growing_cache(model.config)]
    native_layers, forward.native = forward.native, None
    for cache in caches:
        if cached:
            forward(ids[:, :cached], cache, 1)
    forward.native = native_layers
    hidden = forward.inner.embed_tokens(ids[:, cached:])
    n = hidden.shape[1]
    position_ids = (torch.arange(n) + cached).unsqueeze(0)
    cos, sin = forward.inner.rotary_emb(hidden, position_ids)
    mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=caches[0],
                              position_ids=position_ids)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, None)
    library, out = hidden, []
    shape = hidden.new_empty(1, forward.native.kv_heads, n, forward.native.head_dim)
    for index, (layer, step) in enumerate(zip(forward.layers, forward.native.layers)):
        keys, values, held = caches[1].layers[index].reserve(shape, shape)
        rows = torch.ops.specdec_decoder.decoder_layer(
            library[0].contiguous(), step.weights, step.meta, keys, values, held, cos[0].contiguous(),
            sin[0].contiguous(), forward.native.input_eps, forward.native.post_eps, forward.native.scaling,
            forward.native.heads)
        library = forward._layer(layer, index, library, mask, (cos, sin), caches[0], attend)
        out.append((library[0], rows))
        for name in ("keys", "values"):
            held = [getattr(cache.layers[index], name) for cache in caches]
            assert held[0].shape == held[1].shape and torch.allclose(*held, rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [4, 8])
@torch.inference_mode()
def test_each_native_layer_gives_the_library_layers_values_to_rounding(arch, bits):
    """Within float rounding (outputs about 0.1 here; 1e-4 allows the grouped operator's int8 rounding of an
    input 1e-7 from a rounding boundary to step the other way inside the layer, which moved 4-bit outputs by 2e-5;
    a position off by one moves them by 1e-3 and more, test_a_wrong_rotation_would_show)."""
    model = native(tiny(arch, bits, layers=3))
    ids = torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(1))
    for cached, n in ((0, 5), (6, 5), (14, 1)):  # a first forward, a verification-wide one, a step
        for library, ours in layer_by_layer(model, ids[:, :cached + n], cached):
            assert torch.allclose(library, ours, rtol=0, atol=1e-4), (library - ours).abs().max()


@torch.inference_mode()
def test_a_wrong_rotation_would_show():
    """The comparison above can fail: new tokens rotated one position off, after cached ones, come out far
    further apart than its tolerance."""
    model = native(tiny("qwen2", 8, layers=1, initializer_range=0.3))  # attention far from uniform
    forward = fused_forward(model)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    outs = []
    for shift in (0, 1):
        cache, native_layers = growing_cache(model.config), forward.native
        forward.native = None
        forward(ids[:, :6], cache, 1)
        forward.native = native_layers
        hidden = forward.inner.embed_tokens(ids[:, 6:])
        cos, sin = forward.inner.rotary_emb(hidden, (torch.arange(2) + 6 + shift).unsqueeze(0))
        outs.append(forward.native(hidden, cache, cos, sin))
    assert (outs[0] - outs[1]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_logits_stay_near_the_librarys_through_steps_and_rollbacks(arch):
    """The forwards of STEPS (prefills, steps, verification-wide forwards, rollbacks) through CachedModel: the
    native draft's logits near the library's. The int8 rounding of the grouped operator's input can flip by one
    where the inputs differ in the last bit, a few thousandths of a logit here."""
    model = tiny(arch, 4)
    ours = native(model)
    ids = torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    caches = [CachedModel(model), CachedModel(ours)]
    caches[0]._fused = None  # the library's own forward
    at = 0
    for kind, n, keep in STEPS:
        if kind == "rollback":
            for cache in caches:
                cache.rollback(n)
            at = n
            continue
        library, got = (cache.forward(ids[at:at + n], keep=keep) for cache in caches)
        assert got.shape == library.shape
        assert torch.allclose(library, got, atol=2e-2), (library - got).abs().max()
        assert torch.equal(library.argmax(-1), got.argmax(-1))
        at += n


def test_a_row_does_not_depend_on_the_rows_beside_it():
    """Five tokens in one native forward give bitwise the logits of the same five fed one by one."""
    model = native(tiny("qwen2", 4))
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    together, alone = CachedModel(model), CachedModel(model)
    together.forward(ids[:20])
    alone.forward(ids[:20])
    wide = together.forward(ids[20:25], keep=5)
    one_by_one = torch.cat([alone.forward([token]) for token in ids[20:25]])
    assert torch.equal(wide, one_by_one)


def test_prefills_keep_the_fused_forward(monkeypatch):
    model = native(tiny("llama", 8))
    calls = []
    original = NativeLayers.__call__
    monkeypatch.setattr(NativeLayers, "__call__", lambda self, *args: calls.append(args[0].shape[1]) or
                        original(self, *args))
    cached = CachedModel(model)
    cached.forward(list(range(NATIVE_ROWS + 1)))
    cached.forward([1])
    cached.forward([2, 3, 4])
    assert calls == [1, 3]


def test_only_grouped_drafts_are_marked_and_prepare_draft_marks_them():
    float_model = make_model("llama", seed=6, hidden=64)
    prepare_draft(float_model)
    assert MARK not in float_model.__dict__ and fused_forward(float_model).native is None
    model = tiny("qwen2", 4)
    prepare_draft(model)
    assert isinstance(fused_forward(model).native, NativeLayers)
    assert fused_forward(tiny("qwen2", 4)).native is None  # a target (not marked) keeps the fused forward


@pytest.fixture(scope="module")
def native_pair():
    """test_grouped's grouped_pair with the native draft: one-layer Llama models over 8 tokens, hidden 64."""
    from tests.test_exactness import VOCAB

    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=1, hidden=64, initializer_range=0.3)
    draft = grouped_model(perturbed_copy(target, noise=0.05))
    return native(draft), grouped_model(target)


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, variant", [("model", "token", "google"), ("model", "block", "deepmind"),
                                                    ("hybrid", "token", "deepmind"), ("hybrid", "block", "google")])
def test_native_draft_samples_follow_target_distribution(native_pair, monkeypatch, drafter, rule, variant):
    draft, target = native_pair
    calls = []
    original = NativeLayers.__call__
    monkeypatch.setattr(NativeLayers, "__call__", lambda self, *args: calls.append(1) or original(self, *args))
    prompt = HYBRID_PROMPT if drafter == "hybrid" else [1, 2, 3, 1, 2, 3, 1, 2]
    setting = SETTINGS["t0.8-topk5-topp0.9"]
    totals = {}
    counts = draw(SpeculativeDecoder(draft, target), variant, setting, DRAFTER_SAMPLES, seed=41, prompt=prompt,
                  totals=totals, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, exact_distribution(target, *setting, prompt=prompt), DRAFTER_SAMPLES) > 1e-3
    assert len(calls) >= DRAFTER_SAMPLES  # the draft's steps were native
    assert totals[("accepted_by_drafter", "model")] > 0


@pytest.mark.parametrize("drafter, method", [("model", "google"), ("model", "deepmind"), ("hybrid", "google"),
                                             ("model", "adaptive")])
def test_native_draft_greedy_output_equals_target_only(drafter, method):
    target = grouped_model(make_model("llama", seed=0, vocab_size=100, hidden=64, initializer_range=0.3))
    draft = native(grouped_model(perturbed_copy(make_model("llama", seed=0, vocab_size=100, hidden=64,
                                                           initializer_range=0.3), noise=0.05)))
    decoder = SpeculativeDecoder(draft, target)
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = decoder.generate(prompt, max_new_tokens=40, method="target", temperature=0,
                                 eos_token_id=[]).token_ids
    result = decoder.generate(prompt, max_new_tokens=40, method="google" if method == "adaptive" else method,
                              gamma=None if method == "adaptive" else 4, temperature=0, drafter=drafter,
                              eos_token_id=[])
    assert result.token_ids == reference
    assert result.stats.accepted > 0
