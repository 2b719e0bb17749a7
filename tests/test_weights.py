"""Weights read into the process's own memory, and the int8 draft kept in the cache as a ready form: used only
when whole and made under the same key, rebuilt whenever it is missing, stale or damaged. Tiny models."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from specdec.cpu import linear as cpu_linear
from specdec.models import load as loading
from specdec.models import quantization
from specdec.models.checkpoint import WeightsError, read_header
from specdec.models.sources import ModelSource
from specdec.models.weights import ReadyForm, read_safetensors
from tests.support.models import perturbed_copy, save_tiny_pair

pytestmark = pytest.mark.skipif(not cpu_linear.quantization_supported(), reason="no int8 engine in this torch")
IDS = torch.tensor([[5, 17, 42, 8, 99, 3]])
CPU = torch.device("cpu")
QUANTIZE = cpu_linear.quantize_linears  # the reference, whatever a test patches


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def reference_int8(folder) -> torch.Tensor:
    """What a freshly quantized draft gives: from_pretrained, then quantize_linears."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    QUANTIZE(model)
    return logits(model)


@pytest.fixture
def draft(tmp_path, monkeypatch) -> ModelSource:
    """A tiny Qwen2 draft (biased q/k/v projections) in a cache of its own."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    draft_dir, _ = save_tiny_pair(root, arch="qwen2")
    return ModelSource(draft_dir)


@pytest.fixture
def quantizations(monkeypatch) -> list:
    """Each time loading quantizes a float draft (builds the int8 form) rather than using the kept one."""
    calls = []
    original = cpu_linear.quantize_linears

    def spy(model):
        calls.append(type(model).__name__)
        return original(model)

    monkeypatch.setattr(cpu_linear, "quantize_linears", spy)
    return calls


def load(source: ModelSource):
    return loading.load_draft(source, CPU, torch.float32, "int8")


def form_of(source: ModelSource) -> ReadyForm:
    return quantization.int8_draft_form(source)


# --- reading safetensors into own memory -----------------------------------------------------------------------

def test_read_safetensors_reads_every_tensor_and_casts_only_floats(tmp_path):
    tensors = {"f32": torch.randn(7, 5), "bf16": torch.randn(3).bfloat16(), "i64": torch.arange(4),
               "i8": torch.tensor([-3, 0, 7], dtype=torch.int8), "mask": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "w.safetensors")
    read = read_safetensors(tmp_path / "w.safetensors", threads=3)
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    cast = read_safetensors(tmp_path / "w.safetensors", dtype=torch.bfloat16)
    assert cast["f32"].dtype == torch.bfloat16 and torch.equal(cast["f32"], tensors["f32"].bfloat16())
    assert cast["i64"].dtype == torch.int64 and cast["mask"].dtype == torch.bool
    read["f32"].add_(1)  # the process's own memory: writable, and the file is untouched
    assert torch.equal(read_safetensors(tmp_path / "w.safetensors")["f32"], tensors["f32"])


def test_read_safetensors_refuses_a_truncated_file_and_a_wrong_hash(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(64), "b": torch.randn(64)}, path)
    _, start = read_header(path)
    with pytest.raises(WeightsError, match="does not match its recorded sha256"):
        read_safetensors(path, digests={"a": "0" * 64, "b": "0" * 64})
    with pytest.raises(WeightsError, match="has no recorded hash"):
        read_safetensors(path, digests={"a": "0" * 64})
    os.truncate(path, start + 100)
    with pytest.raises(WeightsError, match="truncated"):
        read_safetensors(path)


# --- the kept int8 draft ---------------------------------------------------------------------------------------

def test_the_int8_draft_is_kept_and_later_starts_use_it_bitwise(draft, quantizations, caplog):
    expected = reference_int8(draft.path)
    caplog.set_level("INFO", logger="specdec")
    first = load(draft)
    assert quantizations == ["Qwen2ForCausalLM"] and form_of(draft).path.is_file()
    assert any(r.getMessage().startswith("start-up: kept the int8 draft for later starts") for r in caplog.records)
    assert torch.equal(logits(first), expected)

    caplog.clear()
    kept = load(draft)
    assert quantizations == ["Qwen2ForCausalLM"]  # not quantized again
    assert any("verified" in r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up: read"))
    assert not any(type(m) is torch.nn.Linear for m in kept.modules())  # no float weight of an int8 layer
    assert torch.equal(logits(kept), expected)
    assert kept.name_or_path == draft.path and not kept.training
    assert kept.generation_config.eos_token_id == first.generation_config.eos_token_id


def test_only_folders_in_the_cache_keep_forms(tiny_pair_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "elsewhere"))
    assert form_of(ModelSource(tiny_pair_dirs[0])) is None
    assert form_of(ModelSource(tiny_pair_dirs[0], gguf_file="x.gguf")) is None


def _flip_a_weight_byte(path):
    header, start = read_header(path)
    name = next(n for n in header if n.endswith(".int8_weight"))
    begin, end = header[name]["data_offsets"]
    with open(path, "r+b") as file:
        file.seek(start + (begin + end) // 2)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x5A]))


def _reshape_a_tensor(path, key):
    """The same key and honest hashes, but one int8 weight of another shape (a bug in whatever wrote it)."""
    tensors = read_safetensors(path)
    name = next(n for n in tensors if n.endswith("q_proj.int8_weight"))
    tensors[name] = tensors[name].reshape(-1, 2).clone()
    ReadyForm(path, key).save(tensors)


DAMAGES = {
    "missing": lambda form, monkeypatch, source: form.path.unlink(),
    "truncated": lambda form, monkeypatch, source: os.truncate(form.path, form.path.stat().st_size // 2),
    "wrong hash": lambda form, monkeypatch, source: _flip_a_weight_byte(form.path),
    "wrong shapes": lambda form, monkeypatch, source: _reshape_a_tensor(form.path, form.key),
    "not a form": lambda form, monkeypatch, source: form.path.write_bytes(b"\x00" * 64),
    "other torch": lambda form, monkeypatch, source: monkeypatch.setattr(torch, "__version__", "2.99.0+other"),
    "other machine": lambda form, monkeypatch, source: monkeypatch.setattr(cpu_linear, "_cpu_signature",
                                                                           lambda: "model name: another CPU"),
    "other code": lambda form, monkeypatch, source: monkeypatch.setattr(quantization, "_int8_form_code",
                                                                             lambda: "0123456789abcdef"),
}
REASONS = {"truncated": "truncated", "wrong hash": "sha256", "wrong shapes": "not the expected ones",
           "not a form": "safetensors", "other torch": "differs in: torch", "other machine": "differs in: cpu",
           "other code": "differs in: code"}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_missing_stale_or_damaged_form_is_rebuilt_never_trusted(draft, quantizations, damage, monkeypatch,
                                                                   caplog):
    expected = reference_int8(draft.path)
    load(draft)
    DAMAGES[damage](form_of(draft), monkeypatch, draft)
    caplog.set_level("INFO", logger="specdec")
    rebuilt = load(draft)
    assert quantizations == ["Qwen2ForCausalLM"] * 2  # built again from the float draft
    assert torch.equal(logits(rebuilt), expected)
    if damage in REASONS:
        warning = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("not using the ready"))
        assert REASONS[damage] in warning
    # and kept again, whole: the next start uses it
    assert torch.equal(logits(load(draft)), expected) and len(quantizations) == 2


def test_a_changed_source_checkpoint_makes_the_form_stale(draft, quantizations, caplog):
    old = reference_int8(draft.path)
    load(draft)
    changed = perturbed_copy(AutoModelForCausalLM.from_pretrained(draft.path), noise=0.5, seed=7)
    changed.save_pretrained(draft.path)  # the same names and shapes, other weights
    expected = reference_int8(draft.path)
    assert not torch.equal(expected, old)
    caplog.set_level("INFO", logger="specdec")
    rebuilt = load(draft)
    assert len(quantizations) == 2 and torch.equal(logits(rebuilt), expected)
    warning = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("not using the ready"))
    assert "differs in: source" in warning


def test_the_form_records_its_key_and_a_hash_per_tensor(draft):
    load(draft)
    form = form_of(draft)
    header, _ = read_header(form.path)
    record = json.loads(header["__metadata__"]["specdec_ready"])
    assert record["key"] == form.key and record["key"]["torch"] == torch.__version__
    tensors = [name for name in header if name != "__metadata__"]
    assert sorted(record["sha256"]) == sorted(tensors)
    assert all(re.fullmatch("[0-9a-f]{64}", digest) for digest in record["sha256"].values())
    assert not any(name.startswith(".") for name in os.listdir(form.path.parent))  # no temporary file left


def test_make_models_keeps_the_int8_draft_once(draft, quantizations, tmp_path):
    path = loading.keep_int8_draft(draft)  # what `python -m specdec.default_pair prepare` runs
    assert path == str(form_of(draft).path) and form_of(draft).looks_current()
    assert loading.keep_int8_draft(draft) == path and len(quantizations) == 1  # current: left alone, not read
    os.truncate(path, 100)
    assert not form_of(draft).looks_current()
    loading.keep_int8_draft(draft)
    assert len(quantizations) == 2 and form_of(draft).looks_current()
    assert loading.keep_int8_draft(ModelSource(str(tmp_path))) is None  # outside the cache: nothing kept


def test_a_killed_starts_joined_gguf_is_removed_by_the_next_and_a_live_ones_kept(tmp_path, monkeypatch):
    """gguf_file joins the default pair's parts in a scratch folder of the cache; a start killed meanwhile left its
    0.5-1 GB there, which nothing removed (an audit). The next join removes those whose process is gone."""
    from types import SimpleNamespace

    from specdec.models import default_pair, shipped

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(default_pair, "join_parts", lambda origin, joined: joined.write_bytes(b"GGUF"))
    dead = tmp_path / f"{shipped.SCRATCH_PREFIX}999999999-abc"
    live = tmp_path / f"{shipped.SCRATCH_PREFIX}{os.getpid()}-xyz"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.gguf").write_bytes(b"left")
    with shipped.gguf_file(SimpleNamespace(filename="model.gguf")) as joined:
        assert joined.read_bytes() == b"GGUF" and joined.parent.name.startswith(shipped.SCRATCH_PREFIX)
        assert not dead.exists() and live.exists()
    assert not joined.parent.exists() and sorted(tmp_path.iterdir()) == [live]


@pytest.mark.parametrize("current, loads, packed_with", [
    (True, [None, "model"], [True]),  # found damaged when read: packed again from the GGUF, then read
    (False, ["model"], [False]),  # missing or made under another key (an upgrade): packed first
    (True, ["model"], []),  # the usual start: read as kept
    (True, [None, None], [True]),  # still unusable: None, and load_pair loads the float model
])
def test_a_kept_form_missing_stale_or_damaged_is_packed_from_the_gguf_before_the_model_is_read(
        monkeypatch, current, loads, packed_with):
    """A damaged target form was rebuilt by loading the float target and packing it in place: 7 GB read, 12.9 GB at
    peak against 2.8 for a start (an audit). load_kept packs from the GGUF into a model with no weights first
    (keep_shipped, as `make models` does), then reads the form."""
    from types import SimpleNamespace

    from specdec.cpu import grouped
    from specdec.models import shipped

    packed, read = [], iter(loads)
    monkeypatch.setattr(shipped, "keeps_shipped", lambda source: True)
    monkeypatch.setattr(grouped, "grouped_kernel", lambda: True)
    monkeypatch.setattr(shipped, "shipped_form", lambda source, requantize=None: SimpleNamespace(
        looks_current=lambda: current))
    monkeypatch.setattr(shipped, "keep_shipped", lambda source, requantize=None, rebuild=False: packed.append(rebuild))
    monkeypatch.setattr(shipped, "load_shipped", lambda *args, **kwargs: next(read))
    assert shipped.load_kept("source", "target", torch.float32) == loads[-1]
    assert packed == packed_with
