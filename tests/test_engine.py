"""engine.py: greedy equivalence, stopping, provenance, stats, reproducibility and input checks."""

import random
import time
import types

import pytest
import torch

from specdec import LookupSettings, SpecDecError, SpeculativeDecoder
from specdec.drafters import LookupDrafter, ModelDrafter, NgramIndex, Proposal
from specdec.engine import _Request
from specdec.kv_cache import CachedModel
from specdec.params import DRAFTERS, VERIFICATIONS, SamplingParams
from specdec.sampling import logits_to_probs
from tests.support.models import ARCHITECTURES, make_model, make_tokenizer, perturbed_copy
from tests.support.spies import ended_early, hybrid_rounds, model_runs, rounds_of

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


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_equals_target_greedy_for_every_drafter_and_rule(arch):
    target = make_model(arch, seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target)
    reference = decoder.generate(PROMPT, max_new_tokens=40, method="target", temperature=0).token_ids
    accepted: dict[str, int] = {}
    for drafter in DRAFTERS:
        for rule in VERIFICATIONS:
            for method, gamma in (("google", 1), ("deepmind", 3), ("google", 6), ("deepmind", None)):
                result = decoder.generate(PROMPT, max_new_tokens=40, method=method, gamma=gamma, temperature=0,
                                          drafter=drafter, verification=rule)
                assert result.token_ids == reference, (arch, drafter, rule, method, gamma)
                for name, count in result.stats.accepted_by_drafter.items():
                    accepted[name] = accepted.get(name, 0) + count
    assert accepted["lookup"] > 0 and accepted["model"] > 0  # both drafters had proposals accepted


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_with_a_logit_bias_equals_target_greedy_with_it(arch):
    """logit_bias under greedy decoding: every drafter, rule and variant (the short path and the general one)
    gives target-only's tokens under the same bias; the bias changes them, a banned token never comes, and a
    token past the vocabulary is refused naming the field."""
    target = make_model(arch, seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target)
    plain = decoder.generate(PROMPT, max_new_tokens=40, method="target", temperature=0).token_ids
    common = sorted(set(plain), key=plain.count)[-2:]  # the two tokens target-only greedy gives most
    bias = {common[-1]: -100.0, common[0]: 2.0}
    reference = decoder.generate(PROMPT, max_new_tokens=40, method="target", temperature=0, logit_bias=bias).token_ids
    assert reference != plain and common[-1] not in reference
    for drafter in DRAFTERS:
        for rule in VERIFICATIONS:
            for method, gamma in (("google", 1), ("deepmind", 4), ("google", None)):
                result = decoder.generate(PROMPT, max_new_tokens=40, method=method, gamma=gamma, temperature=0,
                                          drafter=drafter, verification=rule, logit_bias=bias)
                assert result.token_ids == reference, (arch, drafter, rule, method, gamma)
    general = general_path(SpeculativeDecoder(decoder.draft_model, decoder.target_model))
    assert general.generate(PROMPT, max_new_tokens=40, method="google", temperature=0,
                            logit_bias=bias).token_ids == reference
    with pytest.raises(SpecDecError) as error:
        decoder.generate(PROMPT, logit_bias={decoder.vocab_size: 1.0})
    assert error.value.field == "logit_bias"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("penalties", [{"presence_penalty": 0.8}, {"frequency_penalty": 0.5},
                                       {"repetition_penalty": 1.4},
                                       {"presence_penalty": -0.5, "frequency_penalty": 1.0, "repetition_penalty": 0.8}])
