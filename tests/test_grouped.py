"""Weights as GGUF ships them (specdec/cpu/grouped.py): every shipped type packs to values whose dequantization is
bitwise gguf's own, the few-rows kernel computes the layer within float tolerance and gives a row the same bits
whatever rows come with it, and a pair whose linear layers are all grouped keeps the target's distribution
(chi-square, every drafter and both rules, with a wrong rule that fails) and greedy speculative output equal to
greedy target-only output."""

import numpy as np
import pytest
import torch
from torch import nn

from specdec import SpecDecError, SpeculativeDecoder
from specdec.cpu.grouped import (
    EIGHT_BIT,
    SHIPPED_TYPES,
    Grouped,
    GroupedEmbedding,
    GroupedLinear,
    dequantize,
    grouped_kernel,
    pack,
    quantize,
    tiled,
    values,
)
from specdec.models.kernels import use_cpu_kernels
from specdec.models.shipped import gguf_names, gguf_origin, resolve_weights
from specdec.models.sources import ModelSource
from tests.support.models import make_model, perturbed_copy
from tests.test_exactness import DRAFTER_SAMPLES, SETTINGS, VOCAB, draw, exact_distribution, goodness_of_fit, plain_p

pytestmark = pytest.mark.skipif(not grouped_kernel(), reason="the grouped kernel cannot be built here")


