"""The engine's HTTP server (aiohttp): SGLang's `/generate` and admin routes, plus the OpenAI
routes from `openai_routes.py` and the Messages and Responses routes from `agent_routes.py`.
Every error is a JSON error in the route's dialect (`errors.py`)."""

from __future__ import annotations

import secrets
import time
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

from aiohttp import web

from prfaas.common.secret import token_matches
from prfaas.common.tokenizer import Tokenizer
from prfaas.engines.reference.handoff.base import HandoffError
from prfaas.engines.reference.handoff.transport import TransportSender
from prfaas.engines.reference.server.agent_routes import add_agent_routes
from prfaas.engines.reference.server.app_keys import INFO, SERVICE, TOKENIZER, ModelInfo
from prfaas.engines.reference.server.errors import Handler, error_middleware, json_error
from prfaas.engines.reference.server.openai_routes import add_openai_routes
from prfaas.engines.reference.server.service import EngineService
from prfaas.engines.reference.server.streaming import (
    MAX_BODY_BYTES,
    Collected,
    check_abort,
    collect,
    open_sse,
    output_text,
    read_json,
    send_sse,
)
from prfaas.engines.role_fence import Fenced
from prfaas.engines.transport import KVSender, ProcessSender, TransportTelemetry
from prfaas.protocol.errors import APIError, InvalidRequest
from prfaas.protocol.generate import MAX_ROOM, GenerateRequest, answer, parse_request


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang `/generate`: JSON result, or an SSE stream of cumulative results."""
    service, tok = request.app[SERVICE], request.app[TOKENIZER]
    start = time.monotonic()
    call = parse_request(await read_json(request), tok.encode, lambda: secrets.token_hex(16))
    events = service.generate(
        call.rid, list(call.input_ids), call.sampling, call.bootstrap, call.prefix_pull
    )
    if call.stream:
        return await _stream_generate(request, events, call, start)
    result = await collect(events)
    return web.json_response(_result(tok, call, result, start))


def _result(tok: Tokenizer, call: GenerateRequest, r: Collected, start: float) -> dict[str, Any]:
    text = output_text(tok.decode, r.output_ids, r.finish_reason, call.sampling.stop)
    return answer(
        rid=call.rid, text=text, output_ids=list(r.output_ids), finish_reason=r.finish_reason,
        prompt_tokens=len(call.input_ids), cached_tokens=r.cached_tokens,
        e2e_latency=time.monotonic() - start,
    )  # fmt: skip


async def _stream_generate(
    request: web.Request, events: Any, call: GenerateRequest, start: float
) -> web.StreamResponse:
    tok, acc = request.app[TOKENIZER], Collected()
    async with aclosing(events) as it:
        first = await anext(it)  # errors before the first event are still plain JSON errors
        if first.finish_reason is not None:
            check_abort(first.finish_reason)
        response = await open_sse(request)
        event = first
        while True:
            acc.add(event) if event.finish_reason is None else _add_final(acc, event)
            await send_sse(response, _result(tok, call, acc, start))
            if acc.finish_reason is not None:
                break
            event = await anext(it)
    await send_sse(response, "[DONE]")
    return response


def _add_final(acc: Collected, event: Any) -> None:
    """Add the last event without raising: a stream reports an abort in its last chunk."""
    acc.output_ids.extend(event.token_ids)
    acc.cached_tokens = event.cached_tokens or acc.cached_tokens
    acc.finish_reason = event.finish_reason


async def health(request: web.Request) -> web.Response:
    """`GET /health`, open to anyone (load balancers): the engine's own report of its role,
    whether a role switch is draining it, its start id (a new one after a restart), and that
    it can export and pull cached prefixes. A 503 while no KV sender process runs (one
    exited, and the next has not started yet): every hand-off would fail meanwhile, so the
    gateway ejects it until the next one serves."""
    service = request.app[SERVICE]
    transport = _transport(service)
    if isinstance(transport, ProcessSender) and not transport.is_alive():
        raise APIError(503, "the engine's KV sender process exited: KV hand-offs fail until "
                       "the next one starts", code="kv_sender_gone")  # fmt: skip
    body = {
        "status": "ok",
        "role": service.core.role,
        "draining": service.draining,
        "start_id": service.start_id,
        "prefix_pull": True,
    }
    return web.json_response(body)


async def server_info(request: web.Request) -> web.Response:
    service, info = request.app[SERVICE], request.app[INFO]
    core = service.core
    pool = core.pool.config
    body = {
        **asdict(info),
        "role": core.role,
        "page_size": pool.block_size,
        "kv_capacity_tokens": pool.num_blocks * pool.block_size,
        "kv_capacity_blocks": pool.num_blocks,
        "num_state_slots": pool.num_state_slots,
        "max_batch": core.config.max_batch,
        "bootstrap_port": service.sender.bootstrap_port,
        # SGLang's names, read by PD routers:
        "served_model_name": info.model,
        "host": request.url.host,
        "port": request.url.port,
        "disaggregation_mode": core.role if core.role != "both" else "null",
        "disaggregation_bootstrap_host": request.url.host,
        "disaggregation_bootstrap_port": service.sender.bootstrap_port,
        "last_role_switch_s": service.last_switch_s,
        "start_id": service.start_id,
        "prefix_pull": True,  # POST /kv/export, and `prefix_pull` on /generate
    }
    return web.json_response(body)


async def stats(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    core = service.core
    counters, pool = core.counters.snapshot(), core.pool.stats()
    body = {
        "role": core.role,
        "waiting": len(core.waiting),
        "running": len(core.running) + (core.prefilling is not None),  # prefill + decode
        "prefilling": int(core.prefilling is not None),
        "decoding": len(core.running),
        "kv_blocks_used": pool.used_blocks,
        "kv_blocks_cached": pool.cached_blocks,
        "kv_blocks_free": pool.free_blocks,
        "kv_blocks_total": pool.num_blocks,
        "state_slots_held": pool.held_state_slots,
        "prefix_hit_rate": counters.prefix_hit_rate,
        "prompt_tokens_total": counters.prompt_tokens,
        "cached_prompt_tokens_total": counters.cached_prompt_tokens,
        "generated_tokens_total": counters.generated_tokens,
        "prompt_tokens_per_s": counters.prompt_tokens_per_s,
        "generation_tokens_per_s": counters.generation_tokens_per_s,
        "prefix_exported_tokens_total": service.prefix_exported_tokens,
        "prefix_imported_tokens_total": service.prefix_imported_tokens,
        "prefix_pull_failures_total": service.prefix_pull_failures,
    }
    transport = _transport(request.app[SERVICE])
    if transport is not None:
        body.update(_egress_fields(transport.telemetry()))
    return web.json_response(body)


def _transport(service: EngineService) -> KVSender | ProcessSender | None:
    """The engine's KV transport sender (None with an in-process hand-off)."""
    return service.sender.transport if isinstance(service.sender, TransportSender) else None


