"""`RoleMiddleware`: a vLLM server's side of PrfaaS's role API, so the long-term scheduler
converts vLLM instances as it converts reference engines (loaded with `--middleware`;
`launch.py` adds it).

Our vLLM instances run the connector as `kv_both`: an instance prefills or decodes whatever
it is sent, so its role is where the gateways send work. The role lives here, in the
engine's process, so every gateway replica reads the same one from `/health`:
- `GET /health`: vLLM's own answer when it is not 200; else `{"status": "ok", "role",
  "draining", "start_id"}` (the start id changes when the server restarts: its caches
  are then empty).
- `POST /admin/role {"role", "epoch"}`: refuse new generation requests (503 `draining`,
  which a gateway retries elsewhere), wait until those in flight have finished, switch,
  answer `{"role", "switch_seconds"}`; 409 `fenced` for an older leader's epoch (checked
  when the call arrives and again after the drain, `prfaas.engines.role_fence`); 503
  `drain_timeout` when requests still run after `DRAIN_TIMEOUT_S`.
- `POST /admin/fence {"epoch"}`: a new gateway leader announces itself.
The initial role comes from `PRFAAS_ROLE` in the environment (`prefill`, `decode` or
`both`; default `both`). One API server process holds the role: a server started with
`--api-server-count` above 1 would hold one per process, so `launch.py` never does.
Pure ASGI: no import of vLLM or starlette.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prfaas.engines.role_fence import Fenced, RoleFence
from prfaas.engines.vllm.auth import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

ENV_ROLE = "PRFAAS_ROLE"
ROLES = ("prefill", "decode", "both")
DRAIN_TIMEOUT_S = 300.0
"""The longest a switch waits for the requests in flight."""
Handler = Callable[[Any], Awaitable[tuple[int, dict[str, Any]]]]
GENERATION_PREFIXES = ("/v1/", "/v2/", "/inference/", "/generate")
"""POST routes that start work on the engine (counted in flight, refused while draining)."""


class RoleMiddleware:
    """The role, the drain and the fence of one vLLM server (see the module docstring)."""

    def __init__(self, app: ASGIApp, role: str | None = None) -> None:
        self.app = app
        self.role = role or os.environ.get(ENV_ROLE, "both")
        if self.role not in ROLES:
            raise ValueError(f"{ENV_ROLE} must be one of {ROLES}, got {self.role!r}")
        self.start_id = uuid.uuid4().hex
        self.fence = RoleFence()
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"].removeprefix(scope.get("root_path", ""))
        if path == "/health" and method == "GET":
            await self._health(scope, receive, send)
        elif path == "/admin/role" and method == "POST":
            await self._admin(self._switch, receive, send)
        elif path == "/admin/fence" and method == "POST":
            await self._admin(self._announce, receive, send)
        elif method == "POST" and path.startswith(GENERATION_PREFIXES):
            await self._generation(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _generation(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.draining:
            message = f"this engine is switching from {self.role}: retry on another instance"
            await _json(send, 503, _error(message, "draining"))
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's `/health` (a few bytes, buffered), answered with the role when it is 200."""
        answer: list[MutableMapping[str, Any]] = []

        async def keep(message: MutableMapping[str, Any]) -> None:
            answer.append(message)

        await self.app(scope, receive, keep)
        if answer and answer[0].get("status") == 200:
            body = {"status": "ok", "role": self.role, "draining": self.draining,
                    "start_id": self.start_id}  # fmt: skip
            await _json(send, 200, body)
            return
        for message in answer:
            await send(message)

    async def _admin(self, handler: Handler, receive: Receive, send: Send) -> None:
        try:
            body = json.loads(await _read(receive) or b"null")
            status, answer = await handler(body)
        except (ValueError, TypeError) as exc:
            status, answer = 400, _error(str(exc), "invalid_request")
        await _json(send, status, answer)

    async def _switch(self, body: Any) -> tuple[int, dict[str, Any]]:
        keys_ok = isinstance(body, dict) and set(body) <= {"role", "epoch"}
        if not (keys_ok and body.get("role") in ROLES):
            raise ValueError(
                'the body must be {"role": "prefill" | "decode" | "both", "epoch": <int>}'
            )
        epoch, role = _epoch(body.get("epoch", 0)), body["role"]
        began = time.monotonic()
        try:
            self.fence.admit(epoch)
            self.draining = True
            await asyncio.wait_for(self._idle.wait(), DRAIN_TIMEOUT_S)
            self.fence.admit(epoch)
        except Fenced as exc:
            return 409, _error(str(exc), "fenced")
        except TimeoutError:
            return 503, _error("running requests did not drain in time", "drain_timeout")
        finally:
            self.draining = False
        logger.warning("role %s -> %s (leader epoch %d)", self.role, role, epoch)
        self.role = role
        return 200, {"role": role, "switch_seconds": time.monotonic() - began}

    async def _announce(self, body: Any) -> tuple[int, dict[str, Any]]:
        if not (isinstance(body, dict) and set(body) == {"epoch"}):
            raise ValueError('the body must be {"epoch": <int >= 0>}')
        return 200, {"epoch": self.fence.announce(_epoch(body["epoch"]))}


def _epoch(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {value!r}")
    return value


def _error(message: str, code: str) -> dict[str, Any]:
    kind = "invalid_request_error" if code == "invalid_request" else "engine_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def _read(receive: Receive) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return bytes(body)


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
