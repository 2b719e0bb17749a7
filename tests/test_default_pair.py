"""The real default pair (Qwen2.5-Coder-Instruct 0.5B draft, 1.5B target) from the converted cache.

Needs `make models` (which `make test` runs first). Greedy speculative decoding must reproduce the target's greedy
tokens exactly, on a code prompt and on a chat prompt through the target's chat template, and on an input-grounded
prompt (rewriting given code) with every drafter under both verification rules, and with the draft model's
confidence stop.
"""

import logging
import time
from pathlib import Path

import pytest
import torch

from specdec import SamplingParams, SpeculativeDecoder, load_pair
from specdec.models.default_pair import DRAFT, MARKER, TARGET, default_pair_paths, is_ready
from specdec.models.kernels import use_cpu_kernels, use_stock_kernels
from specdec.params import DRAFTERS, VERIFICATIONS

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("real_models")]

logger = logging.getLogger(__name__)
NEW_TOKENS = 32
PROMPTS = {
    "code": ("def is_prime(n: int) -> bool:\n", False),
    "chat": ("Write a Python function that reverses the words of a sentence.", True),
}
GROUNDED = ("Add type hints to this function and return it whole.\n\n```python\ndef total(prices, quantities):\n"
            "    result = 0\n    for price, quantity in zip(prices, quantities):\n        result += price * quantity\n"
            "    return result\n```", True)


@pytest.fixture(scope="module")
def real_pair():
    """(draft_dir, target_dir, decoder, tokenizer), loaded once for the module."""
    draft_dir, target_dir = default_pair_paths(prepare=True)  # converts only if `make models` has not
    started = time.perf_counter()
    draft, target, tokenizer = load_pair()
    logger.info("default pair loaded from the cache in %.1f s", time.perf_counter() - started)
    yield draft_dir, target_dir, SpeculativeDecoder(draft, target, tokenizer), tokenizer


def test_loads_from_the_converted_cache(real_pair):
    draft_dir, target_dir, decoder, _ = real_pair
    assert is_ready(Path(draft_dir), DRAFT) and is_ready(Path(target_dir), TARGET)
    assert (Path(target_dir) / MARKER).is_file() and not list(Path(target_dir).glob("*.gguf"))
    assert Path(decoder.target_model.name_or_path) == Path(target_dir)
    assert Path(decoder.draft_model.name_or_path) == Path(draft_dir)
    assert decoder.target_model.config.num_hidden_layers == 28 and decoder.draft_model.config.num_hidden_layers == 24
    assert decoder.vocab_size == 151_936
    # draft_quantization = "auto": the draft's linear layers all in 4-bit groups, the target's as shipped (Q4_K, Q6_K)
    from specdec.cpu.grouped import GroupedLinear, grouped_kernel

    if grouped_kernel():
        bits = {role: {m.bits for m in model.modules() if isinstance(m, GroupedLinear)}
                for role, model in (("draft", decoder.draft_model), ("target", decoder.target_model))}
        assert bits == {"draft": {4}, "target": {4, 6}}


