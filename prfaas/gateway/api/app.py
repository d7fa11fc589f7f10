"""The gateway's HTTP application on `HttpServer`: the OpenAI and Anthropic APIs, health,
metrics, admin state.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/messages` (Anthropic),
`POST /v1/responses` (OpenAI Responses) with `GET|DELETE /v1/responses/{id}` and `POST
/v1/responses/{id}/cancel` (`responses_routes.py`), `GET /v1/models`, the engine server's
utility routes (`utility_routes.py`: `/tokenize`, `/detokenize`, `/version`, `/ping`,
`POST /v1/messages/count_tokens`), `GET /openapi.json` (what is served, `openapi.py`), `GET
/health`, `GET /metrics` (Prometheus text), `GET /admin/state`, `POST /admin/state` (set
`threshold` and/or `regime`: with schedulers running this pins them until `{"scheduler":
"auto"}`; without schedulers `roles` converts PD instances by hand), `GET /dashboard` (the
live page and its script and style) and `GET /admin/dashboard` (the data it polls); `HEAD`
wherever `GET` is. Unknown paths get a JSON 404, known paths with another method a JSON 405
with `Allow`. Every error is a JSON body in the route's own dialect: Anthropic's under
`/v1/messages`, OpenAI's elsewhere.
`GatewayApp` owns the one engine `ClientSession`, the `Gateway` and the server: `start`
brings them up in that order, `stop` takes them down in reverse, so every background task
stops with the app.

Who may call what: clients' API keys (`api_keys`) open the OpenAI routes; `/admin/*` takes
only an operator key (`admin_keys`, never a client's). Without operator keys the `GET`
admin routes are open (read-only, like `/metrics`) and every admin write is refused (403).
Request bodies are bounded by what could fit the context (`max_body_bytes` of the model
limits), so an oversized one is refused from its `Content-Length` before it is read.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from prfaas.common.secret import DeploymentSecret, token_matches
from prfaas.engine_clients.base import Role
from prfaas.gateway.api import openapi, responses_routes
from prfaas.gateway.api.assembly import Gateway, build_gateway
from prfaas.gateway.api.dashboard import DASHBOARD_PAGES, since_query
from prfaas.gateway.api.utility_routes import count_tokens, detokenize, ping, tokenize, version
from prfaas.gateway.deployment import DeploymentConfig
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.roles import RoleConverter, asked_conversions
from prfaas.http.messages import Exchange, HttpRequest, HttpResponse
from prfaas.http.server import HttpLimits, HttpServer
from prfaas.policies.profile import DeploymentProfile
from prfaas.protocol.errors import APIError, dialect_of, invalid
from prfaas.protocol.openai_request import ModelLimits, load_json, max_body_bytes

SESSION_LIMIT = 0  # no cap on pooled connections: admission bounds concurrency
Route = Callable[[Gateway, HttpRequest, Exchange], Awaitable[HttpResponse | None]]


def _json(obj: object, status: int = 200) -> HttpResponse:
    return HttpResponse(status, orjson.dumps(obj))


def error_response(exc: APIError, path: str = "") -> HttpResponse:
    """An `APIError` as its HTTP response, in the dialect of the route at `path`."""
    return HttpResponse(exc.status, exc.encode(dialect_of(path)), headers=exc.headers)


def server_error(status: int, message: str, path: str = "") -> HttpResponse:
    """The HTTP server's own errors (bad framing, limits, timeouts, a crashed handler), in
    the dialect of the route the request was for."""
    return error_response(APIError(status, message), path)


async def completions(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
    return await gw.service.handle(request, exchange, "completions")


async def chat(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
    return await gw.service.handle(request, exchange, "chat")


async def messages(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
    return await gw.service.handle(request, exchange, "messages")


async def responses(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
    return await gw.service.handle(request, exchange, "responses")


async def models(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    gw.service.check_auth(request)
    model = {
        "id": gw.config.model.name,
        "object": "model",
        "created": 0,
        "owned_by": "prfaas",
        "max_model_len": gw.config.model.context_length,
    }
    return _json({"object": "list", "data": [model]})


async def health(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    roles = {(s.cluster, s.role) for s in gw.instances if s.healthy}
    ok = any(c == "pd" and r in ("decode", "both") for c, r in roles)
    body = {"status": "ok" if ok else "degraded", "healthy_instances": len(roles)}
    return _json(body, 200 if ok else 503)


async def metrics(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    return HttpResponse(200, gw.metrics.render(), CONTENT_TYPE_LATEST)


def check_admin(gw: Gateway, request: HttpRequest, *, write: bool) -> None:
    """Raises APIError unless the request carries an operator key (401), or, with none
    configured, unless it only reads (403 for writes)."""
    keys = gw.config.gateway.admin_keys
    if not keys:
        if write:
            raise APIError(403, "admin writes are disabled: configure an operator key "
                           "(admin_keys, --admin-key)", code="admin_disabled")  # fmt: skip
        return
    header = request.headers.get("authorization")
    if not any(token_matches(header, key) for key in keys):
        raise APIError(401, "/admin needs an operator key", code="invalid_admin_key")


async def admin_state(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    check_admin(gw, request, write=False)
    return _json({**gw.admin_state(), "time": time.time()})


ADMIN_FIELDS = frozenset({"threshold", "regime", "scheduler", "roles"})


def _threshold(value: Any, limit: int) -> float:
    """A threshold in [1, context length] tokens: finite, and one that can route a prompt
    either way (0 would send every prompt with one uncached token to PrfaaS)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and 1 <= value <= limit):
        raise invalid(f"'threshold' must be a number in [1, {limit}], got {value!r}", "threshold")
    return float(value)


