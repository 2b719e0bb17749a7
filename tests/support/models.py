"""Tiny random causal LMs built from configs, a tiny character tokenizer, a saved tiny pair, and an app over a
loaded pair: the helpers the tests (and the stress harness) share. Nothing here downloads; models are seeded.
"""

import contextlib
import os
import time

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

ARCHITECTURES = ("llama", "qwen2", "gpt2", "bloom")
SPECIALS = ["<unk>", "<bos>", "<eos>", "<pad>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<bos>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant: {% endif %}"
)


def tiny_config(arch: str = "llama", vocab_size: int = 64, layers: int = 2, hidden: int = 32, context: int = 256,
                eos_token_id: int | None = None, initializer_range: float = 0.02, tie_word_embeddings: bool = False):
    """A few-layer config of the given architecture; no special tokens unless eos_token_id is given.

    A larger initializer_range gives sharper, less uniform next-token distributions.
    """
    special = dict(bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, tie_word_embeddings=tie_word_embeddings,
                   initializer_range=initializer_range)
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=context, **special)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=context, **special)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=4, n_positions=context,
                          **special)
    if arch == "bloom":
        return BloomConfig(vocab_size=vocab_size, hidden_size=hidden, n_layer=layers, n_head=4, **special)
    raise ValueError(arch)


def make_model(arch: str = "llama", seed: int = 0, **config_kwargs):
    """A seeded tiny random model (untied embeddings unless tie_word_embeddings=True)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **config_kwargs)).eval()


def perturbed_copy(model, noise: float = 0.02, seed: int = 1):
    """A draft close to the target: the same weights plus seeded Gaussian noise (partial acceptance)."""
    draft = AutoModelForCausalLM.from_config(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise * (param.std() if param.numel() > 1 else 1))
    return draft


def make_tokenizer(extra: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: 4 specials + printable ASCII + newline (100 tokens), then the `extra` tokens
    (ids 100, 101, ...; fill-in-the-middle's, say)."""
    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS + list(extra))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_pair(folder, arch: str = "llama", vocab_size: int = 100, noise: float = 0.3):
    """Save a tiny target and a perturbed draft, each with the tokenizer, under folder/target and folder/draft."""
    tokenizer = make_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    target = make_model(arch, seed=0, initializer_range=0.1, vocab_size=vocab_size, eos_token_id=eos)
    draft = perturbed_copy(target, noise=noise)
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        path = os.path.join(str(folder), name)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    return paths["draft"], paths["target"]


def make_app(pair, **overrides):
    """A service app serving an already-loaded (draft, target, tokenizer), ready when returned."""
    from specdec.serve import create_app

    app = create_app({"loader": lambda settings: pair, **overrides})
    assert app.extensions["specdec"].wait_until_loaded(30)
    return app


def wait_until_engine_free(service, seconds: float = 20) -> None:
    """Wait until no request holds the service's engine (a stream's client reading nothing meanwhile), or fail."""
    deadline = time.monotonic() + seconds
    while service.scheduler.busy:
        assert time.monotonic() < deadline, "the engine is still held by a stream nobody reads"
        time.sleep(0.01)




def load_saved_pair(dirs) -> tuple:
    """(draft, target, tokenizer) loaded from the folders save_tiny_pair wrote: a fresh copy each call."""
    draft_dir, target_dir = dirs
    return (AutoModelForCausalLM.from_pretrained(draft_dir), AutoModelForCausalLM.from_pretrained(target_dir),
            AutoTokenizer.from_pretrained(target_dir))


@contextlib.contextmanager
def specdec_env_cleared():
    """No SPECDEC_* variable of the caller's reaches the settings: they come from config/default.toml and the
    test only."""
    from specdec.serve.config import Settings

    with pytest.MonkeyPatch.context() as env:
        for name in list(Settings.model_fields) + ["config"]:
            env.delenv(f"SPECDEC_{name.upper()}", raising=False)
        yield env