def _egress_fields(t: TransportTelemetry) -> dict[str, Any]:
    """The transport's key numbers, as flat `/stats` fields."""
    return {
        "kv_egress_bytes_per_s": t.egress_bytes_per_s,
        "kv_egress_bytes_total": t.bytes_total,
        "kv_egress_capacity_bytes_per_s": t.capacity_bytes_per_s,
        "kv_egress_utilisation": t.utilisation,
        "kv_transfer_rtt_s": t.rtt_s,
        "kv_retransmission_rate": t.retransmission_rate,
        "kv_transfers_active": t.active_transfers,
    }


async def transfer_stats(request: web.Request) -> web.Response:
    """`GET /transfer_stats`: the KV transport's telemetry (egress rate, utilisation of the
    configured capacity, retransmission rate, RTT, per-connection TCP_INFO samples) and its
    pacing settings. `at` is the engine's event-loop clock, for rates between two samples."""
    service = request.app[SERVICE]
    transport = _transport(service)
    if transport is None:
        raise APIError(404, "this engine's KV hand-off has no transport", code="no_transport")
    cfg = transport.config
    body = {
        **asdict(transport.telemetry()),
        "role": service.core.role,
        "connections_per_peer": cfg.connections,
        "egress_rate_bytes_per_s": cfg.process_rate_bytes_per_s,
        "egress_delay_s": cfg.delay_s,
    }
    return web.json_response(body)


async def flush_cache(request: web.Request) -> web.Response:
    request.app[SERVICE].flush_cache()
    return web.json_response({"status": "ok", "message": "prefix cache flush queued"})


async def abort_request(request: web.Request) -> web.Response:
    """SGLang `/abort_request {"rid": ...}`: abort one request (200 even if already done)."""
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
        raise InvalidRequest('the body must be {"rid": "<request id>"}')
    found = request.app[SERVICE].abort(body["rid"])
    return web.json_response({"rid": body["rid"], "aborted": found})


