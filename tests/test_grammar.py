"""grammar.py and constrained decoding on the tiny pair: compilation, its cache and its errors; greedy
constrained speculative decoding equals greedy constrained target-only decoding, token for token, for every
drafter and rule, with and without the grammar's forced proposals; outputs that stop parse and validate."""

import json

import jsonschema
import pytest

from specdec import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.grammar import MAX_SOURCE_BYTES, Constraint, GrammarCompiler
from specdec.params import SamplingParams
from tests.support.models import make_model, make_tokenizer, perturbed_copy

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "kind": {"enum": ["cat", "dog", "bird"]}}}


@pytest.fixture(scope="module")
def tiny():
    tokenizer = make_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    target = make_model(seed=0, initializer_range=0.1, vocab_size=100, eos_token_id=eos)
    decoder = SpeculativeDecoder(perturbed_copy(target, noise=0.3), target, tokenizer)
    return decoder, tokenizer, GrammarCompiler(tokenizer, decoder.vocab_size)


def test_compiled_grammars_are_cached_by_hash_and_bounded():
    compiler = GrammarCompiler(make_tokenizer(), 100, cache_size=2)
    first = compiler.compile(Constraint.json_schema(SCHEMA))
    assert compiler.compile(Constraint.json_schema(json.loads(json.dumps(SCHEMA)))) is first  # same schema
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(Constraint("regex", "a+"))
    compiler.compile(Constraint("regex", "b+"))
    assert compiler.compile(Constraint.json_schema(SCHEMA)) is not first  # evicted, least recently used
    assert compiler.misses == 4


@pytest.mark.parametrize("order", [["name", "age", "kind"], ["kind", "age", "name"]])
def test_an_object_s_properties_come_in_the_order_its_schema_lists_them(order):
    """As OpenAI's structured outputs write them (and a pydantic model's fields are listed): the schema is not
    reordered on its way to the grammar (it once was, sorted for the cache's key)."""
    tokenizer = make_tokenizer()
    schema = {**SCHEMA, "properties": {name: SCHEMA["properties"][name] for name in order}}
    state = GrammarCompiler(tokenizer, 100).compile(Constraint.json_schema(schema)).start({tokenizer.eos_token_id})
    for token in tokenizer.encode('{"', add_special_tokens=False):
        state.advance(token)
    assert tokenizer.decode(state.allowed().nonzero().flatten().tolist()) == order[0][0]


@pytest.mark.parametrize("constraint, field", [
    (lambda: Constraint("regex", "a(b", field="structured_outputs.regex"), "structured_outputs.regex"),
    (lambda: Constraint.json_schema({"type": "nonsense"}), "response_format"),
    (lambda: Constraint("json_schema", "{not json", field="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (lambda: Constraint("grammar", "start: undefined_rule", field="structured_outputs.grammar"),
     "structured_outputs.grammar"),
    (lambda: Constraint("regex", "a" * (MAX_SOURCE_BYTES + 1), field="structured_outputs.regex"),
     "structured_outputs.regex"),
    (lambda: Constraint.choice([], field="structured_outputs.choice"), "structured_outputs.choice"),
])
def test_bad_constraints_name_their_field(constraint, field):
    compiler = GrammarCompiler(make_tokenizer(), 100)
    with pytest.raises(SpecDecError) as error:
        compiler.compile(constraint())
    assert error.value.field == field


def test_ignore_eos_is_refused_under_a_grammar(tiny):
    """A grammar ends with EOS: going on past it has no allowed token, so the request is refused up front."""
    decoder, tokenizer, compiler = tiny
    grammar = compiler.compile(Constraint.json_schema(SCHEMA))
    with pytest.raises(SpecDecError, match="ignore_eos") as error:
        decoder.generate([1, 2], params=SamplingParams(max_new_tokens=8, ignore_eos=True), grammar=grammar)
    assert error.value.field == "ignore_eos"


@pytest.mark.parametrize("drafter", ["model", "lookup", "hybrid"])
@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("method", ["google", "deepmind"])
@pytest.mark.parametrize("forced", [True, False])
def test_greedy_constrained_speculative_equals_constrained_target_only(tiny, method, verification, drafter, forced):
    decoder, tokenizer, compiler = tiny
    grammar = compiler.compile(Constraint.json_schema(SCHEMA))
    prompt = tokenizer.encode('name: "Ann", age 7, a cat. {"name": "Ann", "age": 7', add_special_tokens=False)
    reference = decoder.generate(prompt, params=SamplingParams(max_new_tokens=80, method="target", temperature=0),
                                 grammar=grammar)
    params = SamplingParams(max_new_tokens=80, method=method, temperature=0, gamma=4, drafter=drafter,
                            verification=verification, grammar_drafter=forced)
    result = decoder.generate(prompt, params=params, grammar=grammar)
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == reference.finish_reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(result.token_ids[:-1])), SCHEMA)
    assert (result.stats.forced_tokens > 0) == forced
    assert result.stats.grammar_seconds > 0