def test_greedy_with_penalties_equals_target_greedy_with_them(arch, penalties):
    """presence, frequency and repetition penalties under greedy decoding: every drafter, rule and variant (the
    short path and the general one) gives target-only's tokens under the same penalties, which change them; the
    verification rows are penalized by the proposals before them, or the proposals accepted would differ."""
    target = make_model(arch, seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target)
    plain = decoder.generate(PROMPT, max_new_tokens=40, method="target", temperature=0).token_ids
    reference = decoder.generate(PROMPT, max_new_tokens=40, method="target", temperature=0, **penalties).token_ids
    assert reference != plain
    accepted = 0
    for drafter in DRAFTERS:
        for rule in VERIFICATIONS:
            for method, gamma in (("google", 1), ("deepmind", 4), ("google", None)):
                result = decoder.generate(PROMPT, max_new_tokens=40, method=method, gamma=gamma, temperature=0,
                                          drafter=drafter, verification=rule, **penalties)
                assert result.token_ids == reference, (arch, drafter, rule, method, gamma)
                accepted += result.stats.accepted
    assert accepted > 0
    general = general_path(SpeculativeDecoder(decoder.draft_model, decoder.target_model))
    assert general.generate(PROMPT, max_new_tokens=40, method="google", temperature=0,
                            **penalties).token_ids == reference


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_stop_token_ids_end_decoding_where_the_output_first_has_one(decoder, temperature):
    """stop_token_ids cut the same output where one of them first comes (kept, finish_reason stop), for every
    drafter, rule and variant, greedy and sampled (the same seed draws the same tokens up to the cut), also with
    ignore_eos; a token past the vocabulary is refused naming the field."""
    kwargs = {"max_new_tokens": 30, "temperature": temperature, "seed": 4}
    for drafter in DRAFTERS:
        for rule in VERIFICATIONS:
            for method, gamma in (("google", 4), ("deepmind", 2), ("target", 4)):
                full = decoder.generate(PROMPT, method=method, gamma=gamma, drafter=drafter, verification=rule,
                                        **kwargs).token_ids
                stop = full[len(full) // 2]
                cut = full[: full.index(stop) + 1]
                for extra in ({}, {"ignore_eos": True}):
                    result = decoder.generate(PROMPT, method=method, gamma=gamma, drafter=drafter,
                                              verification=rule, stop_token_ids=[stop, decoder.vocab_size - 1],
                                              **kwargs, **extra)
                    assert result.token_ids == cut, (drafter, rule, method, extra)
                    assert result.finish_reason == "stop"
    with pytest.raises(SpecDecError) as error:
        decoder.generate(PROMPT, stop_token_ids=[decoder.vocab_size])
    assert error.value.field == "stop_token_ids"
    assert SamplingParams(stop_token_ids=[7, 2, 7]).stop_token_ids == (2, 7)
    assert SamplingParams(stop_token_ids=[]).stop_token_ids is None


def test_min_tokens_masks_the_ending_tokens_until_then_for_every_drafter_and_rule(decoder):
    """min_tokens (vLLM's): greedy output is that of plain forwards with the tokens that end decoding (EOS,
    stop_token_ids) at -inf while fewer than min_tokens are generated, for every drafter, rule and variant; it
    changes nothing once the output is past min_tokens or where no token ends decoding (ignore_eos)."""
    plain = decoder.generate(PROMPT, max_new_tokens=30, method="target", temperature=0).token_ids
    eos, stop = plain[1], plain[4]  # the greedy output would end at its second token
    ending = {eos, stop}

    def reference(min_tokens: int, ending: set[int]) -> list[int]:
        ids = list(PROMPT)
        for generated in range(30):
            with torch.no_grad():
                logits = decoder.target_model(input_ids=torch.tensor([ids])).logits[0, -1]
            if generated < min_tokens:
                logits[sorted(ending)] = float("-inf")
            ids.append(int(logits.argmax()))
            if ids[-1] in ending:
                break
        return ids[len(PROMPT):]

    expected = reference(6, ending)
    assert len(expected) > 6 and not ending & set(expected[:6]) and expected[:2] != plain[:2]
    assert reference(0, ending) == plain[:2]
    accepted = 0
    for drafter in DRAFTERS:
        for rule in VERIFICATIONS:
            for method, gamma in (("google", 1), ("deepmind", 4), ("google", None), ("target", 4)):
                result = decoder.generate(PROMPT, max_new_tokens=30, method=method, gamma=gamma, temperature=0,
                                          drafter=drafter, verification=rule, eos_token_id=eos,
                                          stop_token_ids=[stop], min_tokens=6)
                assert result.token_ids == expected, (drafter, rule, method, gamma)
                accepted += result.stats.accepted
    assert accepted > 0
    assert decoder.generate(PROMPT, max_new_tokens=30, method="google", temperature=0, eos_token_id=eos,
                            min_tokens=2).token_ids == reference(2, {eos})
    unmasked = decoder.generate(PROMPT, max_new_tokens=30, method="google", temperature=0, ignore_eos=True,
                                eos_token_id=eos, min_tokens=6)
    assert unmasked.token_ids == plain  # ignore_eos: no token ends decoding, none is masked
    for bad in ({"min_tokens": 31}, {"min_tokens": -1}, {"min_tokens": 1.5}):
        with pytest.raises(SpecDecError) as error:
            decoder.generate(PROMPT, max_new_tokens=30, **bad)
        assert error.value.field == "min_tokens"


def general_path(decoder):
    """A round observer: the engine then verifies greedy rounds as sampled ones are (q and p built, uniforms
    drawn, the rule applied) instead of by its greedy short path."""
    decoder.round_observer = lambda x, q, p: None
    return decoder


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_short_path_gives_the_general_paths_tokens_and_counts(arch):
    """At temperature 0 the engine compares the proposals with the target's argmax (engine._verify_greedy) and the
    draft model proposes its argmax with no q: the same tokens, acceptances, rounds and per-drafter counts as the
    rules applied to one-hot distributions, for every drafter, both rules and both variants."""
    target = make_model(arch, seed=0, initializer_range=0.1)
    draft = perturbed_copy(target, noise=0.3)
    prompt = PROMPT + [5, 6, 7] + PROMPT  # a repeat: the lookup proposes too
    fields = ("accepted", "proposed", "rounds", "drafts", "accepted_by_drafter", "proposed_by_drafter",
              "rounds_by_drafter", "accepted_per_position")
    exercised = 0
    for drafter in DRAFTERS:
        for rule in VERIFICATIONS:
            for method, gamma, stop in (("google", 4, 0.0), ("deepmind", 3, 0.0), ("google", 5, 0.3)):
                params = dict(max_new_tokens=40, method=method, gamma=gamma, temperature=0, drafter=drafter,
                              verification=rule, draft_confidence_threshold=stop)
                short = SpeculativeDecoder(draft, target).generate(prompt, **params)
                general = general_path(SpeculativeDecoder(draft, target)).generate(prompt, **params)
                assert short.token_ids == general.token_ids, (drafter, rule, method)
                assert {f: short.stats[f] for f in fields} == {f: general.stats[f] for f in fields}, \
                    (drafter, rule, method)
                exercised += 0 < short.stats["accepted"] < short.stats["proposed"]
    assert exercised > 6  # most settings saw both acceptances and rejections


def test_greedy_target_only_takes_the_argmax_without_drawing(decoder, monkeypatch):
    """Target-only greedy decoding (and the draft-only baseline) takes each token as the argmax: no distribution
    is sampled, and the tokens are those sampling the one-hots gave (HF generate's, test above)."""
    calls = []
    monkeypatch.setattr("specdec.engine.sample", lambda probs, generator: calls.append(1) or int(probs.argmax()))
    for method in ("target", "draft"):
        greedy = decoder.generate(PROMPT, max_new_tokens=12, method=method, temperature=0)
        assert not calls and len(greedy.token_ids) == 12
        sampled = decoder.generate(PROMPT, max_new_tokens=12, method=method, temperature=1e-5, seed=0)
        assert calls and sampled.token_ids == greedy.token_ids  # a temperature near 0 samples the argmax too
        calls.clear()


LONG_PROMPT = [(7 * i + 3) % 59 + 5 for i in range(40)]  # past FIRST_TOKEN_ALONE_FROM


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_first_token_from_the_prefill_alone_keeps_greedy_equivalence(arch):
    """A prompt of 32 tokens or more: the first round is the target's prefill alone (one token, one target
    forward, no draft forward), then speculation; greedy output is target-only's for every method, drafter,
    rule and gamma, and the cost profile is fed by neither prefill's round."""
    target = make_model(arch, seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target)
    reference = decoder.generate(LONG_PROMPT, max_new_tokens=24, method="target", temperature=0).token_ids
    accepted = 0
    for method in ("google", "deepmind"):
        for drafter in DRAFTERS:
            for verification in VERIFICATIONS:
                for gamma in (2, None):
                    stream = decoder.stream(LONG_PROMPT, max_new_tokens=24, method=method, gamma=gamma,
                                            temperature=0, drafter=drafter, verification=verification)
                    seen = decoder.cost_profile.draft[1], decoder.cost_profile.target[1]
                    first = next(stream)
                    assert len(first.token_ids) == 1 and first.sources == ["bonus"]
                    assert stream.stats().draft_forwards == 0 and stream.stats().target_forwards == 1
                    second = next(stream)
                    if stream.stats().draft_forwards:  # the draft model's prefill round: no per-token cost either
                        assert (decoder.cost_profile.draft[1], decoder.cost_profile.target[1]) == seen
                    tokens = first.token_ids + second.token_ids + [t for chunk in stream for t in chunk.token_ids]
                    assert tokens == reference, (method, drafter, verification, gamma)
                    full = decoder.generate(LONG_PROMPT, max_new_tokens=24, method=method, gamma=gamma,
                                            temperature=0, drafter=drafter, verification=verification)
                    assert full.token_ids == reference
                    assert full.stats.target_forwards == full.stats.rounds  # the prefill is the first round
                    accepted += full.stats.accepted
    assert accepted > 0


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
    other = next(token for token in range(decoder.vocab_size) if token not in greedy)
    result = decoder.generate(PROMPT, max_new_tokens=12, method="google", gamma=8, temperature=0,
                              eos_token_id=[other, eos])
    assert result.token_ids[-1] == eos and result.sources[-1] == "draft"


@pytest.mark.parametrize("method", ["target", "google", "deepmind"])
def test_ignore_eos_keeps_an_eos_and_decodes_to_max_new_tokens(method):
    """ignore_eos: the EOS a greedy run would stop at is kept, the tokens are those of a run with no EOS at all,
    and decoding ends at max_new_tokens ("length")."""
    target = make_model("llama", seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target)
    free = decoder.generate(PROMPT, max_new_tokens=12, method=method, temperature=0, eos_token_id=[])
    eos = free.token_ids[2]
    stopped = decoder.generate(PROMPT, max_new_tokens=12, method=method, temperature=0, eos_token_id=eos)
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 12
    params = SamplingParams(max_new_tokens=12, method=method, temperature=0, ignore_eos=True)
    kept = decoder.generate(PROMPT, params=params, eos_token_id=eos)
    assert kept.token_ids == free.token_ids and kept.finish_reason == "length"


def test_ignore_eos_is_a_boolean_and_not_with_a_grammar():
    with pytest.raises(SpecDecError, match="ignore_eos must be true or false") as error:
        SamplingParams(ignore_eos="yes")
    assert error.value.field == "ignore_eos"


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


@pytest.mark.parametrize("method", ["google", "deepmind", "target"])
@pytest.mark.parametrize("gamma", [4, None])
def test_every_bit_of_a_64_bit_seed_counts(decoder, method, gamma):
    """torch's CPU generator keeps a seed's low 32 bits: seeds 2**32 apart (and 2**63 and 0) drew the same samples,
    though they are documented as taken modulo 2**64 (the third audit). Seeds equal modulo 2**64 still agree."""
    def tokens(seed):
        return decoder.generate(PROMPT, max_new_tokens=30, method=method, gamma=gamma, temperature=1.0,
                                seed=seed).token_ids

    base = tokens(5)
    for other in (5 + 2**32, 5 + 2**40, 5 + 2**63):
        assert tokens(other) != base
    assert tokens(5 - 2**63) == tokens(5 + 2**63) and tokens(-1) == tokens(2**64 - 1)


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


def test_stats_list_every_proposed_position_and_define_the_acceptance_length_as_vllm_does():
    """A request whose drafts were all rejected still lists their positions, at 0, and its mean acceptance
    length is 1 (1 + accepted / drafts), not tokens per target forward with the prefill counted (< 1 there)."""
    state = _Request([1, 2, 3], SamplingParams(method="google", gamma=4), None, 0, set())
    state.record_round(Proposal([5, 6, 7, 8], [None] * 4, ["model"] * 4), accepted=0)
    state.record_round(Proposal(), accepted=0)  # nothing proposed: the target drew alone, not a draft
    stats = state.stats()
    assert stats.accepted_per_position == [0, 0, 0, 0] and stats.drafts == 1 and stats.rounds == 2
    assert stats.mean_acceptance_length == 1.0
    state.record_round(Proposal([5, 6], [None] * 2, ["lookup"] * 2), accepted=2)
    stats = state.stats()
    assert stats.accepted_per_position == [1, 1, 0, 0] and stats.mean_acceptance_length == 1 + 2 / 2
    assert _Request([1], SamplingParams(method="target"), None, 0, set()).stats().mean_acceptance_length is None


def test_stats(decoder):
    result = decoder.generate(PROMPT, max_new_tokens=20, method="google", gamma=3, seed=0)
    stats = result.stats
    assert stats["new_tokens"] == 20
    # the counters agree with the provenance of the tokens themselves
    assert stats.accepted == result.sources.count("draft")
    assert stats.rounds == result.sources.count("bonus") + result.sources.count("resampled")
    assert stats.proposed == stats.draft_forwards and stats.proposed <= 3 * stats.rounds
    assert stats.target_forwards == stats.rounds + 1  # one per round, and the prompt's prefill on its own
    assert sum(stats.accepted_per_position) == stats.accepted and len(stats.accepted_per_position) == 3
    assert stats.mean_acceptance_length >= 1 and stats.drafts == stats.rounds - stats.rounds_by_drafter.get("none", 0)
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


def test_stats_as_a_dict_are_asdicts_and_their_own(decoder):
    """GenerationStats.as_dict (what every answer serialises) is dataclasses.asdict's, its lists and dicts copies."""
    import dataclasses

    stats = decoder.generate(PROMPT, max_new_tokens=12, method="google", gamma=3, seed=0, drafter="hybrid").stats
    assert stats.as_dict() == dataclasses.asdict(stats) and stats.as_dict()["proposed_by_drafter"]
    copy = stats.as_dict()
    copy["accepted_per_position"].append(99)
    copy["proposed_by_drafter"]["model"] = -1
    assert stats.as_dict() == dataclasses.asdict(stats)  # the stats did not change with the copy


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
    chunks, result = rounds_of(decoder.stream(PROMPT, max_new_tokens=25, method="google", gamma=4, seed=3))
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
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"), ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias"), ({"logit_bias": {5: "1"}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": "1"}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 101}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"), ({"no_such_knob": 1}, "no_such_knob"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": "5"}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    # an audit: "x" and 2.7 raised int()'s own errors; True was token 1; an id past the vocabulary was taken and
    # never matched, stopping nothing
    ({"eos_token_id": "x"}, "eos_token_id"), ({"eos_token_id": 2.7}, "eos_token_id"),
    ({"eos_token_id": True}, "eos_token_id"), ({"eos_token_id": 10_000}, "eos_token_id"),
    ({"eos_token_id": [-5]}, "eos_token_id"), ({"eos_token_id": [1, "2"]}, "eos_token_id"),
    ({"eos_token_id": {5, "a"}}, "eos_token_id"), ({"eos_token_id": {5, None}}, "eos_token_id"),  # sorted raised
])
def test_bad_arguments_raise_clear_error(decoder, kwargs, field):
    with pytest.raises(SpecDecError) as err:
        decoder.generate(PROMPT, **kwargs)
    assert err.value.field == field


