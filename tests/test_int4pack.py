"""4-bit groups on torch's own int4 kernel (specdec/cuda/int4pack.py): the layer computes its dequantized weight
and gives a row the same bits whatever rows come with it; a GGUF's Q4_K layer keeps the GGUF's values; a pair on
these layers keeps the target's distribution (chi-square, every drafter and both rules) and greedy speculative
output equal to greedy target-only output; `quantize = int4` on CUDA loads them. The CPU twin of the kernel runs
here; the tests marked `cuda` run the CUDA kernel itself where a GPU is (bench/gpu.py runs them on a lent one)."""

import logging

import numpy as np
import pytest
import torch
from torch import nn

from specdec import SpeculativeDecoder
from specdec.cpu.grouped import Grouped, dequantize, pack, quantize
from specdec.cuda.int4pack import Int4PackLinear, inner_k_tiles, int4pack_model, packable
from tests.support.models import make_model, perturbed_copy
from tests.test_exactness import DRAFTER_SAMPLES, SETTINGS, VOCAB, draw, exact_distribution, goodness_of_fit

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def layer(n: int = 64, k: int = 256, seed: int = 0, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [64, 256, 384])  # inner K tiles 4, 8, 8
def test_the_layer_computes_its_dequantized_weight(device, k):
    linear = layer(k=k)
    grouped = quantize(linear.weight, 4)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    int4 = Int4PackLinear(grouped, linear.bias, torch.device(device), dtype)
    x = torch.randn(2, 5, k)
    expected = x @ dequantize(grouped).t() + linear.bias.detach()
    got = int4(x.to(device, dtype)).float().cpu()
    assert got.shape == expected.shape
    tolerance = 1e-4 if device == "cpu" else 5e-2  # bfloat16 activations, scales and zeros on CUDA
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()
    # what the layer says it computes with is the grouped form's weight, up to the rounding of scales and zeros
    assert (int4.dequantize().cpu() - dequantize(grouped)).abs().max() <= tolerance * dequantize(grouped).abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_gives_the_same_bits_whatever_rows_come_with_it(device):
    """Row-invariance: verification computes gamma + 1 rows where target-only computes one, so greedy speculative
    output is target-only's only if a row's bits do not depend on the others."""
    linear = layer(n=256, k=512)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    int4 = Int4PackLinear(quantize(linear.weight, 4), linear.bias, torch.device(device), dtype)
    x = torch.randn(16, 512).to(device, dtype)
    alone = torch.cat([int4(x[i:i + 1]) for i in range(16)])
    for rows in (2, 5, 9, 16):
        assert torch.equal(int4(x[:rows]), alone[:rows]), rows


