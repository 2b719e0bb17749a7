"""Fill in the middle: /v1/completions' `suffix` on a model with fill-in-the-middle tokens becomes
<prefix> prompt <suffix> suffix <middle> (Qwen2.5-Coder's and StarCoder's order and names), and the completion is
what the target writes after it, exactly; a tokenizer without such tokens refuses a suffix naming it."""

import pytest

from specdec import SpeculativeDecoder
from specdec.errors import SpecDecError
from specdec.text import encode_infill, fim_token_ids
from tests.support.models import make_app, make_model, make_tokenizer, perturbed_copy

pytestmark = [pytest.mark.usefixtures("clean_env"), pytest.mark.xdist_group("openai")]

QWEN = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return c\n"


@pytest.fixture(scope="module")
def pair():
    tokenizer = make_tokenizer(QWEN)  # ids 100, 101, 102
    target = make_model("llama", seed=0, initializer_range=0.1, vocab_size=len(tokenizer),
                        eos_token_id=tokenizer.convert_tokens_to_ids("<eos>"))
    return perturbed_copy(target, noise=0.3), target, tokenizer


@pytest.fixture(scope="module")
def client(pair):
    return make_app(pair).test_client()


def served(client) -> str:
    return client.get("/v1/models").get_json()["data"][0]["id"]


def complete(client, **body):
    response = client.post("/v1/completions", json={"model": served(client), "temperature": 0, "max_tokens": 16,
                                                    **body})
    assert response.status_code == 200, response.get_data(as_text=True)
    return response.get_json()


def test_the_infill_prompt_is_prefix_suffix_middle():
    tokenizer = make_tokenizer(QWEN)
    ids = encode_infill(tokenizer, "ab", "c")
    assert ids == [100, *tokenizer.encode("ab", add_special_tokens=False), 101,
                   *tokenizer.encode("c", add_special_tokens=False), 102]
    assert encode_infill(tokenizer, [7, 8], "") == [100, 7, 8, 101, 102]  # token ids as the prefix
    assert fim_token_ids(make_tokenizer(("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))) == (100, 101, 102)
    with pytest.raises(SpecDecError) as error:
        encode_infill(make_tokenizer(), "ab", "c")
    assert error.value.field == "suffix"


def test_a_suffix_completes_the_middle_as_the_target_would(client, pair):
    draft, target, tokenizer = pair
    body = complete(client, prompt=PREFIX, suffix=SUFFIX)
    ids = encode_infill(tokenizer, PREFIX, SUFFIX)
    assert body["usage"]["prompt_tokens"] == len(ids) == len(PREFIX) + len(SUFFIX) + 3
    expected = SpeculativeDecoder(draft, target, tokenizer).generate(ids, max_new_tokens=16, method="target",
                                                                     temperature=0)
    assert body["choices"][0]["text"] == tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    plain = complete(client, prompt=PREFIX)
    assert plain["choices"][0]["text"] != body["choices"][0]["text"]  # the suffix changed the answer
    as_ids = complete(client, prompt=tokenizer.encode(PREFIX, add_special_tokens=False), suffix=SUFFIX)
    assert as_ids["choices"][0]["text"] == body["choices"][0]["text"]
    several = complete(client, prompt=[PREFIX, "x = "], suffix=SUFFIX)
    assert several["choices"][0]["text"] == body["choices"][0]["text"]
    assert several["usage"]["prompt_tokens"] == len(ids) + len("x = ") + len(SUFFIX) + 3
    empty = complete(client, prompt=PREFIX, suffix="")  # an empty suffix: a plain completion
    assert empty["choices"][0]["text"] == plain["choices"][0]["text"]


def test_a_suffix_with_token_ids_outside_the_vocabulary_is_refused(client):
    response = client.post("/v1/completions", json={"model": served(client), "prompt": [5, 500],
                                                    "suffix": "x"})
    assert response.status_code == 400 and response.get_json()["error"]["param"] == "prompt"
