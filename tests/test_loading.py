"""Model loading: sources (folder, GGUF file, hub id, alias), device and dtype, and the pair's tokenizer check."""

import os
import re
import shutil

import gguf
import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from specdec import SpecDecError, SpeculativeDecoder, load_pair
from specdec.models import load, memory, pair, sources, tokenizers
from specdec.models.sources import ModelSource, resolve_device, resolve_dtype, resolve_source
from tests.support.models import make_model, make_tokenizer

CUDA = torch.cuda.is_available()
# llama.cpp's tensor names for a Qwen2 model
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(path):
    """A tiny random Qwen2 model with a byte-level BPE tokenizer, as an unquantised GGUF file; returns the model."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["\u0120t", "<|endoftext|>"]
    model = make_model("qwen2", seed=0, initializer_range=0.1, vocab_size=len(tokens), eos_token_id=len(tokens) - 1)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])  # the last one is a control token
    writer.add_token_merges(["\u0120 t"])
    writer.add_eos_token_id(len(tokens) - 1)
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            name = f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"
        else:
            name = GGUF_NAMES[name]
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def copy_model(folder, destination, tokenizer=True):
    """A copy of a saved model folder, with or without its tokenizer files."""
    shutil.copytree(folder, destination)
    if not tokenizer:
        for name in os.listdir(destination):
            if name.startswith(("tokenizer", "special_tokens", "chat_template")):
                os.remove(os.path.join(destination, name))
    return str(destination)


def other_tokenizer(size: int = 90) -> PreTrainedTokenizerFast:
    vocab = {f"tok{i}": i for i in range(size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="tok0")),
                                   unk_token="tok0")


@pytest.mark.skipif(CUDA, reason="checks the CPU-only fallbacks")
def test_resolve_device_on_a_cpu_machine():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SpecDecError) as error:
        resolve_device("cuda")
    assert error.value.field == "device"


def test_resolve_device_rejects_nonsense():
    with pytest.raises(SpecDecError, match="device must be"):
        resolve_device("gpu0")


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float32) == torch.float32
    with pytest.raises(SpecDecError) as error:
        resolve_dtype("int8")
    assert error.value.field == "dtype"


def test_load_pair_from_folders(tiny_pair_dirs):
    draft_dir, target_dir = tiny_pair_dirs
    draft, target, tokenizer = load_pair(draft_dir, target_dir, device="cpu")
    assert not draft.training and not target.training
    assert next(target.parameters()).dtype == torch.float32
    assert next(target.parameters()).device.type == "cpu"
    assert len(tokenizer) == 100 and tokenizer.chat_template
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    ids = tokenizer("hello")["input_ids"]
    greedy = decoder.generate(ids, max_new_tokens=8, method="target", temperature=0).token_ids
    assert decoder.generate(ids, max_new_tokens=8, method="google", temperature=0).token_ids == greedy


def test_load_pair_quantizes_a_cpu_draft_unless_told_not_to(tiny_pair_dirs):
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    from specdec.cpu.linear import FewRowsLinear, PackedLinear, quantization_supported

    fast = (FewRowsLinear, PackedLinear)

    def int8(model):
        return any(isinstance(m, Int8Linear) for m in model.modules())

    draft, target, _ = load_pair(*tiny_pair_dirs, device="cpu")  # "auto": int8 for a draft not shipped in GGUF
    if quantization_supported():
        assert int8(draft) and not any(type(m) in (torch.nn.Linear, *fast) for m in draft.modules())
    assert not int8(target) and any(isinstance(m, fast) for m in target.modules())  # never quantized
    draft, _, _ = load_pair(*tiny_pair_dirs, device="cpu", draft_quantization="none")
    assert not int8(draft) and any(isinstance(m, fast) for m in draft.modules())
    # beside a bfloat16 target the draft is loaded in float32 and quantized (int8 layers take float32 inputs);
    # a float16 one (the library's kernels) is left as loaded
    draft, target, tokenizer = load_pair(*tiny_pair_dirs, device="cpu", dtype="bfloat16")
    assert next(target.parameters()).dtype == torch.bfloat16
    if quantization_supported():
        assert int8(draft) and next(draft.parameters()).dtype == torch.float32
        decoder = SpeculativeDecoder(draft, target, tokenizer)
        ids = tokenizer("hello hello")["input_ids"]
        greedy = decoder.generate(ids, max_new_tokens=12, method="target", temperature=0).token_ids
        for drafter in ("model", "hybrid"):
            assert decoder.generate(ids, max_new_tokens=12, temperature=0, drafter=drafter).token_ids == greedy
    draft, _, _ = load_pair(*tiny_pair_dirs, device="cpu", dtype="float16")
    assert not int8(draft) and next(draft.parameters()).dtype == torch.float16
    with pytest.raises(SpecDecError) as error:
        load_pair(*tiny_pair_dirs, draft_quantization="int2")
    assert error.value.field == "draft_quantization" and "int8, int4 or none" in str(error.value)


def test_load_pair_in_bfloat16_with_a_device_map_for_the_target(tiny_pair_dirs, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, path, **kwargs):
        calls.append(kwargs)
        return original(cls, path, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    draft, target, _ = load_pair(*tiny_pair_dirs, dtype="bfloat16", device_map={"": "cpu"}, draft_quantization="none")
    assert next(draft.parameters()).dtype == torch.bfloat16
    assert next(target.parameters()).dtype == torch.bfloat16
    # the target through from_pretrained with the device map; the draft, without one, read into own memory
    (target_call,) = calls
    assert target_call["device_map"] == {"": "cpu"}
    assert target_call["local_files_only"] and target_call["trust_remote_code"] is False


def test_device_map_none_is_the_settings_word_for_none_and_others_are_refused_before_loading(tiny_pair_dirs,
                                                                                             monkeypatch):
    """The fifth audit: `device_map = "none"`, the settings' default, was refused by load_pair and --device_map in
    transformers' words, after the draft had loaded; a bad one too."""
    from transformers import AutoModelForCausalLM

    calls = []
    original = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, path, **kwargs: calls.append(kwargs) or original(cls, path, **kwargs)))
    with pytest.raises(SpecDecError) as error:
        load_pair(*tiny_pair_dirs, device_map="everywhere")
    assert error.value.field == "device_map" and "balanced_low_0" in str(error.value) and not calls
    load_pair(*tiny_pair_dirs, device_map=" None ", draft_quantization="none")
    assert all("device_map" not in call for call in calls)  # both read into the process's memory, no map
    from specdec.models.sources import resolve_device_map

    # one device, as transformers takes it, passes as before (a review: the first version refused it)
    assert [resolve_device_map(value) for value in ("cuda:1", 0, torch.device("cpu"))] == [
        "cuda:1", 0, torch.device("cpu")]


