"""`GET /dashboard`: the live dashboard, one page served from files inside the package
(`static/`: HTML, a hand-written script with its own small SVG charts, a style sheet; no CDN,
no build step). The page polls `GET /admin/dashboard` (in `app.py`, behind the admin check)
once a second; this module serves the files and parses that route's `since` cursor.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from prfaas.http.messages import Exchange, HttpRequest, HttpResponse
from prfaas.protocol.errors import invalid

if TYPE_CHECKING:
    from prfaas.gateway.api.assembly import Gateway

PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    # Everything comes from the gateway itself: nothing inline, nothing from elsewhere.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
}
FILES = {
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
Page = Callable[["Gateway", HttpRequest, Exchange], Awaitable[HttpResponse]]


@functools.cache
def static_file(name: str) -> bytes:
    """A file of `static/`, read once."""
    return (importlib.resources.files("prfaas.gateway.api") / "static" / name).read_bytes()


def _page(name: str, content_type: str) -> Page:
    async def serve(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        return HttpResponse(200, static_file(name), content_type, PAGE_HEADERS)

    return serve


DASHBOARD_PAGES: dict[str, Page] = {path: _page(*file) for path, file in FILES.items()}
"""Path -> handler of each file the page is made of."""


def since_query(query: str) -> float | None:
    """The `since` cursor of `/admin/dashboard?since=T` (a loop-clock time), or None.

    Raises:
        APIError(400): `since` is not a finite number.
    """
    values = parse_qs(query).get("since")
    if not values:
        return None
    try:
        since = float(values[-1])
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        raise invalid(f"'since' must be a finite number, got {values[-1]!r}", "since")
    return since
