"""Loopback test servers for the load-generator tests: a scripted streamer (and its state).

The scripted server picks its behaviour from the request's `model` field, so one server can
answer well, slowly, with errors, or not at all, and it records every body it receives.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

TOKEN_DELAY_S = 0.02
FIRST_DELAY_S = 0.05


@dataclass
class Script:
    """State of the scripted server: received bodies and the concurrency it saw."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def _chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "text": text}]}) + b"\n\n"


SCRIPT = web.AppKey("script", Script)


async def scripted_handler(request: web.Request) -> web.StreamResponse:
    script = request.app[SCRIPT]
    body = await request.json()
    script.bodies.append(body)
    script.in_flight += 1
    script.max_in_flight = max(script.max_in_flight, script.in_flight)
    try:
        return await _behave(request, body)
    finally:
        script.in_flight -= 1


async def _behave(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    mode = body.get("model", "ok")
    if mode == "http500":
        err = {"error": {"message": "engine exploded", "type": "server_error", "code": 500}}
        return web.json_response(err, status=500)
    headers = {"Content-Type": "text/event-stream", "x-prfaas-route": "prfaas"}
    headers["x-prfaas-incremental-tokens"] = str(len(body.get("prompt") or []))
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    if mode == "hang":
        await asyncio.sleep(30)
    await asyncio.sleep(FIRST_DELAY_S)
    n = body.get("max_tokens", 5)
    for i in range(n):  # two tokens per chunk: only `usage` can tell the true count
        if i > 0:
            await asyncio.sleep(TOKEN_DELAY_S)
        await resp.write(_chunk(f" a{i} b{i}"))
        if mode == "midstream-error" and i == 1:
            await resp.write(b'data: {"error": {"message": "decode died"}}\n\n')
            return resp
    if mode == "truncated":
        return resp
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 2 * n,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp
