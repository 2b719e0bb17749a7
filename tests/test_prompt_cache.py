"""The prompt cache (specdec/prompt_cache.py) and the engine's use of it, on the tiny pair: hits, misses and
partial prefixes; the last prompt token always prefilled; eviction order under the byte budget; cache_prompt
false; two interleaved conversations sharing a system prompt each keeping their own entry; greedy speculative
output equal to target-only greedy output with the cache in the same state, for every drafter; and a request that
fails mid-forward, is closed (a client gone) or times out leaving no entry whose caches do not hold its tokens.
Through the service: cached_tokens in the usage, in /predict's stats, on /metrics and in the log line.
"""

import logging
import shutil

import pytest
import torch
from transformers import DynamicCache

from specdec import SamplingParams, SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.models.kernels import use_cpu_kernels
from specdec.prompt_cache import PromptCache, common_prefix, default_budget
from tests.support.models import make_app, make_model, perturbed_copy

VOCAB = 100
HAS_TOOLCHAIN = bool((shutil.which("c++") or shutil.which("g++")) and shutil.which("ninja"))
BUDGET = 50_000_000


@pytest.fixture(scope="module")
def models():
    target = make_model("llama", seed=0, initializer_range=0.1, vocab_size=VOCAB)
    return perturbed_copy(target, noise=0.3), target


def decoder(models, budget: int = BUDGET) -> SpeculativeDecoder:
    return SpeculativeDecoder(*models, prompt_cache_bytes=budget)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(dec, prompt, method="target", n=12, **kwargs):
    return dec.generate(prompt, max_new_tokens=n, method=method, temperature=0, **kwargs)


def assert_entries_hold_their_tokens(dec) -> None:
    """Every entry's caches hold, layer by layer, the keys and values of a prefix of its token ids: compared with
    a fresh forward over those ids (equal up to rounding; other tokens would differ by far more)."""
    for entry in dec.prompt_cache.entries():
        for role, cache in entry.caches.items():
            length = cache.get_seq_length()
            assert 0 < length <= len(entry.token_ids)
            assert_holds(dec.target_model if role == "target" else dec.draft_model, entry.token_ids[:length],
                         [(layer.keys, layer.values) for layer in cache.layers])