def test_eos_token_ids_come_in_the_shapes_callers_hold_them(decoder):
    """An id, a list, a set, a range, a tensor, a NumPy array or scalar: the same stop (a review found a range and
    an array refused as "must be an integer")."""
    import numpy

    greedy = decoder.generate(PROMPT, max_new_tokens=12, temperature=0, eos_token_id=[]).token_ids
    eos = greedy[4]
    stops = [decoder.generate(PROMPT, max_new_tokens=12, temperature=0, eos_token_id=shape).token_ids
             for shape in (eos, [eos], {eos}, range(eos, eos + 1), torch.tensor([eos]), numpy.array([eos]),
                           numpy.int64(eos))]
    assert all(stop == greedy[:greedy.index(eos) + 1] for stop in stops), stops


def test_a_logit_bias_is_kept_sorted_and_an_empty_one_is_none():
    params = SamplingParams(logit_bias={7: -100, 2: 0.5})
    assert params.logit_bias == ((2, 0.5), (7, -100.0)) and hash(params) == hash(params.replace())
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("prompt", [[], [1, 2, 10_000], [-1], "abc", [1.5]])
def test_bad_prompt(decoder, prompt):
    with pytest.raises(SpecDecError):
        decoder.generate(prompt)


@pytest.mark.parametrize("shape", [(2, 3), (1, 1, 3), (2, 1, 3), ()])
def test_a_batch_or_a_scalar_tensor_is_refused_not_joined(decoder, shape):
    """Found by an audit: a (2, 1, n) batch was flattened into one prompt of 2n tokens."""
    with pytest.raises(SpecDecError, match="batch size 1") as error:
        decoder.generate(torch.ones(shape, dtype=torch.long), max_new_tokens=2)
    assert error.value.field == "input_ids"


