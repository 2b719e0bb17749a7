"""auth.py through Flask's test client: API keys accepted, missing, wrong or in the wrong scheme; the open routes;
/metrics protected or public; /v1/ paths covered; keys never in logs or answers; the keys file checked at start-up;
the warning for a non-loopback address without keys."""

import logging

import pytest

from specdec.serve import create_app
from specdec.serve.auth import ApiKeys, is_loopback
from specdec.serve.config import ConfigError, load_settings, read_api_keys
from tests.support.models import make_app

pytestmark = pytest.mark.usefixtures("clean_env")

KEYS = ["sk-first-0123456789abcdef", "sk-second-fedcba9876543210"]
BODY = {"prompt": "Who is", "max_new_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# the service's keys\n\n  {KEYS[0]}  \n# {KEYS[0]}-retired\n{KEYS[1]}\n")
    return path


@pytest.fixture(scope="module")
def app(pair, keys_file):
    return make_app(pair, api_keys_file=str(keys_file))


@pytest.fixture(scope="module")
def public_metrics_app(pair, keys_file):
    return make_app(pair, api_keys_file=str(keys_file), metrics_public=True)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_unauthorized(response, invalid: bool):
    assert response.status_code == 401, response.get_data(as_text=True)
    assert response.mimetype == "application/json"
    assert response.get_json()["error"]["type"] == "unauthorized"
    assert set(response.get_json()["error"]) == {"type", "message", "field"}
    challenge = response.headers["WWW-Authenticate"]
    assert challenge.startswith("Bearer") and ('error="invalid_token"' in challenge) == invalid


@pytest.mark.parametrize("key", KEYS)
def test_every_key_in_the_file_is_accepted(client, key):
    response = client.post("/predict", json=BODY, headers=bearer(key))
    assert response.status_code == 200 and response.get_json()["usage"]["completion_tokens"] == 4


def test_the_scheme_is_case_insensitive(client):
    assert client.post("/predict", json=BODY, headers={"Authorization": f"bearer {KEYS[1]}"}).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": ""}, {"Authorization": "Bearer"},
                                     {"Authorization": "Bearer   "}, {"Authorization": f"Basic {KEYS[0]}"},
                                     {"Authorization": KEYS[0]}],
                         ids=["none", "empty", "no key", "blank key", "basic scheme", "no scheme"])
def test_a_missing_key_is_401(client, headers):
    assert_unauthorized(client.post("/predict", json=BODY, headers=headers), invalid=False)


@pytest.mark.parametrize("key", [KEYS[0][:-1], KEYS[0] + "0", KEYS[0].upper(), f"{KEYS[0]}-retired",
                                 "# the service's keys", KEYS[0] + "\xff"],
                         ids=["prefix", "longer", "other case", "commented out", "a comment line", "non-ASCII byte"])
def test_a_wrong_key_is_401(client, key):
    assert_unauthorized(client.post("/predict", json=BODY, headers=bearer(key)), invalid=True)


def test_the_key_is_checked_before_the_body(client):
    """An unauthenticated client learns nothing about the API: a bad body is 401, not 400 or 422."""
    assert_unauthorized(client.post("/predict", data="not json", content_type="application/json"), invalid=False)
    assert_unauthorized(client.get("/predict"), invalid=False)  # 405 with a key


@pytest.mark.parametrize("method, path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("GET", "/v1/models"), ("GET", "/v1/no-such-route"), ("GET", "/v1"),
                                          ("POST", "/tokenize"), ("POST", "/detokenize")])
def test_v1_paths_need_a_key_and_answer_in_openai_shape(client, method, path):
    for headers, invalid in (({}, False), (bearer("wrong"), True)):
        response = client.open(path, method=method, json={"model": "m", "prompt": "x"}, headers=headers)
        assert response.status_code == 401, response.get_data(as_text=True)
        error = response.get_json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert ('error="invalid_token"' in response.headers["WWW-Authenticate"]) == invalid


def test_v1_with_a_key_goes_on_to_the_route(client):
    assert client.get("/v1/models", headers=bearer(KEYS[1])).status_code == 200
    assert client.get("/v1/no-such-route", headers=bearer(KEYS[1])).status_code == 404


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/openapi.json"])
def test_probes_and_the_api_description_stay_open(client, path):
    assert client.get(path).status_code == 200
    assert client.get(path, headers=bearer("wrong")).status_code == 200


