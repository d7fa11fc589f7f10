"""OpenAI `/v1/completions`, `/v1/chat/completions` and `/v1/models` on the engine, for direct
use (the gateway talks SGLang's `/generate`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from typing import Any

from aiohttp import web

from prfaas.common.tokenizer import ChatMessage
from prfaas.engines.reference.handoff.base import HandoffError
from prfaas.engines.reference.server.app_keys import INFO, SERVICE, TOKENIZER, error_for
from prfaas.engines.reference.server.service import Unavailable
from prfaas.engines.reference.server.streaming import (
    HandoffFailed,
    check_abort,
    collect,
    open_sse,
    openai_finish,
    read_json,
    send_sse,
    stable_text,
    visible_text,
)
from prfaas.engines.reference.step.request import TokenEvent
from prfaas.engines.reference.step.sampling import InvalidRequest, SamplingParams

_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop", "seed",
    "user", "ignore_eos", "stream_options", "presence_penalty", "frequency_penalty",
})  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs"}


def _check_fields(body: Any, allowed: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")
    if body.get("n", 1) != 1:
        raise InvalidRequest(f"only n=1 is supported, got n={body.get('n')!r}")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key, 0) not in (0, 0.0, None):
            raise InvalidRequest(f"{key} is not supported (must be 0)")
    if body.get("echo") or body.get("logprobs"):
        raise InvalidRequest("echo and logprobs are not supported")
    if not isinstance(body.get("stream", False), bool):
        raise InvalidRequest(f"stream must be a boolean, got {body.get('stream')!r}")
    return body


def _params(body: Mapping[str, Any], max_key: str = "max_tokens") -> SamplingParams:
    raw = {
        "max_new_tokens": body.get(max_key, body.get("max_tokens", 16)),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": body.get("stop"),
        "seed": body.get("seed"),
        "ignore_eos": body.get("ignore_eos"),
    }
    return SamplingParams.from_json({k: v for k, v in raw.items() if v is not None})


def _prompt_ids(prompt: Any, encode: Callable[[str], list[int]]) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    raise InvalidRequest("prompt must be a string or a list of token ids (one prompt)")


def _messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        ok = isinstance(m, Mapping) and isinstance(m.get("role"), str)
        if not ok or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}] must have string role and content")
        out.append(ChatMessage(m["role"], m["content"]))
    return out


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions`."""
    tok = request.app[TOKENIZER]
    try:
        body = _check_fields(await read_json(request), COMPLETION_FIELDS)
        prompt = _prompt_ids(body.get("prompt"), tok.encode)
        return await _serve(request, body, prompt, _params(body), chat=False)
    except (InvalidRequest, Unavailable, HandoffError, HandoffFailed) as exc:
        return error_for(exc)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions` (the engine's minimal chat template)."""
    tok = request.app[TOKENIZER]
    try:
        body = _check_fields(await read_json(request), CHAT_FIELDS)
        prompt = tok.apply_chat_template(_messages(body.get("messages")))
        params = _params(body, "max_completion_tokens")
        return await _serve(request, body, prompt, params, chat=True)
    except (InvalidRequest, Unavailable, HandoffError, HandoffFailed) as exc:
        return error_for(exc)


async def _serve(
    request: web.Request, body: Mapping[str, Any], prompt: list[int], params: SamplingParams,
    *, chat: bool,
) -> web.StreamResponse:  # fmt: skip
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    events = request.app[SERVICE].generate(rid, prompt, params, None)
    head = _Head(rid, request.app[INFO].model, chat, len(prompt))
    if body.get("stream", False):
        options = body.get("stream_options") or {}
        usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
        return await _stream(request, events, head, usage)
    result = await collect(events)
    text = visible_text(request.app[TOKENIZER].decode(result.output_ids), result.finish_reason)
    finish = openai_finish(result.finish_reason)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return web.json_response(
        {**head.envelope(chunk=False), "choices": [choice], "usage": head.usage(result.output_ids)}
    )


class _Head:
    """The fields every response object and chunk repeats."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int) -> None:
        self.rid, self.model, self.chat, self.prompt_tokens = rid, model, chat, prompt_tokens
        self.created = int(time.time())

    def envelope(self, *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def usage(self, output_ids: list[int]) -> dict[str, int]:
        n = len(output_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}  # fmt: skip

    def chunk(self, delta: str | None, finish: str | None, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            d: dict[str, str] = {"role": "assistant"} if first else {}
            choice["delta"] = d | ({"content": delta} if delta else {})
        else:
            choice["text"] = delta or ""
        return {**self.envelope(chunk=True), "choices": [choice]}


async def _stream(
    request: web.Request, events: AsyncGenerator[TokenEvent, None], head: _Head, usage: bool
) -> web.StreamResponse:
    decode = request.app[TOKENIZER].decode
    ids: list[int] = []
    sent, first = "", True
    response: web.StreamResponse | None = None
    async with aclosing(events) as it:
        async for event in it:
            if first and event.finish_reason is not None:
                check_abort(event.finish_reason)
            response = response or await open_sse(request)
            ids.extend(event.token_ids)
            final = event.finish_reason is not None
            text = visible_text(stable_text(decode(ids), final), event.finish_reason)
            finish = openai_finish(event.finish_reason)
            await send_sse(response, head.chunk(text[len(sent) :], finish, first))
            sent, first = text, False
    assert response is not None
    if usage:
        await send_sse(response, {**head.envelope(chunk=True), "choices": [],
                                  "usage": head.usage(ids)})  # fmt: skip
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
