"""The gateway's routes (`GatewayApp.dispatch`) behind ASGI and RSGI, for the server bake-off
in benchmarks/gateway.py: the same app on uvicorn or granian instead of prfaas/http/server.py.

`GatewayAsgi(config)` is an ASGI 3 callable (lifespan starts and stops the gateway) and an
RSGI app (`__rsgi_init__` / `__rsgi_del__` do the same on granian's loop). Each request
becomes the `HttpRequest` our server would build (raw header bytes, decoded only if a route
reads them) and an `Exchange` whose streamed responses go out as ASGI `more_body` messages
or an RSGI stream. A handler that raises gets the same JSON 500 as on our server. Limits on
heads, timeouts and disconnect handling are each server's own; only the body limit is ours.

Not part of the product: it exists so the benchmark can price our server against two
maintained ones with everything else equal.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from prfaas.gateway.api.app import GatewayApp, server_error
from prfaas.gateway.api.assembly import egress_setup
from prfaas.gateway.deployment import DeploymentConfig, load_deployment
from prfaas.http.messages import Exchange, HttpRequest, HttpResponse, ResponseStream

logger = logging.getLogger(__name__)
CONFIG_ENV = "PRFAAS_BENCH_GATEWAY_CONFIG"
"""The deployment file `create_app` reads (granian imports the app in its worker process)."""

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[str, str]]
Begin = Callable[[int, Headers], Awaitable[None]]
"""Send a streamed response's status and headers."""
Piece = Callable[[bytes, bool], Awaitable[None]]
"""Send one piece of a streamed body; the flag says more pieces follow."""


class _Stream(ResponseStream):
    """A streamed response handed to the hosting server piece by piece (it frames them)."""

    def __init__(self, exchange: Exchange, status: int, headers: Headers, begin: Begin,
                 piece: Piece) -> None:  # fmt: skip
        super().__init__(exchange, b"")
        self._status, self._headers = status, headers
        self._begin, self._piece = begin, piece
        self._begun = False

    async def write(self, data: bytes) -> None:
        if self.ended:
            raise RuntimeError("write after end()")
        await self._start()
        if data and not self._no_body:
            await self._piece(data, True)

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        await self._start()
        await self._piece(b"", False)

    @property
    def started(self) -> bool:
        return self._begun

    async def _start(self) -> None:
        if not self._begun:
            self._begun = True
            await self._begin(self._status, self._headers)


class _Exchange(Exchange):
    """An `Exchange` without a connection of ours: the hosting server owns the socket."""

    def __init__(self, request: HttpRequest, begin: Begin, piece: Piece) -> None:
        super().__init__(None, request, keep_alive=True)  # type: ignore[arg-type]
        self._begin, self._piece = begin, piece

    def start_stream(
        self, status: int, headers: Mapping[str, str], content_type: str | None = None
    ) -> ResponseStream:
        if self.stream is not None:
            raise RuntimeError("the response has already started")
        self.stream = _Stream(self, status, _headers(content_type, headers),
                              self._begin, self._piece)  # fmt: skip
        return self.stream


def _headers(content_type: str | None, headers: Mapping[str, str]) -> Headers:
    out = [] if content_type is None else [("content-type", content_type)]
    out.extend(headers.items())
    return out


class GatewayAsgi:
    """`GatewayApp`'s routes as an ASGI 3 and an RSGI application."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.app = GatewayApp(config, egress_setup())  # as `prfaas serve --config` builds it
        self.max_body = config.gateway.max_body_bytes

    async def open(self) -> None:
        await self.app.open()
        gc.freeze()  # as serve_gateway does: start-up objects stay out of collections

    async def serve(self, request: HttpRequest, exchange: Exchange) -> HttpResponse | None:
        """`dispatch`, with our server's answer to a handler that raises."""
        try:
            return await self.app.dispatch(request, exchange)
        except Exception:
            logger.exception("unhandled error serving %s %s", request.method, request.path)
            if exchange.stream is not None and exchange.stream.started:
                raise  # too late for a status: the hosting server cuts the response
            exchange.stream = None
            return server_error(500, "internal error")

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._asgi_http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.open()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.app.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _asgi_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            if size > self.max_body:
                too_big = server_error(413, f"request body over {self.max_body} bytes")
                await _asgi_whole(send, too_big, scope["method"] == "HEAD")
                return
            if not message.get("more_body", False):
                break
        request = HttpRequest.from_wire(  # the lazy header decoding our server uses
            scope["method"],
            (scope.get("raw_path") or scope["path"].encode()).decode("latin-1"),
            scope["query_string"].decode("latin-1"),
            scope["headers"],
            b"".join(body),
            scope["http_version"],
        )

        async def begin(status: int, headers: Headers) -> None:
            raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
            await send({"type": "http.response.start", "status": status, "headers": raw})

        async def piece(data: bytes, more: bool) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        exchange = _Exchange(request, begin, piece)
        resp = await self.serve(request, exchange)
        if exchange.stream is not None:
            await exchange.stream.end()
        else:
            await _asgi_whole(send, resp or server_error(500, "no response"),
                              request.method == "HEAD")  # fmt: skip

    # -- RSGI (granian) -----------------------------------------------------------------

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.open())

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.run_until_complete(self.app.stop())

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        body = await protocol()
        if len(body) > self.max_body:  # granian has read it all already: answer all the same
            too_big = server_error(413, f"request body over {self.max_body} bytes")
            headers = _headers(too_big.content_type, too_big.headers)
            protocol.response_bytes(too_big.status, headers, too_big.body)
            return
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in scope.headers.items()]
        request = HttpRequest.from_wire(scope.method, scope.path, scope.query_string, raw,
                                         body, scope.http_version)  # fmt: skip
        transport: Any = None

        async def begin(status: int, headers: Headers) -> None:
            nonlocal transport
            transport = protocol.response_stream(status, headers)

        async def piece(data: bytes, more: bool) -> None:
            nonlocal transport
            if data:
                await transport.send_bytes(data)
            if not more:  # granian ends the body when the transport is freed: free it now
                transport = None  # (the exchange and its stream form a cycle, freed late)

        exchange = _Exchange(request, begin, piece)
        resp = await self.serve(request, exchange)
        if exchange.stream is not None:
            await exchange.stream.end()
            return
        resp = resp or server_error(500, "no response")
        headers = _headers(resp.content_type, resp.headers)
        out = b"" if request.method == "HEAD" else resp.body
        protocol.response_bytes(resp.status, headers, out)


async def _asgi_whole(send: Send, resp: HttpResponse, head: bool) -> None:
    headers = _headers(resp.content_type, resp.headers)
    headers.append(("content-length", str(len(resp.body))))
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    await send({"type": "http.response.start", "status": resp.status, "headers": raw})
    await send({"type": "http.response.body", "body": b"" if head else resp.body})


def create_app() -> GatewayAsgi:
    """The app for the deployment file named by `$PRFAAS_BENCH_GATEWAY_CONFIG` (granian's
    `factory` target)."""
    return GatewayAsgi(load_deployment(os.environ[CONFIG_ENV]))
