"""The engine's HTTP errors: every failure is a JSON error in the route's dialect (OpenAI's,
or Anthropic's under `/v1/messages`: `prfaas.protocol.errors`), never a traceback page."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from prfaas.engines.reference.handoff.base import HandoffError
from prfaas.protocol.errors import APIError, Dialect, dialect_of


class HandoffFailed(APIError):
    """The request ended with an abort carrying a status code (e.g. 502: the KV hand-off
    failed)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(status, message, code="kv_handoff_failed")


def error_for(exc: Exception) -> APIError:
    """The client-facing error of an exception the engine raises on purpose; anything else
    is a bug and is re-raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, HandoffError):
        return APIError(502, f"KV hand-off failed: {exc}", code="kv_handoff_failed")
    raise exc


def json_error(error: APIError, dialect: Dialect = "openai") -> web.Response:
    """`error` as a response."""
    return web.Response(
        status=error.status,
        body=error.encode(dialect),
        content_type="application/json",
        headers=error.headers,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The engine's exceptions, aiohttp's HTTP exceptions and unexpected errors as JSON
    errors; the engine keeps serving."""
    dialect = dialect_of(request.path)
    try:
        return await handler(request)
    except (APIError, HandoffError) as exc:
        return json_error(error_for(exc), dialect)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return json_error(APIError(exc.status, exc.reason), dialect)
    except Exception as exc:  # the last resort
        request.app.logger.exception("unhandled error in %s", request.path)
        return json_error(APIError(500, f"internal error: {type(exc).__name__}"), dialect)
