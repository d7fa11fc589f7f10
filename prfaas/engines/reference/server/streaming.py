"""Shared helpers for the HTTP handlers: JSON bodies, SSE responses, event collection."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from prfaas.engines.reference.server.errors import HandoffFailed
from prfaas.engines.reference.step.request import TokenEvent
from prfaas.protocol.errors import InvalidRequest

MAX_BODY_BYTES = 32 * 1024 * 1024


async def read_json(request: web.Request) -> Any:
    """The decoded JSON body. Raises `InvalidRequest` when it is not JSON."""
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}", code="invalid_json") from exc


@dataclass
class Collected:
    """Everything a request produced."""

    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, object] | None = None
    cached_tokens: int = 0

    def add(self, event: TokenEvent) -> None:
        self.output_ids.extend(event.token_ids)
        self.cached_tokens = event.cached_tokens or self.cached_tokens
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            check_abort(event.finish_reason)


def check_abort(reason: dict[str, object]) -> None:
    """Raise `HandoffFailed` for an abort that carries an HTTP status."""
    status = reason.get("status_code")
    if reason.get("type") == "abort" and isinstance(status, int):
        raise HandoffFailed(str(reason.get("message")), status)


async def collect(events: AsyncGenerator[TokenEvent, None]) -> Collected:
    """Run a request to the end."""
    result = Collected()
    async with aclosing(events) as it:
        async for event in it:
            result.add(event)
    return result


async def open_sse(request: web.Request) -> web.StreamResponse:
    """Start a `text/event-stream` response."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, payload: Any) -> None:
    """One `data: ...` event (`[DONE]` is sent verbatim)."""
    data = b"[DONE]" if payload == "[DONE]" else orjson.dumps(payload)
    await response.write(b"data: " + data + b"\n\n")


def output_text(
    decode: Callable[[list[int]], str],
    ids: list[int],
    reason: dict[str, object] | None,
    stops: Sequence[str] = (),
) -> str:
    """The text a request's output shows so far: a stop token's own text left out (vLLM's
    and SGLang's default), a matched stop string cut (`visible_text`); until the end, an
    incomplete UTF-8 sequence and the last characters that may begin one of `stops` held
    back, so streamed text is never taken back."""
    stopped_on_token = reason is not None and isinstance(reason.get("matched"), int)
    text = visible_text(stable_text(decode(ids[:-1] if stopped_on_token else ids),
                                    reason is not None), reason)  # fmt: skip
    hold = max((len(stop) for stop in stops), default=1) - 1
    return text if reason is not None or not hold else text[: max(len(text) - hold, 0)]


def visible_text(text: str, reason: dict[str, object] | None) -> str:
    """The output text as SGLang shows it: cut before the matched stop string (its last
    occurrence: the one the last token completed)."""
    matched = reason.get("matched") if reason is not None else None
    if isinstance(matched, str) and reason is not None and reason.get("type") == "stop":
        cut = text.rfind(matched)
        return text if cut < 0 else text[:cut]
    return text


def stable_text(text: str, final: bool) -> str:
    """Hold back a trailing replacement character (an incomplete UTF-8 sequence) until the
    end, so streamed deltas never need to be retracted."""
    return text if final else text.rstrip("\ufffd")
