"""The routes of the service, as one Blueprint: health, readiness, metrics, the OpenAPI document, /predict."""

from flask import Blueprint, Response, current_app, g, request

from .openapi import openapi_document
from .protocol import parse_predict, read_json_object

routes = Blueprint("specdec", __name__)


def service():
    return current_app.extensions["specdec"]


@routes.get("/healthz")
def healthz():
    return {"status": "ok"}


@routes.get("/readyz")
def readyz():
    service().require_ready()
    return {"status": "ready", **service().models.info}


@routes.get("/metrics")
def metrics():
    body, content_type = service().metrics.render()
    return Response(body, content_type=content_type)


@routes.get("/openapi.json")
def openapi():
    svc = service()
    decoder = svc.decoder  # None while the models load: the token ids' bound is then not known
    return openapi_document(svc.settings, svc.models.info.get("models", {}).get("target"),
                            decoder.vocab_size if decoder is not None else None)


@routes.post("/predict")
def predict():
    svc = service()
    body = read_json_object(request, svc.settings.max_body_bytes, svc.settings.body_timeout)
    params = parse_predict(body, svc.settings)
    svc.require_ready(g.record.started)
    grammar = svc.grammar(params.constraint)
    prompt_ids = svc.encode(params.prompt, chat=params.chat, max_new_tokens=params.sampling.max_new_tokens)
    generation = svc.generation(prompt_ids, params.sampling, g.record, params.stop, params.details,
                                grammar=grammar)
    return svc.respond(generation, params.stream, large=params.sampling.logprobs is not None)
