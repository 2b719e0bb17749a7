"""The compiled static-cache path (specdec/compiled.py) on tiny transformers models, CPU inductor: samples follow
the target's distribution for every method, drafter and verification rule (chi-square, as in test_exactness.py,
with a deliberately wrong rule that must fail), greedy output equals eager target-only output, the static cache
rolls back by position, serves one request at a time, and a request it cannot hold takes the dynamic cache. With
the prompt cache: a request starts from the prefix of its prompt that the static caches hold from the latest
request, or that the prompt cache's copy holds (a request that writes over the static caches gives it one first):
greedy equal to eager target-only without a cache, samples from a warm static cache and from a copy following the
target's distribution.

Compiling costs seconds per graph, so the module compiles one pair, once, on one worker."""

import copy
import random

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from specdec import SpecDecError, SpeculativeDecoder
from specdec.compiled import MAX_WIDTH, StaticCachedModel, cache_for, compile_model, resolve_compile
from specdec.kv_cache import CachedModel
from tests.support.models import make_model, perturbed_copy
from tests.test_exactness import (
    DRAFTER_SAMPLES,
    SETTINGS,
    VOCAB,
    draw,
    draw_warm,
    every_other,
    exact_distribution,
    goodness_of_fit,
    plain_p,
    prompt_for,
)

pytestmark = pytest.mark.xdist_group("compiled")
CPU = torch.device("cpu")


def close_llama_pair(vocab: int = VOCAB, **config):
    target = make_model("llama", seed=0, vocab_size=vocab, initializer_range=0.3, **config)
    return perturbed_copy(target, noise=0.05), target


@pytest.fixture(scope="module")
def compiled_pair():
    """A one-layer Llama pair over 8 tokens, close enough that drafts are often accepted, compiled."""
    draft, target = close_llama_pair(layers=1, hidden=16)
    assert compile_model(draft, CPU) and compile_model(target, CPU)
    return draft, target


@pytest.fixture(scope="module")
def far_pair():
    """An unrelated draft beside the same kind of target, compiled: most drafts are rejected, so a wrong
    residual shows."""
    target = make_model("llama", seed=0, vocab_size=VOCAB, layers=1, hidden=16, initializer_range=0.3)
    draft = make_model("llama", seed=1, vocab_size=VOCAB, layers=1, hidden=16, initializer_range=0.3)
    assert compile_model(draft, CPU) and compile_model(target, CPU)
    return draft, target


@pytest.fixture(scope="module")
def greedy_pairs():
    """(eager, compiled) copies of a two-layer pair over 100 tokens, for greedy comparisons."""
    eager = close_llama_pair(vocab=100)
    compiled = tuple(copy.deepcopy(model) for model in eager)
    assert all(compile_model(model, CPU) for model in compiled)
    return eager, compiled


# --- exactness ---------------------------------------------------------------------------------------------------

# every drafter under both rules, both variants, on the compiled pair
# the hybrid's prompt here has both drafters proposing and accepted (the lookup on its repeats, the model after)
HYBRID_PROMPT = [3, 1, 4, 1, 3, 1, 4, 1, 3, 1]
COMPILED_RULES = [("model", "token", "google"), ("model", "block", "deepmind"), ("lookup", "token", "deepmind"),
                  ("lookup", "block", "google"), ("hybrid", "token", "google"), ("hybrid", "block", "deepmind")]


@pytest.mark.statistical
@pytest.mark.parametrize("drafter, rule, variant", COMPILED_RULES)
def test_compiled_samples_follow_target_distribution(compiled_pair, drafter, rule, variant):
    draft, target = compiled_pair
    prompt, totals = HYBRID_PROMPT if drafter == "hybrid" else prompt_for(drafter), {}
    expected = exact_distribution(target, *SETTINGS["t0.8-topk5-topp0.9"], prompt=prompt)
    counts = draw(SpeculativeDecoder(draft, target), variant, SETTINGS["t0.8-topk5-topp0.9"], DRAFTER_SAMPLES,
                  seed=17, prompt=prompt, totals=totals, drafter=drafter, verification=rule)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3
    accepted = {name: count for (kind, name), count in totals.items() if kind == "accepted_by_drafter"}
    assert all(accepted.get(name, 0) > 0 for name in ({"model", "lookup"} if drafter == "hybrid" else {drafter}))


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["google", "deepmind"])
def test_compiled_adaptive_gamma_samples_follow_target_distribution(compiled_pair, monkeypatch, method):
    draft, target = compiled_pair
    lengths = random.Random(5)
    monkeypatch.setattr("specdec.engine.AdaptiveGamma.choose", lambda self: lengths.randint(1, 4))
    expected = exact_distribution(target, *SETTINGS["t1"])
    counts = draw(SpeculativeDecoder(draft, target), method, SETTINGS["t1"], DRAFTER_SAMPLES, gamma=None, seed=19)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3


@pytest.mark.statistical
def test_compiled_target_only_follows_target_distribution(compiled_pair):
    _, target = compiled_pair
    counts = draw(SpeculativeDecoder(target, target), "target", SETTINGS["t1.5"], DRAFTER_SAMPLES, seed=23)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1.5"]), DRAFTER_SAMPLES) > 1e-3


@pytest.mark.statistical
def test_a_wrong_rule_fails_the_test_on_the_compiled_path(far_pair, monkeypatch):
    draft, target = far_pair
    monkeypatch.setattr("specdec.verification.residual_probs", plain_p)
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], 5_000, seed=29)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) < 1e-6


@pytest.mark.statistical
def test_the_far_pair_passes_with_the_right_rule(far_pair):
    """The same draws with the right rule pass: the failure above is the rule's, not the pair's."""
    draft, target = far_pair
    counts = draw(SpeculativeDecoder(draft, target), "google", SETTINGS["t1"], 5_000, seed=29)
    assert goodness_of_fit(counts, exact_distribution(target, *SETTINGS["t1"]), 5_000) > 1e-3


@pytest.mark.parametrize("drafter, rule, method", COMPILED_RULES + [("model", "token", "adaptive")])
def test_compiled_greedy_equals_eager_target_only(greedy_pairs, drafter, rule, method):
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = SpeculativeDecoder(draft, target).generate(prompt, max_new_tokens=40, method="target",
                                                           temperature=0, eos_token_id=[]).token_ids
    compiled = SpeculativeDecoder(fast_draft, fast_target)
    gamma = None if method == "adaptive" else 4
    result = compiled.generate(prompt, max_new_tokens=40, method="google" if method == "adaptive" else method,
                               gamma=gamma, temperature=0, drafter=drafter, verification=rule, eos_token_id=[])
    assert result.token_ids == reference
    assert compiled.generate(prompt, max_new_tokens=40, method="target", temperature=0,
                             eos_token_id=[]).token_ids == reference


def test_a_model_over_the_cpp_wrapper_bound_compiles_with_the_python_wrapper_and_keeps_greedy_output(greedy_pairs,
                                                                                                   monkeypatch):
    """The default pair's path on CPU: a model over CPP_WRAPPER_MAX_ELEMENTS compiles with inductor's Python
    wrapper (far shorter to compile for a large graph); a small one, as every other test here, with the C++ one.
    Both give eager target-only's greedy output."""
    import specdec.compiled as compiled_module

    (draft, target), _ = greedy_pairs
    options, compile = [], torch.compile

    def recorded(fn, **kwargs):
        options.append(dict(kwargs.get("options") or {}))
        return compile(fn, **kwargs)

    monkeypatch.setattr(compiled_module.torch, "compile", recorded)
    small = copy.deepcopy(target)
    assert compile_model(small, CPU) and options.pop()["cpp_wrapper"] is True
    monkeypatch.setattr(compiled_module, "CPP_WRAPPER_MAX_ELEMENTS", 0)
    large_draft, large_target = copy.deepcopy(draft), copy.deepcopy(target)
    assert compile_model(large_draft, CPU) and compile_model(large_target, CPU)
    assert not any("cpp_wrapper" in chosen for chosen in options)
    assert set(large_target.specdec_static._direct) == {False, True}  # called directly with either wrapper
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = SpeculativeDecoder(draft, target).generate(prompt, max_new_tokens=24, method="target",
                                                           temperature=0, eos_token_id=[]).token_ids
    result = SpeculativeDecoder(large_draft, large_target).generate(prompt, max_new_tokens=24, method="google",
                                                                    temperature=0, eos_token_id=[])
    assert result.token_ids == reference and result.stats.accepted > 0


