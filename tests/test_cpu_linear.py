"""cpu/linear.py: the few-rows kernel and packed linears reproduce the stock forward and keep greedy outputs."""

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdec import SpeculativeDecoder
from specdec.cpu.linear import (
    FewRowsLinear,
    PackedLinear,
    build_kernel,
    few_rows_kernel,
    pack_linears,
    packing_supported,
    quantization_supported,
    quantize_linears,
    unpack_linears,
)
from specdec.models.kernels import use_cpu_kernels
from tests.support.models import ARCHITECTURES, make_model, perturbed_copy

HAS_TOOLCHAIN = bool((shutil.which("c++") or shutil.which("g++")) and shutil.which("ninja"))
needs_kernel = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler or ninja to build the kernel")
# both ways pack_linears can go: our kernel, and oneDNN packing (what a machine without a compiler gets)
KINDS = [pytest.param(True, id="few-rows", marks=needs_kernel),
         pytest.param(False, id="packed", marks=pytest.mark.skipif(not packing_supported(), reason="no oneDNN"))]


def _kind(few_rows: bool):
    return FewRowsLinear if few_rows else PackedLinear


@needs_kernel
def test_kernel_builds_where_a_compiler_is():
    assert few_rows_kernel()


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(8, 16), (37, 53), (96, 1040), (3, 5), (3, 70)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_linear_and_is_batch_invariant(out_features, in_features, bias, dtype):
    assert few_rows_kernel()
    generator = torch.Generator().manual_seed(out_features * in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    x = torch.randn(20, in_features, generator=generator).to(dtype)
    one_by_one = [torch.ops.specdec.few_rows_linear(x[i:i + 1], weight, b) for i in range(len(x))]
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    for rows in range(1, 21):  # one chunk up to 8 rows, then equal chunks (9 as 5 + 4, 12 as 6 + 6, 20 as 7 + 7 + 6)
        out = torch.ops.specdec.few_rows_linear(x[:rows], weight, b)
        assert out.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(out, F.linear(x[:rows], weight, b), atol=1e-4, rtol=1e-5)
        else:  # float32 sums rounded once: within bfloat16's rounding (8 bits), as close as torch's own linear
            error = (out.double() - exact[:rows]).abs()
            assert (error <= 2 ** -8 * exact[:rows].abs() + 1e-3).all()
            assert error.max() <= 2 * (F.linear(x[:rows], weight, b).double() - exact[:rows]).abs().max() + 1e-6
        # each row summed in the same order whatever the number of rows: bitwise the one-row values
        assert torch.equal(out, torch.cat(one_by_one[:rows]))


@needs_kernel
def test_kernel_rejects_what_it_cannot_compute():
    assert few_rows_kernel()
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    for bad_x, bad_w in [(x.double(), weight.double()), (x.half(), weight.half()), (x.bfloat16(), weight),
                         (x, weight.bfloat16()), (x, weight.t()), (torch.randn(2, 7), weight),
                         (x, torch.randn(8, 4).t())]:
        with pytest.raises(RuntimeError, match="few_rows_linear"):
            torch.ops.specdec.few_rows_linear(bad_x, bad_w, None)


@needs_kernel
def test_a_broken_kernel_source_falls_back_with_a_warning(tmp_path, caplog):
    source = tmp_path / "broken_kernel.cpp"
    source.write_text("this is not C++\n")
    assert build_kernel(source) is False
    assert "could not be built" in caplog.text


@pytest.mark.parametrize("few_rows", KINDS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forward_matches_stock(arch, few_rows):
    stock = make_model(arch, seed=0, hidden=64, initializer_range=0.1)
    fast = copy.deepcopy(stock)
    assert pack_linears(fast, few_rows=few_rows) > 0
    assert any(isinstance(m, _kind(few_rows)) for m in fast.modules())
    ids = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (1, 2, 5, 17):
            torch.testing.assert_close(fast(input_ids=ids[:, :rows]).logits, stock(input_ids=ids[:, :rows]).logits,
                                       atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("few_rows", KINDS)
def test_greedy_unchanged_and_reversible(few_rows):
    stock = make_model("qwen2", seed=0, hidden=64, initializer_range=0.1)
    draft = perturbed_copy(stock, noise=0.3)
    reference = SpeculativeDecoder(draft, stock).generate([1, 2, 3], max_new_tokens=30, method="target",
                                                          temperature=0).token_ids
    fast = copy.deepcopy(stock)
    pack_linears(fast, few_rows=few_rows)
    for method in ("google", "deepmind", "target"):
        assert SpeculativeDecoder(draft, fast).generate([1, 2, 3], max_new_tokens=30, method=method,
                                                        temperature=0).token_ids == reference
    assert unpack_linears(fast) > 0
    assert not any(isinstance(m, (FewRowsLinear, PackedLinear)) for m in fast.modules())
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(fast(input_ids=ids).logits, stock(input_ids=ids).logits)


@pytest.mark.parametrize("few_rows", KINDS)
def test_unpacking_ties_a_tied_output_layer_again(few_rows):
    model = make_model("qwen2", seed=0, hidden=64, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        pack_linears(model, few_rows=few_rows)
        assert isinstance(model.lm_head, _kind(few_rows))
        assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})  # no second copy
        unpack_linears(model)
        assert model.lm_head.weight is model.get_input_embeddings().weight
        assert torch.equal(model(input_ids=ids).logits, reference)


@needs_kernel
def test_few_rows_layers_share_the_stock_weights():
    model = make_model("qwen2", seed=0, hidden=64, tie_word_embeddings=True)
    weights = {name: p for name, p in model.named_parameters()}
    pack_linears(model)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert {name: p for name, p in model.named_parameters()} == weights  # same names, same tensors: no copy


def test_float16_is_left_alone():
    model = make_model("llama").to(torch.float16)
    assert pack_linears(model) == 0
    assert pack_linears(model, few_rows=False) == 0


def test_bfloat16_without_the_kernel_is_left_alone():
    model = make_model("llama").to(torch.bfloat16)
    assert pack_linears(model, few_rows=False) == 0  # oneDNN packing is float32 only


def _pair_with_kernels(arch: str, dtype: torch.dtype):
    target = make_model(arch, seed=0, hidden=64, initializer_range=0.1)
    draft = perturbed_copy(target, noise=0.3)
    target, draft = target.to(dtype), draft.to(dtype)
    for model in (draft, target):
        assert use_cpu_kernels(model)
        assert any(isinstance(m, FewRowsLinear) for m in model.modules())
    return draft, target


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_verification_forward_gives_the_one_by_one_logits(arch, dtype):
    """What greedy equivalence rests on: with our kernels (few-rows linears, attention row by row), a forward over
    several new tokens after cached ones gives bitwise the logits of decoding them one by one."""
    _, target = _pair_with_kernels(arch, dtype)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for width in (2, 5, 8, 12):
            cache = DynamicCache(config=target.config)
            target(input_ids=ids[:, :8], cache=cache, use_cache=True)
            single = copy.deepcopy(cache)
            together = target(input_ids=ids[:, 8:8 + width], cache=cache, use_cache=True).logits
            one_by_one = torch.cat([target(input_ids=ids[:, i:i + 1], cache=single, use_cache=True).logits
                                    for i in range(8, 8 + width)], dim=1)
            assert together.dtype == dtype
            assert torch.equal(together, one_by_one)


@needs_kernel
@pytest.mark.parametrize("draft_kind", ["bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_greedy_equals_target_only_for_every_drafter(arch, draft_kind):
    """A bfloat16 target, with a bfloat16 draft or (what load_pair gives on CPU) a float32 draft in int8."""
    draft, target = _pair_with_kernels(arch, torch.bfloat16)
    if draft_kind == "int8":
        if not quantization_supported():
            pytest.skip("this torch build has no int8 engine")
        draft, _ = _pair_with_kernels(arch, torch.float32)
        assert quantize_linears(draft) > 0
    decoder = SpeculativeDecoder(draft, target)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so that the lookup proposes
    reference = decoder.generate(prompt, max_new_tokens=40, method="target", temperature=0).token_ids
    for method in ("google", "deepmind"):
        for drafter in ("model", "lookup", "hybrid"):
            for verification in ("token", "block"):
                out = decoder.generate(prompt, max_new_tokens=40, method=method, temperature=0, gamma=4,
                                       drafter=drafter, verification=verification)
                assert out.token_ids == reference, (method, drafter, verification)


def _float_linears(model):
    return [m for m in model.modules() if type(m) in (torch.nn.Linear, FewRowsLinear, PackedLinear)]


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


@pytest.mark.skipif(not packing_supported(), reason="no oneDNN")
def test_packing_lets_each_float_weight_go_before_the_next_layer_is_packed(monkeypatch):
    import weakref

    model = make_model("qwen2", seed=0, hidden=64)
    weights = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    alive_at_each_pack = []
    original = PackedLinear.__init__

    def counting(self, linear, tied=False):
        alive_at_each_pack.append(sum(ref() is not None for ref in weights))
        original(self, linear, tied)

    monkeypatch.setattr(PackedLinear, "__init__", counting)
    assert pack_linears(model, few_rows=False) == len(weights)
    # each layer's float weight is gone before the next layer is packed
    assert alive_at_each_pack == list(range(len(weights), 0, -1))
    assert all(ref() is None for ref in weights)


def _target_rows(model):
    """Every target forward's kept logits, each row keyed by the length of the sequence it was computed on (the
    cached tokens and the forward's tokens up to that row), with the forward's tokens; and the hooks' handles."""
    rows, pending = [], []

    def before(module, args, kwargs):
        pending.append((kwargs["cache"].get_seq_length(), kwargs["input_ids"][0].tolist()))

    def after(module, args, kwargs, out):
        cached, tokens = pending.pop()
        logits = out.logits[0]
        first = cached + len(tokens) - logits.shape[0]  # logits_to_keep: the last rows only
        rows.extend((first + i + 1, tokens[: first - cached + i + 1], cached, logits[i].clone())
                    for i in range(logits.shape[0]))

    return rows, [model.register_forward_pre_hook(before, with_kwargs=True),
                  model.register_forward_hook(after, with_kwargs=True)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_every_target_row_on_the_output_is_target_only_bitwise(dtype, drafter):
    """Greedy equality by construction: each target logit row that speculative decoding computed on a prefix of
    its output equals, bitwise, the row target-only decoding computed on that prefix. The prompt is longer than
    the kernel's 16 rows, so a prefill folded together with the first proposals would fail this."""
    draft, target = _pair_with_kernels("qwen2", dtype)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2  # 24 tokens, repeating for the lookup
    rows, hooks = _target_rows(target)
    decoder = SpeculativeDecoder(draft, target)
    try:
        reference = decoder.generate(prompt, max_new_tokens=30, method="target", temperature=0).token_ids
        by_length = {length: logits for length, *_, logits in rows}
        rows.clear()
        out = decoder.generate(prompt, max_new_tokens=30, method="google", temperature=0, gamma=4, drafter=drafter)
    finally:
        for hook in hooks:
            hook.remove()
    assert out.token_ids == reference
    sequence = prompt + reference
    compared = 0
    for length, tokens, cached, logits in rows:
        if length in by_length and sequence[cached:length] == tokens:
            assert torch.equal(logits, by_length[length]), length
            compared += 1
    assert compared >= len(reference)  # the row of every position, once at least
    assert out.stats.target_forwards < len(reference)  # and several per forward