def gguf_blocks(qtype: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks of a GGUF type, [rows, bytes per row]: any bytes are valid quants; the fp16 scales are set to
    finite values of either sign (as real files have)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * k // size, type_size), dtype=np.uint8)
    scales = {"Q4_K": [0, 2], "Q6_K": [208], "Q5_0": [0], "Q8_0": [0]}[qtype]
    for at in scales:
        blocks[:, at:at + 2] = rng.normal(0, 0.01, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", SHIPPED_TYPES)
def test_packed_weights_dequantize_bitwise_as_gguf_does(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    data = gguf_blocks(qtype, 24, 512)
    grouped = pack(data, qtype)
    expected = gguf_dequantize(data, GGMLQuantizationType[qtype])
    assert grouped.shape == expected.shape == (24, 512)
    assert grouped.bits == (4 if qtype == "Q4_K" else 8) and grouped.group == EIGHT_BIT.get(qtype, 32)
    assert np.array_equal(dequantize(grouped).numpy().view(np.uint32), expected.view(np.uint32))


def test_a_type_without_a_grouped_form_is_refused():
    with pytest.raises(ValueError, match="no grouped form"):
        pack(gguf_blocks("Q8_0", 2, 64), "Q4_0")


def quantized_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel quantizes it, per group of `group`: (xq [M, K / group, group] int8 values, dx [M, K / group]),
    dx = max |x| / 127 and xq = round(x * 127 / max |x|), in float32 as the kernel computes them."""
    groups = x.reshape(x.shape[0], -1, group)
    amax = groups.abs().amax(-1)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (groups * inverse.unsqueeze(-1)).round().clamp(-127, 127), amax / 127


@pytest.mark.parametrize("qtype", SHIPPED_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])
def test_the_kernel_computes_the_layer_and_each_row_alone_gives_the_same_bits(qtype, rows):
    """Against float64: the kernel's own arithmetic (integer sums over x quantized per group, then the scales) to
    float rounding; the float layer within the bound that quantizing x allows, sum over k of |w| * dx / 2."""
    torch.manual_seed(rows)
    grouped = pack(gguf_blocks(qtype, 37, 512, seed=rows), qtype)  # 37 outputs: two tiles of 16 and a padded one
    bias = torch.randn(37)
    layer = GroupedLinear(grouped, bias)
    x = torch.randn(rows, 512)
    x[:, 7] *= 20  # an outlier channel, as real activations have
    out = layer(x).double()

    xq, dx = quantized_rows(x, grouped.group)
    n, k = grouped.shape
    v = values(grouped).double().reshape(n, k // grouped.group, grouped.group)
    sums = torch.einsum("mgk,ngk->mng", xq.double(), v)
    kernel = (sums * grouped.scale.double().unsqueeze(0) * dx.double().unsqueeze(1)).sum(-1) + bias.double()
    if grouped.minimum is not None:
        kernel -= x.double().reshape(rows, -1, grouped.group).sum(-1) @ grouped.minimum.double().T
    assert torch.allclose(out, kernel, rtol=1e-5, atol=1e-5 * kernel.abs().max().item())

    w = dequantize(grouped).double()
    exact = x.double() @ w.T + bias.double()
    bound = (w.abs().reshape(n, -1, grouped.group).sum(-1) @ dx.double().T).T / 2
    assert ((out - exact).abs() <= bound * 1.001 + 1e-4).all()
    assert not torch.allclose(out, exact, rtol=1e-6, atol=0)  # x was quantized: the bound is not vacuous

    alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(alone, layer(x))


@pytest.mark.parametrize("qtype, bits", [("Q4_K", 4), ("Q6_K", 6), ("Q5_0", 5), ("Q8_0", 8)])
def test_each_type_is_held_in_the_bits_it_ships_in(qtype, bits):
    """The kernel reads about the bytes the GGUF file has: Q6_K's values in 6 bits and Q5_0's in 5, not 8."""
    layout = tiled(pack(gguf_blocks(qtype, 37, 512, seed=2), qtype))
    assert layout.bits == bits
    assert layout.q.numel() == 48 * 512 * bits // 8  # 37 rows padded to 48


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_0"])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 13])
def test_the_five_and_six_bit_forms_give_the_eight_bit_forms_bits(qtype, rows):
    """Rebuilt from their two planes, the 5- and 6-bit values give the integer sums the 8-bit form gives, so the
    same output bits (over K = 768: three blocks of 64 planes, and every chunk position in them)."""
    grouped = pack(gguf_blocks(qtype, 37, 768, seed=rows), qtype)
    narrow, wide = GroupedLinear(tiled(grouped)), GroupedLinear(tiled(grouped, bits=8))
    assert narrow.bits < 8 == wide.bits and narrow.q.numel() < wide.q.numel()
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    x[:, 5] *= 30
    assert torch.equal(narrow(x), wide(x))


def test_a_form_too_narrow_for_the_values_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        tiled(pack(gguf_blocks("Q6_K", 16, 256), "Q6_K"), bits=5)
    with pytest.raises(ValueError, match="cannot hold"):
        tiled(pack(gguf_blocks("Q4_K", 16, 256), "Q4_K"), bits=8)


@pytest.mark.parametrize("qtype", SHIPPED_TYPES)
def test_a_grouped_embedding_looks_up_rows_bitwise_as_gguf_dequantizes_them(qtype):
    grouped = pack(gguf_blocks(qtype, 37, 256, seed=3), qtype)
    ids = torch.tensor([[0, 36, 15], [16, 17, 5]])
    rows = GroupedEmbedding(grouped)(ids)
    assert rows.shape == (2, 3, 256)
    expected = dequantize(grouped)[ids.reshape(-1)].reshape(2, 3, 256)
    assert torch.equal(rows.view(torch.int32), expected.view(torch.int32))


def test_swapping_in_the_gguf_embedding_keeps_the_models_output_bitwise():
    """`_swap` of the input embedding (GGUF's token_embd): no float table is left, and the logits are bitwise those
    of the float model whose embedding is that tensor dequantized (the conversion's)."""
    from specdec.models.shipped import _swap

    model = make_model("qwen2", vocab_size=VOCAB, hidden=64, layers=1)
    grouped = pack(gguf_blocks("Q8_0", VOCAB, 64, seed=4), "Q8_0")
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(dequantize(grouped))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(ids).logits
        _swap(model, {"model.embed_tokens": {**grouped.tensors(), "group": torch.tensor(grouped.group)}})
        after = model(ids).logits
    assert isinstance(model.get_input_embeddings(), GroupedEmbedding)
    assert not [name for name, _ in model.named_parameters() if "embed" in name]
    assert torch.equal(after, before)


@pytest.mark.parametrize("qtype, form", [("Q4_K", torch.uint8), ("Q6_K", torch.int8), ("Q5_0", torch.float16),
                                         ("Q8_0", torch.float16)])
def test_compact_scales_give_the_kernel_the_float32_scales_bitwise(qtype, form):
    """Scales held as integers times a unit per 256 values, or as float16, are the float32 scales exactly: the layer
    computes bitwise what it computes with float32 scales."""
    grouped = pack(gguf_blocks(qtype, 40, 512, seed=5), qtype)
    layer = GroupedLinear(grouped)
    assert layer.scale.dtype == form and (layer.minimum is None or layer.minimum.dtype == form)

    def widened(values, unit):
        if unit is None:
            return values.float()
        tiles = values.shape[0]
        units = unit.reshape(tiles, -1, 16)
        per = values.numel() // unit.numel()
        return (units.repeat_interleave(per, dim=1) * values.reshape(tiles, -1, 16).float()).reshape(tiles, -1)

    original = torch.nn.functional.pad(grouped.scale, (0, 0, 0, 8)).reshape(3, 16, -1).transpose(1, 2).reshape(3, -1)
    assert torch.equal(widened(layer.scale, layer.scale_unit).view(torch.int32), original.view(torch.int32))
    x = torch.randn(5, 512)
    plain = torch.ops.specdec_grouped.grouped_linear(
        x, layer.q, widened(layer.scale, layer.scale_unit), None,
        None if layer.minimum is None else widened(layer.minimum, layer.minimum_unit), None, layer.bits, layer.group)
    assert torch.equal(layer(x), plain[:, :40])
    assert layer.scale.element_size() < 4


ISA_BUILDS = {"avx2": ["-mno-avx512f"], "scalar": ["-mno-avx512f", "-mno-avx2"]}
ISA_SCRIPT = """
import sys, torch
from torch.utils.cpp_extension import load
isa, source, folder, out = sys.argv[1:5]
load(name="grouped_" + isa, sources=[source], build_directory=folder, is_python_module=False, verbose=False,
     extra_cflags=["-O3", "-march=native", "-fopenmp", *sys.argv[5:]], extra_ldflags=["-fopenmp"])
assert torch.ops.specdec_grouped.isa() == isa, torch.ops.specdec_grouped.isa()
from tests.test_grouped import isa_outputs
torch.save(isa_outputs(), out)
"""


def isa_outputs() -> dict[str, torch.Tensor]:
    """Every form's layer (4, 5, 6 and 8 bits; float32, float16 and integer scales) over 1, 5 and 13 rows of a
    fixed x, with whatever build of the operator this process loaded."""
    outputs = {}
    for qtype in SHIPPED_TYPES:
        layer = GroupedLinear(pack(gguf_blocks(qtype, 37, 512, seed=9), qtype))
        for rows in (1, 5, 13):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            outputs[f"{qtype}/{rows}"] = layer(x)
    return outputs


@pytest.mark.skipif(not (grouped_kernel() and torch.ops.specdec_grouped.amx()),
                    reason="this CPU or kernel has no AMX (Intel Xeon from Sapphire Rapids on, Linux)")
@pytest.mark.parametrize("qtype", SHIPPED_TYPES)
def test_rows_by_amx_tiles_give_the_vnni_paths_bits(qtype):
    """From 5 rows (4-bit form) or 8 (the others), several rows go by AMX tiles, 16 to a pass: the same integer sums
    and the same float epilogue as VNNI's, so the same bits, whether AMX is on or off, and for a row alone."""
    layer = GroupedLinear(pack(gguf_blocks(qtype, 37, 768, seed=4), qtype))
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(4))
    x[:, 3] *= 25
    try:
        for rows in (5, 6, 8, 9, 12, 16, 17, 33, 40):
            torch.ops.specdec_grouped.amx(True)
            tiles = layer(x[:rows])
            torch.ops.specdec_grouped.amx(False)
            assert torch.equal(tiles, layer(x[:rows])), rows
        assert torch.equal(tiles, torch.cat([layer(x[i:i + 1]) for i in range(40)]))
    finally:
        torch.ops.specdec_grouped.amx(True)


@pytest.mark.skipif(not torch.ops.specdec_grouped.vnni() if grouped_kernel() else True,
                    reason="the other builds are compared with the AVX-512 VNNI one")
@pytest.mark.parametrize("isa", ISA_BUILDS)
def test_the_avx2_and_scalar_builds_give_the_vnni_builds_bits(isa, tmp_path):
    """The kernel built without AVX-512 (AVX2: 8 rows a register, pairs summed in 16 bits) and without AVX2 (lane
    by lane) computes the same integer sums and float operations as the VNNI build: the same bits, for every form.
    Each is compiled here in a process of its own (this CPU runs all three)."""
    import subprocess
    import sys
    from pathlib import Path

    from specdec.cpu.grouped import SOURCE

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "build").mkdir()
    out = tmp_path / "outputs.pt"
    done = subprocess.run([sys.executable, "-c", ISA_SCRIPT, isa, str(SOURCE), str(tmp_path / "build"), str(out),
                           *ISA_BUILDS[isa]], cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours = torch.load(out), isa_outputs()
    assert theirs.keys() == ours.keys()
    for key in ours:
        assert torch.equal(theirs[key], ours[key]), key


def test_the_operator_refuses_a_bad_shape_with_a_message():
    grouped = pack(gguf_blocks("Q4_K", 4, 256), "Q4_K")
    with pytest.raises(RuntimeError, match="grouped_linear"):
        torch.ops.specdec_grouped.grouped_linear(torch.randn(2, 128), grouped.q, grouped.scale, None,
                                                  grouped.minimum, None, 4, 32)


# --- a pair on grouped weights: the engine's exactness -------------------------------------------------------------

def group_linear(linear: nn.Linear) -> GroupedLinear:
    """Quantize one layer in the test (4-bit groups of 32 with minimums where K allows, else 8-bit groups of 16),
    in the kernel's layout: what a GGUF file would hold for it."""
    w = linear.weight.detach().float()
    n, k = w.shape
    if k % 64 == 0:
        grouped = quantize(w, 4)  # the service's own quantize = "int4"
    else:
        groups = w.reshape(n, k // 16, 16)
        scale = (groups.abs().amax(-1) / 127).clamp_min(1e-8)
        v = (groups / scale.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
        grouped = Grouped(v.reshape(n, k).contiguous(), scale.contiguous(), None, 8, 16)
    return GroupedLinear(grouped, linear.bias)


def grouped_model(model):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, group_linear(child))
    use_cpu_kernels(model)  # grouped-head attention: row-invariant, like the layers
    return model


@pytest.fixture(scope="module")
def grouped_pair():
    """A one-layer Llama pair over 8 tokens, hidden 64 (4-bit layers) and close enough that drafts are often
    accepted, every linear layer grouped."""
    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=1, hidden=64, initializer_range=0.3)
    draft = perturbed_copy(target, noise=0.05)
    return grouped_model(draft), grouped_model(target)


@pytest.fixture(scope="module")
def far_grouped_pair():
    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=1, hidden=64, initializer_range=0.3)
    draft = make_model("llama", seed=1, vocab_size=VOCAB, layers=1, hidden=16, initializer_range=0.3)
    return grouped_model(draft), grouped_model(target)


RULES = [("model", "token", "google"), ("model", "block", "deepmind"), ("lookup", "token", "deepmind"),
         ("lookup", "block", "google"), ("hybrid", "token", "google"), ("hybrid", "block", "deepmind")]
HYBRID_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def test_the_pair_is_grouped(grouped_pair):
    draft, target = grouped_pair
    assert not [m for model in grouped_pair for m in model.modules() if type(m) is nn.Linear]
    assert {m.bits for m in target.modules() if isinstance(m, GroupedLinear)} == {4}
    assert {m.bits for m in draft.modules() if isinstance(m, GroupedLinear)} == {4}


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, variant", RULES)
def test_grouped_samples_follow_target_distribution(grouped_pair, drafter, rule, variant):
    draft, target = grouped_pair
    prompt = HYBRID_PROMPT if drafter == "hybrid" else [1, 2, 3, 1, 2, 3, 1, 2]
    expected = exact_distribution(target, *SETTINGS["t0.8-topk5-topp0.9"], prompt=prompt)
    totals = {}
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS["t0.8-topk5-topp0.9"], DRAFTER_SAMPLES,
                  seed=31, prompt=prompt, totals=totals, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    proposed = {name for (kind, name), count in totals.items() if kind == "proposed_by_drafter" and count}
    accepted = {name for (kind, name), count in totals.items() if kind == "accepted_by_drafter" and count}
    # the hybrid's lookup proposes from the prompt's repeats, which this target's nucleus leaves out
    assert proposed == ({"model", "lookup"} if drafter == "hybrid" else {drafter}) and accepted, totals


@pytest.mark.statistical
def test_a_wrong_rule_fails_on_grouped_weights(far_grouped_pair, monkeypatch):
    draft, target = far_grouped_pair
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], 5_000, seed=37)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) > 1e-3
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], 5_000, seed=37)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) < 1e-6


