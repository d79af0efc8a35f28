"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Every refusal the gateway makes itself goes through here, so that a client
library sees the same shape whatever was wrong.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    411: "LengthRequiredError",
    413: "RequestTooLargeError",
    414: "URITooLongError",
    415: "UnsupportedMediaTypeError",
    417: "ExpectationFailedError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """OpenAI's error type for a status: a client error is never typed as the gateway's fault."""
    if status in _TYPES:
        return _TYPES[status]
    return (
        "BadRequestError"
        if 400 <= status < 500
        else "InternalServerError"
        if status < 502
        else "BadGatewayError"
    )


class RequestRejected(Exception):
    """A request refused before any route or engine call: its HTTP status, message and field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, kind: str = "", param: str | None = None) -> dict[str, Any]:
    kind = kind or error_type(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, kind: str = "", param: str | None = None, *, close: bool = False
) -> web.Response:
    """An error answer; `close` ends the connection, so that a body left unread is never drained."""
    response = web.json_response(error_body(status, message, kind, param), status=status)
    if close:
        response.force_close()
    return response


def rejection(exc: RequestRejected, *, close: bool = False) -> web.Response:
    return error_response(exc.status, exc.message, param=exc.param, close=close)
