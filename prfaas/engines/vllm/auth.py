"""`ControlTokenMiddleware`: the deployment's control token on every route of a vLLM server
but `/health`, loaded into vLLM's OpenAI server with `--middleware` (`launch.py` adds it).

vLLM's own `--api-key` guards only `/v1`-like prefixes: `/metrics`, `/tokenize`,
`/kv_event_sources`, `/scale_elastic_ep`, `/openapi.json` and the rest stay open to anyone
who reaches the port. With the deployment secret in the server's environment
(`PRFAAS_SECRET`, as `prfaas serve` hands it), this answers every other request without
`Authorization: Bearer <control token>` with an OpenAI-style 401, before vLLM sees it.
Without a secret it lets everything through and logs that the server is open (as a
reference engine does). Pure ASGI: no import of vLLM or starlette.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prfaas.common.secret import DeploymentSecret, token_matches

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
"""What answers without the token: the liveness probe (it tells nothing about requests)."""

_UNAUTHORIZED = json.dumps(
    {
        "error": {
            "message": "this engine answers only its gateway: missing or wrong bearer token",
            "type": "authentication_error",
            "param": None,
            "code": "unauthorized",
        }
    }
).encode()


class ControlTokenMiddleware:
    """Refuses every request but `OPEN_PATHS` without the deployment's control token."""

    def __init__(self, app: ASGIApp, secret: DeploymentSecret | None = None) -> None:
        self.app = app
        secret = secret or DeploymentSecret.from_env()
        self.token = secret.control_token() if secret is not None else None
        if self.token is None:
            logger.warning("no deployment secret: every route of this vLLM server is open")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if path in OPEN_PATHS or token_matches(headers.get("authorization"), self.token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


def transport_key() -> bytes:
    """The KV transport's handshake key from the deployment secret in the environment, so
    the connector's sender and receiver accept only peers of this deployment (empty, and a
    warning, without one: the transport is then open, as a reference engine's)."""
    secret = DeploymentSecret.from_env()
    if secret is None:
        logger.warning("no deployment secret: this vLLM server's KV transport is open")
        return b""
    return secret.transport_key()
