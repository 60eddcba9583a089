"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

400 bad field, 401 bad API key, 404 unknown model, 413 a body or prompt over its byte limit, 429 an
admission refusal (with Retry-After from the `retry-after-ms` hint), 503 no worker, 504 deadline; any
other failure a 500 error object, never a bare one.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pdserve.server.coordinator.chat_template import ChatTemplateError
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
    404: "invalid_request_error",
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
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.counted = False
        """The request path counted it in pdserve_request_failure_total already."""
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
    error = ApiError(status, e.details, code=e.code.name.lower(), headers=headers)
    error.counted = True
    return error


def error_of(e: Exception) -> ApiError:
    """The OpenAI error for a choice's failure."""
    if isinstance(e, (InvalidRequest, RequestFailed)):
        return api_error(e)
    log.error("request failed: %r", e, exc_info=e)
    return internal_error(e)


def internal_error(e: Exception) -> ApiError:
    return ApiError(500, f"internal error: {type(e).__name__}", code="internal_error")


def validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """A body pydantic refused: the first error as a sentence naming the field, and the field."""
    errors = e.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return f"{param or 'body'}: {first.get('msg', 'invalid')}", param