@pytest.mark.parametrize("drafter", ["model", "lookup", "hybrid"])
@pytest.mark.parametrize("verification", ["token", "block"])
def test_greedy_short_path_under_a_grammar_gives_the_general_paths_tokens_and_counts(tiny, drafter, verification):
    """The engine's greedy short path (argmax of the masked logits, engine._verify_greedy) against the rules
    applied to the masked one-hot distributions (a round observer turns it off): same tokens, forced tokens and
    acceptances."""
    decoder, tokenizer, compiler = tiny
    prompt = tokenizer.encode('name: "Ann", age 7, a cat. {"name": "Ann", "age": 7', add_special_tokens=False)
    params = SamplingParams(max_new_tokens=80, method="google", temperature=0, gamma=4, drafter=drafter,
                            verification=verification)
    short = decoder.generate(prompt, params=params, grammar=compiler.compile(Constraint.json_schema(SCHEMA)))
    decoder.round_observer = lambda x, q, p: None
    try:
        general = decoder.generate(prompt, params=params, grammar=compiler.compile(Constraint.json_schema(SCHEMA)))
    finally:
        decoder.round_observer = None
    assert short.token_ids == general.token_ids
    fields = ("accepted", "proposed", "rounds", "forced_tokens", "accepted_by_drafter", "proposed_by_drafter")
    assert {f: short.stats[f] for f in fields} == {f: general.stats[f] for f in fields}
    assert short.stats.forced_tokens > 0


def test_adaptive_greedy_and_sampled_outputs_follow_the_schema(tiny):
    decoder, tokenizer, compiler = tiny
    grammar = compiler.compile(Constraint.json_schema(SCHEMA))
    prompt = tokenizer.encode("a record:", add_special_tokens=False)
    for seed in range(8):
        for gamma, temperature in ((None, 0), (None, 1.0), (3, 0.7)):
            params = SamplingParams(max_new_tokens=120, temperature=temperature, gamma=gamma, seed=seed,
                                    top_p=0.9, drafter="hybrid")
            result = decoder.generate(prompt, params=params, grammar=grammar)
            if result.finish_reason == "stop":
                jsonschema.validate(json.loads(tokenizer.decode(result.token_ids[:-1])), SCHEMA)
            else:  # cut by max_new_tokens: a prefix of a valid document
                assert tokenizer.decode(result.token_ids).startswith('{"')


