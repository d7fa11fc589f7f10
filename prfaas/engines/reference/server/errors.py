"""OpenAI-style JSON errors for every HTTP failure: `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "request_cancelled",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
}


def json_error(status: int, message: str, *, code: str | None = None) -> web.Response:
    """An error response with the OpenAI error envelope."""
    body = {"error": {"message": message, "type": _TYPES.get(status, "error"), "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's HTTP exceptions and unexpected errors into JSON errors, never a
    traceback page."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(exc.status, exc.reason, code=str(exc.status))
    except Exception as exc:  # the last resort: the engine keeps serving
        request.app.logger.exception("unhandled error in %s", request.path)
        return json_error(500, f"internal error: {type(exc).__name__}", code="internal_error")
