"""`create_app`: the Flask application factory (gunicorn calls it in its worker; tests call it directly).

Settings come from config/default.toml < $SPECDEC_CONFIG < SPECDEC_* variables < `config`. The factory
registers the routes' Blueprints (/predict and the rest; the OpenAI-compatible /v1), the per-request record
(request id, one log line, metrics), the API key check (auth.py) and the one error handler, then starts loading
the pair in the background.
"""

import re
import uuid
from collections.abc import Mapping

from flask import Flask, g, jsonify, request
from flask_cors import CORS

from . import auth
from .config import cors_origins, load_settings
from .errors import to_api_error
from .openai_protocol import is_openai_path, openai_error
from .openai_routes import openai_routes
from .routes import routes
from .service import RequestRecord, Service
from .tokenizer_routes import tokenizer_routes

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def create_app(config: Mapping | None = None) -> Flask:
    """The application. `config` overrides settings (see config.py), e.g. {"loader": fn} in tests."""
    settings = load_settings(config)
    app = Flask(__name__)
    # one byte of slack: werkzeug stops a chunked body at the limit without saying so; protocol.py checks it
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes + 1
    app.json.sort_keys = False
    app.json.ensure_ascii = False
    # a doubled slash (/v1//completions) is no route: a JSON 404, not werkzeug's HTML redirect to the merged path
    app.url_map.merge_slashes = False
    service = Service(settings)
    app.extensions["specdec"] = service

    @app.before_request
    def start_record():
        sent = request.headers.get("X-Request-ID", "")
        g.record = RequestRecord(sent if REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex)

    auth.install(app, settings)  # after start_record: a refused request is logged like any other
    if origins := cors_origins(settings.cors_allow_origins):  # browser pages of these origins may call the API
        CORS(app, origins=origins, expose_headers=["X-Request-ID", "Retry-After"], max_age=600)

    @app.after_request
    def finish_record(response):
        record = g.record
        record.status = response.status_code
        if request.url_rule is not None:
            record.endpoint = request.url_rule.rule
        elif response.status_code == 405:  # a known path, labelled by its route's pattern: the label set stays bounded
            record.endpoint = _route_of(app, request)
        record.route = f"{request.method} {request.path}"
        response.headers["X-Request-ID"] = record.request_id
        if response.is_streamed:
            response.call_on_close(lambda: service.finish(record))
        else:
            service.finish(record)
        return response

    @app.errorhandler(Exception)
    def error_response(error):
        record = g.get("record")
        api_error = to_api_error(error, record.request_id if record else None)
        if record:
            record.error = api_error.type
        if is_openai_path(request.path):  # OpenAI's shape, so its clients read the error (and retry a 503)
            body, status = openai_error(api_error)
            return jsonify(body), status, api_error.headers
        return jsonify(api_error.body()), api_error.status, api_error.headers

    app.register_blueprint(routes)
    app.register_blueprint(openai_routes)
    app.register_blueprint(tokenizer_routes)
    service.start_loading()
    return app


def _route_of(app: Flask, req) -> str:
    """The pattern of the route a request's path matched with another method (a 405): /v1/models/<path:model>
    for any model's path, never the path itself, which a client chooses."""
    allowed = getattr(req.routing_exception, "valid_methods", None) or []
    try:
        rule, _ = app.url_map.bind_to_environ(req.environ).match(method=allowed[0], return_rule=True)
        return rule.rule
    except Exception:  # noqa: BLE001 - no route after all
        return "unmatched"