def test_the_compiled_code_is_called_directly_and_gives_the_guarded_calls_logits(greedy_pairs):
    """On CPU each width class (1, and over 1) calls the code torch.compile made directly, past its wrapper and
    guards: at every width, deep into a sequence and after a rollback, the very logits of the guarded call."""
    _, (draft, target) = greedy_pairs
    for model in (draft, target):
        static = model.specdec_static
        assert static.called_directly and set(static._direct) == {False, True}
        assert static._direct[False].__code__ is not static._direct[True].__code__  # width 1's own graph
        assert len(_debug_get_cache_entry_list(static._own.__code__)) == 2  # the self-check compiled no more
        cached = cache_for(model, 200)
        cached.forward(list(range(1, 41)))  # 40 positions in (the prefill: eager, on the same cache)
        for width in (1, 2, 5, MAX_WIDTH):
            ids = torch.tensor([[(7 * width + i) % 100 for i in range(width)]])
            with torch.inference_mode():
                guarded = static.step(static, ids).clone()
                static.cache.crop(-width)
            assert torch.equal(cached.forward(ids[0].tolist(), keep=width), guarded)
            cached.rollback(40)


def assert_decodes_as_eager(draft, target, compiled_target) -> None:
    """`compiled_target` decodes greedily as the eager `target` does (target-only)."""
    prompt = [5, 17, 42, 8, 99, 3]
    reference = SpeculativeDecoder(draft, target).generate(prompt, max_new_tokens=12, method="target",
                                                           temperature=0, eos_token_id=[]).token_ids
    assert SpeculativeDecoder(draft, compiled_target).generate(prompt, max_new_tokens=12, method="target",
                                                               temperature=0, eos_token_id=[]).token_ids == reference


def test_a_model_whose_direct_calls_differ_keeps_the_guarded_ones(greedy_pairs, monkeypatch, caplog):
    """Where a direct call's logits are not the guarded call's (here made to seem so) the model keeps calling
    through torch.compile's guards, and decodes as before."""
    (draft, target), _ = greedy_pairs
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: False)
    odd = copy.deepcopy(target)
    with caplog.at_level("WARNING", logger="specdec.compiled"):
        assert compile_model(odd, CPU)
    monkeypatch.setattr(torch, "equal", equal)
    assert not odd.specdec_static.called_directly and "called guarded" in caplog.text
    assert_decodes_as_eager(draft, target, odd)


def test_a_failure_finding_the_compiled_code_keeps_the_guarded_calls_not_the_eager_path(greedy_pairs, monkeypatch):
    """Where reading dynamo's cache entries fails (its internals moved), the model is still compiled and calls
    through the guards."""
    import torch._dynamo.eval_frame as eval_frame

    (draft, target), _ = greedy_pairs

    def moved(code):
        raise AttributeError("no cache entries here")

    monkeypatch.setattr(eval_frame, "_debug_get_cache_entry_list", moved)
    odd = copy.deepcopy(target)
    assert compile_model(odd, CPU) and not odd.specdec_static.called_directly
    monkeypatch.undo()
    assert_decodes_as_eager(draft, target, odd)


# --- the static cache --------------------------------------------------------------------------------------------

def test_requests_use_the_static_cache_and_its_rollback_moves_the_position(greedy_pairs):
    _, (_, target) = greedy_pairs
    cached = cache_for(target, 50)
    assert isinstance(cached, StaticCachedModel) and cached.length == 0
    ids = list(range(3, 23))
    first = cached.forward(ids[:12], keep=12)
    cached.forward(ids[12:16], keep=4)
    cached.rollback(12)
    assert cached.length == 12 and int(cached.cache.get_seq_length()) == 12
    again = cached.forward(ids[12:20], keep=8)  # the rolled-back positions are written over
    with torch.no_grad():
        plain = target(input_ids=torch.tensor([ids[:20]])).logits[0]
    assert torch.allclose(torch.cat((first, again)), plain, atol=1e-5)


def test_a_newer_claim_takes_the_static_cache_and_the_older_one_is_refused(greedy_pairs):
    _, (_, target) = greedy_pairs
    older = cache_for(target, 50)
    older.forward([1, 2, 3])
    older.release()
    newer = cache_for(target, 50)
    assert isinstance(newer, StaticCachedModel) and newer.length == 0 and int(newer.cache.get_seq_length()) == 0
    with pytest.raises(SpecDecError, match="taken by a newer request"):
        older.forward([4])
    newer.forward([1, 2, 3])


def test_a_request_beside_one_that_holds_the_static_cache_takes_a_dynamic_one(greedy_pairs):
    _, (_, target) = greedy_pairs
    first = cache_for(target, 50)
    assert isinstance(first, StaticCachedModel) and target.specdec_static.busy
    beside = cache_for(target, 50)
    assert type(beside) is CachedModel  # eager, on its own cache
    first.release()
    assert not target.specdec_static.busy and isinstance(cache_for(target, 50), StaticCachedModel)
    del first
    assert not target.specdec_static.busy  # a request's cache dropped without release frees it too