def test_numpy_integers_are_token_ids(decoder):
    import numpy as np

    ids = [1, 2, 3]
    assert decoder.generate(np.array(ids).tolist(), max_new_tokens=4, seed=0).token_ids == \
        decoder.generate([np.int64(t) for t in ids], max_new_tokens=4, seed=0).token_ids
    with pytest.raises(SpecDecError, match="integers"):
        decoder.generate([np.float32(1.0)])


@pytest.mark.parametrize("keyword", [{"temperature": 0}, {"max_new_tokens": 3}, {"seed": 1}, {"gamma": None},
                                     {"drafter": "lookup"}])
def test_a_sampling_keyword_beside_params_is_refused_not_ignored(decoder, keyword):
    """Found by an audit: generate(ids, params=..., temperature=0) sampled at the params' temperature."""
    (name, _), = keyword.items()
    with pytest.raises(SpecDecError, match=f"{name} was given beside params") as error:
        decoder.generate([1, 2, 3], params=SamplingParams(max_new_tokens=8, temperature=1.0, seed=0), **keyword)
    assert error.value.field == name
    assert len(decoder.generate([1, 2, 3], params=SamplingParams(max_new_tokens=8, seed=0), eos_token_id=[])
               .token_ids) == 8  # the end tokens are not a sampling keyword


