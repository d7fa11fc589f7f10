"""OpenAI-style errors: one exception type for the request path, one JSON shape on the wire.

Every HTTP error the gateway returns is `{"error": {"message", "type", "param", "code"}}`
with the matching status; `json_errors` turns aiohttp's own HTTP exceptions and anything
unexpected into that shape, so no traceback ever reaches a client. The gateway applies it
per route (`with_json_errors`), not as a middleware: aiohttp's middleware chain costs every
request a few wrappers, and the gateway's added latency is measured in tens of us.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

logger = logging.getLogger(__name__)

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
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

    def response(self, extra_headers: Mapping[str, str] | None = None) -> web.Response:
        headers = {**self.headers, **(extra_headers or {})}
        return web.Response(
            status=self.status,
            body=orjson.dumps(self.body()),
            content_type="application/json",
            headers=headers,
        )


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """A 400 for bad input."""
    return APIError(400, message, param=param, code=code)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render `APIError`, aiohttp HTTP errors and unexpected exceptions as OpenAI JSON."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http(exc, request).response()
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return APIError(500, "internal error", code="internal_error").response()


def _from_http(exc: web.HTTPException, request: web.Request) -> APIError:
    if exc.status == 413:
        return APIError(413, f"request body too large: {exc.text}", code="request_too_large")
    if exc.status == 404:
        return APIError(404, f"no route {request.method} {request.path}", code="not_found")
    if exc.status == 405:
        return APIError(
            405, f"method {request.method} not allowed on {request.path}", code="method_not_allowed"
        )
    return APIError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))


def with_json_errors(handler: Handler) -> Handler:
    """`handler` wrapped in `json_errors` (for routes registered without middleware)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        return await json_errors(request, handler)

    return wrapped


async def method_not_allowed(request: web.Request) -> web.StreamResponse:
    """A catch-all route of a known path: the JSON 405."""
    return _from_http(web.HTTPMethodNotAllowed(request.method, ()), request).response()


async def not_found(request: web.Request) -> web.StreamResponse:
    """The catch-all route of every unknown path: the JSON 404."""
    return _from_http(web.HTTPNotFound(), request).response()
