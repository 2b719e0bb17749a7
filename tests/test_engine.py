"""engine.py: greedy equivalence, stopping, provenance, stats, reproducibility and input checks."""

import time

import pytest
import torch

from specdec import SpecDecError, SpeculativeDecoder
from specdec.kv_cache import CachedModel
from tests.support.models import ARCHITECTURES, make_model, make_tokenizer, perturbed_copy

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def pair():
    target = make_model("llama", seed=0, initializer_range=0.1)
    return perturbed_copy(target, noise=0.3), target


@pytest.fixture(scope="module")
def decoder(pair):
    return SpeculativeDecoder(*pair)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("method", ["google", "deepmind"])
def test_greedy_equals_target_greedy(arch, method):
    target = make_model(arch, seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target)
    reference = decoder.generate(PROMPT, max_new_tokens=40, method="target", temperature=0)
    accepted = proposed = 0
    for gamma in (1, 2, 4, 7, None):
        result = decoder.generate(PROMPT, max_new_tokens=40, method=method, gamma=gamma, temperature=0)
        assert result.token_ids == reference.token_ids, (arch, method, gamma)
        accepted, proposed = accepted + result.stats["accepted"], proposed + result.stats["proposed"]
    assert 0 < accepted < proposed  # the test exercised both acceptances and rejections


def test_target_greedy_equals_hf_generate(pair):
    _, target = pair
    decoder = SpeculativeDecoder(*pair)
    ours = decoder.generate(PROMPT, max_new_tokens=20, method="target", temperature=0)
    hf = target.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert ours.token_ids == hf[0, len(PROMPT):].tolist()


def test_identical_draft_accepts_everything():
    target = make_model("qwen2", seed=2, initializer_range=0.1)
    decoder = SpeculativeDecoder(target, target)
    for method in ("google", "deepmind"):
        for temperature in (0.0, 1.0):
            result = decoder.generate(PROMPT, max_new_tokens=30, method=method, gamma=4, temperature=temperature,
                                      seed=1)
            assert result.stats["accepted"] == result.stats["proposed"] > 0
            assert set(result.sources) == {"draft", "bonus"}


@pytest.mark.parametrize("method", ["google", "deepmind", "target", "draft"])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_exact_max_new_tokens(decoder, method, max_new_tokens):
    result = decoder.generate(PROMPT, max_new_tokens=max_new_tokens, method=method, gamma=4, seed=0)
    assert len(result.token_ids) == len(result.sources) == max_new_tokens
    assert result.finish_reason == "length"
    assert result.stats["new_tokens"] == max_new_tokens


def test_sources_labels(decoder):
    spec = decoder.generate(PROMPT, max_new_tokens=60, method="google", gamma=3, seed=0)
    assert set(spec.sources) <= {"draft", "resampled", "bonus"}
    assert {"draft", "resampled", "bonus"} <= set(spec.sources)
    for method in ("target", "draft"):
        assert set(decoder.generate(PROMPT, max_new_tokens=5, method=method, seed=0).sources) == {"target"}