def test_missing_folder_is_one_clear_error(tiny_pair_dirs, tmp_path):
    draft_dir, _ = tiny_pair_dirs
    with pytest.raises(SpecDecError) as error:
        load_pair(draft_dir, str(tmp_path / "no-such-model"))
    assert error.value.field == "target_model"
    assert "no-such-model" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(SpecDecError) as error:
        load_pair(str(tmp_path / "missing.gguf"), tiny_pair_dirs[1])
    assert error.value.field == "draft_model" and "does not exist" in str(error.value)


def test_folder_without_config_points_at_its_gguf_file(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(SpecDecError, match="no config.json.*model.gguf"):
        resolve_source(str(tmp_path), "target")


def test_gguf_file_source(tmp_path):
    (tmp_path / "tiny.gguf").write_bytes(b"")
    assert resolve_source(str(tmp_path / "tiny.gguf"), "draft") == ModelSource(str(tmp_path), "tiny.gguf")


def test_load_pair_from_gguf_files(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny-q.gguf")
    path = str(tmp_path / "tiny-q.gguf")
    draft, target, tokenizer = load_pair(path, path)
    assert len(tokenizer) == 258 and tokenizer.eos_token == "<|endoftext|>"
    ids = tokenizer("hello there")["input_ids"]
    with torch.no_grad():
        # the same model; CPU kernels sum in another order, so equal up to float rounding
        torch.testing.assert_close(target(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits,
                                   atol=1e-5, rtol=1e-5)
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    result = decoder.generate(ids, max_new_tokens=6, method="google", temperature=0)
    assert result.sources.count("draft") == len(result.token_ids) - result.stats["rounds"]  # draft == target


def test_broken_gguf_file_is_one_clear_error(tiny_pair_dirs, tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(SpecDecError) as error:
        load_pair(tiny_pair_dirs[0], str(tmp_path / "broken.gguf"))
    assert error.value.field == "target_model" and "broken.gguf" in str(error.value)


def test_mismatched_tokenizers_fail_before_building_a_model_and_drop_the_targets_read(tiny_pair_dirs, tmp_path,
                                                                                     monkeypatch):
    draft_dir, target_dir = tiny_pair_dirs
    draft_copy = copy_model(draft_dir, tmp_path / "draft", tokenizer=False)
    other_tokenizer(90).save_pretrained(draft_copy)
    started, built = [], []
    real_read_soon = pair.read_soon
    monkeypatch.setattr(pair, "read_soon", lambda *a, **k: started.append(real_read_soon(*a, **k)) or started[-1])
    monkeypatch.setattr(pair, "load_draft", lambda *a, **k: built.append(a))
    with pytest.raises(SpecDecError) as error:
        load_pair(draft_copy, target_dir)
    assert "90" in str(error.value) and "100" in str(error.value)
    assert error.value.field == "draft_model"
    assert not built  # no model was built
    (pending,) = started  # the target's weights had started coming in beside the tokenizers ...
    assert pending is not None and pending.cancel.is_set()  # ... and were dropped


def test_same_size_but_different_vocabularies_are_refused(tiny_pair_dirs, tmp_path):
    draft_dir, target_dir = tiny_pair_dirs
    draft_copy = copy_model(draft_dir, tmp_path / "draft", tokenizer=False)
    other_tokenizer(100).save_pretrained(draft_copy)
    with pytest.raises(SpecDecError, match="tokenizers differ"):
        load_pair(draft_copy, target_dir)


def test_draft_without_tokenizer_uses_the_targets(tiny_pair_dirs, tmp_path):
    draft_dir, target_dir = tiny_pair_dirs
    draft_copy = copy_model(draft_dir, tmp_path / "draft", tokenizer=False)
    _, _, tokenizer = load_pair(draft_copy, target_dir)
    assert tokenizer.get_vocab() == make_tokenizer().get_vocab()


def test_mismatched_logit_widths_give_the_engines_error(tiny_pair_dirs, tmp_path):
    _, target_dir = tiny_pair_dirs
    small = str(tmp_path / "small")
    make_model(vocab_size=80).save_pretrained(small)  # no tokenizer: only the models' widths can be compared
    with pytest.raises(SpecDecError, match="draft has 80 tokens, the target 100"):
        load_pair(small, target_dir)


def test_unreachable_hub_id_is_one_sentence(tiny_pair_dirs, monkeypatch):
    monkeypatch.setattr(sources, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(SpecDecError) as error:
        load_pair(tiny_pair_dirs[0], "some-org/no-such-model")
    message = str(error.value)
    assert error.value.field == "target_model"
    assert "some-org/no-such-model" in message and "hub" in message and "\n" not in message


def test_hub_probe_respects_offline_mode(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sources.hub_reachable() is False


def test_path_like_names_are_never_sent_to_the_hub(tmp_path):
    for name in ("./nowhere", "/no/such/dir", "~/no-such-model-dir", "a/b/c"):
        with pytest.raises(SpecDecError, match="neither a model folder"):
            resolve_source(name, "target")
    assert resolve_source("Qwen/Qwen2.5-0.5B", "draft").local is False


def test_aliases_name_the_default_pair(monkeypatch, tmp_path):
    import specdec.default_pair

    folders = (str(tmp_path / "draft"), str(tmp_path / "target"))
    monkeypatch.setattr(specdec.models.default_pair, "default_pair_paths", lambda prepare=True: folders)
    assert resolve_source(None, "draft").path == folders[0]
    assert resolve_source("default", "target").path == folders[1]
    assert resolve_source("qwen2.5-coder-0.5b", "target").path == folders[0]
    assert resolve_source("Qwen2.5-Coder-1.5B-Instruct", "draft").path == folders[1]


def _mapped_from(suffix: str) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from files whose name ends with `suffix`."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(suffix):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((low, high))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_load_pair_copies_cpu_weights_out_of_the_mapped_checkpoint(tiny_pair_dirs):
    def mapped(model):
        ranges = _mapped_from(".safetensors")
        return [name for name, p in model.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]

    _, stock, _ = load_pair(*tiny_pair_dirs, device="cpu", cpu_kernels=False)
    assert mapped(stock)  # what from_pretrained gives: weights in the checkpoint's mapped pages
    draft, target, _ = load_pair(*tiny_pair_dirs, device="cpu")
    assert not mapped(target) and not mapped(draft)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(target(input_ids=ids).logits, stock(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_weights_read_into_own_memory_give_bitwise_the_stock_outputs(tiny_pair_dirs):
    from transformers import AutoModelForCausalLM

    _, target_dir = tiny_pair_dirs
    stock = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    own = load.load_model(ModelSource(target_dir), "target", torch.device("cpu"), torch.float32, own_memory=True)
    ranges = _mapped_from(".safetensors")
    assert not [n for n, p in own.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]
    assert own.name_or_path == target_dir and own.generation_config.eos_token_id == stock.generation_config.eos_token_id
    assert not own.training
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(own(input_ids=ids).logits, stock(input_ids=ids).logits)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_use_own_memory_copies_mapped_weights_one_by_one_bitwise_and_keeps_ties(tmp_path):
    from transformers import AutoModelForCausalLM

    make_model("qwen2", seed=0, hidden=64, tie_word_embeddings=True).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # memory-mapped from the checkpoint
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    mapped_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert memory.use_own_memory(model) == mapped_bytes  # every parameter was mapped
    assert memory.use_own_memory(model) == 0  # and none is now
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)


def test_the_start_up_log_reports_its_steps_with_seconds(tiny_pair_dirs, caplog):
    caplog.set_level("INFO", logger="specdec")
    load_pair(*tiny_pair_dirs, device="cpu")
    steps = [m.group(1) for m in (re.match(r"start-up: (.+) in (\d+\.\d\d) s( \(.+\))?$", r.getMessage())
                                  for r in caplog.records if r.getMessage().startswith("start-up: ")) if m]
    assert len(steps) == sum(r.getMessage().startswith("start-up: ") for r in caplog.records)  # all say seconds
    expected = ["checked the model sources", "loaded the target's tokenizer",
                "compared the draft's tokenizer files with the target's", "read the draft's weights into the "
                "process's memory", "built the draft model", "quantized the draft to int8",
                "read the target's weights into the process's memory", "built the target model", "CPU kernels for the pair"]
    assert steps == expected  # a folder outside the cache: the draft is quantized, not kept


def test_a_draft_with_other_tokenizer_files_is_loaded_and_checked(tiny_pair_dirs, tmp_path, caplog):
    draft_dir, target_dir = tiny_pair_dirs
    draft = copy_model(draft_dir, tmp_path / "draft")
    with open(os.path.join(draft, "tokenizer_config.json"), "a") as config:
        config.write("\n")  # the same tokenizer, other bytes
    assert not tokenizers.same_tokenizer_files(ModelSource(draft), ModelSource(target_dir))
    assert tokenizers.same_tokenizer_files(ModelSource(draft_dir), ModelSource(target_dir))
    caplog.set_level("INFO", logger="specdec")
    load_pair(draft, target_dir, device="cpu")
    assert any(r.getMessage().startswith("start-up: loaded the draft's tokenizer and checked it") for r in caplog.records)


def test_a_broken_draft_checkpoint_is_one_clear_error_while_the_target_is_read_beside_it(tiny_pair_dirs, tmp_path):
    draft_dir, target_dir = tiny_pair_dirs
    draft = copy_model(draft_dir, tmp_path / "draft")
    weights = os.path.join(draft, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    with pytest.raises(SpecDecError) as error:
        load_pair(draft, target_dir, device="cpu", draft_quantization="none")
    assert error.value.field == "draft_model" and "truncated" in str(error.value)