@pytest.mark.parametrize("drafter, rule, method", RULES + [("model", "token", "adaptive")])
def test_grouped_greedy_speculative_equals_grouped_target_only(drafter, rule, method):
    target = grouped_model(make_model("llama", seed=0, vocab_size=100, hidden=64, initializer_range=0.3))
    draft = grouped_model(perturbed_copy(make_model("llama", seed=0, vocab_size=100, hidden=64,
                                                    initializer_range=0.3), noise=0.05))
    assert_greedy_speculative_is_target_only(SpeculativeDecoder(draft, target), drafter, rule, method)


def assert_greedy_speculative_is_target_only(decoder, drafter: str, rule: str, method: str) -> None:
    """Greedy speculative output (method "adaptive": Google with adaptive gamma) equals greedy target-only output,
    with some proposals accepted, on a prompt lookup can draw from."""
    base = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    # the prompt holds the start of its own continuation after a copy of itself, so that prompt lookup has
    # something to propose that the target takes
    prompt = base + decoder.generate(base, max_new_tokens=16, method="target", temperature=0,
                                     eos_token_id=[]).token_ids + base
    reference = decoder.generate(prompt, max_new_tokens=40, method="target", temperature=0,
                                 eos_token_id=[]).token_ids
    result = decoder.generate(prompt, max_new_tokens=40, method="google" if method == "adaptive" else method,
                              gamma=None if method == "adaptive" else 4, temperature=0, drafter=drafter,
                              verification=rule, eos_token_id=[])
    assert result.token_ids == reference
    assert result.stats.accepted > 0