@pytest.mark.parametrize("method", ["target", "google"])
def test_a_grammar_the_tokenizer_cannot_write_takes_the_way_it_can(tiny, method):
    """The character tokenizer has no token for 'é' and no byte tokens: llguidance's mask then offers the
    unknown-token, which its matcher refuses to consume (the 400 'the grammar cannot take token 0' that
    schemathesis found). The state clears it: where another way is open, the generation takes it; where none is,
    it fails (`test_a_grammar_no_token_can_go_on_with_fails_naming_its_field`; it once ended there, "stop" with
    text that does not match)."""
    decoder, tokenizer, compiler = tiny
    state = compiler.compile(Constraint.choice(["é!", "ab"])).start({tokenizer.eos_token_id})
    assert state.allowed().nonzero().flatten().tolist() == tokenizer.convert_tokens_to_ids(["a"])
    prompt = tokenizer.encode("pick:", add_special_tokens=False)
    for seed in range(3):
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed, method=method)
        result = decoder.generate(prompt, params=params, grammar=compiler.compile(Constraint.choice(["ab", "é"])))
        assert tokenizer.unk_token_id not in result.token_ids
        assert tokenizer.decode(result.token_ids, skip_special_tokens=True) == "ab"


@pytest.mark.parametrize("method", ["target", "google"])
def test_a_grammar_beyond_the_limits_while_decoding_fails_naming_its_field(tiny, method):
    """llguidance builds its lexer lazily: `a{999999}` compiles, then fails at its first token, and its matchers
    (copies sharing the lexer) start in an error state from then on, with no token allowed. Each request with it
    fails with a SpecDecError naming the field, the first and every later one (the compiler drops the failed
    grammar), never ending at once as if the grammar were complete, which once answered "stop" with an empty
    text that does not match the regex."""
    decoder, tokenizer, compiler = tiny
    prompt = tokenizer.encode("pick:", add_special_tokens=False)
    constraint = Constraint("regex", "a{999999}", field="structured_outputs.regex")
    for seed in range(3):
        with pytest.raises(SpecDecError, match="beyond the grammar engine's limits") as error:
            decoder.generate(prompt, params=SamplingParams(max_new_tokens=4, seed=seed, method=method),
                             grammar=compiler.compile(constraint))
        assert error.value.field == "structured_outputs.regex"
    assert compiler.compile(Constraint("regex", "a{3}")).start(set()).allowed().sum() == 1  # the others are fine


def test_a_failed_grammar_lets_its_lexer_go_at_once(tiny):
    """Found by a soak audit: a grammar that failed while decoding kept its pristine matcher, and with it the
    lexer in its error state (some 90 MB for `a{999990}`), as long as the cache kept the entry: 64 such regexes
    could hold gigabytes. The matcher goes with the failure; a request given the entry before it failed is
    refused naming the field, and the compiler compiles it again for the next."""
    decoder, tokenizer, compiler = tiny
    prompt = tokenizer.encode("pick:", add_special_tokens=False)
    constraint = Constraint("regex", "a{999990}", field="structured_outputs.regex")
    compiled = compiler.compile(constraint)
    with pytest.raises(SpecDecError, match="beyond the grammar engine's limits"):
        decoder.generate(prompt, params=SamplingParams(max_new_tokens=4, seed=0), grammar=compiled)
    assert compiled.failed and compiled._matcher is None
    with pytest.raises(SpecDecError, match="another request") as error:
        compiled.start(set())
    assert error.value.field == "structured_outputs.regex"
    again = compiler.compile(constraint)
    assert again is not compiled and again._matcher is not None
    # a dead end (a character no token writes) depends on the path taken and leaves the lexer sound: the entry
    # keeps its matcher (found by a review: requests queued with it were refused)
    dead_end = compiler.compile(Constraint("regex", "ab\tc", field="structured_outputs.regex"))
    with pytest.raises(SpecDecError, match="cannot be completed"):
        decoder.generate(prompt, params=SamplingParams(max_new_tokens=10, temperature=0), grammar=dead_end)
    assert dead_end.failed and dead_end._matcher is not None and dead_end.start(set()) is not None


@pytest.mark.parametrize("method", ["target", "google"])
@pytest.mark.parametrize("constraint, made", [(Constraint("regex", "ab\tc", field="structured_outputs.regex"), 2),
                                              (Constraint.choice(["tab\there"]), 3), (Constraint.choice(["é"]), 0)])
