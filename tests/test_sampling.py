"""sampling.py: warpers match transformers' own, greedy is one-hot, draws follow the distribution."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.sampling import logits_to_probs, sample, token_probability, top_p_removed, warp_logits


def hf_probs(logits, temperature, top_k, top_p):
    scores = logits.clone()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.7, 10, 0.9), (1.0, 1, 1.0), (1.0, 0, 0.01)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = logits_to_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(ours, hf_probs(logits, temperature, top_k, top_p))


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0, 40.0])  # flat (nearly every token a candidate) to peaked
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99, 0.999])
@pytest.mark.parametrize("size", [50, 3000, 151_936])
def test_top_p_shortcut_removes_exactly_what_the_full_sort_does(scale, top_p, size):
    logits = torch.randn(3, size, generator=torch.Generator().manual_seed(1)) * scale
    logits[1, ::2] = float("-inf")  # a row that top-k or a grammar masked already
    full = top_p_removed(logits, top_p, shortcut=False)
    assert torch.equal(top_p_removed(logits, top_p), full)
    assert torch.equal(top_p_removed(logits[0], top_p), full[0])  # one row alone, as a draft step has it
    if size <= 3000:
        torch.testing.assert_close(logits_to_probs(logits, 1.0, 0, top_p), hf_probs(logits, 1.0, 0, top_p))


def test_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert torch.isfinite(warp_logits(logits, 1.0, 1, 1.0)).tolist() == [[False, True, True, False]]


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 0.0, 0.0]])
    assert logits_to_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_sample_never_draws_zero_probability_and_token_zero_is_normal():
    probs = torch.tensor([0.5, 0.0, 0.5, 0.0])
    generator = torch.Generator().manual_seed(0)
    draws = [sample(probs, generator) for _ in range(2000)]
    assert set(draws) == {0, 2}
    assert abs(draws.count(0) / len(draws) - 0.5) < 0.05


def test_sample_frequencies_match_probabilities():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([sample(probs, generator) for _ in range(20000)]), minlength=4)
    assert torch.allclose(counts / 20000, probs, atol=0.015)


def test_sample_is_reproducible_with_seed_zero():
    probs = torch.softmax(torch.randn(30), -1)
    first = [sample(probs, torch.Generator().manual_seed(0)) for _ in range(1)]
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert [sample(probs, g1) for _ in range(20)] == [sample(probs, g2) for _ in range(20)]
    assert first


def test_token_probability_is_the_unwarped_softmax_entry():
    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(0)) * 4
    probs = logits.double().softmax(-1)
    for token in (0, int(probs.argmax()), 151_935):
        assert token_probability(logits, token) == pytest.approx(float(probs[token]), rel=1e-4)
    assert token_probability(torch.tensor([0.0, 0.0, float("-inf")]), 2) == 0.0


def test_a_temperature_past_float32s_range_samples_uniformly_over_what_is_not_masked():
    """Found by the OpenAPI fuzzer: at T = 6e307 the divisor overflowed float32 to inf, a grammar's masked logits
    (-inf) became NaN, and the draw could land on a forbidden token."""
    logits = torch.tensor([[2.0, float("-inf"), -3.0, float("-inf"), 0.5]])
    for temperature in (6.1e307, 1e39, 3e38):
        probs = logits_to_probs(logits, temperature)
        assert not probs.isnan().any()
        torch.testing.assert_close(probs, torch.tensor([[1 / 3, 0.0, 1 / 3, 0.0, 1 / 3]]))
    generator = torch.Generator().manual_seed(0)
    assert {sample(logits_to_probs(logits[0], 6.1e307), generator) for _ in range(200)} == {0, 2, 4}


@pytest.mark.parametrize("presence, frequency, repetition", [(0.7, 0.0, 1.0), (0.0, 1.3, 1.0), (0.0, 0.0, 1.6),
                                                            (-0.4, 0.9, 0.6)])
def test_penalties_match_transformers_repetition_and_openais_formula_row_by_row(presence, frequency, repetition):
    """penalize on 4 rows, row i after the context's first len - 3 + i tokens: each row equals transformers'
    RepetitionPenaltyLogitsProcessor over prompt and output, then OpenAI's frequency and presence penalties over
    the output, written out; and the same bits as the row penalized alone (rows never mix). A token id past the
    logits (a draft with fewer of them) is left out."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from specdec.sampling import penalize

    prompt, output = [5, 9, 2, 9], [2, 7, 7, 30, 1, 7, 4]
    context, rows, size = prompt + output, 4, 12
    logits = torch.randn(rows, size, generator=torch.Generator().manual_seed(3)) * 3
    logits[1, 3] = float("-inf")  # a masked token stays masked
    got = penalize(logits, context, len(prompt), presence, frequency, repetition)
    for i in range(rows):
        seen = context[: len(context) - rows + 1 + i]
        expected = logits[i: i + 1].clone()
        if repetition != 1:
            ids = torch.tensor([[t for t in seen if t < size]])
            expected = RepetitionPenaltyLogitsProcessor(repetition)(ids, expected)
        generated = seen[len(prompt):]
        for token in set(generated) - {30}:
            expected[0, token] -= frequency * generated.count(token) + presence
        torch.testing.assert_close(got[i: i + 1], expected, rtol=0, atol=1e-6)
        alone = penalize(logits[i: i + 1], seen, len(prompt), presence, frequency, repetition)
        assert torch.equal(alone, got[i: i + 1])
    assert got[1, 3] == float("-inf")
    untouched = [t for t in range(size) if t not in context]
    assert torch.equal(got[:, untouched], logits[:, untouched])


def test_penalties_refuse_rows_that_would_start_inside_the_prompt():
    from specdec.sampling import penalize

    with pytest.raises(ValueError):
        penalize(torch.zeros(3, 8), [1, 2, 3], 2, presence=1.0)