@pytest.mark.parametrize("hidden", [64, 48])  # 4-bit layers; 8-bit groups of 16 (K not a multiple of 64)
def test_wide_verifications_keep_greedy_speculative_equal_to_target_only(hidden):
    """gamma 8: verifications of up to 9 rows (by AMX tiles where the CPU has them: from 5 rows of the 4-bit form,
    8 of the others) against target-only's one-row steps (VNNI): the tokens are target-only's all the same."""
    def model():
        return make_model("llama", seed=0, vocab_size=100, hidden=hidden, initializer_range=0.3)

    target, draft = grouped_model(model()), grouped_model(perturbed_copy(model(), noise=0.02))
    assert {m.bits for m in target.modules() if isinstance(m, GroupedLinear)} == ({4} if hidden == 64 else {8})
    decoder = SpeculativeDecoder(draft, target)
    prompt = [5, 17, 42, 8, 99, 3]
    reference = decoder.generate(prompt, max_new_tokens=48, method="target", temperature=0,
                                 eos_token_id=[]).token_ids
    result = decoder.generate(prompt, max_new_tokens=48, gamma=8, temperature=0, eos_token_id=[])
    assert result.token_ids == reference
    stats = result.stats  # rounds verify 8 proposals and the bonus, but where max_new_tokens cuts the last ones
    assert stats.proposed > 6 * stats.drafts and stats.accepted > 0


