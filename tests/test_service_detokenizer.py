"""detokenizer.py: incremental text equals one-shot decoding, multi-byte characters split over tokens, stop
strings cut the text and are never streamed."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdec.text import PROMPT_CONTEXT, Completion, Detokenizer, concatenates, token_bytes
from tests.support.models import make_tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE with no merges: every UTF-8 byte is a token, so "é" takes two."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="module")
def merged_tokenizer():
    """Byte-level BPE with a few merges: tokens of one to four characters, and "é" one token or two bytes."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("a", "b"), ("ab", "c"), ("abc", "d"), ("Ã", "©"), ("Ġ", "a"), ("Ġa", "b")]
    vocab = {symbol: i for i, symbol in enumerate(alphabet + ["".join(m) for m in merges])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def decoder_of(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_multibyte_characters_come_whole(byte_tokenizer):
    text = "naïve café — 日本 🙂!"
    ids = byte_tokenizer.encode(text)
    assert len(ids) > len(text)
    detokenizer = Detokenizer(decoder_of(byte_tokenizer), byte_tokenizer.encode("Say: "))
    pieces = [detokenizer.add(i) for i in ids]
    assert "".join(pieces) == text
    assert "" in pieces and all("\ufffd" not in p for p in pieces)


def test_an_incomplete_last_character_is_flushed_as_replacement(byte_tokenizer):
    ids = byte_tokenizer.encode("ok é")[:-1]
    completion = Completion(decoder_of(byte_tokenizer), [], ())
    completion.feed(ids, ["target"] * len(ids))
    assert completion.take() == "ok "
    completion.finish()
    assert completion.text == "ok \ufffd" and completion.take() == "\ufffd"


@settings(max_examples=60, deadline=None)
@given(prompt=st.text(min_size=0, max_size=8), text=st.text(min_size=1, max_size=30),
       cuts=st.lists(st.integers(1, 5), max_size=10))
def test_chunked_text_equals_decoding_at_once(byte_tokenizer, prompt, text, cuts):
    ids = byte_tokenizer.encode(text)
    completion = Completion(decoder_of(byte_tokenizer), byte_tokenizer.encode(prompt), ())
    sent, start = [], 0
    for size in cuts + [len(ids)]:
        chunk = ids[start:start + size]
        start += size
        completion.feed(chunk, ["draft"] * len(chunk))
        sent.append(completion.take())
    completion.finish()
    sent.append(completion.take())
    assert "".join(sent) == completion.text == text
    assert "".join(t["text"] for t in completion.tokens) == text


def reference_pieces(decode, prompt_ids, token_ids):
    """The offsets scheme of TGI and vLLM, token by token, as plainly as it can be written."""
    ids, prefix, read, pieces = list(prompt_ids[-PROMPT_CONTEXT:]), 0, len(prompt_ids[-PROMPT_CONTEXT:]), []
    for token_id in token_ids:
        ids.append(token_id)
        before, after = decode(ids[prefix:read]), decode(ids[prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before):])
            prefix, read = read, len(ids)
        else:
            pieces.append("")
    return pieces


@pytest.fixture(scope="module")
def char_tokenizer():
    return make_tokenizer()  # one token a character, joined by a Fuse decoder, specials skipped


def rounds_of(ids: list[int], cuts: list[int], with_logprobs: bool) -> list[SimpleNamespace]:
    """Engine chunks of `ids` cut after each of `cuts` tokens (the rest last), with stand-in logprobs or none."""
    chunks, start = [], 0
    for size in cuts + [len(ids)]:
        token_ids = ids[start:start + size]
        start += size
        chunks.append(SimpleNamespace(token_ids=token_ids, sources=["draft"] * len(token_ids),
                                      logprobs=[(start, i) for i in range(len(token_ids))] if with_logprobs else None))
    return chunks


@pytest.mark.parametrize("name", ["byte_tokenizer", "merged_tokenizer", "char_tokenizer"])
@settings(max_examples=80, deadline=None)
@given(prompt=st.text(min_size=0, max_size=8), text=st.text("ab.é ", max_size=30) | st.text(max_size=20),
       cuts=st.lists(st.integers(0, 5), max_size=10), with_logprobs=st.booleans(), stop=st.sampled_from([(), ("é",)]))
def test_feed_and_extend_give_each_token_the_text_of_the_offsets_scheme(request, name, prompt, text, cuts,
                                                                          with_logprobs, stop):
    """Feeding rounds one by one (a token's text alone decoded once per id; these decoders join the tokens' texts,
    so a token after a whole one adds its own text alone) and all at the end (a JSON answer: Completion.extend)
    give each token its text by the offsets scheme decoded token by token, characters split over tokens, special
    tokens and empty rounds included; with a stop string, the text ends before it and the tokens with the one
    that completes it (extend then feeds round by round)."""
    tokenizer = request.getfixturevalue(name)
    assert concatenates(tokenizer)
    ids = tokenizer.encode(text)
    if name == "char_tokenizer":  # its special tokens (skipped: no text) among the characters
        ids = ids[:3] + [0, 2] + ids[3:]
    text = decoder_of(tokenizer)(ids)  # what the pieces join to
    chunks = rounds_of(ids, cuts, with_logprobs)
    decode, prompt_ids = decoder_of(tokenizer), tokenizer.encode(prompt)
    fed, extended = (Completion(decode, prompt_ids, stop, concatenative=True) for _ in range(2))
    for chunk in chunks:
        fed.feed(chunk.token_ids, chunk.sources, chunk.logprobs)
    extended.extend(chunks)
    for completion in (fed, extended):
        completion.finish()
    assert extended.text == fed.text and extended.tokens == fed.tokens
    assert extended.offsets == fed.offsets and extended.logprobs == fed.logprobs
    assert extended.stopped == fed.stopped and extended.take() == fed.take()
    pieces = reference_pieces(decode, prompt_ids, ids)
    if stop:  # the text up to the stop string; the tokens up to the one whose text completes it
        assert fed.stopped == (stop[0] in text) and fed.text == text.split(stop[0])[0]
        if fed.stopped:
            ends = [len("".join(pieces[:i + 1])) for i in range(len(pieces))]
            pieces = pieces[:next(i for i, end in enumerate(ends) if stop[0] in text[:end]) + 1]
            assert len(fed.tokens) == len(pieces)
    else:
        assert fed.text == text
    assert [token["text"] for token in fed.tokens[:-1]] == pieces[:len(fed.tokens) - 1]  # the last may hold the rest
    assert fed.offsets == [sum(map(len, pieces[:i])) for i in range(len(fed.tokens))]
    assert fed.logprobs == [entry for c in chunks for entry in (c.logprobs or [None] * len(c.token_ids))][
        :len(fed.tokens)]


@pytest.mark.parametrize("name", ["byte_tokenizer", "merged_tokenizer", "char_tokenizer"])
@settings(max_examples=80, deadline=None)
@given(prompt=st.text(min_size=0, max_size=8), text=st.text("ab.é ", max_size=30) | st.text(max_size=20),
       cuts=st.lists(st.integers(0, 5), max_size=10), batches=st.lists(st.integers(1, 4), max_size=6),
       with_logprobs=st.booleans(), taken_first=st.booleans())
def test_rounds_fed_together_give_each_round_the_text_that_feeding_and_taking_it_gives(
        request, name, prompt, text, cuts, batches, with_logprobs, taken_first):
    """A stream's greenlet feeds the rounds it takes at once (Completion.feed_rounds: one pass of the
    detokenizer) and renders each from its text: the same texts as feeding each round and taking its text, the
    same completion after (tokens, offsets, logprobs, text), characters split over rounds and empty rounds
    included; text fed before and not taken goes with the first round."""
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(text)
    chunks = rounds_of(ids, cuts, with_logprobs)
    decode, prompt_ids = decoder_of(tokenizer), tokenizer.encode(prompt)
    one_by_one, together = (Completion(decode, prompt_ids, concatenative=True) for _ in range(2))
    head = chunks[:1] if not taken_first else []  # fed and not taken before the batches
    for completion in (one_by_one, together):
        for chunk in head:
            completion.feed(chunk.token_ids, chunk.sources, chunk.logprobs)
    rest, expected, got = chunks[len(head):], [], []
    for chunk in rest:
        one_by_one.feed(chunk.token_ids, chunk.sources, chunk.logprobs)
        expected.append(one_by_one.take())
    start = 0
    for size in batches + [len(rest)]:
        got += together.feed_rounds(rest[start:start + size])
        start += size
    assert got == expected
    assert together.text == one_by_one.text and together.tokens == one_by_one.tokens
    assert together.offsets == one_by_one.offsets and together.logprobs == one_by_one.logprobs
    assert together.take() == one_by_one.take()  # nothing left, or (with no rounds after it) what was fed first
    for completion in (one_by_one, together):
        completion.finish()
    assert together.text == one_by_one.text and together.take() == one_by_one.take()


def test_rounds_are_not_fed_together_where_a_stop_string_may_cut_the_text(char_tokenizer):
    completion = Completion(decoder_of(char_tokenizer), [], ("x",), concatenative=True)
    with pytest.raises(ValueError, match="stop strings"):
        completion.feed_rounds([SimpleNamespace(token_ids=[5], sources=["target"], logprobs=None)])


def feed_text(completion, tokenizer, text, chunk=3):
    ids = tokenizer.encode(text)
    sent = []
    for i in range(0, len(ids), chunk):
        completion.feed(ids[i:i + chunk], ["draft"] * len(ids[i:i + chunk]))
        sent.append(completion.take())
        if completion.stopped:
            break
    completion.finish()
    sent.append(completion.take())
    return "".join(sent)


@pytest.mark.parametrize("text, stop, expected", [
    ("Hello world. Bye", ["."], "Hello world"),
    ("Hello world. Bye", ["world", "Hello"], ""),
    ("Hello world. Bye", ["orld", "lo w"], "Hel"),
    ("a--b--c", ["--"], "a"),
    ("Hello world", ["xyz"], "Hello world"),
    ("Hello wor", ["world"], "Hello wor"),  # a stop string's start at the very end is released when decoding ends
])
def test_stop_strings(text, stop, expected):
    tokenizer = make_tokenizer()
    completion = Completion(decoder_of(tokenizer), [], stop)
    assert feed_text(completion, tokenizer, text) == expected
    assert completion.text == expected
    assert completion.stopped == (expected != text)


@pytest.mark.parametrize("min_tokens, expected", [(0, "a"), (3, "a"), (4, "a--b"), (6, "a--b"), (7, "a--b--c")])
def test_no_stop_string_cuts_the_text_before_min_tokens(min_tokens, expected):
    """As vLLM: a stop string is looked for only once min_tokens tokens are out, each time in the text the latest
    token may have completed, so "--" completed by the 3rd token (one a character here) cuts there up to
    min_tokens 3, at the 6th from 4 to 6, and not at all from 7."""
    tokenizer = make_tokenizer()
    completion = Completion(decoder_of(tokenizer), [], ["--"], min_tokens=min_tokens)
    assert feed_text(completion, tokenizer, "a--b--c", chunk=1) == expected
    assert completion.stopped == (expected != "a--b--c")


def test_tokens_after_a_stop_string_are_dropped():
    tokenizer = make_tokenizer()
    completion = Completion(decoder_of(tokenizer), [], ["b"])
    ids = tokenizer.encode("abcdef")
    kept = completion.feed(ids, ["draft", "draft", "draft", "resampled", "bonus", "draft"])
    assert [t["text"] for t in kept] == ["a", "b"] and completion.stopped
    assert completion.text == "a" and completion.take() == "a"
    assert completion.feed(tokenizer.encode("gh"), ["bonus", "bonus"]) == []


def test_a_possible_stop_string_start_is_held_back():
    tokenizer = make_tokenizer()
    completion = Completion(decoder_of(tokenizer), [], ["STOP"])
    completion.feed(tokenizer.encode("go ST"), ["draft"] * 5)
    assert completion.take() == "go "
    completion.feed(tokenizer.encode("ay"), ["draft"] * 2)
    assert completion.take() == "STay"


# --- which tokens go out with the text (their logprobs travel with them) ------------------------------------------

@pytest.mark.parametrize("text, stop, chunk", [
    ("Hello world. Bye", ["."], 3), ("Hello world. Bye", ["lo w"], 2), ("a--b--c", ["--"], 1),
    ("go STay STOP now", ["STOP"], 4), ("Hello world", [], 5)])
def test_each_token_is_taken_once_with_the_text_it_belongs_to(text, stop, chunk):
    tokenizer = make_tokenizer()
    completion = Completion(decoder_of(tokenizer), [], stop)
    ids = tokenizer.encode(text)
    sent_text, sent_tokens = "", []
    for i in range(0, len(ids), chunk):
        completion.feed(ids[i:i + chunk], ["draft"] * len(ids[i:i + chunk]), [f"lp{j}" for j in range(i, i + chunk)])
        sent_text += completion.take()
        taken = completion.take_tokens()
        # a token goes out only once its whole text has
        assert all(completion.offsets[j] + len(completion.tokens[j]["text"]) <= len(sent_text) for j in taken)
        sent_tokens += taken
        if completion.stopped:
            break
    completion.finish()
    sent_text += completion.take()
    sent_tokens += completion.take_tokens()
    assert sent_tokens == list(range(completion.answered()))
    # the tokens sent show the text sent: the one that a stop string cut inside of, none wholly after the cut
    shown = "".join(completion.tokens[j]["text"] for j in sent_tokens)
    assert shown.startswith(sent_text) and len(shown) - len(sent_text) < max(map(len, stop), default=1)
    assert [completion.logprobs[j] for j in sent_tokens] == [f"lp{j}" for j in sent_tokens]


def stream_and_whole(completion_of, ids: list[int], chunk: int = 1) -> tuple[list[tuple[str, list[int]]], list[int]]:
    """(each chunk's text and the tokens taken with it, streamed; the tokens the same answer shows whole)."""
    streamed, whole = completion_of(), completion_of()
    chunks = []
    for i in range(0, len(ids), chunk):
        streamed.feed(ids[i:i + chunk], ["draft"] * len(ids[i:i + chunk]))
        chunks.append((streamed.take(), list(streamed.take_tokens())))
        if streamed.stopped:
            break
    streamed.finish()
    chunks.append((streamed.take(), list(streamed.take_tokens())))
    whole.feed(ids, ["draft"] * len(ids))
    whole.finish()
    return chunks, list(range(whole.answered()))


@pytest.mark.parametrize("stop", [["#"], []])
def test_a_token_without_text_goes_out_with_the_text_after_it(stop):
    """Found by an audit: special tokens (no text of their own) just before a stop string were streamed with their
    logprobs and not reported whole; a token without text now waits for the text after it, and where a stop string
    cuts right after it, it is not reported at all, as `answered` counts it."""
    tokenizer = make_tokenizer()
    specials = tokenizer.convert_tokens_to_ids(["<unk>", "<bos>"])
    ids = tokenizer.encode("z?") + specials + tokenizer.encode("#x") + specials
    chunks, whole = stream_and_whole(lambda: Completion(decoder_of(tokenizer), [], stop), ids)
    assert [token for _, taken in chunks for token in taken] == whole
    assert whole == ([0, 1] if stop else list(range(len(ids))))
    # the specials before "#" went out with it (no stop string), not in a chunk of their own
    assert all(text or not taken for text, taken in chunks[:-1])


@pytest.mark.parametrize("stop", [["é"], ["!"], []])
def test_a_characters_first_bytes_go_out_with_the_character(byte_tokenizer, stop):
    """The first byte of "é" has no text of its own (byte-level BPE): it goes out with the byte that completes the
    character, never in a chunk without text, and a stop string cutting at "é" reports neither byte."""
    ids = byte_tokenizer.encode("aé!é")
    chunks, whole = stream_and_whole(lambda: Completion(decoder_of(byte_tokenizer), [], stop), ids)
    assert [token for _, taken in chunks for token in taken] == whole
    assert all(text or not taken for text, taken in chunks)
    assert whole == {"é": [0], "!": [0, 1, 2], "": list(range(6))}["".join(stop)]


def test_token_bytes_of_a_byte_level_token_are_its_own(byte_tokenizer):
    ids = byte_tokenizer.encode("é!")
    assert [token_bytes(byte_tokenizer, i) for i in ids] == [b"\xc3", b"\xa9", b"!"]
    tokenizer = make_tokenizer()
    assert token_bytes(tokenizer, tokenizer.convert_tokens_to_ids("x")) == b"x"


@settings(max_examples=80, deadline=None)
@given(ids=st.lists(st.integers(0, 99), max_size=20))
def test_the_direct_decoder_gives_the_tokenizers_text(byte_tokenizer, ids):
    """text.decoder_of calls the Rust tokenizer directly: the same text as `decode` (specials skipped, no
    clean-up), also where a byte-level token ends inside a character."""
    from specdec import text

    for tokenizer in (byte_tokenizer, make_tokenizer()):
        assert text._generic_backend(tokenizer) is not None
        assert text.decoder_of(tokenizer)(ids) == decoder_of(tokenizer)(ids)  # this file's: through `decode`


def test_a_tokenizer_that_decodes_its_own_way_is_asked_through_its_decode():
    from specdec import text

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    base = make_tokenizer()
    shouting = Shouting(tokenizer_object=base.backend_tokenizer, unk_token="<unk>", eos_token="<eos>")
    ids = base.encode("abc", add_special_tokens=False)
    assert text._generic_backend(shouting) is None
    assert text.decoder_of(shouting)(ids) == "ABC" == decoder_of(shouting)(ids)
