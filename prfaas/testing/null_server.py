"""The null server: NOT an engine. It runs no model and answers instantly with filler tokens.

It exists only to measure overhead: of the load generator (benchmarks/loadgen.py) and of the
gateway (benchmarks/gateway.py). It parses requests with the project's one parser of each
protocol (`prfaas.protocol`), as the gateway and the reference engine do, and answers:

- OpenAI `/v1/completions` and `/v1/chat/completions`, streaming (SSE) or not, with `usage`
  including `prompt_tokens_details.cached_tokens`;
- Anthropic `/v1/messages` and OpenAI `/v1/responses` (stateless), streaming or not: the chat
  answer converted as the reference engine converts it (`prfaas.protocol.anthropic_answer`,
  `responses_answer`);
- SGLang's `/generate`: streamed `data: {"text", "output_ids", "meta_info": {"id",
  "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}}` chunks (text and
  ids cumulative, as SGLang streams them by default), then `data: [DONE]`;
- `/health`, `/v1/models`.

Output length is the request's `max_tokens` / `max_new_tokens` (the protocols' defaults
when absent: 16 and 128), for any model name. `cached_tokens` comes from a toy prefix cache
of full blocks of prompt ids (text is byte-level tokenized), so clients can check hit-rate
plumbing. Run: `python -m prfaas.testing.null_server --port P` (port 0 picks a free one; the
first stdout line says which).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from prfaas.common.event_loop import run_main
from prfaas.common.hashing import hash_blocks
from prfaas.common.tokenizer import ByteTokenizer
from prfaas.protocol import (
    anthropic_answer,
    anthropic_messages,
    openai_responses,
    responses_answer,
    sse,
)
from prfaas.protocol.errors import APIError
from prfaas.protocol.generate import GenerateChunk, GenerateRequest, answer, parse_request
from prfaas.protocol.openai_request import (
    Api,
    CompletionCall,
    ModelLimits,
    load_json,
    parse_call,
)
from prfaas.protocol.openai_response import Accumulator
from prfaas.protocol.responses_answer import ResponseStream

MAX_CONTEXT = 2_000_000  # prompt + output tokens the null server takes
_BYTES = ByteTokenizer()


@dataclass(frozen=True)
class NullConfig:
    """Behaviour of the null server."""

    first_token_delay_s: float = 0.0
    """Sleep before the first token (a stand-in for prefill time)."""
    token_delay_s: float = 0.0
    """Sleep between later tokens."""
    block_size: int = 16
    """Block size of the toy prefix cache behind `cached_tokens`."""
    cache_blocks: int = 100_000
    """Prefix-cache capacity in blocks (LRU)."""
    model: str = "null"
    """The name `/v1/models` lists (requests for any model are answered)."""

    def __post_init__(self) -> None:
        for name in ("first_token_delay_s", "token_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1 or self.cache_blocks < 1:
            raise ValueError(
                f"block_size and cache_blocks must be >= 1, got "
                f"{self.block_size}, {self.cache_blocks}"
            )


def _filler(i: int) -> str:
    return f" t{i}"


def _filler_ids(n: int) -> list[int]:
    return [100 + k % 1000 for k in range(n)]


def openai_chunks(call: CompletionCall, cached: int) -> list[GenerateChunk]:
    """The output as one chunk per token (the last one with finish reason "length")."""
    n, prompt = call.sampling.max_new_tokens, len(call.input_ids)
    return [
        GenerateChunk(
            (100 + i % 1000,), _filler(i), prompt, i + 1, cached, "length" if i == n - 1 else None
        )
        for i in range(n)
    ]


def generate_answer(call: GenerateRequest, n: int, cached: int) -> dict[str, Any]:
    """SGLang's answer object after `n` output tokens (cumulative text and ids)."""
    done = n == call.sampling.max_new_tokens
    return answer(
        rid=call.rid,
        text="".join(_filler(k) for k in range(n)),
        output_ids=_filler_ids(n),
        finish_reason={"type": "length", "length": n} if done else None,
        prompt_tokens=len(call.input_ids),
        cached_tokens=cached,
        e2e_latency=0.0,
    )


class PrefixCache:
    """LRU set of chained block hashes: how much of a prompt was seen before. Mutating."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def lookup_and_insert(self, ids: list[int]) -> int:
        """Cached prefix length (tokens) of `ids`, then remember all of its full blocks."""
        hits = 0
        hashes = hash_blocks(ids, self.block_size)
        for h in hashes:
            if h not in self._blocks:
                break
            hits += 1
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return hits * self.block_size


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bad requests, unknown paths and methods answer with OpenAI-style JSON errors."""
    try:
        return await handler(request)
    except APIError as exc:
        return _error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(APIError(exc.status, exc.reason))


def _error(exc: APIError) -> web.Response:
    return web.Response(status=exc.status, body=exc.encode(), content_type="application/json")