def test_vocabularies_identical(real_pair):
    from transformers import AutoTokenizer

    draft_dir, _, _, tokenizer = real_pair
    draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True)
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert draft_tokenizer.all_special_tokens == tokenizer.all_special_tokens
    text = "def f(x):\n    return {'a': x ** 2}  # 平方\n"
    assert draft_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_the_direct_decoder_gives_the_tokenizers_text(real_pair):
    """The service decodes through the Rust tokenizer directly (text.decoder_of): on Qwen's tokenizer, the same
    text as `decode` for random ids, special and added tokens and split characters among them."""
    from specdec.text import _generic_backend, decoder_of

    tokenizer = real_pair[3]
    assert _generic_backend(tokenizer) is not None
    decode = decoder_of(tokenizer)
    generator = torch.Generator().manual_seed(0)
    specials = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>"])
    pieces = tokenizer.encode("naïve 日本 🙂 def f(x):\n\treturn x", add_special_tokens=False)
    for _ in range(300):
        ids = torch.randint(0, len(tokenizer), (int(torch.randint(1, 24, (1,), generator=generator)),),
                            generator=generator).tolist()
        ids[::5] = [specials[i % len(specials)] for i in range(len(ids[::5]))]
        ids += pieces[: int(torch.randint(0, len(pieces), (1,), generator=generator))]
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_qwens_tokens_get_the_same_text_when_each_after_a_whole_one_is_decoded_alone(real_pair):
    """Qwen's decoder is byte-level BPE's, which joins texts (text.concatenates): the detokenizer then gives a token
    after a whole one its own text alone. The same pieces as the offsets scheme with both decodes, on random ids
    with special and added tokens, tokens that split characters, and text around them."""
    from specdec.text import Detokenizer, concatenates, decoder_of

    tokenizer = real_pair[3]
    assert concatenates(tokenizer)
    decode = decoder_of(tokenizer)
    generator = torch.Generator().manual_seed(1)
    specials = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>"])
    text = tokenizer.encode("naïve 日本 🙂 def f(x):\n\treturn x  # 平方", add_special_tokens=False)
    split = [i for i in range(len(tokenizer)) if "\ufffd" in decode([i])][:2000]  # parts of characters
    assert len(split) > 100
    for _ in range(200):
        n = int(torch.randint(1, 60, (1,), generator=generator))
        ids = torch.randint(0, len(tokenizer), (n,), generator=generator).tolist()
        for i in range(0, n, 3):
            kind = int(torch.randint(0, 4, (1,), generator=generator))
            ids[i] = (specials[i % len(specials)] if kind == 0 else split[(i * 37) % len(split)] if kind == 1
                      else text[i % len(text)])
        prompt = text[: int(torch.randint(0, 8, (1,), generator=generator))]
        fast, plain = Detokenizer(decode, prompt, concatenative=True), Detokenizer(decode, prompt)
        assert fast.add_all(ids) == plain.add_all(ids) and fast.flush() == plain.flush()


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_greedy_speculative_equals_target_greedy(real_pair, kind):
    _, _, decoder, tokenizer = real_pair
    text, chat = PROMPTS[kind]
    prompt = encode(tokenizer, text, chat)
    target = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, method="target", temperature=0)
    assert target.finish_reason == "stop" or len(target.token_ids) == NEW_TOKENS
    for method in ("google", "deepmind"):
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, method=method, gamma=4, temperature=0)
        assert result.token_ids == target.token_ids, (
            f"{method} greedy diverged from target greedy on the {kind} prompt:\n"
            f"{tokenizer.decode(result.token_ids)!r}\nvs\n{tokenizer.decode(target.token_ids)!r}")
        assert result.stats["acceptance_rate"] > 0.3  # a working draft, not just correct resampling
        logger.info("%s %s: %s", kind, method, {k: result.stats[k] for k in (
            "acceptance_rate", "tokens_per_target_forward", "tokens_per_second")})
    logger.info("%s target: %.2f tokens/s, %r", kind, target.stats["tokens_per_second"],
                tokenizer.decode(target.token_ids))


def test_greedy_equals_target_greedy_for_every_drafter_and_rule(real_pair):
    _, _, decoder, tokenizer = real_pair
    prompt = encode(tokenizer, *GROUNDED)
    target = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, method="target", temperature=0)
    lookup_accepted = 0
    for drafter in DRAFTERS:
        for verification in VERIFICATIONS:
            result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, gamma=4, temperature=0, drafter=drafter,
                                      verification=verification)
            assert result.token_ids == target.token_ids, (
                f"{drafter}/{verification} greedy diverged from target greedy:\n"
                f"{tokenizer.decode(result.token_ids)!r}\nvs\n{tokenizer.decode(target.token_ids)!r}")
            lookup_accepted += result.stats.accepted_by_drafter.get("lookup", 0)
            logger.info("grounded %s/%s: %s", drafter, verification, {k: result.stats[k] for k in (
                "tokens_per_target_forward", "round_share_by_drafter", "tokens_per_second")})
    assert lookup_accepted > NEW_TOKENS // 2  # the code is repeated: the lookup carried much of it
    # the draft model ending its runs on tokens it is unsure of
    for drafter, verification in (("model", "token"), ("hybrid", "block")):
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, gamma=4, temperature=0, drafter=drafter,
                                  verification=verification, draft_confidence_threshold=0.6)
        assert result.token_ids == target.token_ids, (
            f"{drafter}/{verification} with the confidence stop diverged from target greedy:\n"
            f"{tokenizer.decode(result.token_ids)!r}\nvs\n{tokenizer.decode(target.token_ids)!r}")