def test_max_ngram_alone_below_the_hybrids_default_match_is_taken():
    """An audit: LookupSettings(max_ngram=2) (and --lookup_max_ngram 2, lookup_max_ngram = 2) was refused for a
    hybrid_min_match of 3 nobody had set. The default's value, 3, is cut to max_ngram (the service's default.toml
    sets it, so 3 cannot be told from the default); any other value past max_ngram is still refused."""
    assert LookupSettings(max_ngram=2).hybrid_min_match == 2 and LookupSettings().hybrid_min_match == 3
    assert LookupSettings(max_ngram=5).hybrid_min_match == 3
    with pytest.raises(SpecDecError, match="between 1 and 2") as error:
        LookupSettings(max_ngram=2, hybrid_min_match=4)
    assert error.value.field == "hybrid_min_match"
    # the bound the service's settings had alone (64): the API and the command line took 100 (an audit)
    for field in ("max_ngram", "max_tokens"):
        with pytest.raises(SpecDecError, match="between 1 and 64") as error:
            LookupSettings(**{field: 65})
        assert error.value.field == field


def test_lookup_settings_may_be_a_dict_and_anything_else_is_refused(pair):
    """Found by an audit: lookup={"max_ngram": 3} was taken, and the lookup drafter then failed on it."""
    decoder = SpeculativeDecoder(*pair, lookup={"max_ngram": 3, "hybrid_min_match": 2})
    assert decoder.lookup == LookupSettings(max_ngram=3, hybrid_min_match=2)
    assert decoder.generate([1, 2, 1, 2, 1], max_new_tokens=4, drafter="lookup", seed=0).token_ids
    for bad, words in [({"max_grams": 3}, "unknown setting 'max_grams'"), ([3], "got list")]:
        with pytest.raises(SpecDecError, match=words) as error:
            SpeculativeDecoder(*pair, lookup=bad)
        assert error.value.field == "lookup"


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


# --- drafters -------------------------------------------------------------------------------------------------

def test_ngram_index_finds_the_most_recent_longest_match():
    index = NgramIndex(max_ngram=3)
    ids = [5, 1, 2, 3, 9, 1, 2, 7, 4, 1, 2]
    index.update(ids[:6])
    assert index.indexed == 5 and index.match([1], 1) == (1, 1)  # the 1 at position 5 has no next token yet
    index.update(ids)
    assert index.match(ids, 1) == (6, 2)  # (1, 2) last ended at 6 with a next token (7); the one at 10 has none
    assert index.match(ids + [7], 1) == (7, 3)  # (1, 2, 7) -> 4 follows
    assert index.match(ids + [3], 1) == (3, 3)  # the longest suffix wins: (1, 2, 3) at 1..3
    assert index.match([8, 8], 1) is None and index.match(ids, 3) is None  # (4, 1, 2) never had a next token
    rescanned = NgramIndex(max_ngram=3)
    rescanned.update(ids)
    assert rescanned.last == index.last  # incremental updates index exactly what one pass does


def test_lookup_proposes_the_continuation_of_the_match_with_one_hot_distributions():
    lookup = LookupDrafter(16, LookupSettings(max_ngram=2, max_tokens=4, hybrid_min_match=2))
    ids = [1, 2, 3, 4, 5, 9, 1, 2]
    proposal = lookup.propose(ids, gamma=1, limit=10)
    assert proposal.tokens == [3, 4, 5, 9] and proposal.drafters == ["lookup"] * 4  # max_tokens, not gamma
    for token, q in zip(proposal.tokens, proposal.probs):
        assert q.shape == (16,) and q[token] == 1 and q.sum() == 1
    assert lookup.propose(ids, gamma=1, limit=2).tokens == [3, 4]
    assert lookup.propose([1, 2, 3, 7], gamma=4, limit=4).tokens == []  # 7 never occurred before
    strict = LookupDrafter(16, LookupSettings(max_ngram=2, hybrid_min_match=2), min_match=2)
    assert strict.propose([1, 2, 3, 1, 7, 1], gamma=1, limit=3).tokens == []  # only 1-gram matches
    assert strict.propose([1, 2, 3, 1, 2], gamma=1, limit=3).tokens == [3, 1, 2]