class NullServer:
    """Request handlers; state is the prefix cache and a request counter."""

    def __init__(self, config: NullConfig) -> None:
        self.config = config
        self.cache = PrefixCache(config.block_size, config.cache_blocks)
        self.served = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[json_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "served": self.served})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.config.model, "object": "model", "owned_by": "prfaas-null"}],
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic Messages: the chat answer as the message (or its events)."""
        body = load_json(await request.read())
        call = anthropic_messages.parse_call(body, _limits(body), _BYTES)
        acc, chunks = self._chat(call)
        if not call.stream:
            await self._pause(len(chunks))
            return web.json_response(anthropic_answer.message(_whole(acc, chunks)))
        stream = anthropic_answer.MessageStream()
        events = (e for c in chunks for e in stream.feed(_delta(acc, c)))
        return await self._stream(
            request, "messages", events, lambda: [*stream.feed(acc.usage_chunk()), *stream.done()]
        )

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI Responses (stateless): the chat answer as the response (or its events)."""
        body = load_json(await request.read())
        call = openai_responses.parse_call(body, _limits(body), _BYTES)
        acc, chunks = self._chat(call)
        response_id = f"resp_null{self.served}"
        if not call.stream:
            await self._pause(len(chunks))
            return web.json_response(responses_answer.response(body, _whole(acc, chunks),
                                                               response_id))  # fmt: skip
        stream = ResponseStream(body, response_id, int(time.time()), call.model)
        events = (e for c in chunks for e in stream.feed(_delta(acc, c)))
        named = ((e["type"], e) for e in itertools.chain(stream.start(), events))
        return await self._stream(
            request,
            "responses",
            named,
            lambda: [(e["type"], e) for e in stream.finish(acc.usage())],
        )

    def _chat(self, call: CompletionCall) -> tuple[Accumulator, list[GenerateChunk]]:
        """The filler answer of `call` as a chat answer's pieces."""
        self.served += 1
        cached = self.cache.lookup_and_insert(list(call.input_ids))
        chat = replace(call, api="chat")
        return Accumulator(chat, f"chatcmpl-null{self.served}", int(time.time())), openai_chunks(
            chat, cached
        )

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        body = load_json(await request.read())
        self.served += 1
        rid = f"null-{self.served}"
        if api == "generate":
            call = parse_request(body, _BYTES.encode, lambda: rid)
            cached = self.cache.lookup_and_insert(list(call.input_ids))
            n = call.sampling.max_new_tokens
            if not call.stream:  # a stream takes its delays event by event (`_stream`)
                await self._pause(n)
                return web.json_response(generate_answer(call, n, cached))
            answers = ((None, generate_answer(call, i + 1, cached)) for i in range(n))
            return await self._stream(request, "completions", answers, list)
        limits = _limits(body)  # the null server answers for any model name
        api_name: Api = "chat" if api == "chat" else "completions"
        # `forward` reads only the model, prompt and max tokens (all a null answer uses) and
        # takes any other field, the PD fields of a router or our gateway's too
        completion = parse_call(body, api_name, limits, _BYTES, "forward", pd_fields=True)
        cached = self.cache.lookup_and_insert(list(completion.input_ids))
        acc = Accumulator(completion, rid, int(time.time()))
        chunks = openai_chunks(completion, cached)
        if not completion.stream:
            await self._pause(len(chunks))
            for chunk in chunks:
                acc.add(chunk)
            return web.json_response(acc.final())
        events = ((None, _delta(acc, c)) for c in chunks)
        usage = completion.include_usage
        return await self._stream(request, api_name, events,
                                  lambda: [(None, acc.usage_chunk())] if usage else [])  # fmt: skip

    async def _pause(self, tokens: int) -> None:
        delay = self.config.first_token_delay_s + self.config.token_delay_s * (tokens - 1)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _stream(
        self,
        request: web.Request,
        api: Api,
        events: Iterator[tuple[str | None, dict[str, Any]]],
        after: Callable[[], list[tuple[str | None, dict[str, Any]]]],
    ) -> web.StreamResponse:
        """`events` (name, data), then what `after` gives once they were sent, then the
        API's end (`data: [DONE]` where it has one); delays as configured."""
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for i, (name, event) in enumerate(events):
            delay = self.config.first_token_delay_s if i == 0 else self.config.token_delay_s
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(sse.frame(api, orjson.dumps(event), name))
        for name, event in after():
            await resp.write(sse.frame(api, orjson.dumps(event), name))
        await resp.write(sse.end(api))
        await resp.write_eof()
        return resp


def _delta(acc: Accumulator, chunk: GenerateChunk) -> dict[str, Any]:
    acc.add(chunk)
    return acc.chunk(chunk)


def _whole(acc: Accumulator, chunks: list[GenerateChunk]) -> dict[str, Any]:
    for chunk in chunks:
        acc.add(chunk)
    return acc.final()


def _limits(body: dict[str, Any]) -> ModelLimits:
    """Any model is served: the limits name the body's."""
    model = body.get("model")
    return ModelLimits(model if isinstance(model, str) and model else "null", MAX_CONTEXT)


async def serve(config: NullConfig, host: str, port: int) -> None:
    """Serve until cancelled; prints `prfaas-null listening on http://HOST:PORT` first."""
    runner = web.AppRunner(NullServer(config).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"prfaas-null listening on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Null server (not an engine): instant answers.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--first-token-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--token-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        config = NullConfig(args.first_token_delay, args.token_delay, args.block_size)
    except ValueError as exc:
        print(f"prfaas-null: error: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        run_main(serve(config, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
