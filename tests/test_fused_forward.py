"""fused_forward.py: a Llama or Qwen2 model's fused forward gives the library forward's logits bitwise (float,
grouped 4- and 8-bit, and mixed layouts; the library's attention and ours; prefill, decoding, verification-wide
forwards, rollbacks), joins only what shares a layout and holds no byte twice, and leaves other models to the
library."""

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from torch import nn

from specdec.cpu.attention import use_gqa_attention
from specdec.cpu.grouped import GroupedLinear, grouped_kernel, quantize
from specdec.fused_forward import FusedForward, _Joined, fused_forward, supports
from specdec.kv_cache import CachedModel
from specdec.prompt_cache import weights_bytes
from tests.support.models import make_model

STEPS = [("forward", 7, 1), ("forward", 1, 1), ("forward", 5, 5), ("rollback", 10, 0), ("forward", 1, 1),
         ("forward", 9, 9), ("rollback", 12, 0), *(("forward", 1, 1),) * 6, ("rollback", 3, 0), ("forward", 6, 3)]


def library_cached(model) -> CachedModel:
    """The model over a cache like CachedModel's, through the library's own forward."""
    cached = CachedModel(model)
    cached._fused = None
    return cached


def grouped(model, bits_of=lambda name: 8):
    """`model` with its linear layers (the output layer's too) quantized to grouped weights of bits_of(name)."""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                full = f"{parent_name}.{name}".strip(".")
                setattr(parent, name, GroupedLinear(quantize(child.weight, bits_of(full)), child.bias))
    return model


def run_steps(cached: CachedModel, ids: list[int]) -> list[torch.Tensor]:
    """The logits of each forward of STEPS over ids, its rollbacks done in between."""
    logits, at = [], 0
    for kind, n, keep in STEPS:
        if kind == "rollback":
            cached.rollback(n)
            at = n
        else:
            logits.append(cached.forward(ids[at:at + n], keep=keep))
            at += n
    return logits


def run_both(model, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The logits of STEPS through the library's forward (first, before anything is fused) and the fused one."""
    ids = torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(seed)).tolist()
    return run_steps(library_cached(model), ids), run_steps(CachedModel(model), ids)


def assert_bitwise(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"step {step}: largest difference {(a - b).abs().max().item()}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["library", "ours"])
def test_float_models_give_the_library_forwards_logits_bitwise(arch, attention):
    model = make_model(arch, seed=4, hidden=64)
    if attention == "ours":
        assert use_gqa_attention(model)
    assert supports(model)
    expected, got = run_both(model)
    assert isinstance(CachedModel(model)._fused, FusedForward)
    assert_bitwise(expected, got)


needs_kernel = pytest.mark.skipif(not grouped_kernel(), reason="the grouped kernel cannot be built here")


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_models_give_the_library_forwards_logits_bitwise_with_projections_joined(arch, bits):
    model = grouped(make_model(arch, seed=6, hidden=64, tie_word_embeddings=False), lambda name: bits)
    use_gqa_attention(model)
    before = weights_bytes(model)
    expected, got = run_both(model, seed=2)
    assert_bitwise(expected, got)
    forward = fused_forward(model)
    for layer in forward.layers:  # q, k and v as one call; gate and up as one
        assert [type(part) for part in layer.qkv.parts] == [_Joined]
        assert [type(part) for part in layer.gate_up.parts] == [_Joined]
    assert weights_bytes(model) == before
    attention = model.model.layers[0].self_attn
    joined = forward.layers[0].qkv.parts[0]
    assert attention.q_proj.q.data_ptr() == joined.q.data_ptr()  # the module's weight is a view of the joined one
    assert attention.k_proj.q.untyped_storage().data_ptr() == joined.q.untyped_storage().data_ptr()
    # the library's forward still reads the modules (now views): the same logits as before
    again, _ = run_both(model, seed=2)
    assert_bitwise(expected, again)


@needs_kernel
def test_projections_of_another_layout_stay_apart_and_give_their_own_bits():
    """v in 4 bits beside q and k in 8 (the default draft has such layers): q and k joined, v alone."""
    model = grouped(make_model("qwen2", seed=7, hidden=64), lambda name: 4 if name.endswith("v_proj") else 8)
    expected, got = run_both(model, seed=3)
    assert_bitwise(expected, got)
    parts = fused_forward(model).layers[0].qkv.parts
    assert [type(part) for part in parts] == [_Joined, GroupedLinear]
    assert parts[0].sizes == [64, 32]


def test_other_models_keep_the_librarys_forward():
    assert fused_forward(make_model("gpt2")) is None
    assert fused_forward(make_model("bloom")) is None
    hooked = make_model("llama")
    hooked.model.layers[0].mlp.register_forward_hook(lambda *args: None)  # someone watches a module: keep its calls
    assert fused_forward(hooked) is None
    training = make_model("llama").train()
    assert not supports(training)


def test_the_fused_forward_is_made_once_per_model():
    model = make_model("llama")
    assert CachedModel(model)._fused is CachedModel(model)._fused is fused_forward(model)


def test_hooks_added_later_bring_the_librarys_forward_back():
    model = make_model("llama")
    assert fused_forward(model) is not None
    hook = model.register_forward_pre_hook(lambda *args: None)
    assert fused_forward(model) is None and CachedModel(model)._fused is None
    hook.remove()
    assert fused_forward(model) is not None
    # accelerate's hooks (a device_map's, offloading's) replace a module's forward and mark it with _hf_hook
    add_hook_to_module(model.model.layers[1].self_attn, ModelHook())
    assert fused_forward(model) is None and not supports(model)
    remove_hook_from_module(model.model.layers[1].self_attn)
    assert fused_forward(model) is not None


@needs_kernel
def test_weights_replaced_after_joining_are_joined_again():
    """A model whose modules were given new weight tensors (moved, or swapped) after its projections were joined:
    the fused forward joins the new ones, and still gives the library forward's logits."""
    model = grouped(make_model("llama", seed=8, hidden=64))
    first = fused_forward(model)
    for module in model.modules():
        if isinstance(module, GroupedLinear):
            module._buffers["q"] = module.q.clone()  # what .to() does: new tensors, one per buffer
    again = fused_forward(model)
    assert again is not first and again.current()
    expected, got = run_both(model, seed=4)
    assert_bitwise(expected, got)


def test_a_qwen2_model_with_sliding_window_layers_keeps_the_librarys_forward():
    from transformers import AutoModelForCausalLM

    from tests.support.models import tiny_config

    config = tiny_config("qwen2")
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["full_attention", "sliding_attention"]
    assert fused_forward(AutoModelForCausalLM.from_config(config).eval()) is None