def test_eos_inside_accepted_draft_run():
    target = make_model("llama", seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(target, target)  # every proposal is accepted
    greedy = decoder.generate(PROMPT, max_new_tokens=12, method="target", temperature=0).token_ids
    eos = greedy[5]
    first = greedy.index(eos)
    for method in ("google", "deepmind", "target"):
        result = decoder.generate(PROMPT, max_new_tokens=12, method=method, gamma=8, temperature=0, eos_token_id=eos)
        assert result.token_ids == greedy[: first + 1]
        assert result.finish_reason == "stop"
    result = decoder.generate(PROMPT, max_new_tokens=12, method="google", gamma=8, temperature=0,
                              eos_token_id=[10_000, eos])
    assert result.token_ids[-1] == eos and result.sources[-1] == "draft"


def test_eos_from_generation_config():
    target = make_model("llama", seed=0, initializer_range=0.1)
    greedy = SpeculativeDecoder(target, target).generate(PROMPT, max_new_tokens=12, method="target",
                                                          temperature=0).token_ids
    target.generation_config.eos_token_id = [greedy[3]]
    result = SpeculativeDecoder(target, target).generate(PROMPT, max_new_tokens=12, temperature=0)
    assert result.token_ids == greedy[: greedy.index(greedy[3]) + 1] and result.finish_reason == "stop"


def test_token_id_zero_is_a_normal_token():
    target = make_model("llama", seed=0, vocab_size=64)
    with torch.no_grad():
        target.get_output_embeddings().weight[0] = target.get_output_embeddings().weight[0] + 10
        target.get_output_embeddings().weight[0].mul_(0)  # a zero row, plus a bias via the norm: make 0 the argmax
        target.get_output_embeddings().weight[0] = target.model.norm.weight * 50
    decoder = SpeculativeDecoder(target, target)
    result = decoder.generate([0, 0, 0], max_new_tokens=8, temperature=0)
    assert 0 in result.token_ids
    assert decoder.generate([0], max_new_tokens=3, seed=0).token_ids


def test_seed_reproducibility_and_seed_zero(decoder):
    for method in ("google", "deepmind", "target"):
        a = decoder.generate(PROMPT, max_new_tokens=30, method=method, seed=0)
        b = decoder.generate(PROMPT, max_new_tokens=30, method=method, seed=0)
        c = decoder.generate(PROMPT, max_new_tokens=30, method=method, seed=1)
        assert a.token_ids == b.token_ids and a.sources == b.sources
        assert a.token_ids != c.token_ids
    unseeded = [decoder.generate(PROMPT, max_new_tokens=5, seed=None).stats.seed for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # a fresh random seed each time, and the stats say which


def test_adaptive_gamma_is_reproducible_whatever_lengths_it_chooses(decoder, monkeypatch):
    """gamma=None picks draft lengths from wall-clock costs, which differ run to run; the same seed and request
    must still give the same completion (sampling, not only greedy)."""
    runs = []
    for lengths in ([1], [6], [2, 5, 1, 3]):
        schedule = iter(lengths * 100)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: next(schedule))
        for method in ("google", "deepmind"):
            runs.append(decoder.generate(PROMPT, max_new_tokens=30, method=method, gamma=None, temperature=1.0,
                                         seed=11))
    assert len({tuple(run.token_ids) for run in runs}) == 1
    assert len({run.stats.target_forwards for run in runs}) > 1  # the lengths did differ
    other_seed = decoder.generate(PROMPT, max_new_tokens=30, gamma=None, temperature=1.0, seed=12)
    assert other_seed.token_ids != runs[0].token_ids


def test_does_not_touch_global_rng(decoder):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    decoder.generate(PROMPT, max_new_tokens=10, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_tensor_input(decoder):
    as_list = decoder.generate(PROMPT, max_new_tokens=6, seed=0)
    as_tensor = decoder.generate(torch.tensor([PROMPT]), max_new_tokens=6, seed=0)
    assert as_list.token_ids == as_tensor.token_ids


def test_stats(decoder):
    result = decoder.generate(PROMPT, max_new_tokens=20, method="google", gamma=3, seed=0)
    stats = result.stats
    assert stats["new_tokens"] == 20
    # the counters agree with the provenance of the tokens themselves
    assert stats.accepted == result.sources.count("draft")
    assert stats.rounds == result.sources.count("bonus") + result.sources.count("resampled")
    assert stats.proposed == stats.draft_forwards and stats.proposed <= 3 * stats.rounds
    assert stats.target_forwards == stats.rounds
    assert sum(stats.accepted_per_position) == stats.accepted and len(stats.accepted_per_position) <= 3
    assert list(stats.accepted_per_position) == sorted(stats.accepted_per_position, reverse=True)
    assert 0 < stats.draft_seconds < stats.total_seconds and 0 < stats.target_seconds < stats.total_seconds
    # the first round (prefill included) apart: time to the first tokens, and the rate of the rest
    assert 1 <= stats["first_chunk_tokens"] <= 4
    assert 0 < stats["first_chunk_seconds"] < stats["total_seconds"]
    assert stats["decode_tokens_per_second"] == pytest.approx(
        (20 - stats["first_chunk_tokens"]) / (stats["total_seconds"] - stats["first_chunk_seconds"]))
    baseline = decoder.generate(PROMPT, max_new_tokens=10, method="target", seed=0).stats
    assert baseline["target_forwards"] == 10 and baseline["draft_forwards"] == 0
    assert baseline["tokens_per_target_forward"] == 1.0 and baseline["acceptance_rate"] is None
    assert baseline["first_chunk_tokens"] == 1
    one = decoder.generate(PROMPT, max_new_tokens=1, method="target", seed=0).stats
    assert one["first_chunk_tokens"] == 1 and one["decode_tokens_per_second"] is None  # nothing after it


def test_stats_prefill_is_each_models_first_forward(decoder):
    # a slow prompt forward (only the first forward sees the whole prompt) must land in the prefill figures alone
    def slow_prompt(module, args, kwargs):
        if kwargs["input_ids"].shape[1] >= len(PROMPT):  # later forwards: at most gamma + 1 = 4 tokens
            time.sleep(0.05)

    hooks = [model.register_forward_pre_hook(slow_prompt, with_kwargs=True)
             for model in (decoder.draft_model, decoder.target_model)]
    try:
        stats = decoder.generate(PROMPT, max_new_tokens=12, method="google", gamma=3, seed=0).stats
        baseline = decoder.generate(PROMPT, max_new_tokens=5, method="target", seed=0).stats
    finally:
        for hook in hooks:
            hook.remove()
    for role in ("draft", "target"):
        assert stats[f"{role}_prefill_seconds"] >= 0.05
        assert stats[f"{role}_seconds"] - stats[f"{role}_prefill_seconds"] < 0.05 * (stats[f"{role}_forwards"] - 1)
    assert baseline["target_prefill_seconds"] >= 0.05 and baseline["draft_prefill_seconds"] == 0.0


def test_stream_chunks_add_up(decoder):
    stream = decoder.stream(PROMPT, max_new_tokens=25, method="google", gamma=4, seed=3)
    chunks = []
    while True:
        try:
            chunks.append(next(stream))
        except StopIteration as done:
            result = done.value
            break
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert any(len(c.token_ids) > 1 for c in chunks)
    assert result.token_ids == decoder.generate(PROMPT, max_new_tokens=25, gamma=4, seed=3).token_ids


def test_send_stop_ends_with_stats(decoder):
    stream = decoder.stream(PROMPT, max_new_tokens=40, method="google", gamma=4, seed=3)
    first = next(stream)
    with pytest.raises(StopIteration) as done:
        stream.send("stop")
    result = done.value.value
    assert result.finish_reason == "stop"
    assert result.token_ids == first.token_ids
    assert result.stats["proposed"] >= 1 and result.stats["rounds"] == 1


def test_caches_hold_committed_prefix_after_each_round(pair, monkeypatch):
    """After every round both caches hold a prefix of the committed sequence: everything but the newest token."""
    decoder = SpeculativeDecoder(*pair)
    seen = []
    original = CachedModel.rollback

    def spy(self, length):
        original(self, length)
        seen.append((self.length, length))

    monkeypatch.setattr(CachedModel, "rollback", spy)
    stream = decoder.stream(PROMPT, max_new_tokens=30, method="google", gamma=4, seed=0)
    committed = len(PROMPT)
    for chunk in stream:
        committed += len(chunk.token_ids)
        target_len, draft_len = seen[-2][0], seen[-1][0]
        assert target_len == committed - 1
        assert draft_len <= committed - 1


@pytest.mark.parametrize("kwargs,field", [
    ({"gamma": 0}, "gamma"), ({"gamma": -1}, "gamma"), ({"gamma": 2.5}, "gamma"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e-30}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"method": "beam"}, "method"), ({"seed": "x"}, "seed"),
])
def test_bad_arguments_raise_clear_error(decoder, kwargs, field):
    with pytest.raises(SpecDecError) as err:
        decoder.generate(PROMPT, **kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("prompt", [[], [1, 2, 10_000], [-1], "abc", [1.5]])
def test_bad_prompt(decoder, prompt):
    with pytest.raises(SpecDecError):
        decoder.generate(prompt)


def test_prompt_that_fills_the_context_is_an_error():
    target = make_model("gpt2", context=16)
    decoder = SpeculativeDecoder(target, target)
    with pytest.raises(SpecDecError, match="context"):
        decoder.generate(list(range(16)))
    result = decoder.generate(list(range(12)), max_new_tokens=50, gamma=4, seed=0)
    assert len(result.token_ids) == 4 and result.finish_reason == "length"


def test_mismatched_vocabularies_name_both_sizes():
    with pytest.raises(SpecDecError, match="64.*80|80.*64"):
        SpeculativeDecoder(make_model("llama", vocab_size=64), make_model("llama", vocab_size=80))


def test_padded_target_vocabulary_with_tokenizer():
    tokenizer = make_tokenizer()  # 100 real tokens
    draft = make_model("llama", seed=1, vocab_size=100)
    target = make_model("llama", seed=0, vocab_size=128)  # embedding padded beyond the tokenizer
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    assert decoder.vocab_size == 100
    result = decoder.generate([5, 6], max_new_tokens=40, seed=0, temperature=1.5)
    assert max(result.token_ids) < 100
    with pytest.raises(SpecDecError):
        SpeculativeDecoder(make_model("llama", vocab_size=64), target, tokenizer)


def test_speculative_rounds_feed_the_decoders_cost_profile(pair):
    decoder = SpeculativeDecoder(*pair)
    assert decoder.cost_profile.cost_ratio is None
    result = decoder.generate(PROMPT, max_new_tokens=20, method="google", gamma=3, temperature=0)
    assert result.stats["rounds"] > 1
    profile = decoder.cost_profile
    # every round but the first (its forwards include the prefills), by verification width: gamma + 1 = 4
    assert profile.cost_ratio > 0 and 4 in profile.target_by_width
    assert sum(n for _, n in profile.target_by_width.values()) == result.stats["rounds"] - 1
    adaptive = decoder.generate(PROMPT, max_new_tokens=20, method="deepmind", gamma=None, temperature=0)
    assert adaptive.token_ids == result.token_ids  # greedy: the same output whatever gamma adaptive picks
    assert sum(n for _, n in profile.target_by_width.values()) > result.stats["rounds"] - 1