@pytest.mark.parametrize("method", ["target", "google"])
def test_two_streams_of_one_compiled_decoder_read_in_turn_decode_as_each_alone(greedy_pairs, method):
    """The third audit: on the compiled path a second open stream took the first's static cache, and the first
    then failed ("taken by a newer request"), where the eager path interleaves. The second now decodes eagerly on
    a dynamic cache while the first holds the static one, and each gives what it gives alone."""
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    forget_held(fast_draft, fast_target)
    eager, compiled = SpeculativeDecoder(draft, target), SpeculativeDecoder(fast_draft, fast_target)
    prompts = [[5, 17, 42, 8, 99, 3], [7, 7, 1, 2, 60, 61, 62]]
    params = {"max_new_tokens": 24, "method": method, "temperature": 0, "eos_token_id": []}
    alone = [eager.generate(prompt, **params).token_ids for prompt in prompts]
    streams = [compiled.stream(prompt, **params) for prompt in prompts]
    tokens = [[], []]
    for _ in range(60):  # in turn, a round each
        for i, stream in enumerate(streams):
            tokens[i] += next(stream, None).token_ids if len(tokens[i]) < 24 else []
    assert tokens == alone
    for stream in streams:
        stream.close()
    assert not fast_target.specdec_static.busy and not fast_draft.specdec_static.busy
    assert compiled.generate(prompts[1], **params).token_ids == alone[1]  # the static cache again


def test_a_request_longer_than_the_static_cache_takes_the_dynamic_cache(greedy_pairs):
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    longest = fast_target.specdec_static.max_len
    assert type(cache_for(fast_target, longest + 1)) is CachedModel
    assert type(cache_for(target, 10)) is CachedModel  # no compiled form: the dynamic cache
    prompt = [7] * (longest - 30)  # with 40 new tokens it outgrows the static cache
    eager = SpeculativeDecoder(draft, target).generate(prompt, max_new_tokens=40, temperature=0, eos_token_id=[])
    compiled = SpeculativeDecoder(fast_draft, fast_target).generate(prompt, max_new_tokens=40, temperature=0,
                                                                    eos_token_id=[])
    assert compiled.token_ids == eager.token_ids


def test_forwards_wider_than_the_compiled_widths_run_eagerly_on_the_static_cache(greedy_pairs):
    _, (_, target) = greedy_pairs
    cached = cache_for(target, 100)
    ids = list(range(2, 2 + MAX_WIDTH + 5))
    out = cached.forward(ids, keep=len(ids))
    with torch.no_grad():
        assert torch.allclose(out, target(input_ids=torch.tensor([ids])).logits[0], atol=1e-5)


# --- the static cache as the prompt cache ----------------------------------------------------------------------

PROMPT_CACHE_BYTES = 10_000_000
CHAT = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]


def forget_held(*models) -> None:
    """Nothing held from the tests before (a model's static cache outlives the decoders built on it)."""
    for model in models:
        model.specdec_static.claim(None)


