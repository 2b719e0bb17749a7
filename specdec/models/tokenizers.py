"""The pair's one tokenizer: the target's, checked against the draft's (the same token for the same id) before any
model is built."""

import hashlib
import os
from pathlib import Path

from ..errors import SpecDecError
from .sources import ModelSource, load_error, pretrained_kwargs
from .startup import startup_step

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")
# every file a tokenizer may be read from, by the start of its name
TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges",
                           "spiece", "sentencepiece")


def has_tokenizer(source: ModelSource) -> bool:
    """Whether the source ships a tokenizer: GGUF files and hub ids do; a folder only with tokenizer files."""
    if source.gguf_file or not source.local:
        return True
    return any(os.path.isfile(os.path.join(source.path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(source: ModelSource, role: str = "target", trust_remote_code: bool = False):
    """The source's tokenizer (with its chat template, if any)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path, **pretrained_kwargs(source, trust_remote_code))
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as error:
        raise load_error(source, role, "tokenizer", error) from None


def _tokenizer_files(source: ModelSource) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(Path(source.path).iterdir())
            if path.is_file() and path.name.startswith(TOKENIZER_FILE_PREFIXES)}


def same_tokenizer_files(draft: ModelSource, target: ModelSource) -> bool:
    """Whether two local folders hold the same tokenizer files, byte for byte (then the tokenizers are one, and
    the draft's need not be loaded): the default pair's draft carries a verbatim copy of the target's."""
    if not (draft.local and target.local) or draft.gguf_file or target.gguf_file:
        return False
    files = _tokenizer_files(target)
    return bool(files) and any(name.startswith("tokenizer") for name in files) and files == _tokenizer_files(draft)


def check_tokenizers(draft_tokenizer, target_tokenizer) -> None:
    """Speculative decoding needs one vocabulary: the same token for the same id, specials and added tokens too."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sum(1 for token, i in target_vocab.items() if draft_vocab.get(token) != i)
        raise SpecDecError(
            f"the draft and target tokenizers differ: the draft's vocabulary has {len(draft_vocab)} tokens, the "
            f"target's {len(target_vocab)}, and {differing} of the target's tokens have another id or none in the "
            f"draft", field="draft_model")


def load_and_check_tokenizers(draft_source: ModelSource, target_source: ModelSource, trust_remote_code: bool):
    """The pair's tokenizer: the target's, and the draft's too where its files differ, checked to be the same
    tokenizer (a mismatched pair fails here, before any model is built)."""
    with startup_step("loaded the target's tokenizer"):
        tokenizer = load_tokenizer(target_source, "target", trust_remote_code) \
            if has_tokenizer(target_source) else None
    if has_tokenizer(draft_source):
        with startup_step("compared the draft's tokenizer files with the target's") as note:
            same = tokenizer is not None and same_tokenizer_files(draft_source, target_source)
            note["detail"] = "the same bytes: one tokenizer, not loaded again" if same else "not the same"
        if not same:
            with startup_step("loaded the draft's tokenizer and checked it against the target's"):
                draft_tokenizer = load_tokenizer(draft_source, "draft", trust_remote_code)
                if tokenizer is None:
                    tokenizer = draft_tokenizer
                else:
                    check_tokenizers(draft_tokenizer, tokenizer)
    if tokenizer is None:
        raise SpecDecError(f"neither {target_source} nor {draft_source} has a tokenizer", field="target_model")
    return tokenizer
