"""The null server: NOT an engine. It runs no model and answers instantly with filler tokens.

It exists only to measure overhead: of the load generator (benchmarks/loadgen.py) and, later,
of the gateway. It speaks just enough of the real protocols for that:

- OpenAI `/v1/completions` and `/v1/chat/completions`, streaming (SSE) or not, with `usage`
  including `prompt_tokens_details.cached_tokens`;
- SGLang's `/generate`: streamed `data: {"text", "output_ids", "meta_info": {"id",
  "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}}` chunks (text and
  ids cumulative, as SGLang streams them by default), then `data: [DONE]`;
- `/health`, `/v1/models`.

Output length is the request's `max_tokens` / `max_new_tokens` (default
`NullConfig.output_tokens`). `cached_tokens` comes from a toy prefix cache of full blocks of
prompt ids (text prompts count one token per word), so clients can check hit-rate plumbing.
Run: `python -m prfaas.testing.null_server --port P` (port 0 picks a free one; the first stdout line
says which).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import sys
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from prfaas.common.hashing import hash_blocks

MAX_OUTPUT_TOKENS = 1_000_000


@dataclass(frozen=True)
class NullConfig:
    """Behaviour of the null server."""

    output_tokens: int = 16
    """Tokens generated when a request does not say."""
    first_token_delay_s: float = 0.0
    """Sleep before the first token (a stand-in for prefill time)."""
    token_delay_s: float = 0.0
    """Sleep between later tokens."""
    block_size: int = 16
    """Block size of the toy prefix cache behind `cached_tokens`."""
    cache_blocks: int = 100_000
    """Prefix-cache capacity in blocks (LRU)."""
    model: str = "null"

    def __post_init__(self) -> None:
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        for name in ("first_token_delay_s", "token_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1 or self.cache_blocks < 1:
            raise ValueError(
                f"block_size and cache_blocks must be >= 1, got "
                f"{self.block_size}, {self.cache_blocks}"
            )


def _int_field(body: dict[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise ValueError(f"{key} must be an integer in [1, {MAX_OUTPUT_TOKENS}], got {value!r}")
    return value


def _prompt(value: object, key: str) -> tuple[list[int], str]:
    if isinstance(value, str):
        return [], value
    if isinstance(value, list) and value and _token_ids(value):
        return value, ""
    raise ValueError(f"{key} must be a string or a non-empty list of token ids")


def _token_ids(values: list[object]) -> bool:
    """Whether every value is a uint32 token id (JSON `true`/`false` pass as 1/0, as in a
    lax pydantic `list[int]`). Packing them as uint32 checks that in C: a per-item Python
    check costs ~20 us per 500 ids, more than the text path's whole work, which would bias
    overhead measurements against clients that send token ids."""
    try:
        array.array("I", values)  # type: ignore[type-var]
    except (TypeError, OverflowError):
        return False
    return True


def _chat_text(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts = [m.get("content") if isinstance(m, dict) else None for m in messages]
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("every message needs a string content")
    return " ".join(str(p) for p in parts)


@dataclass(frozen=True)
class NullRequest:
    """The parts of a request the null server looks at."""

    api: str
    rid: str
    model: str
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    stream: bool
    include_usage: bool

    @classmethod
    def parse(cls, body: object, api: str, default_tokens: int, rid: str) -> NullRequest:
        """Validate a request body. Raises ValueError naming the bad field."""
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        if api == "generate":
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise ValueError("sampling_params must be an object")
            key = "input_ids" if body.get("input_ids") is not None else "text"
            ids, text = _prompt(body.get(key), key)
            n_out = _int_field(params, "max_new_tokens", default_tokens)
        else:
            if api == "chat":
                ids, text = [], _chat_text(body.get("messages"))
            else:
                ids, text = _prompt(body.get("prompt"), "prompt")
            key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            n_out = _int_field(body, key, default_tokens)
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage", False))
        return cls(
            api,
            str(body.get("rid") or rid),
            str(body.get("model", "")),
            ids,
            text,
            n_out,
            bool(body.get("stream", False)),
            usage,
        )


def _usage(n_prompt: int, n_out: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_out,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_text(i: int) -> str:
    return f" t{i}"


def openai_chunk(req: NullRequest, i: int | None, n_prompt: int, cached: int) -> dict[str, Any]:
    """Stream chunk for output token `i`, or the final usage-only chunk when `i` is None."""
    chat = req.api == "chat"
    out: dict[str, Any] = {
        "id": req.rid,
        "created": int(time.time()),
        "model": req.model,
        "object": "chat.completion.chunk" if chat else "text_completion",
    }
    if i is None:
        return {**out, "choices": [], "usage": _usage(n_prompt, req.max_tokens, cached)}
    finish = "length" if i == req.max_tokens - 1 else None
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"role": "assistant", "content": _token_text(i)}
    else:
        choice.update(text=_token_text(i), logprobs=None)
    return {**out, "choices": [choice], "usage": None}


def openai_final(req: NullRequest, n_prompt: int, cached: int) -> dict[str, Any]:
    """Non-streaming response (OpenAI shape, or SGLang's for `/generate`)."""
    text = "".join(_token_text(i) for i in range(req.max_tokens))
    if req.api == "generate":
        return sglang_chunk(req, req.max_tokens - 1, n_prompt, cached)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if req.api == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, logprobs=None)
    obj = "chat.completion" if req.api == "chat" else "text_completion"
    return {
        "id": req.rid,
        "object": obj,
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": _usage(n_prompt, req.max_tokens, cached),
    }