# --- quantize: float models in the same forms ---------------------------------------------------------------------

def range_levels_error(w: torch.Tensor) -> torch.Tensor:
    """Each 4-bit group's squared error with the plain levels: the group's range in 15 steps, nearest level."""
    groups = w.reshape(w.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp_min(1e-30)
    v = ((groups - low) / scale).round().clamp(0, 15)
    return (scale * v + low - groups).square().sum(-1)


def test_quantize_to_4_bits_fits_each_group_no_worse_than_its_range():
    """4 bits: each group's squared error is at most the plain range levels' (up to the float16 rounding of scale
    and minimum), lower overall on a weight with outliers, and a flat group is exact; the scales and minimums are
    float16 values, which the kernel reads in two bytes (5 bits a weight)."""
    generator = torch.Generator().manual_seed(4)
    w = torch.randn(40, 128, generator=generator) * 0.05
    w[:, 7] *= 10  # an outlier column, as real weights have
    w[3, :32] = 0.25  # a flat group
    w[5, 32:64] += 3.0  # a group far from 0
    grouped = quantize(w, 4)
    assert (grouped.bits, grouped.group) == (4, 32) and grouped.minimum is not None
    error = (dequantize(grouped) - w).square().reshape(40, 4, 32).sum(-1)
    plain = range_levels_error(w)
    assert (error <= plain * 1.01 + 1e-9).all()
    assert error.sum() < 0.9 * plain.sum()
    assert error[3, 0] <= 1e-12
    layout = tiled(grouped)
    assert layout.scale.dtype == layout.minimum.dtype == torch.float16


def test_quantize_to_8_bits_puts_each_value_within_half_a_step():
    """8 bits, symmetric: round to nearest per group of 32, every dequantized value within half a step (the group's
    scale) of the float weight; the scales are float16 values."""
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(8)) * 0.05
    w[5, 32:64] += 3.0
    grouped = quantize(w, 8)
    assert (grouped.bits, grouped.group) == (8, 32) and grouped.minimum is None
    error = (dequantize(grouped) - w).abs().reshape(40, 4, 32)
    assert (error <= grouped.scale.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-7).all()
    assert error.max() > 0  # it did change the model
    assert tiled(grouped).scale.dtype == torch.float16


