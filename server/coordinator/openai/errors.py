"""OpenAI error objects as vLLM writes them (its ErrorResponse): `{"error": {"message", "type", "param",
"code"}}`, `code` the HTTP status as an integer, with that status.

400 bad field, 401 bad API key, 404 unknown model, 413 a body or prompt over its byte limit, 429 an
admission refusal (with Retry-After from the `retry-after-ms` hint), 503 no worker, 504 deadline; any
other failure a 500 error object, never a bare one. Every body is ASCII JSON, so a message that quotes a
client's string (a lone surrogate in a model name) still encodes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pdserve.server.coordinator.chat_template import ChatTemplateError
from pdserve.server.coordinator.json_input import JsonRefused, printable
from pdserve.server.coordinator.service import RequestFailed
from pdserve.server.coordinator.validate import InvalidRequest, TooLarge
from pdserve.server.serving import RETRY_HINT

log = logging.getLogger("pdserve.coordinator.http")

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "NotFoundError",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.type = type
        """The error's `type` (default: the status's, ERROR_TYPES)."""
        self.status = status
        self.message = message
        self.param = param
        self.counted = False
        """The request path counted it in pdserve_request_failure_total already."""
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type or ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        return AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: encodes whatever a message quotes (lone surrogates too)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def api_error(e: InvalidRequest | RequestFailed | ChatTemplateError) -> ApiError:
    """The OpenAI error for a refusal of the shared request path (or of the chat template)."""
    if isinstance(e, (InvalidRequest, ChatTemplateError)):
        message = str(e)
        error = ApiError(413 if isinstance(e, TooLarge) else 400, message, param=message.split(" ", 1)[0].split(":")[0] or None)
        error.counted = isinstance(e, InvalidRequest)
        return error
    status = HTTP_STATUS.get(e.code, 500)
    headers = {}
    retry_ms = dict(e.metadata).get(RETRY_HINT)
    if status == 429 and retry_ms is not None and retry_ms.isdigit():
        headers["Retry-After"] = str(max(1, math.ceil(int(retry_ms) / 1000)))
    error = ApiError(status, e.details, param="model" if status == 404 else None, headers=headers)
    error.counted = True
    return error


def error_of(e: Exception) -> ApiError:
    """The OpenAI error for a choice's failure."""
    if isinstance(e, (InvalidRequest, RequestFailed)):
        return api_error(e)
    log.error("request failed: %r", e, exc_info=e)
    return internal_error(e)


def internal_error(e: Exception) -> ApiError:
    return ApiError(500, f"internal error: {type(e).__name__}")


CLIENT_INPUT_ERRORS = (RecursionError, UnicodeError, OverflowError, JsonRefused)
"""What reading a client's input can raise that the field checks (json_input.py, convert.py) should have
caught first: a 400, never a 500."""


@contextlib.contextmanager
def client_input(field: str | None = None) -> Iterator[None]:
    """Around the code that reads a request (never the request path): CLIENT_INPUT_ERRORS become a 400
    naming `field` (logged: a check is missing); anything else stays a server error."""
    try:
        yield
    except JsonRefused as e:
        raise ApiError(400, str(e), param=e.field) from e
    except CLIENT_INPUT_ERRORS as e:
        log.warning("a request's input raised %r past the field checks", e)
        name = field or "body"
        raise ApiError(400, f"{name}: {type(e).__name__}: {printable(str(e))[:200]}", param=field) from e


def validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """A body pydantic refused: the first error as a sentence naming the field, and the field."""
    errors = e.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [printable(str(p)) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return f"{param or 'body'}: {first.get('msg', 'invalid')}", param
