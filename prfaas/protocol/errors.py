"""OpenAI-style errors: one exception type for the request path, one JSON shape on the wire.

Every HTTP error the gateway returns is `{"error": {"message", "type", "param", "code"}}`
with the matching status: route handlers raise `APIError`, and the HTTP server renders its
own protocol errors (malformed request, body or head too large, timeout, a handler that
crashed) through `error_response`, so no traceback ever reaches a client.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from prfaas.http.server import HttpResponse

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    501: "invalid_request_error",
    502: "engine_error",
    503: "service_unavailable",
    504: "engine_timeout",
}


class APIError(Exception):
    """A request failed in a way the client should hear about, with status and details."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")

    def body(self) -> dict[str, object]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> HttpResponse:
        return HttpResponse(self.status, orjson.dumps(self.body()), headers=self.headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 for bad input."""
    return APIError(400, message, param=param, code=code)


_SERVER_CODES = {
    400: "invalid_request",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_header_fields_too_large",
    500: "internal_error",
    501: "not_implemented",
}


def error_response(status: int, message: str) -> HttpResponse:
    """The HTTP server's own errors (bad framing, limits, timeouts, a crashed handler)."""
    return APIError(status, message, code=_SERVER_CODES.get(status, "http_error")).response()
