"""Log-probabilities (params.logprobs, params.prompt_logprobs): the target's own, exactly.

Speculative decoding reports for each committed token the log-softmax of the target's raw logits on the row it
was verified on. On the same output they equal target-only decoding's: bitwise with our CPU kernels where the
logits are bitwise equal (grouped-head models: Llama, Qwen2), within 1e-5 elsewhere; and a plain transformers
forward of the target over prompt plus output within 1e-4, for every drafter and verification rule, greedy and
sampled. A request without logprobs does no vocabulary-wide work for them.
"""

import pytest
import torch

from specdec import SamplingParams, SpecDecError, SpeculativeDecoder
from specdec.kv_cache import CachedModel
from specdec.models.kernels import use_cpu_kernels
from specdec.params import DRAFTERS, MAX_LOGPROBS, VERIFICATIONS
from specdec.sampling import TokenLogprobs, token_logprobs
from tests.support.models import ARCHITECTURES, make_model, perturbed_copy

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]  # repeats, so the lookup has matches
TOP = 3
# (method, gamma): fixed and adaptive draft lengths, both variants
RUNS = (("google", 4), ("deepmind", 2), ("google", None))


def decoder_for(arch: str, kernels: bool) -> SpeculativeDecoder:
    target = make_model(arch, seed=0, initializer_range=0.1)
    draft = perturbed_copy(target, noise=0.3)
    if kernels:
        use_cpu_kernels(target)
        use_cpu_kernels(draft)
    return SpeculativeDecoder(draft, target)


def teacher_forced(target, prompt: list[int], tokens: list[int], top: int = TOP) -> list[TokenLogprobs]:
    """What target-only decoding reports for `tokens`: a prefill over the prompt, then one token per forward
    with its cache, the log-softmax of each row."""
    model, rows = CachedModel(target), []
    rows.append(model.forward(prompt, keep=1))
    for token in tokens[:-1]:
        rows.append(model.forward([token], keep=1))
    return token_logprobs(torch.cat(rows), tokens, top)


def plain_forward(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(prompt) + len(tokens) - 1,) the log-probability of every token after the first, by one forward of
    transformers without a cache."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = target(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)


def assert_same(ours: list[TokenLogprobs], reference: list[TokenLogprobs], bitwise: bool) -> None:
    assert [t.token for t in ours] == [t.token for t in reference]
    if bitwise:
        assert ours == reference
        return
    for mine, theirs in zip(ours, reference):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
        assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top], abs=1e-5)


# --- the pure function -------------------------------------------------------------------------------------------

def test_token_logprobs_is_the_log_softmax_of_the_raw_logits_with_the_top_alternatives():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)) * 3
    tokens = [4, 0, 9]
    result = token_logprobs(logits, tokens, top=2)
    expected = logits.log_softmax(-1)
    for row, (token, entry) in enumerate(zip(tokens, result)):
        assert entry.token == token and entry.logprob == pytest.approx(float(expected[row, token]), abs=1e-6)
        values, ids = expected[row].topk(2)
        assert entry.top == tuple(zip(ids.tolist(), values.tolist()))
        assert entry.top[0][1] >= entry.top[1][1] and entry.top[0][1] >= entry.logprob
    assert token_logprobs(logits, tokens)[0].top == ()  # top 0: the chosen token only
    assert len(token_logprobs(logits, tokens, top=MAX_LOGPROBS)[0].top) == 10  # never more than the vocabulary
    assert token_logprobs(logits, []) == []


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_logprobs_out_of_range_names_the_field(field, value):
    with pytest.raises(SpecDecError) as error:
        SamplingParams(**{field: value})
    assert error.value.field == field


def test_no_tokens_only_with_prompt_logprobs():
    with pytest.raises(SpecDecError) as error:
        SamplingParams(max_new_tokens=0, logprobs=1)
    assert error.value.field == "max_new_tokens"
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=0).max_new_tokens == 0