def test_lookup_answers_from_the_sequence_alone_wherever_the_round_began():
    """Within a round the lookup also matches the round's own proposals, as it would once they were committed: for
    random sequences, its next token after ids[:m] is the same whether the round began at k <= m or at m."""
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(4) for _ in range(rng.randint(2, 30))]
        n = rng.randint(1, 4)
        settings = LookupSettings(max_ngram=n, hybrid_min_match=1, min_match=rng.randint(1, n))
        k = rng.randint(1, len(ids))
        in_round = LookupDrafter(4, settings)
        in_round.start(ids[:k])
        for m in range(k, len(ids) + 1):
            fresh = LookupDrafter(4, settings)
            fresh.start(ids[:m])
            assert in_round.next_token(ids[:m]) == fresh.next_token(ids[:m]), (ids, k, m)


def test_a_lookup_run_once_started_runs_to_its_cap():
    """Its proposals copy earlier text, whose n-grams all have a known next token: a lookup proposal is empty or
    as long as max_tokens and the limit allow (why mixed hybrid rounds start with the draft model)."""
    rng = random.Random(4)
    for _ in range(300):
        settings = LookupSettings(max_ngram=rng.randint(1, 5), max_tokens=rng.randint(1, 8), hybrid_min_match=1)
        min_match = rng.randint(1, settings.max_ngram)
        ids = [rng.randrange(rng.choice((2, 4, 8))) for _ in range(rng.randint(1, 40))]
        limit = rng.randint(1, 10)
        proposal = LookupDrafter(8, settings, min_match=min_match).propose(ids, gamma=1, limit=limit)
        assert len(proposal) in (0, min(settings.max_tokens, limit)), (ids, settings, min_match, limit)


class ScriptedModel:
    """A draft model as HybridDrafter sees it, proposing the tokens of a script with one-hot distributions."""

    name = "model"

    def __init__(self, script: list[int]):
        self.script = iter(script)

    def draw(self, seq, generator=None):
        token = next(self.script)
        return token, torch.nn.functional.one_hot(torch.tensor(token), 16).float(), True

    def rollback(self, length: int) -> None:
        pass


@pytest.mark.parametrize("extend", [False, True])
def test_hybrid_hands_over_within_a_round_only_with_extend(extend):
    from specdec.drafters import HybridDrafter

    settings = LookupSettings(max_ngram=2, max_tokens=6, hybrid_min_match=1, extend=extend)
    hybrid = HybridDrafter(ScriptedModel([5, 11, 12, 13]), LookupDrafter(16, settings, min_match=1), settings)
    ids = [9, 5, 6, 1, 2, 3, 7]  # 7 is new: the draft model proposes; its 5 occurred before, followed by 6 ...
    proposal = hybrid.propose(ids, gamma=3, limit=10, generator_at=lambda i: None)
    if not extend:  # the round ends where the lookup would take over
        assert proposal.tokens == [5] and proposal.drafters == ["model"]
        return
    # ... the lookup copies 6, 1, 2, 3, 7 up to the end of the committed text, and goes on: (3, 7) last occurred
    # there, followed by this round's first proposal, 5; its cap of 6 tokens ends the round
    assert proposal.tokens == [5, 6, 1, 2, 3, 7, 5]
    assert proposal.drafters == ["model"] + ["lookup"] * 6
    for token, q in zip(proposal.tokens, proposal.probs):
        assert q.shape == (16,) and q[token] == 1 and q.sum() == 1
    assert torch.equal(proposal.draft_probs(), torch.stack(proposal.probs))


def test_hybrid_uses_lookup_where_it_matches_and_the_model_elsewhere():
    target = make_model("llama", seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(target, target)  # every proposal of the model is accepted
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10]
    greedy = decoder.generate(prompt, max_new_tokens=30, method="target", temperature=0).token_ids
    result = decoder.generate(prompt, max_new_tokens=30, gamma=3, temperature=0, drafter="hybrid")
    assert result.token_ids == greedy
    stats = result.stats
    assert stats.rounds_by_drafter.get("lookup", 0) >= 1 and stats.rounds_by_drafter.get("model", 0) >= 1
    assert sum(stats.round_share_by_drafter.values()) == pytest.approx(1.0)
    assert sum(stats.proposed_by_drafter.values()) == stats.proposed
    assert sum(stats.accepted_by_drafter.values()) == stats.accepted
    assert stats.accepted_by_drafter["model"] == result.sources.count("draft")
    assert stats.accepted_by_drafter.get("lookup", 0) == result.sources.count("lookup")
    assert stats.drafter == "hybrid" and stats.verification == "token"
    # the first round is the lookup's: (7, 8, 9, 10) occurred before, followed by 11, 12, ...
    first = next(iter(decoder.stream(prompt, max_new_tokens=30, gamma=3, temperature=0, drafter="hybrid")))
    assert first.sources[0] in ("lookup", "resampled")