def test_a_grammar_no_token_can_go_on_with_fails_naming_its_field(tiny, method, constraint, made):
    """Found by an audit: where the grammar goes on only through a character the character-level vocabulary has
    no token for (a tab, "é"), the mask held only the unknown-token, which the matcher refuses, and the answer
    ended there as if the grammar were complete: "stop" with "ab" for the regex `ab\tc`. It fails now, naming the
    constraint's field, after the tokens that could be made."""
    decoder, tokenizer, compiler = tiny
    prompt = tokenizer.encode("pick:", add_special_tokens=False)
    with pytest.raises(SpecDecError, match=f"cannot be completed with this model's tokens after {made} tokens") \
            as error:
        decoder.generate(prompt, params=SamplingParams(max_new_tokens=10, temperature=0, method=method),
                         grammar=compiler.compile(constraint))
    assert error.value.field == constraint.field


def test_a_dead_end_only_proposed_is_no_failure_and_one_committed_is(tiny):
    """Found reviewing the dead-end fix: a draft may propose into a dead end that the target then rejects, so the
    dead end allows only an end there and fails the request when that end is committed, not when it is proposed
    (failing at once would fail requests target-only decoding completes)."""
    _, tokenizer, compiler = tiny
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    state = compiler.compile(Constraint("regex", "ab\tc|xyz", field="structured_outputs.regex")).start({eos})
    ids = {c: tokenizer.convert_tokens_to_ids(c) for c in "abxyz"}
    for token in (ids["a"], ids["b"]):  # proposed
        state.advance(token)
    assert state.allowed().nonzero().flatten().tolist() == [eos]  # the dead end: only an end
    state.sync([ids["x"]])  # the target rejected "a": back, and on another way
    for token in (ids["y"], ids["z"]):
        state.sync(state.tokens + [token])
    state.sync(state.tokens + [eos])  # a real end: fine
    state = compiler.compile(Constraint("regex", "ab\tc|xyz", field="structured_outputs.regex")).start({eos})
    with pytest.raises(SpecDecError, match="after 2 tokens") as error:
        state.sync([ids["a"], ids["b"], eos])  # the dead end's end, committed
    assert error.value.field == "structured_outputs.regex"


@pytest.mark.parametrize("dead, open_", [("a", "b"), ("f", "c"), ("i", "a")])
def test_a_dead_end_the_draft_proposes_fails_no_method_that_target_only_completes(tiny, dead, open_):
    """`(<dead>\t|<open><open>)` on the character tokenizer (no tab token): greedy, the draft takes the dead way (draft-only
    decoding fails) and the target the open one. Target-only, Google and DeepMind give the same answer: the draft's
    proposal into the dead end is rejected, not a failure of the request."""
    decoder, tokenizer, compiler = tiny
    prompt = tokenizer.encode("pick 0:", add_special_tokens=False)
    constraint = Constraint("regex", f"({dead}\\t|{open_}{open_})", field="structured_outputs.regex")

    def decode(method):
        return decoder.generate(prompt, params=SamplingParams(max_new_tokens=4, temperature=0, method=method, gamma=4),
                                grammar=compiler.compile(constraint)).token_ids

    with pytest.raises(SpecDecError, match="cannot be completed"):
        decode("draft")
    answer = decode("target")
    assert tokenizer.decode(answer, skip_special_tokens=True) == open_ * 2
    assert decode("google") == decode("deepmind") == answer


def test_regex_and_choice_constraints(tiny):
    decoder, tokenizer, compiler = tiny
    prompt = tokenizer.encode("pick:", add_special_tokens=False)
    for seed in range(5):
        params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed)
        text = tokenizer.decode(decoder.generate(prompt, params=params, grammar=compiler.compile(
            Constraint.choice(["yes", "no", "maybe"]))).token_ids, skip_special_tokens=True)
        assert text in ("yes", "no", "maybe")
        text = tokenizer.decode(decoder.generate(prompt, params=params, grammar=compiler.compile(
            Constraint("regex", r"[0-9]{3}-[a-z]{2}"))).token_ids, skip_special_tokens=True)
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