def test_a_q4k_layer_keeps_the_ggufs_values():
    """From a GGUF's Q4_K blocks: the layer computes gguf's own dequantization, up to float32 rounding on CPU."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from tests.test_grouped import gguf_blocks  # (not at import: it builds the grouped kernel)

    data = gguf_blocks("Q4_K", 32, 512)
    expected = torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType.Q4_K))
    int4 = Int4PackLinear(pack(data, "Q4_K"), None, torch.device("cpu"), torch.float32)
    assert int4.weight_shape == (32, 512)
    assert torch.allclose(int4.dequantize(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_other_forms_and_shapes_are_refused():
    eight = Grouped(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2), None, 8, 32)
    with pytest.raises(ValueError, match="4-bit groups of 32"):
        Int4PackLinear(eight, None, torch.device("cpu"))
    assert packable(64, 256) and not packable(56, 256) and not packable(64, 96)
    assert inner_k_tiles(256) == 8 and inner_k_tiles(64) == 4 and inner_k_tiles(32) == 2 and inner_k_tiles(40) is None


def test_int4pack_model_swaps_what_it_can_and_takes_given_forms_as_they_are():
    model = make_model("llama", seed=0, vocab_size=100, hidden=64)
    given = quantize(model.model.layers[0].mlp.down_proj.weight, 4)
    count = int4pack_model(model, {"model.layers.0.mlp.down_proj": given}, quantize_rest=False)
    assert count == 1 and isinstance(model.model.layers[0].mlp.down_proj, Int4PackLinear)
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    count = int4pack_model(model)
    assert type(model.lm_head) is nn.Linear  # 100 rows: not a multiple of 16
    assert count == 2 * 7 - 1 and not [m for m in model.model.layers.modules() if type(m) is nn.Linear]


def int4_model(model: nn.Module) -> nn.Module:
    assert int4pack_model(model) > 0
    return model


@pytest.fixture(scope="module")
def int4_pair():
    """A one-layer Llama pair over 8 tokens, hidden 64, close enough that drafts are often accepted, every linear
    layer on the int4 kernel."""
    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=1, hidden=64, initializer_range=0.3)
    draft = perturbed_copy(target, noise=0.05)
    return int4_model(draft), int4_model(target)


RULES = [("model", "token", "google"), ("lookup", "block", "deepmind"), ("hybrid", "block", "google"),
         ("model", "block", "deepmind"), ("lookup", "token", "google"), ("hybrid", "token", "deepmind")]


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, variant", RULES[:3])  # every drafter, both rules, both variants
def test_int4_samples_follow_target_distribution(int4_pair, drafter, rule, variant):
    draft, target = int4_pair
    # every layer but the output one (8 rows: the kernel takes multiples of 16)
    assert not [m for model in int4_pair for m in model.model.modules() if type(m) is nn.Linear]
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    expected = exact_distribution(target, *SETTINGS["t0.8-topk5-topp0.9"], prompt=prompt)
    totals = {}
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS["t0.8-topk5-topp0.9"], DRAFTER_SAMPLES,
                  seed=41, prompt=prompt, totals=totals, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    accepted = {name for (kind, name), count in totals.items() if kind == "accepted_by_drafter" and count}
    assert accepted, totals


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drafter, rule, method", RULES + [("model", "token", "adaptive")])
def test_int4_greedy_speculative_equals_int4_target_only(device, drafter, rule, method):
    def model(noise: float | None = None):
        base = make_model("llama", seed=0, vocab_size=128, hidden=64, initializer_range=0.3)
        base = base if noise is None else perturbed_copy(base, noise=noise)
        return int4_model(base.to(device, torch.float32 if device == "cpu" else torch.bfloat16))

    from tests.test_grouped import assert_greedy_speculative_is_target_only  # (not at import: see above)

    assert_greedy_speculative_is_target_only(SpeculativeDecoder(model(0.05), model()), drafter, rule, method)


def test_quantize_int4_applies_on_cuda_and_int8_does_not(caplog):
    from specdec.models.shipped import quantize_applies

    cuda = torch.device("cuda")
    assert quantize_applies("int4", cuda, None)
    with caplog.at_level(logging.WARNING, logger="specdec.models.shipped"):
        assert not quantize_applies("int8", cuda, None)
        assert not quantize_applies("int4", cuda, "auto")
    assert "on CUDA only int4" in caplog.text and "one CPU or GPU" in caplog.text


def write_gguf(path, model: nn.Module, types: dict[str, str]) -> None:
    """A GGUF file holding `model`'s linear layers named as gguf maps them, each of the given type (random
    blocks)."""
    import gguf

    from specdec.models.shipped import gguf_names
    from tests.test_grouped import gguf_blocks

    writer = gguf.GGUFWriter(str(path), "qwen2")
    for i, (module_name, tensor_name) in enumerate(gguf_names(model).items()):
        qtype = types.get(module_name.rsplit(".", 1)[-1], "Q8_0")
        n, k = model.get_submodule(module_name).weight.shape
        writer.add_tensor(tensor_name, gguf_blocks(qtype, n, k, seed=i),
                          raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_model_takes_its_q4k_layers_as_shipped_and_keeps_the_others(tmp_path):
    """int4pack_layers (quantize = int4 on CUDA) on a model from a GGUF file: its Q4_K layers hold the GGUF's
    values; its Q8_0 layers and its embedding stay as loaded; a float model has every packable layer quantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from specdec.models.pair import int4pack_layers
    from specdec.models.shipped import four_bit_layers, gguf_names
    from specdec.models.sources import ModelSource

    model = make_model("qwen2", seed=0, vocab_size=64, layers=1, hidden=256)
    write_gguf(tmp_path / "m.gguf", model, {"up_proj": "Q4_K", "gate_proj": "Q4_K"})
    source = ModelSource(str(tmp_path), "m.gguf")
    four = four_bit_layers(model, source)
    assert set(four) == {"model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"}
    assert int4pack_layers(model, source) == "2 layers (as shipped)"
    up = model.model.layers[0].mlp.up_proj
    import gguf

    reader = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    data = reader[gguf_names(model)["model.layers.0.mlp.up_proj"]].data
    expected = torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType.Q4_K).reshape(up.weight_shape))
    assert isinstance(up, Int4PackLinear) and torch.allclose(up.dequantize(), expected, rtol=1e-5,
                                                               atol=1e-6 * float(expected.abs().max()))
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear and type(model.lm_head) is nn.Linear
    assert four_bit_layers(make_model("qwen2", seed=0, vocab_size=64, layers=1, hidden=256),
                           ModelSource(str(tmp_path))) == {}
    plain = make_model("qwen2", seed=0, vocab_size=64, layers=1, hidden=256)
    assert int4pack_layers(plain, ModelSource(str(tmp_path))) == "8 layers (quantized)"


