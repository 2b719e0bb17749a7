"""The default pair's cache without the real models: joining parts, the size and sha256 checks, atomic conversion."""

import hashlib
import json
import sys

import pytest

from specdec import SpecDecError
from specdec import default_pair as command
from specdec.models import cache, default_pair
from specdec.models.default_pair import MARKER, GGUFSource, is_ready, join_parts, prepare_model


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three importable part packages (`fakepart1..3`) holding bytes, like the PyPI ones, and their source."""
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"second part" * 50, b"end"]
    packages = tmp_path / "site"
    for i, chunk in enumerate(chunks, start=1):
        package = packages / f"fakepart{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (package / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n")
    monkeypatch.syspath_prepend(str(packages))
    for i in range(1, 4):
        sys.modules.pop(f"fakepart{i}", None)
    joined = b"".join(chunks)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return GGUFSource("fake-model", "draft", "fakepart", 3, "fake.gguf", len(joined),
                      hashlib.sha256(joined).hexdigest()), joined


def test_join_parts_in_order_and_verify(fake_parts, tmp_path):
    source, joined = fake_parts
    join_parts(source, tmp_path / "out.gguf")
    assert (tmp_path / "out.gguf").read_bytes() == joined


def test_wrong_sha256_is_refused(fake_parts, tmp_path):
    source, _ = fake_parts
    tampered = GGUFSource(**{**source.__dict__, "sha256": "0" * 64})
    with pytest.raises(SpecDecError, match="refusing fake.gguf: its sha256 is"):
        join_parts(tampered, tmp_path / "out.gguf")


def test_wrong_size_is_refused_before_joining(fake_parts, tmp_path):
    source, _ = fake_parts
    with pytest.raises(SpecDecError, match="not the pinned ones"):
        join_parts(GGUFSource(**{**source.__dict__, "size": source.size + 1}), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_missing_part_package_says_how_to_install(fake_parts, tmp_path):
    source, _ = fake_parts
    with pytest.raises(SpecDecError, match="fakepart4 is not installed: run `make models`"):
        join_parts(GGUFSource(**{**source.__dict__, "parts": 4}), tmp_path / "out.gguf")


def test_conversion_is_atomic_and_marked_last(fake_parts, monkeypatch, tmp_path):
    source, joined = fake_parts
    destination = default_pair.model_dir(source)

    def crash(gguf_path, folder, tokenizer_dir=None):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed half-way

    monkeypatch.setattr(default_pair, "convert", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_model(source)
    assert not destination.exists()
    assert [p.name for p in destination.parent.iterdir()] == [f".{source.name}.lock"]

    seen = {}

    def fake_convert(gguf_path, folder, tokenizer_dir=None):
        seen["gguf"] = gguf_path.read_bytes()
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(default_pair, "convert", fake_convert)
    assert prepare_model(source) == destination
    assert seen["gguf"] == joined
    assert is_ready(destination, source)
    assert json.loads((destination / MARKER).read_text())["sha256"] == source.sha256
    assert sorted(p.name for p in destination.iterdir()) == ["config.json", MARKER]  # no GGUF copy kept

    seen.clear()
    assert prepare_model(source) == destination and not seen  # a finished cache is not converted again


def test_a_folder_without_marker_is_never_trusted(fake_parts, monkeypatch):
    source, _ = fake_parts
    destination = default_pair.model_dir(source)
    destination.mkdir(parents=True)
    (destination / "model.safetensors").write_bytes(b"half written")
    stale = destination.parent / f".{source.name}.tmp-abc"
    stale.mkdir()
    assert not is_ready(destination, source)
    (destination / MARKER).write_text(json.dumps({"format": default_pair.FORMAT_VERSION, "sha256": "0" * 64}))
    assert not is_ready(destination, source)  # a marker for another file

    monkeypatch.setattr(default_pair, "convert", lambda gguf, folder, tokenizer_dir=None: None)
    prepare_model(source)
    assert is_ready(destination, source)
    assert not (destination / "model.safetensors").exists() and not stale.exists()


def test_default_pair_paths_without_preparing(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with pytest.raises(SpecDecError, match="not prepared.*make models"):
        default_pair.default_pair_paths(prepare=False)


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert default_pair.model_dir(default_pair.TARGET) == tmp_path / "qwen2.5-coder-1.5b-instruct"
    monkeypatch.delenv("SPECDEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.cache_root() == tmp_path / ".cache" / "specdec"


def test_pinned_sources_match_models_md():
    assert (default_pair.DRAFT.size, default_pair.DRAFT.sha256[:12]) == (491_400_064, "1d9614638d18")
    assert (default_pair.TARGET.size, default_pair.TARGET.sha256[:12]) == (1_117_320_768, "cc324af070c2")
    assert default_pair.DRAFT.tokenizer_from is default_pair.TARGET


def test_quick_prepare_trusts_a_whole_int8_form_to_loading_and_builds_a_missing_or_truncated_one(
        monkeypatch, tmp_path, capsys):
    import struct

    from specdec.models import load, shipped

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(default_pair, "prepare_model", lambda source, force=False: default_pair.model_dir(source))
    built, packed = [], []
    monkeypatch.setattr(load, "keep_int8_draft", lambda source: built.append(source.path) or "kept")
    monkeypatch.setattr(shipped, "keep_shipped",
                        lambda source, requantize=None: packed.append((source.path, requantize)) or "kept")
    form = cache.int8_form_path(default_pair.model_dir(default_pair.DRAFT))

    assert command.main(["prepare", "--quick"]) == 0 and len(built) == 1  # no form yet: built
    # no packed GGUF weights yet: packed for both models, and the draft's 4-bit form (draft_quantization = "auto")
    assert sorted(requantize or 0 for _, requantize in packed) == [0, 0, 4]
    assert {path for path, requantize in packed if requantize == 4} == {
        str(default_pair.model_dir(default_pair.DRAFT))}
    header = json.dumps({"w": {"dtype": "I8", "shape": [2, 2], "data_offsets": [0, 4]}}).encode()
    form.parent.mkdir(parents=True)
    form.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03")  # one byte short
    assert command.main(["prepare", "--quick"]) == 0 and len(built) == 2  # truncated: built again
    form.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03\x04")
    capsys.readouterr()
    assert command.main(["prepare", "--quick"]) == 0 and len(built) == 2  # whole: left to loading
    assert "checked when loaded" in capsys.readouterr().out
    assert command.main(["prepare"]) == 0 and len(built) == 3  # without --quick the key is checked
    with pytest.raises(SystemExit):
        command.main(["prepare", "--quick", "--force"])


def test_the_quick_prepare_imports_no_torch(tmp_path):
    """make serve's check of the cache costs a fraction of a second: it imports neither torch nor transformers."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import json, struct, sys
        from specdec import default_pair as command
        from specdec.models import default_pair
        from specdec.models.cache import int8_form_path, shipped_form_path
        default_pair.prepare_model = lambda source, force=False: default_pair.model_dir(source)  # as if converted
        form = int8_form_path(default_pair.model_dir(default_pair.DRAFT))
        form.parent.mkdir(parents=True)
        header = json.dumps({"w": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}}).encode()
        form.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
        for source in (default_pair.DRAFT, default_pair.TARGET):  # the packed GGUF weights are there too
            shipped_form_path(default_pair.model_dir(source)).write_bytes(form.read_bytes())
        shipped_form_path(default_pair.model_dir(default_pair.DRAFT), 4).write_bytes(form.read_bytes())
        assert command.main(["prepare", "--quick"]) == 0
        print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={"SPECDEC_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip().splitlines()[-1] == "[]"