async def admin_role(request: web.Request) -> web.Response:
    """`POST /admin/role {"role": "prefill"|"decode"|"both", "epoch": E}`: drain, switch,
    report the time. `epoch` (optional, default 0): the converting gateway leader's; a
    conversion from an epoch older than one already announced is refused with 409 `fenced`
    (`prfaas.engines.role_fence`)."""
    body = await read_json(request)
    ok = isinstance(body, dict) and "role" in body and set(body) <= {"role", "epoch"}
    if not ok:
        raise InvalidRequest(
            'the body must be {"role": "prefill" | "decode" | "both", "epoch": <int>}'
        )
    epoch = _epoch(body.get("epoch", 0))
    try:
        seconds = await request.app[SERVICE].switch_role(body["role"], epoch=epoch)
    except TimeoutError:
        message = "running requests did not drain in time"
        raise APIError(503, message, code="drain_timeout") from None
    except Fenced as exc:
        raise APIError(409, str(exc), code="fenced") from None
    return web.json_response({"role": body["role"], "switch_seconds": seconds})


async def admin_fence(request: web.Request) -> web.Response:
    """`POST /admin/fence {"epoch": E}`: a new gateway leader announces its epoch; from now on
    conversions from older epochs are refused. Answers the engine's floor."""
    body = await read_json(request)
    if not isinstance(body, dict) or set(body) != {"epoch"}:
        raise InvalidRequest('the body must be {"epoch": <int >= 0>}')
    floor = request.app[SERVICE].fence.announce(_epoch(body["epoch"]))
    return web.json_response({"epoch": floor})


def _epoch(value: object) -> int:
    if type(value) is not int or value < 0:
        raise InvalidRequest(f"epoch must be an integer >= 0, got {value!r}", "epoch")
    return value


async def kv_export(request: web.Request) -> web.Response:
    """`POST /kv/export {"input_ids": [...], "room": R}`: send the longest cached prefix of
    the prompt into room R on this engine's KV transport (another engine pulls it, see
    `/generate`'s `prefix_pull`); answers `{"prefix_tokens": n}` once it was delivered."""
    body = await read_json(request)
    ok = isinstance(body, dict) and set(body) == {"input_ids", "room"}
    ids, room = (body["input_ids"], body["room"]) if ok else (None, None)
    if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
        raise InvalidRequest('the body must be {"input_ids": [<int>, ...], "room": <int>}')
    if type(room) is not int or not 0 <= room <= MAX_ROOM:
        raise InvalidRequest(f"room must be an integer in 0..2^64-1, got {room!r}", "room")
    try:
        tokens = await request.app[SERVICE].export_prefix(ids, room)
    except HandoffError as exc:
        raise APIError(502, f"prefix export failed: {exc}", code="kv_export_failed") from None
    return web.json_response({"prefix_tokens": tokens})


async def admin_egress(request: web.Request) -> web.Response:
    """`POST /admin/egress {"rate_mbps": R}`: re-pace this engine's KV egress (the emulated
    cross-DC link of `prfaas serve`) from now on; answers the transport's new settings."""
    body = await read_json(request)
    ok = isinstance(body, dict) and set(body) == {"rate_mbps"}
    rate = body["rate_mbps"] if ok else None
    if isinstance(rate, bool) or not isinstance(rate, int | float):
        raise InvalidRequest('the body must be {"rate_mbps": <number > 0>}')
    transport = _transport(request.app[SERVICE])
    if transport is None:
        raise APIError(404, "this engine's KV hand-off has no transport", code="no_transport")
    try:
        transport.set_process_rate(float(rate) * 1e6 / 8)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return web.json_response({"egress_rate_bytes_per_s": transport.config.process_rate_bytes_per_s})


OPEN_PATHS = frozenset({"/health"})
"""Routes anyone may call when the engine has a control token (load-balancer probes)."""


def auth_middleware(token: str) -> Any:
    """Refuse (401) every request but `GET /health` unless it carries `Authorization: Bearer
    <token>` (the deployment secret's control token; SGLang's `--api-key` header)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS and request.method in ("GET", "HEAD"):
            return await handler(request)
        if not token_matches(request.headers.get("Authorization"), token):
            error = APIError(401, "this engine needs the deployment's control token",
                             code="invalid_api_key")  # fmt: skip
            return json_error(error)
        return await handler(request)

    return check


def create_app(
    service: EngineService, tokenizer: Tokenizer, info: ModelInfo, token: str | None = None
) -> web.Application:
    """The aiohttp application; starting it starts the engine, cleanup closes it. With
    `token`, every route but `/health` needs it as a bearer token."""
    middlewares = (
        [error_middleware] if token is None else [auth_middleware(token), error_middleware]
    )
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[SERVICE], app[TOKENIZER], app[INFO] = service, tokenizer, info

    async def lifecycle(app: web.Application) -> Any:
        await service.start()
        yield
        await service.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/stats", stats)
    app.router.add_get("/transfer_stats", transfer_stats)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/admin/role", admin_role)
    app.router.add_post("/admin/fence", admin_fence)
    app.router.add_post("/admin/egress", admin_egress)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/kv/export", kv_export)
    add_openai_routes(app)
    add_agent_routes(app)
    return app
