"""models/draft_vocab.py: a draft over part of the vocabulary computes its ids' logits as the whole head does
(bitwise for grouped weights) and -inf elsewhere (the special tokens kept, no weight copied), and speculative
decoding with it still samples exactly the target's distribution (chi-square, Google and DeepMind, token and block
verification, the model and hybrid drafters; under a grammar whose allowed tokens lie outside the draft's ids at
some position) and keeps greedy output the target's."""

import copy

import pytest
import torch
from torch import nn

from specdec import SpecDecError, SpeculativeDecoder
from specdec.cpu.grouped import GroupedLinear, grouped_kernel, quantize
from specdec.models.draft_vocab import (
    DEFAULT_PAIR_DRAFT_VOCAB,
    PartialHead,
    limit_draft_vocab,
    resolve_draft_vocab_size,
)
from specdec.params import SamplingParams
from tests.support.models import make_model
from tests.test_exactness import (
    DRAFTER_SAMPLES,
    HYBRID_PROMPT,
    SETTINGS,
    VOCAB,
    draw,
    exact_distribution,
    goodness_of_fit,
    make_close_pair,
    plain_p,
)

KEPT = 4  # the tiny draft proposes among ids 0..3 of 8


class _Tokenizer:
    """What limit_draft_vocab reads of a tokenizer: its added (special) tokens."""

    def __init__(self, special):
        self.added_tokens_decoder = dict.fromkeys(special, None)
        self.all_special_ids = list(special)


def test_draft_vocab_size_is_resolved_and_checked():
    assert resolve_draft_vocab_size("auto", default_pair=True) == DEFAULT_PAIR_DRAFT_VOCAB
    assert resolve_draft_vocab_size(None, default_pair=False) == 0
    assert resolve_draft_vocab_size("32768", default_pair=True) == 32768
    assert resolve_draft_vocab_size(0, default_pair=True) == 0
    for bad in (-1, "many", 1.5, True):
        with pytest.raises(SpecDecError) as error:
            resolve_draft_vocab_size(bad, default_pair=False)
        assert error.value.field == "draft_vocab_size"


def test_a_float_head_keeps_its_first_ids_and_the_special_tokens_and_shares_its_weight():
    model = make_model("llama", seed=2, vocab_size=64, hidden=32)
    head = model.get_output_embeddings()
    x = torch.randn(3, 32)
    full = head(x)
    rows = limit_draft_vocab(model, _Tokenizer([60, 61]), 16)
    partial = model.get_output_embeddings()
    assert isinstance(partial, PartialHead) and rows == 18
    out = partial(x)
    # float: the same products, summed as BLAS blocks a narrower matrix (the grouped operator's are bitwise)
    torch.testing.assert_close(out[:, :16], full[:, :16], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:, 60:62], full[:, 60:62], rtol=1e-5, atol=1e-6)
    assert torch.isneginf(out[:, 16:60]).all() and torch.isneginf(out[:, 62:]).all()
    assert partial.parts[0].weight.data_ptr() == head.weight.data_ptr()  # a view, not a copy


@pytest.mark.skipif(not grouped_kernel(), reason="the grouped kernel cannot be built here")
def test_a_grouped_head_keeps_whole_tiles_bitwise():
    model = make_model("llama", seed=3, vocab_size=100, hidden=64)
    model.lm_head = GroupedLinear(quantize(model.lm_head.weight, 8))
    x = torch.randn(2, 64)
    full = model.lm_head(x)
    rows = limit_draft_vocab(model, _Tokenizer([97]), 20)
    out = model.get_output_embeddings()(x)
    assert rows == 32 + 4  # ids 0..31 (two tiles), and 96..99 (the tile of 97, cut at the vocabulary's end)
    assert torch.equal(out[:, :32], full[:, :32]) and torch.equal(out[:, 96:], full[:, 96:])
    assert torch.isneginf(out[:, 32:96]).all()


def test_nothing_changes_where_the_whole_vocabulary_is_asked_for():
    model = make_model("llama", vocab_size=64)
    head = model.get_output_embeddings()
    assert limit_draft_vocab(model, _Tokenizer([]), 0) == 0 and limit_draft_vocab(model, _Tokenizer([]), 64) == 0
    assert model.get_output_embeddings() is head


def close_pair_over(ranges: list[tuple[int, int]]):
    """The tests' close pair, the draft proposing among the ids of `ranges` only."""
    draft, target = make_close_pair()
    draft.head = PartialHead(draft.head, ranges)
    return draft, target


@pytest.fixture(scope="module")
def partial_pair():
    """The draft over ids 0..3 only: the target gives 4..7 much of its mass."""
    return close_pair_over([(0, KEPT)])


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, method", [("model", "token", "google"), ("model", "block", "deepmind"),
                                                   ("model", "token", "deepmind"), ("hybrid", "block", "google")])
def test_a_draft_over_part_of_the_vocabulary_samples_the_targets_distribution(partial_pair, drafter, rule, method):
    draft, target = partial_pair
    setting = SETTINGS["t1"]
    prompt = HYBRID_PROMPT if drafter == "hybrid" else [1, 2]
    expected = exact_distribution(target, *setting, prompt=prompt)
    assert sum(p for key, p in expected.items() if any(t >= KEPT for t in key)) > 0.3  # the draft cannot say these
    totals = {}
    counts = draw(SpeculativeDecoder(draft, target), method, setting, DRAFTER_SAMPLES, seed=41, prompt=prompt,
                  totals=totals, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert any(t >= KEPT for key in counts for t in key)  # the residual draws them
    assert totals.get(("accepted_by_drafter", "model"), 0) > 0


@pytest.mark.statistical
def test_a_wrong_rule_fails_with_a_draft_over_part_of_the_vocabulary(partial_pair, monkeypatch):
    draft, target = partial_pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], DRAFTER_SAMPLES, seed=41)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), DRAFTER_SAMPLES) < 1e-6


