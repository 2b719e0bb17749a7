"""Optional API keys: with `api_keys_file` set, every route but the open ones needs `Authorization: Bearer <key>`.

Open: /healthz and /readyz (probes), /openapi.json (the API's description), /metrics with `metrics_public`, and a
browser's CORS preflight (OPTIONS) where `cors_allow_origins` is set.
Everything else, /predict and any /v1/ route included, is checked by one before_request hook that raises the
service's ApiError (401, with `WWW-Authenticate`), so each route family's error handler answers in its own shape.
Keys are compared in constant time, as SHA-256 digests against every key; no key is ever logged or echoed.
"""

import hashlib
import hmac
import ipaddress
import logging

from flask import Flask, request

from .config import Settings, cors_origins, read_api_keys
from .errors import ApiError

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"})
REALM = 'Bearer realm="specdec"'


class ApiKeys:
    """The accepted keys (text, as the keys file holds them), kept only as SHA-256 digests of their UTF-8 bytes."""

    def __init__(self, keys):
        self._digests = [hashlib.sha256(key.encode("utf-8")).digest() for key in keys]

    def __contains__(self, sent: bytes) -> bool:
        """Whether `sent` (the key's bytes as they came over the wire) is one of the keys."""
        digest = hashlib.sha256(sent).digest()
        found = False
        for key in self._digests:  # every key, whatever matched: the time does not depend on which, or on lengths
            found |= hmac.compare_digest(digest, key)
        return found


def install(app: Flask, settings: Settings) -> None:
    """Register the key check on `app` when a keys file is configured; otherwise warn if the server is reachable
    beyond this host without one."""
    if not settings.api_keys_file.strip():
        if not is_loopback(settings.host):
            logger.warning("listening on %s without API keys: anyone who can reach the port can use the service "
                           "(set api_keys_file, SPECDEC_API_KEYS_FILE, to require keys)", settings.host)
        return
    keys = ApiKeys(read_api_keys(settings.api_keys_file))
    open_paths = OPEN_PATHS | ({"/metrics"} if settings.metrics_public else set())
    cors = bool(cors_origins(settings.cors_allow_origins))

    @app.before_request
    def require_api_key():
        if request.path in open_paths:
            return
        if cors and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return  # a browser's CORS preflight never carries the key; the request it asks about must
        scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
        sent = sent.strip()
        if scheme.lower() != "bearer" or not sent:
            raise ApiError(401, "unauthorized", "this server needs an API key: send Authorization: Bearer <key>",
                           headers={"WWW-Authenticate": REALM})
        if sent.encode("latin-1", "replace") not in keys:  # WSGI gives header bytes as latin-1 text
            raise ApiError(401, "unauthorized", "the API key is not valid",
                           headers={"WWW-Authenticate": f'{REALM}, error="invalid_token"'})


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only listens on this machine: 127.0.0.0/8, ::1 or localhost."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False