async def set_admin_state(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    """Move the threshold or regime by hand. With schedulers running, that pins them (the
    loops stop moving them) until `{"scheduler": "auto"}` hands them back. Without
    schedulers, `roles` (`{instance: "prefill" | "decode"}`) converts PD instances as the
    long-term loop would (drain, then the engine's role API), answering once they are done:
    a 502 names any that failed (each keeps the role its engine reports; a threshold or
    regime in the same body is set first and stays). One conversion by hand at a time (409
    while an instance drains), and none on replicas (each would check the roles alone). A
    client that leaves mid-drain ends the gateway's wait, not the engine's switch: the
    gateway takes the engine's role at its next health probe. Every value is checked
    before anything changes."""
    check_admin(gw, request, write=True)
    body = load_json(request.body)
    unknown = sorted(set(body) - ADMIN_FIELDS)
    if unknown or not body:
        raise invalid(
            f"set 'threshold', 'regime', 'scheduler' and/or 'roles'; unknown: {unknown}",
            unknown[0] if unknown else None,
        )
    if "roles" in body and gw.scheduler is not None:
        raise APIError(409, "the long-term scheduler converts this gateway's roles; convert "
                       "by hand only without it (--no-scheduler)", code="scheduler_owns_roles",
                       param="roles")  # fmt: skip
    if "roles" in body and gw.config.coordination is not None:
        raise APIError(409, "gateway replicas convert roles through the leader's scheduler "
                       "only", code="scheduler_owns_roles", param="roles")  # fmt: skip
    moves = [] if "roles" not in body else _asked_moves(gw, body["roles"])
    threshold, regime = body.get("threshold"), body.get("regime")
    t = None if threshold is None else _threshold(threshold, gw.config.model.context_length)
    if regime is not None and regime not in ("bandwidth_scarce", "bandwidth_abundant"):
        raise invalid(f"'regime' must be bandwidth_scarce|bandwidth_abundant: {regime!r}", "regime")
    state, by_hand = gw.router.state, "set by hand (POST /admin/state)"
    mode = body.get("scheduler")
    if mode not in (None, "auto"):
        raise invalid(f"'scheduler' may only be \"auto\" (hand t back), got {mode!r}")
    scheduler = gw.scheduler
    if scheduler is not None and not scheduler.leading:  # another replica decides
        leader = None if gw.coordinator is None else gw.coordinator.leadership.leader
        raise APIError(
            409,
            f"this gateway follows the leader {leader}: set the schedule there",
            code="not_leader",
        )
    if scheduler is not None:  # its decision board reports the change to the dashboard
        if t is not None or regime is not None:
            scheduler.pin(threshold=t, regime=regime)
        if mode == "auto":
            scheduler.release()
    else:
        if t is not None:
            gw.activity.decision("threshold", by_hand, state.threshold, t)
            state.threshold = t
        if regime is not None:
            gw.activity.decision("regime", by_hand, state.regime, regime)
            state.regime = regime
    if moves:
        await _convert(gw, moves, by_hand)
    return _json(gw.admin_state())


def _asked_moves(gw: Gateway, asked: object) -> list[tuple[str, Role]]:
    pd = [s for s in gw.instances if s.cluster == "pd"]
    busy = sorted(s.instance_id for s in pd if s.draining)
    if busy:
        raise APIError(409, f"'roles': {', '.join(busy)} draining (a conversion is under "
                       "way); ask again once it ends", code="conversion_under_way",
                       param="roles")  # fmt: skip
    roles = {s.instance_id: s.role for s in pd}
    try:
        return asked_conversions(roles, asked, {s.instance_id for s in pd if s.healthy})
    except ValueError as exc:
        raise invalid(str(exc), "roles") from None


async def _convert(gw: Gateway, moves: list[tuple[str, Role]], reason: str) -> None:
    """Convert PD instances by hand, all at once; each is a `role` decision.

    Raises:
        APIError: 502 naming the conversions that failed.
    """
    converter = RoleConverter(gw.instances, drain_timeout_s=SchedulerConfig.drain_timeout_s)
    before = {i: gw.instances[i].role for i, _ in moves}
    for instance_id, _ in moves:  # draining now, before another request's check can run
        gw.instances[instance_id].draining = True
    results = await asyncio.gather(*(converter.convert(i, role) for i, role in moves))
    for r in results:
        outcome = "" if r.ok else f" failed ({r.error})"
        gw.activity.decision("role", f"{reason}: {r.instance_id} -> {r.to_role}{outcome}",
                             before[r.instance_id], gw.instances[r.instance_id].role)  # fmt: skip
    failed = [f"{r.instance_id} -> {r.to_role}: {r.error}" for r in results if not r.ok]
    if failed:
        raise APIError(502, f"conversion failed: {'; '.join(failed)}",
                       code="conversion_failed")  # fmt: skip


async def dashboard_data(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    """What `/dashboard` polls: `ActivityRecorder.snapshot`, newer than `?since=` (the
    previous answer's `now`), with the wall-clock `time`. Like every `/admin` route, it
    takes an operator key when any is configured."""
    check_admin(gw, request, write=False)
    return _json({**gw.activity.snapshot(since_query(request.query)), "time": time.time()})


async def openapi_json(gw: Gateway, request: HttpRequest, exchange: Exchange) -> HttpResponse:
    """`GET /openapi.json`: what this gateway serves (`openapi.py`)."""
    paths: dict[str, list[str]] = {p: [*m, *(["HEAD"] if "GET" in m else [])]
                                   for p, m in ROUTES.items()}  # fmt: skip
    for action, methods in RESPONSE_ROUTES.items():
        template = "/v1/responses/{response_id}" + (f"/{action}" if action else "")
        paths[template] = list(methods)
    return _json(openapi.document(paths, gw.config.model.name))


ROUTES: dict[str, dict[str, Route]] = {
    "/v1/completions": {"POST": completions},
    "/v1/chat/completions": {"POST": chat},
    "/v1/messages": {"POST": messages},
    "/v1/messages/count_tokens": {"POST": count_tokens},
    "/v1/responses": {"POST": responses},
    "/v1/models": {"GET": models},
    "/tokenize": {"POST": tokenize},
    "/detokenize": {"POST": detokenize},
    "/version": {"GET": version},
    "/ping": {"GET": ping, "POST": ping},
    "/health": {"GET": health},
    "/metrics": {"GET": metrics},
    "/admin/state": {"GET": admin_state, "POST": set_admin_state},
    "/admin/dashboard": {"GET": dashboard_data},
    "/openapi.json": {"GET": openapi_json},
    **{path: {"GET": page} for path, page in DASHBOARD_PAGES.items()},
}
RESPONSE_ROUTES: dict[str, dict[str, Route]] = {
    "": {"GET": responses_routes.retrieve, "DELETE": responses_routes.delete},
    "cancel": {"POST": responses_routes.cancel},
}
"""`/v1/responses/{id}` and `/v1/responses/{id}/cancel`, by action."""


def routes_of(path: str) -> dict[str, Route] | None:
    """The handlers by method at `path` (None: no route)."""
    methods = ROUTES.get(path)
    if methods is None and (found := responses_routes.response_path(path)) is not None:
        methods = RESPONSE_ROUTES[found[1]]
    return methods


class GatewayApp:
    """One gateway served over HTTP. `setup` runs on the built gateway before it starts
    (e.g. to attach link telemetry); `profile` is the schedulers' planner profile when the
    deployment's `[scheduler]` table names none (`prfaas serve`'s measured one)."""

    def __init__(
        self,
        config: DeploymentConfig,
        setup: Callable[[Gateway], Awaitable[None]] | None = None,
        profile: DeploymentProfile | None = None,
        secret: DeploymentSecret | None = None,
        replica_id: str | None = None,
    ) -> None:
        """`secret`: the deployment secret the engines hold (their control token goes on
        every engine call); None reads it from `gateway.secret_file` or the environment.
        `replica_id`: this gateway's name among the replicas (`[coordination]`)."""
        self.config = config
        self._replica_id = replica_id
        self._setup = setup
        self._profile = profile
        self._secret = secret or DeploymentSecret.from_env(path=config.gateway.secret_file)
        self._gateway: Gateway | None = None
        self._session: aiohttp.ClientSession | None = None
        self._server: HttpServer | None = None

    @property
    def gateway(self) -> Gateway:
        if self._gateway is None:
            raise RuntimeError("the gateway app has not started")
        return self._gateway

    async def start(self, host: str, port: int) -> int:
        """Build and start the gateway, then listen; returns the bound port."""
        await self.open()
        try:
            m = self.config.model
            fits = max_body_bytes(ModelLimits(m.name, m.context_length, m.vocab_size))
            limits = HttpLimits(max_body_bytes=min(self.config.gateway.max_body_bytes, fits))
            self._server = HttpServer(self.dispatch, server_error, limits)
            return await self._server.start(host, port)
        except BaseException:
            await self.stop()
            raise

    async def open(self) -> Gateway:
        """Build and start the gateway without listening: `start` does this, then listens;
        another HTTP server may instead call `dispatch` itself (benchmarks/gateway_asgi.py).
        `stop` undoes it."""
        connector = aiohttp.TCPConnector(limit=SESSION_LIMIT, ttl_dns_cache=300)
        # No cookie jar, no decompression: engine calls need neither, and both cost per call.
        self._session = aiohttp.ClientSession(
            connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False
        )
        try:
            gateway = build_gateway(
                self.config, self._session, self._secret, self._profile, self._replica_id
            )
            if self._setup is not None:
                await self._setup(gateway)
            self._gateway = gateway
            await gateway.start()
            return gateway
        except BaseException:
            await self.stop()
            raise

    async def stop(self, drain_s: float = 2.0) -> None:
        """Drain, then stop: stop listening, answer new requests 503 (`/health` too, so a
        load balancer takes this gateway out), let requests in flight finish for up to
        `drain_s` seconds (`cut_drain` ends that wait), end what is left with an error
        (`HttpServer.stop`), while a coordinated leader resigns (another replica decides
        from the drain's start, even if etcd is slow to answer); then the gateway's tasks
        and engine connections. Engines stay up throughout: those `prfaas serve` started
        stop after this returns. Idempotent."""
        try:
            steps = []
            if self._gateway is not None:
                steps.append(self._gateway.resign())
            if self._server is not None:
                steps.append(self._server.stop(drain_s))
            for outcome in await asyncio.gather(*steps, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        finally:
            try:
                if self._gateway is not None:
                    await self._gateway.stop()
            finally:
                if self._session is not None:
                    await self._session.close()
                self._server = self._gateway = self._session = None

    def cut_drain(self) -> None:
        """End a `stop`'s wait for requests in flight now (what is left ends with an
        error); nothing happens when no drain is under way."""
        if self._server is not None:
            self._server.cut()

    async def dispatch(self, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
        """Route one request; `APIError` becomes its JSON response."""
        path = request.path
        methods = routes_of(path)
        if methods is None:
            return error_response(
                APIError(404, f"no route {request.method} {path}", code="not_found"), path
            )
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            allow = ", ".join([*methods, "HEAD"] if "GET" in methods else methods)
            return error_response(
                APIError(
                    405,
                    f"method {request.method} not allowed on {path}",
                    code="method_not_allowed",
                    headers={"Allow": allow},
                ),
                path,
            )
        try:
            return await handler(self.gateway, request, exchange)
        except APIError as exc:
            if exchange.stream is not None:
                raise  # too late for a status: the server cuts the response
            return error_response(exc, path)
