"""The aiohttp application: OpenAI API, health, metrics, admin state.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text), `GET /admin/state`, `POST /admin/state` (set `threshold`
and/or `regime`). The app owns one `ClientSession` and the `Gateway` through its cleanup
context, so every background task stops with the app.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from prfaas.gateway.config import DeploymentConfig
from prfaas.gateway.errors import invalid, method_not_allowed, not_found, with_json_errors
from prfaas.gateway.gateway import Gateway, build_gateway
from prfaas.gateway.openai_request import load_json

GATEWAY = web.AppKey("gateway", Gateway)
CONFIG = web.AppKey("config", DeploymentConfig)
SESSION_LIMIT = 0  # no cap on pooled connections: admission bounds concurrency


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


async def completions(request: web.Request) -> web.StreamResponse:
    return await gateway_of(request).service.handle(request, "completions")


async def chat(request: web.Request) -> web.StreamResponse:
    return await gateway_of(request).service.handle(request, "chat")


async def models(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    gw.service.check_auth(request)
    model = {
        "id": gw.config.model.name,
        "object": "model",
        "created": 0,
        "owned_by": "prfaas",
        "max_model_len": gw.config.model.context_length,
    }
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    roles = {(s.cluster, s.role) for s in gw.instances if s.healthy}
    ok = any(c == "pd" and r in ("decode", "both") for c, r in roles)
    body = {"status": "ok" if ok else "degraded", "healthy_instances": len(roles)}
    return web.json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    text = gw.metrics.render(gw.gauges())
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def admin_state(request: web.Request) -> web.Response:
    gw = gateway_of(request)
    gw.service.check_auth(request)
    return web.json_response({**gw.admin_state(), "time": time.time()})


async def set_admin_state(request: web.Request) -> web.Response:
    """Move the threshold or regime by hand (what the short-term scheduler will do)."""
    gw = gateway_of(request)
    gw.service.check_auth(request)
    body = load_json(await request.read())
    threshold, regime = body.get("threshold"), body.get("regime")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or threshold < 0:
            raise invalid(f"'threshold' must be a number >= 0, got {threshold!r}", "threshold")
        gw.router.state.threshold = float(threshold)
    if regime is not None:
        if regime not in ("bandwidth_scarce", "bandwidth_abundant"):
            raise invalid(f"'regime' must be bandwidth_scarce|bandwidth_abundant: {regime!r}")
        gw.router.state.regime = regime
    return web.json_response(gw.admin_state())


def _gateway_ctx(
    config: DeploymentConfig, setup: Callable[[Gateway], Awaitable[None]] | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=SESSION_LIMIT, ttl_dns_cache=300)
        # No cookie jar, no decompression: engine calls need neither, and both cost per call.
        session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False
        )
        async with session:
            gateway = build_gateway(config, session)
            if setup is not None:
                await setup(gateway)
            app[GATEWAY] = gateway
            await gateway.start()
            try:
                yield
            finally:
                await gateway.stop()

    return ctx


def create_app(
    config: DeploymentConfig, setup: Callable[[Gateway], Awaitable[None]] | None = None
) -> web.Application:
    """The gateway's aiohttp application (serve it with `handler_cancellation=True` so a
    client disconnect aborts the request on the engines). `setup` runs on the built
    gateway before it starts (e.g. to attach link telemetry)."""
    app = web.Application(client_max_size=config.gateway.max_body_bytes)
    app[CONFIG] = config
    app.cleanup_ctx.append(_gateway_ctx(config, setup))
    _add_routes(app)
    return app


def _add_routes(app: web.Application) -> None:
    """Every route wrapped in `with_json_errors`; JSON 405s and 404s from catch-all routes
    (no middleware: it would cost every request its wrapper chain)."""
    routes: dict[str, dict[str, Handler]] = {
        "/v1/completions": {"POST": completions},
        "/v1/chat/completions": {"POST": chat},
        "/v1/models": {"GET": models},
        "/health": {"GET": health},
        "/metrics": {"GET": metrics},
        "/admin/state": {"GET": admin_state, "POST": set_admin_state},
    }
    for path, methods in routes.items():
        for method, handler in methods.items():
            if method == "GET":
                app.router.add_get(path, with_json_errors(handler))  # and HEAD
            else:
                app.router.add_route(method, path, with_json_errors(handler))
        app.router.add_route("*", path, method_not_allowed)
    app.router.add_route("*", "/{tail:.*}", not_found)  # last: any other path