def test_draft_model_ends_its_run_after_a_token_it_is_unsure_of():
    """ModelDrafter proposes up to gamma tokens and stops after the first whose probability under the draft
    (softmax of its logits, before any warping) is below confidence_threshold; that token is still proposed."""
    confidence = [0.9, 0.8, 0.3, 0.9, 0.9]  # the draft's probability of its argmax at each step

    def forward(model, tokens):
        p = confidence[forward.calls]
        forward.calls += 1
        probs = torch.full((1, 8), (1 - p) / 7)
        probs[0, forward.calls] = p  # the argmax is token 1, 2, 3, ... in turn
        return probs.log()

    for threshold, expected in ((0.0, [1, 2, 3, 4]), (0.5, [1, 2, 3]), (0.85, [1, 2]), (0.95, [1]),
                                (0.29, [1, 2, 3, 4])):
        forward.calls = 0
        drafter = ModelDrafter(types.SimpleNamespace(length=0), lambda logits, context=None: logits_to_probs(logits, 0), forward,
                               confidence_threshold=threshold)
        proposal = drafter.propose([0], gamma=4, limit=10, generator_at=lambda i: None)
        assert proposal.tokens == expected, threshold
        assert forward.calls == len(expected)  # no draft forward after the unsure token


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_draft_confidence_stop_keeps_greedy_equivalence(arch, monkeypatch):
    """The draft model ending its runs early (every run at threshold 1, some at 0.05: these tiny models give
    their argmax 0.04-0.07) leaves greedy output target-only's, for model and hybrid drafting, both rules,
    fixed and adaptive gamma."""
    runs = model_runs(monkeypatch)
    target = make_model(arch, seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    reference = decoder.generate(prompt, max_new_tokens=30, method="target", temperature=0).token_ids
    for threshold in (0.05, 1.0):
        for drafter in ("model", "hybrid"):
            for rule in VERIFICATIONS:
                for method, gamma in (("google", 4), ("deepmind", 6), ("google", None)):
                    result = decoder.generate(prompt, max_new_tokens=30, method=method, gamma=gamma, temperature=0,
                                              drafter=drafter, verification=rule,
                                              draft_confidence_threshold=threshold)
                    assert result.token_ids == reference, (arch, threshold, drafter, rule, method, gamma)
    assert ended_early(runs) > 0 and any(proposed > 1 for proposed, cap in runs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hybrid_rounds_that_mix_drafters_keep_greedy_equivalence(arch, monkeypatch):
    """LookupSettings.extend: rounds where the lookup continues the draft model's run keep greedy equivalence."""
    rounds = hybrid_rounds(monkeypatch)
    target = make_model(arch, seed=0, initializer_range=0.1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.2), target,
                                 lookup=LookupSettings(max_ngram=3, max_tokens=3, hybrid_min_match=2, extend=True))
    reference = decoder.generate(prompt, max_new_tokens=40, method="target", temperature=0).token_ids
    accepted = proposed = 0
    for rule in VERIFICATIONS:
        for method, gamma in (("google", 1), ("deepmind", 4), ("google", None)):
            result = decoder.generate(prompt, max_new_tokens=40, method=method, gamma=gamma, temperature=0,
                                      drafter="hybrid", verification=rule)
            assert result.token_ids == reference, (arch, rule, method, gamma)
            accepted, proposed = accepted + result.stats.accepted, proposed + result.stats.proposed
    assert 0 < accepted < proposed  # acceptances and rejections
    mixed = [drafters for drafters in rounds if len(set(drafters)) > 1]
    # the lookup took over from the draft model within a round (at gamma 1 on every architecture here)
    assert any(a == "model" and b == "lookup" for drafters in mixed for a, b in zip(drafters, drafters[1:]))
    for drafters in mixed:  # each drafter's cap holds within a mixed round: gamma <= 4 model, 3 lookup tokens
        assert drafters.count("lookup") <= 3 and drafters.count("model") <= 8


def test_lookup_rounds_leave_the_draft_cache_to_catch_up_in_one_forward(monkeypatch):
    target = make_model("llama", seed=0, initializer_range=0.1)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.0), target)  # the target's weights, its own object
    fed = []
    original = CachedModel.forward

    def spy(self, tokens, keep=1):
        if self.model is decoder.draft_model:
            fed.append(len(tokens))
        return original(self, tokens, keep)

    monkeypatch.setattr(CachedModel, "forward", spy)
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10]
    result = decoder.generate(prompt, max_new_tokens=30, gamma=2, temperature=0, drafter="hybrid")
    assert result.stats.draft_forwards == len(fed) < result.stats.accepted_by_drafter["model"] + len(fed)
    assert max(fed[1:]) > 2  # a model round after lookup rounds fed what it missed in one forward


@pytest.mark.parametrize("drafter", ["lookup", "hybrid"])
def test_adaptive_gamma_with_lookup_is_reproducible_whatever_lengths_it_chooses(pair, monkeypatch, drafter):
    """Token verification: each position's proposer and draws depend on the sequence before it and (seed,
    position) only, so neither the draft model's lengths nor the lookup's cap change the completion."""
    target = make_model("llama", seed=0, initializer_range=0.1)
    draft = perturbed_copy(target, noise=0.05)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    runs = []
    for lengths, max_tokens in (([1], 1), ([6], 10), ([2, 5, 1, 3], 3)):
        schedule = iter(lengths * 100)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: next(schedule))
        # short matches suffice here (2 tokens for the hybrid), so that the lookup serves often on this prompt
        decoder = SpeculativeDecoder(draft, target, lookup=LookupSettings(max_ngram=3, max_tokens=max_tokens,
                                                                          hybrid_min_match=2))
        runs.append(decoder.generate(prompt, max_new_tokens=30, gamma=None, temperature=0.3, seed=11, drafter=drafter))
    assert len({tuple(run.token_ids) for run in runs}) == 1
    assert len({run.stats.target_forwards for run in runs}) > 1  # the rounds did differ
    assert all(run.stats.accepted_by_drafter.get("lookup", 0) > 0 for run in runs)


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_adaptive_gamma_with_the_confidence_stop_is_reproducible_whatever_lengths_it_chooses(monkeypatch, drafter):
    """Where the draft model's run ends on an unsure token depends on the sequence and that position's draw only,
    and adaptive gamma's rounds have no bonus token, so the stop leaves the completion as the schedule does: the
    same whatever lengths are chosen, and the same as without the stop."""
    target = make_model("llama", seed=0, initializer_range=0.1)
    draft = perturbed_copy(target, noise=0.05)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    runs, stopped = [], model_runs(monkeypatch)
    for lengths, threshold in (([1], 0.0), ([6], 0.05), ([2, 5, 1, 3], 0.05), ([7], 0.0)):
        schedule = iter(lengths * 100)
        monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: next(schedule))
        decoder = SpeculativeDecoder(draft, target, lookup=LookupSettings(max_ngram=3, hybrid_min_match=2))
        runs.append(decoder.generate(prompt, max_new_tokens=30, gamma=None, temperature=0.3, seed=11,
                                     drafter=drafter, draft_confidence_threshold=threshold))
    assert len({tuple(run.token_ids) for run in runs}) == 1
    assert len({run.stats.target_forwards for run in runs}) > 1  # the rounds did differ
    if drafter == "model":
        assert ended_early(stopped) > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("rule", VERIFICATIONS)
