"""Requests drawn from the service's own /openapi.json by schemathesis, checked against it: shared by the fuzz
tests of /predict and the tokenizer routes (test_fuzz.py) and of the /v1 routes (test_openai.py)."""

from collections.abc import Callable

from hypothesis import given, reject


def check_against_the_document(operation, mode: str, stated: Callable[[dict], bool], drawn) -> list[int]:
    """Cases of `operation` drawn in `mode` under the hypothesis settings `drawn`: valid ones ("positive") must
    get 200, except those `stated` refuses (what the document cannot state, left out), invalid ones ("negative")
    a 4xx; every answer must match the document (schemathesis's checks: no 5xx, a documented status, its schemas).
    The statuses answered."""
    import schemathesis

    statuses = []

    @drawn
    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    def check(case):
        if mode == "positive" and isinstance(case.body, dict) and not stated(case.body):
            reject()
        response = case.call()
        statuses.append(response.status_code)
        case.validate_response(response)
        assert (response.status_code == 200) == (mode == "positive"), response.text[:500]

    check()
    return statuses
