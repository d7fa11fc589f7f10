"""OpenAI `/v1/completions`, `/v1/chat/completions` and `/v1/models` on the engine, for direct
use (the gateway talks SGLang's `/generate`).

Requests are parsed by the one OpenAI parser (`prfaas.protocol.openai_request`, with the
one chat-template rule of `prfaas.common.tokenizer`) and answered by the one response
builder (`prfaas.protocol.openai_response`), exactly as the gateway does: the same chat gives
the same token ids and the same body shapes by either route.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from aiohttp import web

from prfaas.engines.reference.server.app_keys import INFO, SERVICE, TOKENIZER
from prfaas.engines.reference.server.streaming import (
    check_abort,
    open_sse,
    send_sse,
    stable_text,
    visible_text,
)
from prfaas.engines.reference.step.request import TokenEvent
from prfaas.protocol.generate import GenerateChunk
from prfaas.protocol.openai_request import Api, ModelLimits, load_json, parse_call
from prfaas.protocol.openai_response import Accumulator


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`."""
    return await _serve(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`."""
    return await _serve(request, "chat")


async def _serve(request: web.Request, api: Api) -> web.StreamResponse:
    service, tok, info = request.app[SERVICE], request.app[TOKENIZER], request.app[INFO]
    pool = service.core.pool.config
    limits = ModelLimits(info.model, pool.num_blocks * pool.block_size, info.vocab_size)
    call = parse_call(load_json(await request.read()), api, limits, tok)
    rid = ("chatcmpl-" if api == "chat" else "cmpl-") + secrets.token_hex(16)
    acc = Accumulator(call, rid, int(time.time()))
    events = service.generate(rid, list(call.input_ids), call.sampling, None)
    chunks = _chunks(events, tok.decode, len(call.input_ids))
    if call.stream:
        return await _stream(request, acc, chunks)
    async with aclosing(chunks) as it:
        async for chunk in it:
            acc.add(chunk)
    return web.json_response(acc.final())


async def _chunks(
    events: AsyncGenerator[TokenEvent, None],
    decode: Callable[[Sequence[int]], str],
    prompt_tokens: int,
) -> AsyncGenerator[GenerateChunk, None]:
    """The engine's token events as output chunks with text deltas (a stop string is cut
    from the visible text; an incomplete UTF-8 sequence is held back until it completes).
    An abort that carries a status before any output raises it as an HTTP error."""
    ids: list[int] = []
    sent, first = "", True
    async with aclosing(events) as it:
        async for event in it:
            if first and event.finish_reason is not None:
                check_abort(event.finish_reason)
            first = False
            ids.extend(event.token_ids)
            reason = event.finish_reason
            text = visible_text(stable_text(decode(ids), reason is not None), reason)
            finish = None if reason is None else str(reason.get("type"))
            delta, sent = text[len(sent) :], text
            yield GenerateChunk(
                event.token_ids, delta, prompt_tokens, len(ids), event.cached_tokens, finish
            )


async def _stream(
    request: web.Request, acc: Accumulator, chunks: AsyncGenerator[GenerateChunk, None]
) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    async with aclosing(chunks) as it:
        async for chunk in it:
            response = response or await open_sse(request)  # errors before it stay JSON errors
            acc.add(chunk)
            await send_sse(response, acc.chunk(chunk))
    assert response is not None, "a request ends with a finish reason"
    if acc.call.include_usage:
        await send_sse(response, acc.usage_chunk())
    await send_sse(response, "[DONE]")
    return response


async def models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the one served model."""
    info = request.app[INFO]
    card = {"id": info.model, "object": "model", "created": 0, "owned_by": "prfaas"}
    return web.json_response({"object": "list", "data": [card]})


def add_openai_routes(app: web.Application) -> None:
    """Register the OpenAI routes on `app`."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