def test_every_drafter_and_rule_respects_max_new_tokens_and_reports_itself(decoder, drafter, rule):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1]
    for gamma in (4, None):
        result = decoder.generate(prompt, max_new_tokens=13, gamma=gamma, seed=2, drafter=drafter, verification=rule)
        assert len(result.token_ids) == len(result.sources) == 13
        assert set(result.sources) <= {"draft", "lookup", "resampled", "bonus"}
        assert (result.stats.drafter, result.stats.verification) == (drafter, rule)
        assert result.stats.rounds == sum(result.stats.rounds_by_drafter.values())
    baseline = decoder.generate(prompt, max_new_tokens=3, method="target", drafter=drafter).stats
    assert baseline.drafter is None and baseline.rounds_by_drafter == {}


def test_bad_drafter_or_rule_names_the_field(decoder):
    for kwargs, field in (({"drafter": "ngram"}, "drafter"), ({"verification": "tree"}, "verification"),
                          ({"draft_confidence_threshold": 1.5}, "draft_confidence_threshold"),
                          ({"draft_confidence_threshold": float("nan")}, "draft_confidence_threshold"),
                          ({"draft_confidence_threshold": "high"}, "draft_confidence_threshold")):
        with pytest.raises(SpecDecError) as err:
            decoder.generate(PROMPT, **kwargs)
        assert err.value.field == field


def test_round_observer_sees_each_verified_block(decoder):
    blocks = []
    decoder.round_observer = lambda x, q, p: blocks.append((x.clone(), q.shape, p.shape))
    try:
        result = decoder.generate(PROMPT, max_new_tokens=12, gamma=3, seed=0, verification="block")
    finally:
        decoder.round_observer = None
    assert len(blocks) == result.stats.rounds - (result.stats.rounds_by_drafter.get("none", 0))
    assert all(q == p and q[0] == len(x) for x, q, p in blocks)


def test_greedy_adaptive_gamma_keeps_the_bonus_token():
    """Greedy output is the target's argmax whatever lengths adaptive gamma picks, so its greedy rounds end with
    the target's bonus token, as fixed gamma's do, instead of spending a draft forward on a proposal in its
    place (which adaptive sampling does to stay reproducible)."""
    target = make_model("qwen2", seed=2, initializer_range=0.1)
    decoder = SpeculativeDecoder(target, target)  # every proposal accepted: every round ends with the bonus
    reference = decoder.generate(PROMPT, max_new_tokens=30, method="target", temperature=0).token_ids
    for method in ("google", "deepmind"):
        result = decoder.generate(PROMPT, max_new_tokens=30, method=method, gamma=None, temperature=0)
        assert result.token_ids == reference
        assert result.sources.count("bonus") == result.stats.rounds - (result.sources[-1] != "bonus")
        # one draft forward per proposal, and one token more than proposed per round
        assert result.stats.draft_forwards == result.stats.proposed < result.stats.new_tokens
    sampled = decoder.generate(PROMPT, max_new_tokens=30, gamma=None, temperature=1.0, seed=3)
    assert "bonus" not in sampled.sources  # sampling: the last proposal stands in for the bonus


def test_adaptive_gamma_proposes_at_most_its_maximum_when_sampling_too(monkeypatch):
    """Adaptive sampling's last proposal stands in for the bonus token: an audit found it proposing
    ADAPTIVE_MAX_GAMMA + 1 tokens a round, past the max_gamma = 8 the service requires for it (and past the
    acceptance positions its metrics export)."""
    from specdec.engine import ADAPTIVE_MAX_GAMMA, AdaptiveGamma

    monkeypatch.setattr(AdaptiveGamma, "choose", lambda self: self.max_gamma)  # as when the draft costs nothing
    target = make_model("qwen2", seed=2, initializer_range=0.1)
    decoder = SpeculativeDecoder(target, target)  # every proposal accepted
    for temperature in (0, 1.0):
        stats = decoder.generate(PROMPT, max_new_tokens=120, gamma=None, temperature=temperature, seed=3).stats
        assert len(stats.accepted_per_position) == ADAPTIVE_MAX_GAMMA, (temperature, stats.accepted_per_position)