def test_quantize_refuses_a_width_without_whole_groups():
    with pytest.raises(ValueError, match="no 4-bit groups"):
        quantize(torch.randn(4, 96), 4)
    assert quantize(torch.randn(4, 96), 8).shape == (4, 96)


def test_a_4bit_draft_requantizes_the_wider_gguf_types_from_their_own_values(tmp_path):
    """pack_from_gguf with requantize = 4 (draft_quantization = int4 on a shipped draft): Q8_0, Q5_0 and Q6_K layers
    become 4-bit groups quantized from gguf's own dequantization (scales and minimums float16, 5 bits a weight as
    kept); a Q4_K layer and an embedding stay bitwise as shipped; without it every layer keeps its shipped type."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from specdec.models.shipped import pack_from_gguf

    kinds = {"wide": ("Q8_0", 24, 128), "five": ("Q5_0", 24, 128), "six": ("Q6_K", 24, 256),
             "four": ("Q4_K", 24, 256), "embed": ("Q8_0", 24, 128)}
    blocks = {name: gguf_blocks(qtype, rows, k, seed=i) for i, (name, (qtype, rows, k)) in enumerate(kinds.items())}
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for name, (qtype, _, _) in kinds.items():
        writer.add_tensor(f"{name}.weight", blocks[name], raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    names = {name: f"{name}.weight" for name in kinds}
    shipped = pack_from_gguf(path, names, frozenset({"embed"}))
    requantized = pack_from_gguf(path, names, frozenset({"embed"}), requantize=4)
    for name in ("wide", "five", "six"):
        qtype = kinds[name][0]
        weight = torch.from_numpy(gguf_dequantize(blocks[name], gguf.GGMLQuantizationType[qtype]))
        expected = tiled(quantize(weight, 4)).tensors()
        assert int(requantized[name]["layout"][0]) == 4 and int(shipped[name]["layout"][0]) > 4
        assert expected.keys() == requantized[name].keys()
        assert all(torch.equal(expected[key], requantized[name][key]) for key in expected)
        assert requantized[name]["scale"].dtype == requantized[name]["minimum"].dtype == torch.float16
    for name in ("four", "embed"):
        assert shipped[name].keys() == requantized[name].keys()
        assert all(torch.equal(shipped[name][key], requantized[name][key]) for key in shipped[name])


def test_load_pair_with_a_4bit_draft_quantizes_the_draft_alone_and_speculation_stays_the_targets(tiny_pair_dirs,
                                                                                                  caplog):
    """draft_quantization = int4 on a float pair: the draft's linear layers become 4-bit groups, the target stays
    float, and greedy speculative output equals the target's own, with both rules."""
    import logging

    from specdec.models.pair import load_pair

    with caplog.at_level(logging.INFO, logger="specdec"):
        draft, target, _ = load_pair(*tiny_pair_dirs, device="cpu", draft_quantization="int4")
    layers = [m for m in draft.modules() if isinstance(m, GroupedLinear)]
    assert layers and {m.bits for m in layers} == {4}
    assert not any(isinstance(m, GroupedLinear) for m in target.modules())
    assert "quantized the draft to int4" in caplog.text
    reference_target = load_pair(*tiny_pair_dirs, device="cpu", draft_quantization="none")[1]
    decoder = SpeculativeDecoder(draft, target)
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = SpeculativeDecoder(draft, reference_target).generate(prompt, max_new_tokens=24, method="target",
                                                                     temperature=0, eos_token_id=[])
    for method in ("google", "deepmind"):
        result = decoder.generate(prompt, max_new_tokens=24, method=method, temperature=0, eos_token_id=[])
        assert result.token_ids == reference.token_ids


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_load_pair_quantizes_a_float_pair_and_speculation_stays_the_quantized_targets(tiny_pair_dirs, quantization,
                                                                                       caplog):
    """quantize = int4 or int8 on a float pair (not from a GGUF): its linear layers become grouped ones of those
    bits, the draft is not quantized again, and greedy speculative output equals the quantized target's greedy
    output with every method."""
    import logging

    from specdec.models.pair import load_pair

    with caplog.at_level(logging.INFO, logger="specdec"):
        draft, target, _ = load_pair(*tiny_pair_dirs, device="cpu", quantize=quantization)
    bits = 4 if quantization == "int4" else 8
    for model in (draft, target):
        layers = [m for m in model.modules() if isinstance(m, GroupedLinear)]
        assert layers and {m.bits for m in layers} <= {bits, 5, 6} and not any(
            type(m) is nn.Linear for m in model.modules())
    assert f"quantized the float models to {quantization}" in caplog.text
    decoder = SpeculativeDecoder(draft, target)
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = decoder.generate(prompt, max_new_tokens=24, method="target", temperature=0, eos_token_id=[])
    for method in ("google", "deepmind"):
        result = decoder.generate(prompt, max_new_tokens=24, method=method, temperature=0, eos_token_id=[])
        assert result.token_ids == reference.token_ids