def test_metrics_are_protected_unless_public(client, public_metrics_app):
    assert_unauthorized(client.get("/metrics"), invalid=False)
    assert client.get("/metrics", headers=bearer(KEYS[0])).status_code == 200
    public = public_metrics_app.test_client()
    assert public.get("/metrics").status_code == 200
    assert_unauthorized(public.post("/predict", json=BODY), invalid=False)  # only /metrics is opened


def test_refusals_are_logged_and_counted_like_other_requests(client, caplog):
    with caplog.at_level(logging.INFO, logger="specdec.serve"):
        client.post("/predict", json=BODY, headers={"X-Request-ID": "no-key-1"})
    assert any("request_id=no-key-1 POST /predict status=401" in r.getMessage() and "error=unauthorized"
               in r.getMessage() for r in caplog.records)
    metrics = client.get("/metrics", headers=bearer(KEYS[0])).get_data(as_text=True)
    assert 'specdec_requests_total{endpoint="/predict",status="401"}' in metrics


def test_keys_never_reach_logs_or_answers(pair, keys_file, caplog):
    with caplog.at_level(logging.DEBUG):
        app = make_app(pair, api_keys_file=str(keys_file), log_level="debug")
        client = app.test_client()
        answers = [client.post("/predict", json=BODY, headers=bearer(key)).get_data(as_text=True)
                   for key in (KEYS[0], KEYS[1] + "x", "Bearer " + KEYS[0][:10])]
        answers.append(client.get("/openapi.json").get_data(as_text=True))
    logged = caplog.text + "".join(repr(r.args) for r in caplog.records)
    for key in KEYS:
        assert key not in logged and key[:10] not in logged
        assert not any(key in answer or key[:10] in answer for answer in answers)


def test_without_a_keys_file_nothing_is_asked(pair):
    client = make_app(pair).test_client()
    assert client.post("/predict", json=BODY).status_code == 200
    assert client.get("/metrics").status_code == 200


def test_the_api_description_names_the_scheme(client):
    document = client.get("/openapi.json").get_json()
    assert document["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert document["paths"]["/predict"]["post"]["security"] == [{"bearer": []}]
    assert "401" in document["paths"]["/predict"]["post"]["responses"]
    assert "security" not in document["paths"]["/healthz"]["get"]


# --- the keys file ---------------------------------------------------------------------------------------------

def test_the_file_is_read_as_keys_one_a_line(keys_file):
    assert read_api_keys(str(keys_file)) == tuple(KEYS)


def test_a_byte_order_mark_is_not_part_of_the_first_key(tmp_path):
    """Windows editors and PowerShell begin a UTF-8 file with a byte-order mark, which made the first key one no
    client could send (an audit)."""
    path = tmp_path / "keys"
    path.write_bytes(b"\xef\xbb\xbffirst-key\r\nsecond-key\r\n")
    assert read_api_keys(str(path)) == ("first-key", "second-key")


@pytest.mark.parametrize("content, problem", [(None, "does not exist"), ("", "holds no key"),
                                              ("# only\n\n   \n# comments\n", "holds no key"),
                                              (b"\xff\xfe\x00k", "not UTF-8"), ("dir", "cannot read")])
def test_a_bad_keys_file_stops_start_up(tmp_path, content, problem):
    path = tmp_path / "keys"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as raised:
        load_settings(environ={"SPECDEC_API_KEYS_FILE": str(path)})
    message = str(raised.value)
    assert problem in message and f"api_keys_file = '{path}' (from SPECDEC_API_KEYS_FILE)" in message
    with pytest.raises(ConfigError):  # and the factory refuses it too
        create_app({"api_keys_file": str(path), "loader": lambda settings: None})


def test_a_bad_keys_file_never_quotes_its_text(tmp_path):
    path = tmp_path / "keys"
    path.write_bytes(b"sk-secret-\xff\n")  # not UTF-8: the error says so without echoing the line
    with pytest.raises(ConfigError) as raised:
        read_api_keys(str(path))
    assert "sk-secret" not in str(raised.value)


def test_api_keys_match_exactly():
    keys = ApiKeys(["abc", "abcd", "ключ"])
    assert b"abc" in keys and b"abcd" in keys and "ключ".encode() in keys  # a UTF-8 key, sent as its bytes
    assert b"ab" not in keys and b"abcde" not in keys and b"ABC" not in keys and b"" not in keys


def test_a_non_ascii_key_sent_as_utf8_is_accepted(pair, tmp_path):
    path = tmp_path / "keys"
    path.write_text("ключ-1\n", encoding="utf-8")
    client = make_app(pair, api_keys_file=str(path)).test_client()
    wire = "ключ-1".encode().decode("latin-1")  # the header's bytes as WSGI hands them over
    assert client.post("/predict", json=BODY, headers=bearer(wire)).status_code == 200


# --- the start-up warning --------------------------------------------------------------------------------------

@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("::", False), ("10.0.0.5", False), ("example.com", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host, keys, warned", [("0.0.0.0", False, True), ("::", False, True),
                                                ("0.0.0.0", True, False), ("127.0.0.1", False, False)])