@pytest.mark.statistical
@pytest.mark.parametrize("forced", [True, False], ids=["grammar-drafter", "masked-only"])
def test_under_a_grammar_allowing_only_ids_the_draft_lacks_the_output_stays_the_constrained_targets(
        forced, monkeypatch):
    """The grammar of tests/test_grammar_exactness.py allows only 0, 1 or 2 at its first position, none of them this
    draft's (3..7): the draft proposes nothing there (no NaN from an empty distribution) and the target draws it."""
    import llguidance

    from specdec.grammar import Constraint, GrammarCompiler
    from tests.test_grammar_exactness import LANGUAGE, REGEX, _Chars, allowed_after
    from tests.test_grammar_exactness import draw as constrained_draw

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Chars()))
    grammar = GrammarCompiler(tokenizer, VOCAB).compile(Constraint("regex", REGEX))
    from specdec.drafters import ModelDrafter

    empty = []
    original = ModelDrafter.draw

    def draw_counted(self, *args, **kwargs):
        drawn = original(self, *args, **kwargs)
        empty.append(drawn is None)
        return drawn

    monkeypatch.setattr(ModelDrafter, "draw", draw_counted)
    draft, target = close_pair_over([(KEPT - 1, VOCAB)])
    setting = SETTINGS["t1"]
    counts = constrained_draw(SpeculativeDecoder(draft, target), grammar, "google", setting, DRAFTER_SAMPLES, seed=5,
                              grammar_drafter=forced)
    assert set(counts) <= LANGUAGE
    expected = exact_distribution(target, *setting, prompt=[1, 2], allowed=allowed_after)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    assert any(empty)  # the draft proposed nothing at the first position
    assert forced or not all(empty)  # ... and, without the forced d, proposed it at the second


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
@pytest.mark.parametrize("method", ["google", "deepmind"])
def test_greedy_output_with_a_draft_over_part_of_the_vocabulary_is_the_targets(drafter, method):
    target = make_model("llama", seed=0, vocab_size=100, hidden=64, initializer_range=0.3)
    draft = copy.deepcopy(target)
    assert limit_draft_vocab(draft, _Tokenizer([99]), 50) == 51
    decoder = SpeculativeDecoder(draft, target)
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = decoder.generate(prompt, max_new_tokens=40, method="target", temperature=0, eos_token_id=[])
    assert any(t >= 50 and t != 99 for t in reference.token_ids)  # the draft cannot propose these
    result = decoder.generate(prompt, params=SamplingParams(max_new_tokens=40, method=method, gamma=4,
                                                            temperature=0, drafter=drafter), eos_token_id=[])
    assert result.token_ids == reference.token_ids
    assert result.stats.accepted > 0


def test_the_draft_keeps_a_float_head_of_another_kind_whole(caplog):
    model = make_model("llama", vocab_size=64)
    model.lm_head = nn.Sequential(model.lm_head)  # not a kind it knows how to cut
    model.lm_head.out_features = 64
    assert limit_draft_vocab(model, _Tokenizer([]), 16) == 0
    assert "keeps its whole vocabulary" in caplog.text


@pytest.mark.parametrize("draft_quantization", ["none", "int8", "int4"])
def test_every_form_the_cpu_draft_takes_is_cut(tiny_pair_dirs, draft_quantization):
    """The third audit: with the CPU kernels the float draft's head is the few-rows kernel's, and the int8 draft's
    torch's int8 layer, and neither was cut (a warning, the whole vocabulary). Both are now, their rows' logits
    the whole head's, and greedy speculative output stays target-only's."""
    from specdec import load_pair

    draft_dir, target_dir = tiny_pair_dirs
    whole, _, _ = load_pair(draft_dir, target_dir, device="cpu", draft_quantization=draft_quantization,
                            draft_vocab_size=0)
    draft, target, tokenizer = load_pair(draft_dir, target_dir, device="cpu", draft_quantization=draft_quantization,
                                         draft_vocab_size=40)
    head = draft.get_output_embeddings()
    assert isinstance(head, PartialHead) and 40 <= head.rows < head.out_features
    assert type(head.parts[0]) is type(whole.get_output_embeddings()) or draft_quantization == "int4"
    x = torch.randn(2, head.in_features)
    full, out = whole.get_output_embeddings()(x), head(x)
    for start, part in zip(head.starts, head.parts):
        torch.testing.assert_close(out[:, start:start + part.out_features], full[:, start:start + part.out_features],
                                   rtol=1e-5, atol=1e-5)
    decoder = SpeculativeDecoder(draft, target, tokenizer)
    prompt = tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):")
    reference = decoder.generate(prompt, max_new_tokens=30, method="target", temperature=0, eos_token_id=[])
    assert decoder.generate(prompt, max_new_tokens=30, method="google", gamma=4, temperature=0,
                            eos_token_id=[]).token_ids == reference.token_ids
