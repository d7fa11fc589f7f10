"""The generation handlers of every API (OpenAI completions and chat, Anthropic Messages,
OpenAI Responses): authenticate, parse, admit, route, relay (SSE or JSON).

The routing itself lives in `Router` (no HTTP there); this module only adapts HTTP to it
and keeps the metrics. A client that disconnects cancels the handler, which closes the
Router's stream and so aborts the request on both the prefill and the decode engine. So does
the end of the gateway's drain (`GatewayApp.stop`): a stream still running then ends with the
API's error event (`shutting_down`) and, like every stream that fails, without the API's end
(`[DONE]`, `message_stop`, `response.completed`); a whole answer not ready gets the HTTP
server's 503.

A forwarded request (every Messages and Responses request; every request in `forward` mode,
for vLLM engines; in `generate` mode, one that `/generate` cannot express) goes to the
engines whole and their answer comes back as they wrote it: each event (or the whole body)
unchanged, the engine's refusal with its own status and body; the metrics read the answer's
usage. A Responses answer also has the `previous_response_id` the client gave, and is stored
before the client has it all (`prfaas.gateway.responses`). Any other request's answer is
rendered here from the engine's `/generate` output.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import orjson

from prfaas.common.tokenizer import Tokenizer
from prfaas.engine_clients.base import EngineError
from prfaas.gateway.admission import AdmissionManager, QueueFull, QueueTimeout
from prfaas.gateway.api.activity import ActivityRecorder, FinishedRequest
from prfaas.gateway.api.metrics import GatewayMetrics
from prfaas.gateway.responses.service import EventSink, ResponsesService
from prfaas.gateway.responses.turn import ResponseTurn
from prfaas.gateway.router import Dispatch, Router
from prfaas.http.messages import Exchange, HttpRequest, HttpResponse, StreamTarget
from prfaas.policies.routing import NoInstanceAvailable, RouteDecision
from prfaas.protocol import anthropic_messages, openai_responses, sse
from prfaas.protocol.errors import APIError
from prfaas.protocol.openai_request import (
    Api,
    CompletionCall,
    ModelLimits,
    OpenAIMode,
    load_json,
    parse_call,
)
from prfaas.protocol.openai_response import Accumulator

SSE_HEADERS = {"Cache-Control": "no-cache"}
STOPPED = APIError(503, "the gateway stopped before the answer was complete; retry",
                   code="shutting_down")  # fmt: skip
"""A stream still running at the end of the gateway's drain ends with this error's event
(written by the HTTP server: `Exchange.start_stream`'s `cut_tail`)."""
RID_PREFIXES: dict[Api, str] = {"completions": "cmpl", "chat": "chatcmpl", "messages": "msg",
                                "responses": "resp"}  # fmt: skip
PARSE_IN_THREAD_BYTES = 64 * 1024
"""Bodies larger than this are parsed and tokenized on a worker thread, so a burst of big
bodies cannot hold the event loop (and `/health`) for long."""
logger = logging.getLogger(__name__)


@dataclass
class _Timing:
    """What one request's metrics record, gathered on the way and booked after the answer."""

    api: Api
    start: float
    route: str = "none"
    status: int = 200
    prompt_tokens: int | None = None
    ttft: float | None = None
    incremental_tokens: int = 0
    stream: bool = False
    output_tokens: int = 0
    booked: bool = False
    """Already booked (a streamed background response's creation, before its relay)."""


@dataclass
class CompletionService:
    """Serves `/v1/completions` and `/v1/chat/completions` through a `Router`."""

    router: Router
    tokenizer: Tokenizer
    limits: ModelLimits
    admission: AdmissionManager
    metrics: GatewayMetrics
    activity: ActivityRecorder | None = None
    """Where finished requests are booked for the dashboard."""
    responses: ResponsesService | None = None
    """The Responses API's stored state (None: `/v1/responses` is not served)."""
    api_keys: frozenset[str] = frozenset()
    retry_after_s: int = 1
    mode: OpenAIMode = "generate"
    """`forward` when the engines' own OpenAI servers answer every request (vLLM), else
    `generate` (`/generate` where it expresses the request, else forwarded)."""
    clock: Callable[[], float] = field(default=lambda: asyncio.get_running_loop().time())

    def check_auth(self, request: HttpRequest) -> None:
        """Raises APIError(401) unless API keys are off or the request carries one of them:
        as a bearer key (OpenAI's clients), or in `x-api-key` (Anthropic's)."""
        if not self.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key.strip() in self.api_keys:
            return
        if request.headers.get("x-api-key", "").strip() not in self.api_keys:
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    async def handle(
        self, request: HttpRequest, exchange: Exchange, api: Api
    ) -> HttpResponse | None:
        """Serve one completion request: a whole JSON response, or None once an SSE stream
        was written to `exchange`."""
        timing = _Timing(api, self.clock())
        try:
            return await self._handle(request, exchange, api, timing)
        except APIError as exc:
            timing.status = exc.status
            raise
        except asyncio.CancelledError:
            timing.status = 499  # the client went away
            raise
        except ConnectionError:
            timing.status = 499  # ... while we were streaming to it
            return None
        finally:
            # Booked once the current step has written the answer: off the critical path.
            if not timing.booked:
                asyncio.get_running_loop().call_soon(self._account, timing)

    def _account(self, timing: _Timing) -> None:
        metrics, route, now = self.metrics, timing.route, self.clock()
        metrics.requests.labels(timing.api, route, str(timing.status)).inc()
        if timing.prompt_tokens is not None:
            metrics.prompt.observe(timing.prompt_tokens)
        if timing.ttft is not None:
            metrics.ttft.labels(route).observe(timing.ttft)
            metrics.incremental.labels(route).observe(timing.incremental_tokens)
        e2e = tpot = None
        if timing.status == 200:
            e2e = now - timing.start
            metrics.e2e.labels(route).observe(e2e)
            if timing.stream and timing.ttft is not None and timing.output_tokens > 1:
                tpot = (e2e - timing.ttft) / (timing.output_tokens - 1)
                metrics.tpot.labels(route).observe(tpot)
        if self.activity is not None:
            routed = timing.ttft is not None
            incremental = timing.incremental_tokens if routed else None
            self.activity.finished(
                FinishedRequest(now, route, timing.status, incremental, timing.ttft, tpot, e2e)
            )

    async def _handle(
        self, request: HttpRequest, exchange: Exchange, api: Api, timing: _Timing
    ) -> HttpResponse | None:
        self.check_auth(request)
        big = len(request.body) > PARSE_IN_THREAD_BYTES
        body = await asyncio.to_thread(load_json, request.body) if big else load_json(request.body)
        turn = None
        if api == "responses":
            if self.responses is None:
                raise APIError(404, "the Responses API is not served here", code="not_found")
            turn = await self.responses.turn(body)
            body = turn.engine
        call = await asyncio.to_thread(self._parse, body, api) if big else self._parse(body, api)
        if turn is not None and turn.client.get("background") is True:
            assert self.responses is not None
            run = partial(self._background, call, _Timing(api, self.clock()))
            queued = await self.responses.start_background(turn, call.model, run)
            if not call.stream:
                return HttpResponse(200, orjson.dumps(queued))
            # booked as answered now: the relay that follows is a reader of the response
            asyncio.get_running_loop().call_soon(self._account, replace(timing))
            timing.booked = True
            await relay_events(exchange, self.responses.follow(queued["id"], 0))
            return None
        return await self._admitted(exchange, call, timing, turn)

    async def _admitted(
        self, exchange: StreamTarget | None, call: CompletionCall, timing: _Timing,
        turn: ResponseTurn | None,
    ) -> HttpResponse | None:  # fmt: skip
        """Serve `call` once admission gives it a slot (a 429 when the queue is full, a 408
        when no slot came in time)."""
        queued = self.clock()
        try:
            async with self.admission.slot():
                self.metrics.queue_wait.observe(self.clock() - queued)
                timing.prompt_tokens = len(call.input_ids)  # admitted requests only
                return await self._serve(exchange, call, timing, turn)
        except QueueFull as exc:
            raise APIError(
                429,
                f"the gateway is at capacity ({exc}); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            ) from None
        except QueueTimeout as exc:
            self.metrics.queue_wait.observe(self.clock() - queued)
            raise APIError(408, f"the gateway is at capacity: {exc}; retry later",
                           code="queue_timeout",
                           headers={"Retry-After": str(self.retry_after_s)}) from None  # fmt: skip

    async def _background(
        self, call: CompletionCall, timing: _Timing, turn: ResponseTurn, sink: EventSink | None
    ) -> bytes | None:
        """A background response's whole answer, or (`sink`: streamed) None once its events
        went to `sink` through `turn` (its metrics booked like a request's).

        Raises:
            APIError: it failed (the engine's refusal too, with its words).
        """
        try:
            answer = await self._admitted(sink, call, timing, None if sink is None else turn)
            if answer is None:
                return None  # streamed
            if answer.status != 200:
                raise APIError(answer.status, _refusal_message(answer.body), code="engine_refused")
            return answer.body
        except APIError as exc:
            timing.status = exc.status
            raise
        except asyncio.CancelledError:
            timing.status = 499
            raise
        finally:
            asyncio.get_running_loop().call_soon(self._account, timing)

    def _parse(self, body: dict[str, Any], api: Api) -> CompletionCall:
        if api == "messages":
            return anthropic_messages.parse_call(body, self.limits, self.tokenizer)
        if api == "responses":
            return openai_responses.parse_call(body, self.limits, self.tokenizer)
        return parse_call(body, api, self.limits, self.tokenizer, self.mode)

    async def _serve(
        self, exchange: StreamTarget | None, call: CompletionCall, timing: _Timing,
        turn: ResponseTurn | None,
    ) -> HttpResponse | None:  # fmt: skip
        rid = f"{RID_PREFIXES[call.api]}-{secrets.token_hex(16)}"
        acc = Accumulator(call, rid, int(time.time()))
        try:
            routed = await self.router.dispatch(
                acc.rid, call.input_ids, call.sampling, stream=call.stream, client_body=call.body
            )
        except NoInstanceAvailable as exc:
            raise APIError(503, str(exc), code="no_instance_available") from None
        except EngineError as exc:
            if exc.answer is not None:  # the engine refused what the client sent: its words
                timing.status = exc.status
                return HttpResponse(exc.status, exc.answer)
            raise _engine_error(exc) from None
        try:
            timing.route = routed.decision.route
            timing.ttft = self.clock() - timing.start
            timing.incremental_tokens = routed.decision.incremental_tokens
            timing.stream = call.stream
            acc.index_cached_tokens = routed.decision.cached_tokens
            if call.stream:
                assert exchange is not None, "a streamed answer has its exchange"
                await self._sse(exchange, acc, routed, turn)
                return None
            return await self._whole(acc, routed, turn)
        finally:
            timing.output_tokens = acc.last.completion_tokens if acc.last else 0
            routed.close()

    async def _whole(
        self, acc: Accumulator, routed: Dispatch, turn: ResponseTurn | None
    ) -> HttpResponse:
        """A non-streaming request: the engines answered in one piece, so does the gateway."""
        chunk = routed.first
        try:
            while chunk is not None:
                acc.add(chunk)
                chunk = await routed.next()
        except EngineError as exc:
            raise _engine_error(exc) from None
        headers = route_headers(routed.decision)
        if acc.call.body is not None and acc.last is not None and acc.last.raw is not None:
            raw = acc.last.raw if turn is None else await turn.whole(acc.last.raw)
            return HttpResponse(200, raw, headers=headers)  # the engine's own answer
        return HttpResponse(200, orjson.dumps(acc.final()), headers=headers)

    async def _sse(
        self, exchange: StreamTarget, acc: Accumulator, routed: Dispatch,
        turn: ResponseTurn | None,
    ) -> None:  # fmt: skip
        api = acc.call.api
        headers = {**SSE_HEADERS, **route_headers(routed.decision)}
        resp = exchange.start_stream(200, headers, "text/event-stream",
                                     cut_tail=sse.error_event(api, STOPPED))  # fmt: skip
        chunk = routed.first
        forwarded = acc.call.body is not None
        try:
            while chunk is not None:
                acc.add(chunk)
                if not forwarded:
                    await resp.write(_sse(acc.chunk(chunk)))
                elif chunk.raw:  # the engine's own event, as written
                    raw = chunk.raw if turn is None else await turn.event(chunk.event, chunk.raw)
                    await resp.write(sse.frame(api, raw, chunk.event))
                chunk = await routed.next()
        except EngineError as exc:
            # Too late for a status: the API's error event, and not its end, so a client
            # that trusts the end never takes the cut-off answer for a whole one.
            sequence = None if turn is None else turn.events
            await resp.write(sse.error_event(api, _engine_error(exc), sequence))
        else:
            if acc.call.include_usage and not forwarded:
                await resp.write(_sse(acc.usage_chunk()))
            await resp.write(sse.end(api))
        await resp.end()


async def relay_events(exchange: Exchange, frames: AsyncIterator[bytes]) -> None:
    """Stream a Responses event log's frames to the client (a streamed background
    response's, read with `ResponsesService.events`)."""
    resp = exchange.start_stream(200, SSE_HEADERS, "text/event-stream",
                                 cut_tail=sse.error_event("responses", STOPPED))  # fmt: skip
    async for frame in frames:
        await resp.write(frame)
    await resp.end()


def _refusal_message(body: bytes) -> str:
    """The message of an engine's error body (OpenAI's or Anthropic's shape)."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return "the engine refused the request"
    message = error.get("message") if isinstance(error, dict) else None
    return str(message or "the engine refused the request")


def _engine_error(exc: EngineError) -> APIError:
    """The client's view of an engine failure: its status and short code, never the
    engine's own text (which may name bootstrap rooms or peers); that goes to the log."""
    logger.warning("request failed on an engine: %s", exc)
    status = exc.status if exc.status in (502, 503, 504) else 502
    return APIError(status, f"the request failed on an engine ({exc.code})", code="engine_error")


def route_headers(decision: RouteDecision) -> dict[str, str]:
    """`x-prfaas-route` and `x-prfaas-incremental-tokens` for a routed request."""
    return {
        "x-prfaas-route": decision.route,
        "x-prfaas-incremental-tokens": str(decision.incremental_tokens),
    }


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"