def test_a_request_starts_from_the_prefix_of_its_prompt_that_the_static_caches_hold(greedy_pairs):
    """A conversation's next turn (the last answer and new text after it): the static caches held the last
    request's sequence but its newest token, so only the rest is prefilled; the tokens are eager target-only's
    without a cache, for target-only, draft-only and every drafter and rule."""
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    eager = SpeculativeDecoder(draft, target)
    compiled = SpeculativeDecoder(fast_draft, fast_target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    for start, (method, drafter, rule) in enumerate([("target", "model", "token"), ("draft", "model", "token"),
                                                     ("google", "model", "token"), ("deepmind", "hybrid", "block"),
                                                     ("google", "lookup", "block")]):
        chat = [start + 1] + CHAT[1:]  # shares nothing with the others' sequences, which the prompt cache keeps
        first = compiled.generate(chat, max_new_tokens=12, method=method, temperature=0, eos_token_id=[],
                                  drafter=drafter, verification=rule)
        sequence = chat + first.token_ids
        role = fast_draft if method == "draft" else fast_target
        assert role.specdec_static.held == sequence[:-1]
        turn = sequence + [11, 12, 13]
        second = compiled.generate(turn, max_new_tokens=12, method=method, temperature=0, eos_token_id=[],
                                   drafter=drafter, verification=rule)
        assert second.stats.cached_tokens == len(sequence) - 1
        reference = eager.generate(turn, max_new_tokens=12, method="draft" if method == "draft" else "target",
                                   temperature=0, eos_token_id=[])
        assert second.token_ids == reference.token_ids, (method, drafter, rule)


@pytest.mark.parametrize("method, drafter, rule", [("target", "model", "token"), ("google", "model", "token"),
                                                   ("deepmind", "hybrid", "block")])
def test_conversations_taking_turns_each_find_theirs(greedy_pairs, method, drafter, rule):
    """A request that writes over what the static caches hold first gives the prompt cache a copy; the next turn
    of that conversation has it copied back in, and prefills only its new tokens. Greedy output is eager
    target-only's without a cache."""
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    eager = SpeculativeDecoder(draft, target)
    compiled = SpeculativeDecoder(fast_draft, fast_target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    settings = {"max_new_tokens": 10, "method": method, "temperature": 0, "eos_token_id": [], "drafter": drafter,
                "verification": rule}
    forget_held(fast_draft, fast_target)
    conversations = {name: [start] + CHAT[1:] for name, start in (("a", 61), ("b", 62))}
    for name, prompt in conversations.items():  # each first turn: nothing to start from
        result = compiled.generate(prompt, **settings)
        assert result.stats.cached_tokens == 0
        conversations[name] = prompt + result.token_ids
    assert len(compiled.prompt_cache) == 1  # a's, given when b's first turn wrote over it
    for turn in range(2):
        for name, sequence in conversations.items():
            prompt = sequence + [70 + turn, 71]
            result = compiled.generate(prompt, **settings)
            assert result.stats.cached_tokens == len(sequence) - 1, (name, turn)
            assert result.token_ids == eager.generate(prompt, max_new_tokens=10, method="target", temperature=0,
                                                      eos_token_id=[]).token_ids
            conversations[name] = prompt + result.token_ids


@pytest.mark.parametrize("method, drafter, rule", [("google", "model", "token"), ("deepmind", "hybrid", "block")])
def test_what_the_static_caches_hold_and_their_copies_are_the_keys_of_their_tokens(greedy_pairs, method, drafter,
                                                                                 rule):
    """After speculative requests with rejections (the draft fed proposals the target refused), each static cache
    holds, layer by layer, the keys and values of the tokens it says it holds, and so do the prompt cache's copies
    of them: a wrong draft cache would not change greedy output or the distribution, only acceptance."""
    from tests.test_prompt_cache import assert_entries_hold_their_tokens, assert_holds

    _, (fast_draft, fast_target) = greedy_pairs
    forget_held(fast_draft, fast_target)
    compiled = SpeculativeDecoder(fast_draft, fast_target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    for start in (71, 72):
        result = compiled.generate([start] + CHAT[1:], max_new_tokens=16, method=method, temperature=0.9, seed=3,
                                   eos_token_id=[], drafter=drafter, verification=rule)
        assert result.stats.accepted < result.stats.proposed  # some proposals were refused
    assert len(compiled.prompt_cache) == 1  # the first request's, copied when the second wrote over it
    assert_entries_hold_their_tokens(compiled)
    for model in (fast_draft, fast_target):
        static = model.specdec_static
        held = len(static.held)
        assert held and int(static.cache.get_seq_length()) == held
        assert_holds(model, static.held,
                     [(layer.keys[:, :, :held], layer.values[:, :, :held]) for layer in static.cache.layers])


def test_a_prompt_that_leaves_the_held_sequence_reuses_what_they_share(greedy_pairs):
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    compiled = SpeculativeDecoder(fast_draft, fast_target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    compiled.generate(CHAT, max_new_tokens=8, temperature=0, eos_token_id=[])
    other = CHAT[:6] + [60, 61, 62]
    result = compiled.generate(other, max_new_tokens=8, temperature=0, eos_token_id=[])
    assert result.token_ids == SpeculativeDecoder(draft, target).generate(
        other, max_new_tokens=8, method="target", temperature=0, eos_token_id=[]).token_ids
    assert result.stats.cached_tokens == 6
    again = compiled.generate(other, max_new_tokens=8, temperature=0, eos_token_id=[])
    assert again.stats.cached_tokens == len(other) - 1 and again.token_ids == result.token_ids


def test_a_request_that_does_not_read_the_prompt_cache_starts_from_an_empty_static_cache(greedy_pairs):
    """cache_prompt false, prompt logprobs (a full prefill) or the prompt cache off: nothing is read, and the
    request writes over what the static caches held, leaving nothing held; with the prompt cache on, it first
    gives it a copy, which the next request finds."""
    _, (fast_draft, fast_target) = greedy_pairs
    for kwargs in ({"cache_prompt": False}, {"prompt_logprobs": 0}):
        forget_held(fast_draft, fast_target)
        compiled = SpeculativeDecoder(fast_draft, fast_target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
        first = compiled.generate(CHAT, max_new_tokens=8, temperature=0, eos_token_id=[])
        assert fast_target.specdec_static.held and not len(compiled.prompt_cache)
        result = compiled.generate(CHAT, max_new_tokens=8, temperature=0, eos_token_id=[], **kwargs)
        assert result.stats.cached_tokens is None and fast_target.specdec_static.held == []
        assert len(compiled.prompt_cache) == 1
        again = compiled.generate(CHAT + first.token_ids, max_new_tokens=8, temperature=0, eos_token_id=[])
        assert again.stats.cached_tokens == len(CHAT) + len(first.token_ids) - 1
    SpeculativeDecoder(fast_draft, fast_target).generate(CHAT, max_new_tokens=8, temperature=0, eos_token_id=[])
    assert fast_target.specdec_static.held == [] and fast_draft.specdec_static.held == []


def test_a_request_that_fails_mid_forward_leaves_nothing_held(greedy_pairs, monkeypatch):
    """A forward that raised may have written some layers' keys and not others': no later request reads them."""
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    compiled = SpeculativeDecoder(fast_draft, fast_target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    compiled.generate(CHAT, max_new_tokens=8, temperature=0, eos_token_id=[])
    calls = {"n": 0}
    step = fast_target.specdec_static.compiled_step

    def failing(ids):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the device went away")
        return step(ids)

    monkeypatch.setattr(fast_target.specdec_static, "compiled_step", failing)
    with pytest.raises(RuntimeError, match="went away"):
        compiled.generate(CHAT + [1, 2], max_new_tokens=8, temperature=0, eos_token_id=[])
    monkeypatch.undo()
    assert fast_target.specdec_static.held == []
    result = compiled.generate(CHAT + [1, 2], max_new_tokens=8, temperature=0, eos_token_id=[])
    assert result.stats.cached_tokens == len(CHAT)  # the first request's copy (the failed one wrote over it)
    assert result.token_ids == SpeculativeDecoder(draft, target).generate(
        CHAT + [1, 2], max_new_tokens=8, method="target", temperature=0, eos_token_id=[]).token_ids


def test_a_request_beside_an_open_one_leaves_it_the_static_cache_and_feeds_the_prompt_cache(greedy_pairs):
    """A request that starts while another holds the static cache (an open stream) decodes on dynamic caches,
    which go to the prompt cache when it ends; the open one keeps the static cache, which holds its tokens."""
    (draft, target), (fast_draft, fast_target) = greedy_pairs
    forget_held(fast_draft, fast_target)
    compiled = SpeculativeDecoder(fast_draft, fast_target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    greedy = {"method": "target", "temperature": 0, "eos_token_id": []}
    older = compiled.stream(CHAT, max_new_tokens=8, **greedy)
    first = next(older)
    newer = compiled.generate(CHAT[:5], max_new_tokens=4, **greedy)
    assert newer.token_ids == SpeculativeDecoder(draft, target).generate(CHAT[:5], max_new_tokens=4,
                                                                         **greedy).token_ids
    older.close()  # abandoned after its first round: the static cache holds what it committed
    assert fast_target.specdec_static.held == (CHAT + first.token_ids)[:-1]
    follow_up = CHAT[:5] + newer.token_ids
    assert compiled.generate(follow_up, max_new_tokens=2, **greedy).stats.cached_tokens == len(follow_up) - 1


def test_a_sliding_window_cache_is_never_started_from_a_prefix():
    """A sliding-window layer forgets what left its window: its static cache holds nothing for the next request."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from specdec.compiled import StaticDecoding

    config = MistralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    static = StaticDecoding(AutoModelForCausalLM.from_config(config).eval(), 64, cuda_graphs=False)
    owner = object()
    assert not static.reusable and static.claim(owner, CHAT) == 0
    static.hold(owner, CHAT)
    assert static.held == [] and static.claim(object(), CHAT) == 0


# each draw from the prompt cache's copy: a request for another prompt between two draws wrote over the static
# caches, after giving the prompt cache a copy, which the next draw has copied back in
@pytest.mark.statistical
@pytest.mark.parametrize("method, drafter, rule, setting", [("google", "model", "token", "t1"),
                                                            ("deepmind", "hybrid", "block", "t0.8-topk5-topp0.9")])
def test_compiled_samples_follow_target_distribution_from_the_prompt_caches_copy(compiled_pair, method, drafter,
                                                                               rule, setting):
    draft, target = compiled_pair
    decoder = SpeculativeDecoder(draft, target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    counts = draw_warm(decoder, HYBRID_PROMPT, DRAFTER_SAMPLES, lambda i: ([7, 6, 5, 4], 1), seed=37,
                       method=method, setting=setting, drafter=drafter, verification=rule)
    expected = exact_distribution(target, *SETTINGS[setting], prompt=HYBRID_PROMPT)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3


# every other draw leaves a one-token request's sequence (the prompt) held, taken whole; the others start from the
# previous draw's sequence, of which they share the prompt
WARM_RULES = [("google", "model", "token", "t1", 2), ("deepmind", "hybrid", "block", "t0.8-topk5-topp0.9", 2),
              ("google", "hybrid", "token", "topp0.8", None), ("target", "model", "token", "t1.5", 2)]


@pytest.mark.statistical
@pytest.mark.parametrize("method, drafter, rule, setting, gamma", WARM_RULES)
def test_compiled_samples_follow_target_distribution_with_a_warm_static_cache(compiled_pair, method, drafter, rule,
                                                                            setting, gamma):
    draft, target = compiled_pair
    decoder = SpeculativeDecoder(draft, target, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    counts = draw_warm(decoder, HYBRID_PROMPT, DRAFTER_SAMPLES, every_other(HYBRID_PROMPT), seed=31, method=method,
                       setting=setting, gamma=gamma, drafter=drafter, verification=rule)
    expected = exact_distribution(target, *SETTINGS[setting], prompt=HYBRID_PROMPT)
    assert goodness_of_fit(counts, expected, DRAFTER_SAMPLES) > 1e-3


# --- choosing the path -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, device, expected", [
    ("auto", "cpu", False), ("auto", "cuda", True), (True, "cpu", True), ("false", "cuda", False),
    ("TRUE", "cpu", True), (None, "cpu", False), (False, "cpu", False)])
def test_resolve_compile(value, device, expected):
    assert resolve_compile(value, torch.device(device)) is expected


def test_resolve_compile_refuses_other_values():
    with pytest.raises(SpecDecError, match="compile must be auto, true or false") as error:
        resolve_compile("sometimes", CPU)
    assert error.value.field == "compile"


def test_load_pair_compiles_and_logs_the_seconds(tiny_pair_dirs, caplog):
    import logging

    from specdec import load_pair

    with caplog.at_level(logging.INFO, logger="specdec.models.startup"):
        draft, target, _ = load_pair(*tiny_pair_dirs, device="cpu", compile=True, draft_quantization="none")
    assert hasattr(draft, "specdec_static") and hasattr(target, "specdec_static")
    lines = [r.getMessage() for r in caplog.records if "compiled the" in r.getMessage()]
    assert len(lines) == 2 and all("static cache of" in line for line in lines)
    eager_draft, eager_target, _ = load_pair(*tiny_pair_dirs, device="cpu", compile="auto")
    assert not hasattr(eager_target, "specdec_static")  # auto: off on CPU


def test_a_draft_that_cannot_compile_is_named_and_logged_as_eager(tiny_pair_dirs, caplog, monkeypatch):
    """The third audit: an int8 draft's failed compile was logged as the model's class, then as "compiled the
    draft's forwards ... (not compiled: it stays eager)". The warning now names the draft and says why, and the
    start-up line says it stays eager."""
    import logging

    import specdec.compiled as compiled_module
    from specdec import load_pair

    class Refused(compiled_module.StaticDecoding):
        def warm_up(self):
            raise RuntimeError("Failed to convert args/kwargs to proxy")

    monkeypatch.setattr(compiled_module, "StaticDecoding", Refused)  # as torch refuses the int8 draft (slow to try)
    with caplog.at_level(logging.INFO, logger="specdec"):
        draft, target, _ = load_pair(*tiny_pair_dirs, device="cpu", compile=True, draft_quantization="int8")
    assert not hasattr(draft, "specdec_static") and not hasattr(target, "specdec_static")
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("the draft (LlamaForCausalLM) cannot be compiled whole (Failed to convert") and
               "torch's int8 layers do not compile" in m for m in messages), messages
    assert any(m.startswith("the target (LlamaForCausalLM) cannot be compiled whole") and "int8" not in m
               for m in messages), messages
    assert any(m.startswith("start-up: tried to compile the draft's forwards: it stays eager in ") for m in messages)
    assert not any("compiled the draft" in m for m in messages)


@pytest.mark.usefixtures("clean_env")
def test_the_service_compiles_before_it_is_ready_and_serves_greedy_target_only(tiny_pair_dirs, caplog):
    import logging

    from specdec.serve import create_app

    draft_dir, target_dir = tiny_pair_dirs
    with caplog.at_level(logging.INFO, logger="specdec"):
        app = create_app({"draft_model": draft_dir, "target_model": target_dir, "device": "cpu",
                          "compile": "true", "draft_quantization": "none"})
        assert app.extensions["specdec"].wait_until_loaded(600)
    messages = [record.getMessage() for record in caplog.records]
    compiled = [i for i, m in enumerate(messages) if m.startswith("start-up: compiled the")]
    ready = [i for i, m in enumerate(messages) if m.startswith("models ready in")]
    assert len(compiled) == 2 and ready and max(compiled) < ready[0]
    client = app.test_client()
    assert client.get("/readyz").status_code == 200
    body = {"prompt": "def add(a, b):", "max_new_tokens": 24, "temperature": 0}
    speculative = client.post("/predict", json={**body, "method": "google"}).get_json()
    target_only = client.post("/predict", json={**body, "method": "target"}).get_json()
    assert speculative["text"] == target_only["text"] and speculative["usage"]["completion_tokens"] > 0
    # the next turn starts from what the static caches hold (the prompt cache's part on this path)
    turn = {**body, "prompt": body["prompt"] + target_only["text"] + "\n", "method": "google"}
    cached = client.post("/predict", json=turn).get_json()
    fresh = client.post("/predict", json={**turn, "cache_prompt": False}).get_json()
    prompt_tokens = cached["usage"]["prompt_tokens"]
    assert 0 < cached["stats"]["cached_tokens"] < prompt_tokens and fresh["stats"]["cached_tokens"] is None
    assert cached["text"] == fresh["text"]
    assert client.get("/readyz").get_json()["prompt_cache_bytes"] > 0


def test_compiled_logprobs_are_the_targets_on_every_drafter_and_rule(greedy_pairs):
    """On the compiled path too, the logprobs reported are the target's: speculative equal target-only on the
    same tokens within 1e-5, and a plain eager forward within 1e-4 (the prompt's, from the prefill, as well)."""
    from specdec import SamplingParams
    from tests.test_logprobs import plain_forward

    (_, target), (fast_draft, fast_target) = greedy_pairs
    decoder = SpeculativeDecoder(fast_draft, fast_target)
    prompt = [5, 17, 42, 8, 99, 3, 5, 17, 42, 8]
    reference = decoder.generate(prompt, params=SamplingParams(max_new_tokens=24, method="target", temperature=0,
                                                               logprobs=2, prompt_logprobs=1), eos_token_id=[])
    plain = plain_forward(target, prompt, reference.token_ids)
    assert [t.logprob for t in reference.logprobs] == pytest.approx(plain[len(prompt) - 1:].tolist(), abs=1e-4)
    assert [t.logprob for t in reference.prompt_logprobs[1:]] == pytest.approx(plain[:len(prompt) - 1].tolist(),
                                                                                abs=1e-4)
    for drafter, rule, method in COMPILED_RULES:
        result = decoder.generate(prompt, params=SamplingParams(
            max_new_tokens=24, method=method, gamma=4, temperature=0, logprobs=2, drafter=drafter,
            verification=rule), eos_token_id=[])
        assert result.token_ids == reference.token_ids
        assert [t.logprob for t in result.logprobs] == pytest.approx([t.logprob for t in reference.logprobs],
                                                                      abs=1e-5)


def test_a_model_that_cannot_be_compiled_keeps_its_eager_kernels(monkeypatch):
    """compile_model gives the library's attention to a model it compiles; one it cannot compile keeps ours (the
    row-invariant one that makes greedy speculative output target-only's bitwise)."""
    from specdec.compiled import StaticDecoding
    from specdec.cpu.attention import GQA_ATTENTION, use_gqa_attention

    model = make_model("qwen2", seed=3, vocab_size=VOCAB, layers=1, hidden=16)
    assert use_gqa_attention(model)

    def refuse(self):
        raise RuntimeError("not compilable here")

    monkeypatch.setattr(StaticDecoding, "warm_up", refuse)
    assert not compile_model(model, CPU)
    assert model.config._attn_implementation == GQA_ATTENTION and not hasattr(model, "specdec_static")
