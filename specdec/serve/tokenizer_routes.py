"""vLLM's /tokenize and /detokenize: the served tokenizer, as the generation routes use it, for clients that count
tokens or check what a prompt becomes (agents, editors, evaluation harnesses). Errors take OpenAI's shape."""

from flask import Blueprint, current_app, g, request

from .openai_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, parse
from .openai_routes import check_model
from .protocol import read_json_object

tokenizer_routes = Blueprint("tokenizer", __name__)


def _request(model):
    svc = current_app.extensions["specdec"]
    req = parse(model, read_json_object(request, svc.settings.max_body_bytes, svc.settings.body_timeout))
    if req.model is None:
        svc.require_ready(g.record.started)
    else:
        check_model(svc, req.model)
    return svc, req


@tokenizer_routes.post("/tokenize")
def tokenize():
    svc, req = _request(TokenizeRequest)
    ids = svc.tokenize(**req.encoding())
    strings = svc.token_strings(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=svc.decoder.context_length, tokens=ids,
                            token_strs=strings).model_dump()


@tokenizer_routes.post("/detokenize")
def detokenize():
    svc, req = _request(DetokenizeRequest)
    return DetokenizeResponse(prompt=svc.detokenize(svc.check_vocabulary(req.tokens, "tokens"))).model_dump()
