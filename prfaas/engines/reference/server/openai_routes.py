"""OpenAI `/v1/completions`, `/v1/chat/completions` and `/v1/models` on the engine: what the
gateway forwards a client's body to when `/generate` cannot express it, and a direct API.

Requests are parsed by `prfaas.protocol.openai_engine_call` (the gateway's parser plus the
engine's own fields, one chat-template rule: the same chat gives the same token ids by either
route) and answered by `openai_answer`. In a PD pair the prefill and the decode instance get
the same body with SGLang's `bootstrap_host`/`bootstrap_port`/`bootstrap_room`: the prefill
computes the prompt and its first token under the request's sampling (grammar and
log-probabilities included) and hands both over; the decode continues from there. Several
sequences (`n`) run as that many engine requests over the one prompt (the prefix cache
shares it).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from prfaas.common.tokenizer import Tokenizer
from prfaas.engines.reference.server.app_keys import INFO, SERVICE, TOKENIZER
from prfaas.engines.reference.server.openai_answer import Answer, Decode, Delta
from prfaas.engines.reference.server.streaming import check_abort, open_sse, send_sse
from prfaas.engines.reference.step.constraint import GrammarVocab, TokenConstraint
from prfaas.engines.reference.step.request import TokenEvent
from prfaas.protocol.openai_engine_call import EngineOpenAICall, parse_engine_call
from prfaas.protocol.openai_request import Api, ModelLimits, load_json

Piece = tuple[int, Delta]


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`."""
    return await _serve(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions`."""
    return await _serve(request, "chat")


async def _serve(request: web.Request, api: Api) -> web.StreamResponse:
    answer, pieces = await start_chat(request, load_json(await request.read()), api)
    if not answer.request.call.stream:
        return web.json_response(await whole_answer(pieces, answer))
    response: web.StreamResponse | None = None
    async with aclosing(chat_events(pieces, answer)) as events:
        async for event in events:
            response = response or await open_sse(request)  # errors before it stay JSON
            await send_sse(response, event)
    assert response is not None, "a request ends with a finish reason"
    await send_sse(response, "[DONE]")
    return response


async def start_chat(
    request: web.Request, body: dict[str, Any], api: Api
) -> tuple[Answer, AsyncGenerator[Piece, None]]:
    """Parse a completions or chat `body` and start its sequences: the answer they fill, and
    their deltas as they come (`whole_answer` or `chat_events` reads them). The other APIs'
    routes (`agent_routes.py`) run their chat bodies through here too."""
    service, tok, info = request.app[SERVICE], request.app[TOKENIZER], request.app[INFO]
    pool = service.core.pool.config
    limits = ModelLimits(info.model, pool.num_blocks * pool.block_size, info.vocab_size)
    call = parse_engine_call(body, api, limits, tok)
    rid = ("chatcmpl-" if api == "chat" else "cmpl-") + secrets.token_hex(16)
    answer = Answer(call, rid, int(time.time()), tok.decode)
    constraints = await asyncio.to_thread(_constraints, request.app, call)  # off the loop
    ids = list(call.call.input_ids)
    runs = []
    for i in range(call.n):
        seq_rid = rid if call.n == 1 else f"{rid}-{i}"
        params, bootstrap = call.sequence(i), call.bootstrap
        runs.append(service.generate(seq_rid, ids, params, bootstrap, call.prefix_pull,
                                     constraint=constraints[i]))  # fmt: skip
    return answer, _merged(runs, answer)


async def whole_answer(pieces: AsyncGenerator[Piece, None], answer: Answer) -> dict[str, Any]:
    """The whole (non-streamed) answer, once every sequence ended."""
    async with aclosing(pieces) as it:
        async for _ in it:
            pass
    return answer.whole()


async def chat_events(
    pieces: AsyncGenerator[Piece, None], answer: Answer
) -> AsyncGenerator[dict[str, Any], None]:
    """The streamed answer's events (the usage event last, when asked; no `[DONE]`)."""
    options = answer.request
    async with aclosing(pieces) as it:
        async for index, delta in it:
            event = answer.event(index, delta)
            if event is not None:
                if options.continuous_usage:
                    event["usage"] = answer.usage()
                yield event
    if options.call.include_usage:
        yield answer.usage_event()


def _constraints(app: web.Application, call: EngineOpenAICall) -> list[TokenConstraint | None]:
    """One grammar per sequence (compiled for the engine's vocabulary on first use; a
    large vocabulary or schema takes a while, so callers run this on a worker thread)."""
    if call.structured is None:
        return [None] * call.n
    with _COMPILING:
        vocab = _vocab(app[TOKENIZER], app[SERVICE].core.runner.shape.vocab_size)
        first = TokenConstraint.compile(call.structured, vocab)  # a 400 names its field
        return [first, *(first.fork() for _ in range(call.n - 1))]


_VOCABS: dict[tuple[str, int], GrammarVocab] = {}
_COMPILING = threading.Lock()
"""Grammars compile on worker threads, one at a time (the vocabularies' caches)."""


def _vocab(tokenizer: Tokenizer, vocab_size: int) -> GrammarVocab:
    """The vocabulary an engine's grammars compile against, built once per tokenizer (by
    its name: the checkpoint directory, or byte-level) and model vocabulary size."""
    key = (tokenizer.name, vocab_size)
    if key not in _VOCABS:
        _VOCABS[key] = GrammarVocab(tokenizer, vocab_size)
    return _VOCABS[key]


async def _merged(
    runs: list[AsyncGenerator[TokenEvent, None]], answer: Answer
) -> AsyncGenerator[Piece, None]:
    """Every sequence's deltas as they come (one sequence: in order, no task). An abort
    that carries a status before any output raises it as an HTTP error."""
    decode = answer.token_text
    if len(runs) == 1:
        async with aclosing(runs[0]) as it:
            async for event in it:
                yield 0, _take(answer, 0, event, decode)
        return
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(index: int, run: AsyncGenerator[TokenEvent, None]) -> None:
        try:
            async with aclosing(run) as it:
                async for event in it:
                    queue.put_nowait((index, _take(answer, index, event, decode)))
        except BaseException as exc:  # handed to the reader, which raises it
            queue.put_nowait(exc)
            raise
        queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _take(answer: Answer, index: int, event: TokenEvent, decode: Decode) -> Delta:
    seq = answer.sequences[index]
    if not seq.ids and event.finish_reason is not None:
        check_abort(event.finish_reason)
    return seq.add(event, decode, answer.request.sampling.stop)


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
