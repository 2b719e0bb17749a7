"""Error answers: ApiError (status, stable type, message, field) and the mapping of any exception onto one.

Every error leaves the service through one handler as `{"error": {"type", "message", "field"}}`; nothing
unexpected reaches a client as a traceback, and the request id in the message finds the log line.
"""

import gc
import logging

import torch
from flask import current_app, request
from werkzeug.exceptions import HTTPException

from ..errors import SpecDecError

logger = logging.getLogger(__name__)

HTTP_ERROR_TYPES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
                    415: "unsupported_media_type"}
ENGINE_FIELDS = {"input_ids": "prompt"}  # engine argument -> request field
# the headers of an answer that leaves the request's body unread (408, 413): the connection cannot go on (the server
# would wait for the rest of the body, and the client's next request there would be lost; RFC 9110, 15.5.9)
CLOSE = {"Connection": "close"}
ERROR_TYPES = ["invalid_json", "not_found", "method_not_allowed", "body_too_large", "unsupported_media_type",
               "invalid_field", "prompt_too_long", "overloaded", "not_ready", "internal_error", "bad_request",
               "unauthorized", "body_timeout", "shutting_down", "client_gone"]


class ApiError(Exception):
    """An error answer: HTTP status, a stable `type`, a human message, the offending field (if any)."""

    def __init__(self, status: int, type: str, message: str, field: str | None = None,
                 headers: dict | None = None):
        message, field = printable(message), None if field is None else printable(field)
        super().__init__(message)
        self.status, self.type, self.message, self.field = status, type, message, field
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"type": self.type, "message": self.message, "field": self.field}}


def printable(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate echoed from a request becomes a visible escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def to_api_error(error: Exception, request_id: str | None) -> ApiError:
    """Any exception as the ApiError to answer with; unexpected ones are logged with the request id."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, SpecDecError):
        return ApiError(422, "invalid_field", error.message, ENGINE_FIELDS.get(error.field, error.field))
    if isinstance(error, HTTPException) and error.code and error.code < 500:
        if error.code == 404:
            message = f"no such route: {request.path}"
        elif error.code == 405:
            message = f"{request.method} is not allowed on {request.path}"
        elif error.code == 413:
            message = f"the request body is over the limit of {current_app.config['MAX_CONTENT_LENGTH'] - 1} bytes"
        else:
            message = error.description
        headers = {k: v for k, v in error.get_headers() if k.lower() == "allow"}
        if error.code == 413:  # the body was left unread
            headers |= CLOSE
        return ApiError(error.code, HTTP_ERROR_TYPES.get(error.code, "bad_request"), message, headers=headers)
    request_id = request_id or "-"
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        logger.error("request_id=%s ran out of memory", request_id, exc_info=error)
        release_memory()
        return ApiError(500, "internal_error", f"the server ran out of memory for this request; quote request id "
                                               f"{request_id} when reporting it")
    logger.error("request_id=%s failed with an unexpected error", request_id, exc_info=error)
    return ApiError(500, "internal_error", f"internal error; quote request id {request_id} when reporting it")


def release_memory() -> None:
    """After an out-of-memory error: free what the failed request held, so the next one starts clean."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