# --- exactness ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_logprobs_equal_target_only_decodings(arch):
    """Same tokens (greedy), same logprobs: bitwise where our kernels make the logits bitwise equal."""
    decoder = decoder_for(arch, kernels=True)
    bitwise = arch in ("llama", "qwen2")  # grouped-head attention: our kernel (gpt2 and bloom keep sdpa)
    reference = decoder.generate(PROMPT, params=SamplingParams(max_new_tokens=30, method="target", temperature=0,
                                                               logprobs=TOP))
    assert len(reference.logprobs) == len(reference.token_ids) == 30
    plain = plain_forward(decoder.target_model, PROMPT, reference.token_ids)[len(PROMPT) - 1:]
    assert [t.logprob for t in reference.logprobs] == pytest.approx(plain.tolist(), abs=1e-4)
    for drafter in DRAFTERS:
        for rule in VERIFICATIONS:
            for method, gamma in RUNS:
                result = decoder.generate(PROMPT, params=SamplingParams(
                    max_new_tokens=30, method=method, gamma=gamma, temperature=0, logprobs=TOP, drafter=drafter,
                    verification=rule))
                assert result.token_ids == reference.token_ids, (drafter, rule, method, gamma)
                assert_same(result.logprobs, reference.logprobs, bitwise)
                assert all(t.top[0] == (t.token, t.logprob) for t in result.logprobs)  # greedy: the argmax


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("rule", VERIFICATIONS)
def test_sampled_logprobs_equal_target_only_on_the_same_output_and_a_plain_forward(arch, drafter, rule):
    """Sampled output (every source: accepted, resampled, bonus): each token's logprob is the one target-only
    decoding computes for it, and a plain transformers forward over prompt plus output agrees within 1e-4."""
    decoder = decoder_for(arch, kernels=True)
    bitwise = arch == "llama"
    sources = set()
    for method, gamma in RUNS:
        for seed in range(2):
            result = decoder.generate(PROMPT, params=SamplingParams(
                max_new_tokens=24, method=method, gamma=gamma, temperature=0.6, top_k=20, top_p=0.9, seed=seed,
                logprobs=TOP, prompt_logprobs=TOP, drafter=drafter, verification=rule))
            sources.update(result.sources)
            assert_same(result.logprobs, teacher_forced(decoder.target_model, PROMPT, result.token_ids), bitwise)
            plain = plain_forward(decoder.target_model, PROMPT, result.token_ids)
            ours = [t.logprob for t in result.prompt_logprobs[1:] + result.logprobs]
            assert ours == pytest.approx(plain.tolist(), abs=1e-4)
            assert result.prompt_logprobs[0] is None
    assert "resampled" in sources and (drafter == "lookup" or "draft" in sources)
    if arch == "llama":
        assert "bonus" in sources and ("lookup" in sources or drafter != "lookup")


def test_target_only_and_speculative_prompt_logprobs_come_from_the_prefill():
    decoder = decoder_for("llama", kernels=True)
    results = [decoder.generate(PROMPT, params=SamplingParams(max_new_tokens=n, method=method, temperature=0,
                                                              prompt_logprobs=2))
               for method, n in (("target", 5), ("google", 5), ("google", 0))]
    assert results[0].prompt_logprobs == results[1].prompt_logprobs == results[2].prompt_logprobs
    assert results[0].logprobs is None  # logprobs were not asked for
    scored = results[2]
    assert scored.token_ids == [] and scored.finish_reason == "length" and scored.stats.new_tokens == 0
    assert scored.stats.target_forwards == 1 and scored.stats.draft_forwards == 0  # the prefill alone
    plain = plain_forward(decoder.target_model, PROMPT, [])
    assert [t.logprob for t in scored.prompt_logprobs[1:]] == pytest.approx(plain.tolist(), abs=1e-4)
    assert [t.token for t in scored.prompt_logprobs[1:]] == PROMPT[1:]


# --- chunks ------------------------------------------------------------------------------------------------------

def test_each_chunk_carries_its_tokens_logprobs_through_eos_and_budget_cuts():
    target = make_model("llama", seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(target, target)  # everything accepted: rounds of gamma + 1 tokens, then cut
    greedy = decoder.generate(PROMPT, max_new_tokens=12, method="target", temperature=0).token_ids
    for eos, max_new_tokens in ((greedy[6], 12), (None, 7)):
        length = greedy.index(eos) + 1 if eos is not None else max_new_tokens
        stream = decoder.stream(PROMPT, params=SamplingParams(max_new_tokens=max_new_tokens, gamma=4,
                                                              temperature=0, logprobs=1, prompt_logprobs=1),
                                eos_token_id=eos)
        chunks = []
        while True:
            try:
                chunks.append(next(stream))
            except StopIteration as done:
                result = done.value
                break
        assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
        assert [t.token for c in chunks for t in c.logprobs] == result.token_ids == greedy[:length]
        assert chunks[0].prompt_logprobs == result.prompt_logprobs and len(result.prompt_logprobs) == len(PROMPT)
        assert all(c.prompt_logprobs is None for c in chunks[1:])


def test_without_logprobs_nothing_is_computed_for_them(monkeypatch):
    decoder = decoder_for("llama", kernels=False)

    def refuse(*args, **kwargs):
        raise AssertionError("token_logprobs called without logprobs asked for")

    monkeypatch.setattr("specdec.engine.token_logprobs", refuse)
    keeps = []
    forward = CachedModel.forward
    monkeypatch.setattr(CachedModel, "forward", lambda self, tokens, keep=1: keeps.append(keep) or
                        forward(self, tokens, keep))
    for method, gamma in RUNS + (("target", None),):
        result = decoder.generate(PROMPT, max_new_tokens=10, method=method, gamma=gamma, seed=0)
        assert result.logprobs is None and result.prompt_logprobs is None
    assert max(keeps) <= 5  # no forward kept the prompt's rows (it has 11 tokens): at most gamma + 1