def assert_holds(model, token_ids: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`layers`, each (keys, values), are the model's keys and values of `token_ids`: compared with a fresh forward
    over them (equal up to rounding; other tokens would differ by far more)."""
    fresh = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([token_ids]), cache=fresh, use_cache=True)
    for (keys, values), recomputed in zip(layers, fresh.layers, strict=True):
        assert keys.shape == recomputed.keys.shape
        assert torch.allclose(keys, recomputed.keys, atol=1e-4)
        assert torch.allclose(values, recomputed.values, atol=1e-4)


# --- the pure parts --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
                                     ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 2), ([7], [8], 0),
                                     (list(range(1000)), list(range(999)) + [5], 999)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_default_budget_is_the_weights_or_a_quarter_of_what_they_leave():
    assert default_budget(4_000, 100_000) == 4_000  # plenty of memory: the weights' size
    assert default_budget(4_000, 12_000) == 2_000  # a quarter of the 8,000 left
    assert default_budget(4_000, 3_000) == 0 and default_budget(4_000, None) == 0


def test_a_budget_must_be_a_byte_count(models):
    """The engine's one exception for bad input, naming the argument, as its other arguments' (the third audit:
    it was a bare ValueError)."""
    for bad in (-1, 1.5, True, "auto"):
        with pytest.raises(SpecDecError) as raised:
            PromptCache(bad)
        assert raised.value.field == "prompt_cache_bytes"
        with pytest.raises(SpecDecError, match="byte count"):
            SpeculativeDecoder(*models, prompt_cache_bytes=bad)


# --- hits, misses, partial prefixes ----------------------------------------------------------------------------

def test_a_miss_then_a_hit_of_the_whole_sequence_then_a_partial_one(models):
    dec = decoder(models)
    prompt = tokens(30, 1)
    first = greedy(dec, prompt)
    assert first.stats.cached_tokens == 0  # a miss
    (entry,) = dec.prompt_cache.entries()
    assert entry.token_ids == prompt + first.token_ids[:-1]  # the newest token was never fed
    assert_entries_hold_their_tokens(dec)

    turn = prompt + first.token_ids + tokens(5, 2)
    second = greedy(dec, turn)
    assert second.stats.cached_tokens == len(prompt) + len(first.token_ids) - 1  # all of the entry: it continues it
    (entry,) = dec.prompt_cache.entries()  # taken, extended and put back
    assert entry.token_ids == turn + second.token_ids[:-1]

    other = prompt[:20] + tokens(10, 3)  # shares 20 tokens, then differs
    third = greedy(dec, other)
    assert third.stats.cached_tokens == common_prefix(other, prompt) >= 20
    lengths = sorted(len(e.token_ids) for e in dec.prompt_cache.entries())
    assert lengths == [len(other) + 11, len(turn) + 11]  # a copy served it: the longer entry stays whole
    assert_entries_hold_their_tokens(dec)


def test_the_same_prompt_again_prefills_its_last_token(models):
    dec = decoder(models)
    prompt = tokens(25, 4)
    first = greedy(dec, prompt, method="google", gamma=3)
    again = greedy(dec, prompt, method="google", gamma=3)
    assert again.stats.cached_tokens == len(prompt) - 1  # one token left: its logits predict the first new one
    assert again.token_ids == first.token_ids
    assert again.stats.target_forwards >= 1


def test_cache_prompt_false_neither_reads_nor_stores(models):
    dec = decoder(models)
    prompt = tokens(30, 5)
    greedy(dec, prompt)
    before = [(e.token_ids, e.nbytes) for e in dec.prompt_cache.entries()]
    off = SamplingParams(max_new_tokens=12, method="google", temperature=0, cache_prompt=False)
    result = dec.generate(prompt + tokens(4, 6), params=off)
    assert result.stats.cached_tokens is None
    assert [(e.token_ids, e.nbytes) for e in dec.prompt_cache.entries()] == before
    off_cache = SpeculativeDecoder(*models)  # budget 0: the cache is off altogether
    assert off_cache.generate(prompt, params=off.replace(cache_prompt=True)).stats.cached_tokens is None
    assert len(off_cache.prompt_cache) == 0


def test_two_interleaved_conversations_sharing_a_system_prompt_keep_their_own_entries(models):
    dec = decoder(models)
    system = tokens(30, 7)
    turns = {"a": system + tokens(10, 8), "b": system + tokens(10, 9)}
    history = {}
    for name in ("a", "b"):  # b shares only the system prompt with a's entry: a copy of it, a's stays whole
        result = greedy(dec, turns[name])
        assert result.stats.cached_tokens == (0 if name == "a" else len(system))
        history[name] = turns[name] + result.token_ids
    for turn in range(2):
        for name in ("a", "b"):
            prompt = history[name] + tokens(6, 10 + turn)
            result = greedy(dec, prompt)
            assert result.stats.cached_tokens == len(history[name]) - 1  # all of its own last turn
            history[name] = prompt + result.token_ids
    assert len(dec.prompt_cache) == 2
    assert_entries_hold_their_tokens(dec)


# --- the byte budget -------------------------------------------------------------------------------------------

def test_eviction_is_least_recently_used_first_within_the_budget(models):
    probe = decoder(models)
    greedy(probe, tokens(30, 20))
    size = probe.prompt_cache.nbytes  # one entry of a 30-token prompt and 12 new tokens
    dec = decoder(models, budget=int(size * 2.5))
    first, second, third = ([seed] + tokens(29, seed) for seed in (21, 22, 23))  # no shared first token
    for prompt in (first, second):
        greedy(dec, prompt)
    assert [e.token_ids[0] for e in dec.prompt_cache.entries()] == [21, 22]
    greedy(dec, third)  # does not fit beside both: the least recently used goes
    assert [e.token_ids[0] for e in dec.prompt_cache.entries()] == [22, 23]
    assert dec.prompt_cache.nbytes <= dec.prompt_cache.budget
    used = greedy(dec, second[:15] + tokens(15, 24))  # served by a copy of `second`'s prefix: `second` is used
    assert used.stats.cached_tokens >= 15
    assert [e.token_ids[0] for e in dec.prompt_cache.entries()] == [22, 22]  # `third` was least recently used
    assert dec.prompt_cache.nbytes <= dec.prompt_cache.budget
    assert_entries_hold_their_tokens(dec)


def test_an_entry_larger_than_the_budget_is_not_kept(models):
    dec = decoder(models, budget=1_000)
    result = greedy(dec, tokens(30, 25))
    assert result.stats.cached_tokens == 0 and len(dec.prompt_cache) == 0 and dec.prompt_cache.nbytes == 0


# --- exactness -------------------------------------------------------------------------------------------------

SPECULATIVE = {  # name: sampling keywords
    "google-model": dict(method="google", gamma=4),
    "deepmind-model": dict(method="deepmind", gamma=3),
    "google-lookup": dict(method="google", gamma=4, drafter="lookup"),
    "google-hybrid-adaptive": dict(method="google", gamma=None, drafter="hybrid"),
    "google-block": dict(method="google", gamma=4, verification="block"),
}


@pytest.mark.parametrize("name", SPECULATIVE)
def test_speculative_greedy_equals_target_only_greedy_with_the_cache_in_the_same_state(models, name):
    """Both decoders get the same warm-up request, so their caches hold the same keys, bit for bit; the next
    turn then decodes target-only on one and speculatively on the other."""
    kwargs = SPECULATIVE[name]
    repeated = tokens(12, 30)
    prompt = repeated + tokens(8, 31) + repeated  # repeats: the lookup finds matches
    outputs, cached = [], []
    for method in ("target", kwargs["method"]):
        dec = decoder(models)
        warm = greedy(dec, prompt, n=20, **kwargs)
        turn = prompt + warm.token_ids + repeated[:6]
        result = greedy(dec, turn, n=24, **(kwargs if method != "target" else {"method": "target"}))
        outputs.append(result.token_ids)
        cached.append(result.stats.cached_tokens)
    assert outputs[0] == outputs[1]
    assert cached[0] == cached[1] == len(prompt) + 20 - 1


@pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no C++ compiler or ninja to build the kernel")
@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_bfloat16_target_rows_are_target_onlys_to_the_bit_with_a_warm_cache(drafter, monkeypatch):
    """What load_pair gives on CPU (bfloat16, our kernels), where a forward's rounding depends on its width: the
    rows speculative decoding verifies on are target-only decoding's, bit for bit (the logprobs read them), after
    a warm-up that left the same cache. Folding the first proposals into the prefill of the uncached rest would
    change their rounding: the target's first forward must be the uncached rest alone (its width recorded)."""
    from specdec.kv_cache import CachedModel

    widths, original = [], CachedModel.forward

    def spy(self, tokens, keep=1):
        if self.model is target:
            widths.append(len(tokens))
        return original(self, tokens, keep)

    monkeypatch.setattr(CachedModel, "forward", spy)
    outputs = []
    for method in ("target", "google"):
        target = make_model("qwen2", seed=0, hidden=64, initializer_range=0.1)
        draft = perturbed_copy(target, noise=0.3)
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
        assert use_cpu_kernels(target) and use_cpu_kernels(draft)
        dec = SpeculativeDecoder(draft, target, prompt_cache_bytes=BUDGET)
        prompt = [1, 2, 3, 1, 2, 3, 1, 2] * 3
        warm = greedy(dec, prompt, method="google", n=20, drafter=drafter)
        params = SamplingParams(max_new_tokens=30, method=method, temperature=0, drafter=drafter, logprobs=3)
        tail = [t % 64 for t in tokens(40, 60)]  # a prefill wide enough for the library's matrix products
        widths.clear()
        result = dec.generate(prompt + warm.token_ids + tail, params=params)
        assert result.stats.cached_tokens == len(prompt) + 20 - 1
        assert widths[0] == len(tail) + 1  # the prefill: the newest warm-up token (never fed) and the tail
        outputs.append((result.token_ids, [(t.logprob, t.top) for t in result.logprobs]))
    assert outputs[0] == outputs[1]


def test_greedy_with_a_warm_cache_equals_greedy_without(models):
    dec, fresh = decoder(models), SpeculativeDecoder(*models)
    history = tokens(20, 40)
    for turn in range(4):
        with_cache = greedy(dec, history, method="google", n=16, gamma=4)
        without = greedy(fresh, history, method="google", n=16, gamma=4)
        assert with_cache.token_ids == without.token_ids
        assert (with_cache.stats.cached_tokens > 0) == (turn > 0)
        history = history + with_cache.token_ids + tokens(5, 41 + turn)


# --- requests that end badly -----------------------------------------------------------------------------------

def test_a_request_that_fails_mid_forward_leaves_no_entry(models, monkeypatch):
    dec = decoder(models)
    prompt = tokens(30, 50)
    warm = greedy(dec, prompt, method="google")
    turn = prompt + warm.token_ids + tokens(4, 51)
    norm = dec.target_model.model.layers[-1].post_attention_layernorm  # called by either forward (fused_forward.py)
    calls = {"n": 0}
    original = type(norm).forward

    def failing(self, *args, **kwargs):  # the third target forward fails after its first layer took its keys
        calls["n"] += self is norm
        if self is norm and calls["n"] == 3:
            raise RuntimeError("out of memory (simulated)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(norm), "forward", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        greedy(dec, turn, method="google", n=30)
    monkeypatch.undo()
    assert len(dec.prompt_cache) == 0  # the entry it took went with it; nothing was put back
    after = greedy(dec, turn, method="google", n=30)
    assert after.stats.cached_tokens == 0
    assert after.token_ids == greedy(SpeculativeDecoder(*models), turn, method="google", n=30).token_ids


def test_an_error_between_forwards_keeps_only_the_committed_tokens(models, monkeypatch):
    """An error after the target scored a round's proposals but before the caches were rolled back: the entry
    keeps the committed tokens only, not the proposals the caches were fed."""
    import specdec.engine as engine

    dec = decoder(models)
    calls = {"n": 0}
    original = engine.SpeculativeDecoder._verify_greedy  # greedy rounds' verification

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("a bug in verification (simulated)")
        return original(*args)

    monkeypatch.setattr(engine.SpeculativeDecoder, "_verify_greedy", staticmethod(failing))
    with pytest.raises(ValueError, match="simulated"):
        greedy(dec, tokens(30, 52), method="google", n=30, gamma=4)
    (entry,) = dec.prompt_cache.entries()
    assert len(entry.token_ids) < 30 + 30
    assert_entries_hold_their_tokens(dec)


def test_a_stream_closed_mid_way_keeps_what_it_committed(models):
    dec = decoder(models)
    prompt = tokens(30, 53)
    stream = dec.stream(prompt, max_new_tokens=40, method="google", gamma=3, temperature=0)
    committed = [t for _ in range(2) for t in next(stream).token_ids]
    stream.close()  # a client gone: abandoned at a round's end
    (entry,) = dec.prompt_cache.entries()
    assert entry.token_ids == prompt + committed[:-1]
    assert_entries_hold_their_tokens(dec)
    following = greedy(dec, prompt + committed + [5], method="google", n=10)
    assert following.stats.cached_tokens == len(prompt) + len(committed) - 1


# --- through the service ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(models):
    from tests.support.models import make_tokenizer

    return (*models, make_tokenizer())


def metric(client, name: str) -> float:
    for line in client.get("/metrics").get_data(as_text=True).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not on /metrics")


def held_entries(app) -> list:
    service = app.extensions["specdec"]
    return service.engine.call(lambda: list(service.decoder.prompt_cache.entries()))


def test_service_reports_cached_tokens_in_stats_usage_metrics_and_log(pair, caplog):
    app = make_app(pair, prompt_cache_bytes=BUDGET)
    client = app.test_client()
    hits, misses = metric(client, "specdec_prompt_cache_hits_total"), metric(client, "specdec_prompt_cache_misses_total")
    body = {"prompt": "Hello there, how are you", "max_new_tokens": 8, "temperature": 0}
    first = client.post("/predict", json=body).get_json()
    assert first["stats"]["cached_tokens"] == 0
    with caplog.at_level(logging.INFO, logger="specdec.serve"):
        again = client.post("/predict", json={**body, "prompt": body["prompt"] + first["text"] + "!"}).get_json()
    assert again["stats"]["cached_tokens"] > len(body["prompt"])
    assert any(f"cached_tokens={again['stats']['cached_tokens']} " in r.getMessage() for r in caplog.records)
    assert metric(client, "specdec_prompt_cache_hits_total") == hits + 1
    assert metric(client, "specdec_prompt_cache_misses_total") == misses + 1
    assert metric(client, "specdec_prompt_cache_cached_tokens_total") >= again["stats"]["cached_tokens"]
    assert metric(client, "specdec_prompt_cache_entries") == len(held_entries(app)) >= 1
    assert 0 < metric(client, "specdec_prompt_cache_bytes") <= metric(client, "specdec_prompt_cache_budget_bytes") \
        == BUDGET
    off = client.post("/predict", json={**body, "cache_prompt": False}).get_json()
    assert off["stats"]["cached_tokens"] is None
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    client.post("/v1/chat/completions", json=chat)
    usage = client.post("/v1/chat/completions", json=chat).get_json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    bad = client.post("/predict", json={**body, "cache_prompt": "yes"})
    assert bad.status_code == 422 and bad.get_json()["error"]["field"] == "cache_prompt"


def test_service_a_timed_out_request_keeps_only_what_its_caches_hold(pair):
    app = make_app(pair, prompt_cache_bytes=BUDGET, request_timeout=1e-6)
    client = app.test_client()
    answer = client.post("/predict", json={"prompt": "Once upon a time", "max_new_tokens": 200, "gamma": 2,
                                           "temperature": 0}).get_json()
    assert answer["finish_reason"] == "time_limit" and answer["usage"]["completion_tokens"] < 200
    (entry,) = held_entries(app)
    service = app.extensions["specdec"]
    assert len(entry.token_ids) == answer["usage"]["prompt_tokens"] + answer["stats"]["new_tokens"] - 1
    service.engine.call(assert_entries_hold_their_tokens, service.decoder)


def test_service_a_client_that_disconnects_leaves_a_consistent_entry(pair):
    app = make_app(pair, prompt_cache_bytes=BUDGET)
    client = app.test_client()
    response = client.post("/predict", json={"prompt": "Far far away", "max_new_tokens": 200, "gamma": 2,
                                             "seed": 1, "stream": True})
    assert next(iter(response.response)).startswith(b"data: ")
    response.close()
    (entry,) = held_entries(app)
    assert len(entry.token_ids) < len("Far far away") + 200
    service = app.extensions["specdec"]
    service.engine.call(assert_entries_hold_their_tokens, service.decoder)


def test_prompt_cache_bytes_from_the_environment_and_auto(pair, clean_env):
    from specdec.prompt_cache import memory_bytes, weights_bytes
    from specdec.serve.config import ConfigError, load_settings
    from specdec.serve.loader import prompt_cache_budget

    assert load_settings(environ={"SPECDEC_PROMPT_CACHE_BYTES": "0"}).prompt_cache_bytes == 0
    assert load_settings(environ={"SPECDEC_PROMPT_CACHE_BYTES": "123456"}).prompt_cache_bytes == 123456
    auto = load_settings(environ={"SPECDEC_PROMPT_CACHE_BYTES": "auto"})
    assert auto.prompt_cache_bytes is None and load_settings(environ={}).prompt_cache_bytes is None  # the default
    draft, target, _ = pair
    assert prompt_cache_budget(auto, draft, target) == default_budget(weights_bytes(draft, target),
                                                                      memory_bytes(torch.device("cpu"))) > 0
    with pytest.raises(ConfigError, match="prompt_cache_bytes"):
        load_settings(environ={"SPECDEC_PROMPT_CACHE_BYTES": "-5"})
    off = make_app(pair, prompt_cache_bytes=0).test_client()
    assert off.get("/readyz").get_json()["prompt_cache_bytes"] == 0
    assert off.post("/predict", json={"prompt": "Hi", "max_new_tokens": 2}).get_json()["stats"]["cached_tokens"] is None


def test_a_wide_prefill_after_cached_tokens_takes_one_attention_call(monkeypatch):
    """Our CPU attention goes row by row over a verification's few rows (bitwise decoding's sums), but a forward
    wider than any verification after cached tokens is the prefill of what the prompt cache did not hold: one
    masked call, equal to the row-by-row result within rounding."""
    import specdec.cpu.attention as attention
    from specdec.models.kernels import use_cpu_kernels

    model = make_model("qwen2", seed=0, hidden=64, initializer_range=0.1, context=1024, vocab_size=VOCAB)
    use_cpu_kernels(model)
    calls = {"n": 0}
    original = attention.one_query_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "one_query_attention", counted)
    ids = tokens(400, 70)
    width = attention.ROW_BY_ROW_MAX + 20
    outputs = {}
    for limit in (attention.ROW_BY_ROW_MAX, 10_000):  # the bound, and none (row by row at any width)
        monkeypatch.setattr(attention, "ROW_BY_ROW_MAX", limit)
        cache = DynamicCache(config=model.config)
        calls["n"] = 0
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:-width]]), cache=cache, use_cache=True)
            outputs[limit] = model(input_ids=torch.tensor([ids[-width:]]), cache=cache, use_cache=True).logits
        assert (calls["n"] == 0) == (limit < width)
    first, second = outputs.values()
    assert torch.allclose(first, second, atol=1e-4)


def test_a_request_that_feeds_the_cache_hands_the_heaps_free_pages_back(models, monkeypatch):
    """The memory a request freed (its transients, the entries its own evicted) goes back to the system once its
    entry is in, so resident memory follows what the cache holds (glibc keeps freed heap pages otherwise: 0.4 GB
    over the weights plus the budget in the benchmark before); a request that does not use the cache skips it."""
    import specdec.engine

    dec = decoder(models)
    held_when_released = []
    monkeypatch.setattr(specdec.engine, "release_free_memory", lambda: held_when_released.append(len(dec.prompt_cache)))
    greedy(dec, tokens(20, seed=1))
    dec.generate(tokens(20, seed=2), params=SamplingParams(max_new_tokens=12, temperature=0, cache_prompt=False))
    greedy(dec, tokens(20, seed=3), method="google")
    assert held_when_released == [1, 2]  # after each cached request, its entry already in