def test_quantize_choice_is_checked_and_int8_applies_to_cpu_models_only(caplog):
    import logging

    from specdec.models.shipped import quantize_applies, resolve_quantize

    assert resolve_quantize(None) == "none" and resolve_quantize(" INT8 ") == "int8"
    with pytest.raises(SpecDecError, match="quantize must be none, int4 or int8") as raised:
        resolve_quantize("int3")
    assert raised.value.field == "quantize"
    assert not quantize_applies("none", torch.device("cpu"), None)
    assert quantize_applies("int4", torch.device("cpu"), None)
    with caplog.at_level(logging.WARNING, logger="specdec.models.shipped"):
        assert not quantize_applies("int8", torch.device("cuda"), None)  # int4 on CUDA: tests/test_int4pack.py
    assert "CPU models" in caplog.text


# --- loading: the choice, the origin, the names ----------------------------------------------------------------------

def test_weights_choice_is_checked():
    assert resolve_weights(None) == "float" and resolve_weights(" Shipped ") == "shipped"
    with pytest.raises(SpecDecError, match="weights must be shipped or float") as raised:
        resolve_weights("int3")
    assert raised.value.field == "weights"


def test_only_a_model_from_a_gguf_file_has_shipped_weights(tmp_path):
    assert gguf_origin(ModelSource(str(tmp_path))) is None  # a float checkpoint outside the cache
    assert gguf_origin(ModelSource("org/model", local=False)) is None
    assert gguf_origin(ModelSource(str(tmp_path), "model.gguf")) == tmp_path / "model.gguf"


def test_linear_layers_and_the_embedding_map_to_gguf_tensor_names():
    names = gguf_names(make_model("qwen2", layers=2))
    assert names["model.layers.1.self_attn.q_proj"] == "blk.1.attn_q.weight"
    assert names["model.layers.0.mlp.down_proj"] == "blk.0.ffn_down.weight"
    assert names["lm_head"] == "output.weight" and names["model.embed_tokens"] == "token_embd.weight"
    assert len(names) == 2 * 7 + 2


def test_shipped_weights_apply_to_gguf_models_on_one_cpu_with_a_vector_kernel(monkeypatch, tmp_path, caplog):
    import logging

    from specdec.cpu import grouped
    from specdec.models.shipped import shipped_applies

    gguf, plain, cpu = ModelSource(str(tmp_path), "model.gguf"), ModelSource(str(tmp_path)), torch.device("cpu")
    assert shipped_applies("shipped", cpu, None, [plain, gguf]) == grouped.fast_kernel()
    assert not shipped_applies("float", cpu, None, [gguf])
    assert not shipped_applies("shipped", torch.device("cuda"), None, [gguf])
    assert not shipped_applies("shipped", cpu, "auto", [gguf])
    assert not shipped_applies("shipped", cpu, None, [plain])  # nothing shipped in low-bit form
    monkeypatch.setattr(grouped, "fast_kernel", lambda: False)  # the lane-by-lane kernel only: float instead
    with caplog.at_level(logging.WARNING, logger="specdec.models.shipped"):
        assert not shipped_applies("shipped", cpu, None, [gguf])
    assert "VNNI" in caplog.text
