"""OpenAI-style errors: one exception type, one JSON shape on the wire, for every HTTP server
in the project (the gateway, the reference engine, the null server).

The body is `{"error": {"message", "type", "param", "code"}}` with the matching status, or,
on Anthropic's routes (`/v1/messages`), Anthropic's `{"type": "error", "error": {"type",
"message"}}` (`Dialect`). Code that serves HTTP raises `APIError` (or `InvalidRequest`, a 400
that is also a `ValueError`) and renders its `encode()`, so no traceback ever reaches a client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import orjson

Dialect = Literal["openai", "anthropic"]
"""Whose error body a route answers with."""
ANTHROPIC_PATHS = "/v1/messages"
"""The prefix of Anthropic's routes."""

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "client_closed_request",
    500: "internal_error",
    501: "invalid_request_error",
    502: "engine_error",
    503: "service_unavailable",
    504: "engine_timeout",
}

_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
"""Anthropic's error types by status (any other 4xx is `invalid_request_error`, any other
5xx `api_error`)."""

# The codes of errors the HTTP servers raise themselves (framing, limits, timeouts, crashes).
_SERVER_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    431: "request_header_fields_too_large",
    500: "internal_error",
    501: "not_implemented",
    503: "shutting_down",  # a draining server's answer to requests it no longer runs
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
        self.code = code if code is not None else _SERVER_CODES.get(status, "error")
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "api_error")

    def body(self, dialect: Dialect = "openai") -> dict[str, object]:
        """The error object: OpenAI's, or Anthropic's (which has no param or code)."""
        if dialect == "anthropic":
            fallback = "invalid_request_error" if self.status < 500 else "api_error"
            kind = _ANTHROPIC_TYPES.get(self.status, fallback)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def encode(self, dialect: Dialect = "openai") -> bytes:
        """The JSON body."""
        return orjson.dumps(self.body(dialect))


def dialect_of(path: str) -> Dialect:
    """The error dialect of the route at `path`."""
    return "anthropic" if path.startswith(ANTHROPIC_PATHS) else "openai"


class InvalidRequest(APIError, ValueError):
    """A 400 for bad input; also a `ValueError`, so constructors that validate their fields
    (e.g. `SamplingParams`) raise the error a client should see."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(400, message, param=param, code=code)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 for bad input."""
    return InvalidRequest(message, param, code)