@pytest.fixture(scope="module")
def float_target(real_pair):
    """The target with `weights = "float"` (the pair's default is the GGUF's own weights): every layer dequantized."""
    return load_pair(weights="float")[1]


def test_logprobs_are_target_only_decodings_and_a_stock_forwards(real_pair, float_target):
    """Greedy: bitwise target-only's (our kernels make every target row bitwise equal), for the model and lookup
    drafters under both rules; sampled: each token's logprob equals a forward of the target with the library's
    own layers over prompt plus output within 1e-4, the prompt's (echo) included. On the float target: with the
    GGUF's own weights x is rounded to int8 in every layer, and the attention's last-bit differences between the
    library's layers and ours can move a rounding (logprobs then differ by up to a few hundredths)."""
    tokenizer = real_pair[3]
    decoder = SpeculativeDecoder(real_pair[2].draft_model, float_target, tokenizer)
    prompt = encode(tokenizer, *GROUNDED)
    target = decoder.generate(prompt, params=SamplingParams(max_new_tokens=16, method="target", temperature=0,
                                                            logprobs=5, prompt_logprobs=1))
    for drafter, verification in (("model", "token"), ("lookup", "block")):
        result = decoder.generate(prompt, params=SamplingParams(max_new_tokens=16, temperature=0, logprobs=5,
                                                                prompt_logprobs=1, drafter=drafter,
                                                                verification=verification))
        assert result.token_ids == target.token_ids
        assert result.logprobs == target.logprobs and result.prompt_logprobs == target.prompt_logprobs
    sampled = decoder.generate(prompt, params=SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=0,
                                                             logprobs=1, prompt_logprobs=1, drafter="hybrid"))
    ids = torch.tensor([prompt + sampled.token_ids])
    use_stock_kernels(decoder.target_model)
    try:
        with torch.inference_mode():
            rows = decoder.target_model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    finally:
        use_cpu_kernels(decoder.target_model)
    plain = rows.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()
    ours = [t.logprob for t in sampled.prompt_logprobs[1:] + sampled.logprobs]
    assert ours == pytest.approx(plain, abs=1e-4)


def test_shipped_weights_keep_the_float_paths_logits_within_tolerance(real_pair, float_target):
    """The GGUF's own weights (`weights = "shipped"`: the same values, x quantized to int8 per group of 32 in the
    kernel) against the dequantized float32 target, on the integration prompts: past the first position (whose
    massive activations int8 rounds hardest), each next-token distribution within 0.02 nats (KL) of the float one;
    greedy agreement over the prompts' positions is reported, not required."""
    from specdec.cpu.grouped import GroupedLinear

    shipped_target = real_pair[2].target_model  # the default
    assert any(isinstance(m, GroupedLinear) for m in shipped_target.modules())
    assert not any(isinstance(m, GroupedLinear) for m in float_target.modules())
    tokenizer = real_pair[3]
    agree = total = 0
    for text, chat in [*PROMPTS.values(), GROUNDED]:
        ids = torch.tensor([encode(tokenizer, text, chat)])
        with torch.inference_mode():
            exact = float_target(input_ids=ids).logits[0].float().log_softmax(-1)
            shipped = shipped_target(input_ids=ids).logits[0].float().log_softmax(-1)
        kl = (exact.exp() * (exact - shipped)).sum(-1)
        assert kl[1:].max().item() < 0.02, f"KL {kl[1:].max().item():.4f} nats past the first position: {text[:30]!r}"
        agree += int((exact.argmax(-1) == shipped.argmax(-1)).sum())
        total += len(kl)
        logger.info("shipped against float on %r: KL max %.4f (first position %.4f)", text[:30], kl[1:].max(), kl[0])
    logger.info("greedy agreement, shipped against float: %d/%d positions", agree, total)
    assert agree > 0.9 * total