@CUDA
def test_load_pair_with_quantize_int4_on_cuda_serves_int4_layers_and_stays_exact(tiny_pair_dirs, caplog):
    from specdec.models.pair import load_pair

    with caplog.at_level(logging.INFO, logger="specdec"):
        draft, target, _ = load_pair(*tiny_pair_dirs, device="cuda", quantize="int4", compile=False)
    assert "int4 layers for torch's CUDA kernel" in caplog.text
    for model in (draft, target):
        layers = [m for m in model.modules() if isinstance(m, Int4PackLinear)]
        assert layers and all(m.packed.is_cuda for m in layers)
    decoder = SpeculativeDecoder(draft, target)
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = decoder.generate(prompt, max_new_tokens=24, method="target", temperature=0, eos_token_id=[])
    for method in ("google", "deepmind"):
        assert decoder.generate(prompt, max_new_tokens=24, method=method, temperature=0,
                                eos_token_id=[]).token_ids == reference.token_ids
    assert np.isfinite(reference.stats.tokens_per_second)


@pytest.mark.xdist_group("compiled")  # beside tests/test_compiled.py's compiles
def test_the_compiled_path_takes_int4_layers_and_keeps_greedy_output():
    """compile = auto is on for CUDA, so int4 layers run compiled there: on the kernel's CPU twin, both models
    compile whole (the operator has a shape function) and greedy output with compile equals it without, for
    target-only and both variants."""
    import torch._dynamo

    from specdec.compiled import compile_model

    target = int4_model(make_model("llama", seed=0, vocab_size=128, hidden=64, initializer_range=0.3))
    draft = int4_model(perturbed_copy(make_model("llama", seed=0, vocab_size=128, hidden=64,
                                                 initializer_range=0.3), noise=0.05))
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    eager = SpeculativeDecoder(draft, target).generate(prompt, max_new_tokens=40, method="target", temperature=0,
                                                       eos_token_id=[]).token_ids
    try:
        assert compile_model(target, torch.device("cpu")) and compile_model(draft, torch.device("cpu"))
        decoder = SpeculativeDecoder(draft, target)
        for method in ("target", "google", "deepmind"):
            result = decoder.generate(prompt, max_new_tokens=40, method=method, temperature=0, eos_token_id=[])
            assert result.token_ids == eager, method
    finally:
        torch._dynamo.reset()