def sglang_chunk(req: NullRequest, i: int, n_prompt: int, cached: int) -> dict[str, Any]:
    """SGLang `/generate` chunk after token `i`: cumulative text and ids, `meta_info`."""
    n = i + 1
    finish = {"type": "length", "length": req.max_tokens} if n == req.max_tokens else None
    meta = {
        "id": req.rid,
        "finish_reason": finish,
        "prompt_tokens": n_prompt,
        "completion_tokens": n,
        "cached_tokens": cached,
    }
    return {
        "text": "".join(_token_text(k) for k in range(n)),
        "output_ids": [100 + k % 1000 for k in range(n)],
        "meta_info": meta,
    }


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


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """An OpenAI-style JSON error."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Unknown paths and methods answer with OpenAI-style JSON errors, not aiohttp's text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason, "not_found_error")


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

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
            req = NullRequest.parse(body, api, self.config.output_tokens, f"null-{self.served}")
        except (orjson.JSONDecodeError, ValueError) as exc:
            return error_response(400, f"bad request: {exc}")
        self.served += 1
        ids = req.prompt_ids or [zlib.crc32(w.encode()) for w in req.prompt_text.split()]
        cached = self.cache.lookup_and_insert(ids)
        if not req.stream:
            await self._pause(req.max_tokens)
            return web.Response(
                body=orjson.dumps(openai_final(req, len(ids), cached)),
                content_type="application/json",
            )
        return await self._stream(request, req, len(ids), cached)

    async def _pause(self, tokens: int) -> None:
        delay = self.config.first_token_delay_s + self.config.token_delay_s * (tokens - 1)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _stream(
        self, request: web.Request, req: NullRequest, n_prompt: int, cached: int
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for i in range(req.max_tokens):
            delay = self.config.first_token_delay_s if i == 0 else self.config.token_delay_s
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(_sse(self._chunk(req, i, n_prompt, cached)))
        if req.api != "generate" and req.include_usage:
            await resp.write(_sse(openai_chunk(req, None, n_prompt, cached)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _chunk(self, req: NullRequest, i: int, n_prompt: int, cached: int) -> dict[str, Any]:
        if req.api == "generate":
            return sglang_chunk(req, i, n_prompt, cached)
        return openai_chunk(req, i, n_prompt, cached)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


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
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--first-token-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--token-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        config = NullConfig(
            args.output_tokens, args.first_token_delay, args.token_delay, args.block_size
        )
    except ValueError as exc:
        print(f"prfaas-null: error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(serve(config, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