def test_one_warning_when_reachable_beyond_this_host_without_keys(pair, keys_file, caplog, host, keys, warned):
    overrides = {"host": host, **({"api_keys_file": str(keys_file)} if keys else {})}
    with caplog.at_level(logging.WARNING, logger="specdec.serve.auth"):
        make_app(pair, **overrides)
    warnings = [r for r in caplog.records if r.name == "specdec.serve.auth" and r.levelno == logging.WARNING]
    assert len(warnings) == int(warned)
    if warned:
        assert host in warnings[0].getMessage() and "without API keys" in warnings[0].getMessage()


# --- CORS (cors_allow_origins) -----------------------------------------------------------------------------------

UI = "https://ui.example.com"
PREFLIGHT = {"Origin": UI, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def cors_app(pair, keys_file):
    return make_app(pair, api_keys_file=str(keys_file), cors_allow_origins=f"{UI}, http://localhost:3000/")


def test_a_browser_page_of_an_allowed_origin_may_call_the_api_with_its_key(cors_app):
    """A browser client (a web UI, openai-node in a page) first asks with a preflight, which carries no key: it is
    answered without one; the request itself still needs its key, and its answers (errors too) carry the headers
    that let the page read them."""
    client = cors_app.test_client()
    for path in ("/predict", "/v1/chat/completions"):
        preflight = client.options(path, headers=PREFLIGHT)
        assert preflight.status_code == 200, preflight.get_data(as_text=True)
        assert preflight.headers["Access-Control-Allow-Origin"] == UI
        assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
        assert "authorization" in preflight.headers["Access-Control-Allow-Headers"].lower()
    answer = client.post("/predict", json=BODY, headers={"Origin": UI, **bearer(KEYS[0])})
    assert answer.status_code == 200 and answer.headers["Access-Control-Allow-Origin"] == UI
    assert "X-Request-ID" in answer.headers["Access-Control-Expose-Headers"]
    refused = client.post("/predict", json=BODY, headers={"Origin": UI})
    assert refused.status_code == 401 and refused.headers["Access-Control-Allow-Origin"] == UI
    local = client.post("/predict", json=BODY, headers={"Origin": "http://localhost:3000", **bearer(KEYS[1])})
    assert local.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"  # the trailing slash left out


def test_other_origins_and_a_server_without_cors_get_no_cors_headers(cors_app, app):
    client = cors_app.test_client()
    other = client.post("/predict", json=BODY, headers={"Origin": "https://evil.example.com", **bearer(KEYS[0])})
    assert "Access-Control-Allow-Origin" not in other.headers
    assert client.options("/predict", headers={**PREFLIGHT, "Origin": "https://evil.example.com"}).headers.get(
        "Access-Control-Allow-Origin") is None
    plain = app.test_client()  # cors_allow_origins unset (the default): no headers, and OPTIONS needs the key
    assert "Access-Control-Allow-Origin" not in plain.post("/predict", json=BODY,
                                                           headers={"Origin": UI, **bearer(KEYS[0])}).headers
    assert plain.options("/predict", headers=PREFLIGHT).status_code == 401


def test_any_origin_with_a_star(pair):
    client = make_app(pair, cors_allow_origins="*").test_client()
    answer = client.post("/predict", json=BODY, headers={"Origin": "https://anywhere.example"})
    assert answer.headers["Access-Control-Allow-Origin"] == "https://anywhere.example"  # reflected, with Vary
    assert "Origin" in answer.headers["Vary"]


@pytest.mark.parametrize("bad", ["ui.example.com", "https://ui.example.com/app", "ftp://x", "https://a b"])
def test_a_bad_origin_stops_start_up_naming_the_setting(bad):
    with pytest.raises(ConfigError, match="cors_allow_origins"):
        load_settings({"cors_allow_origins": bad})
