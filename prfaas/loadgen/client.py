"""The streaming benchmark client: one request in, one `RequestRecord` (and the answer) out.

Latencies are read from `time.perf_counter` (a measurement clock, injectable); scheduling
elsewhere uses the event loop's clock. Errors, bad status codes, broken streams and
timeouts become failed records: they are counted, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from prfaas.loadgen.apis import StreamApi, StreamState
from prfaas.loadgen.conversation import Conversation
from prfaas.loadgen.records import RequestRecord

ROUTE_HEADER = "x-prfaas-route"
INCREMENTAL_HEADER = "x-prfaas-incremental-tokens"
_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


@dataclass(frozen=True)
class Answer:
    """What the server generated: text, and token ids when the API returns them."""

    text: str
    output_ids: list[int] | None


@dataclass(frozen=True)
class RequestSpec:
    """Identity and timing of one request to send."""

    request_id: str
    session_id: int
    turn: int
    scheduled_s: float
    max_tokens: int


class _Timing:
    """Chunk arrival times of one stream."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.sent = clock()
        self.first: float | None = None
        self.last = self.sent
        self.end = self.sent
        self.itl: list[float] = []

    def token(self) -> None:
        now = self.clock()
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now


class StreamingClient:
    """Sends streaming requests over one shared aiohttp session (owned by the caller)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        api: StreamApi,
        *,
        model: str,
        timeout_s: float,
        origin: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 s, got {timeout_s}")
        self._session = session
        self._url = base_url.rstrip("/") + api.path
        self._api = api
        self._model = model
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 10))
        self._origin = origin
        self._clock = clock

    def mark_origin(self) -> None:
        """Measure `start_s` offsets from now (the run's schedule time 0). Mutates."""
        self._origin = self._clock()

    async def send(self, spec: RequestSpec, conv: Conversation) -> tuple[RequestRecord, Answer]:
        """Send `conv` as one streaming request and measure it. Never raises on server faults."""
        body = orjson.dumps(
            self._api.body(conv, spec.max_tokens, spec.request_id, self._model), option=_JSON_OPTS
        )
        state = StreamState()
        timing = _Timing(self._clock)
        status: int | None = None
        headers: dict[str, str] = {}
        try:
            status, headers = await self._stream(body, spec.request_id, state, timing)
        except TimeoutError:
            state.error = f"timeout after {self._timeout.total:g}s"
        except aiohttp.ClientError as exc:
            state.error = f"connection error: {exc.__class__.__name__}: {exc}"
        timing.end = self._clock()
        record = self._record(spec, conv, state, timing, status, headers)
        return record, Answer("".join(state.text), state.output_ids)

    async def _stream(
        self, body: bytes, rid: str, state: StreamState, timing: _Timing
    ) -> tuple[int, dict[str, str]]:
        req_headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        async with self._session.post(
            self._url, data=body, headers=req_headers, timeout=self._timeout
        ) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-")}
            if resp.status >= 400:
                state.error = f"HTTP {resp.status}: {await _error_message(resp)}"
                return resp.status, headers
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                self._chunk(data, state, timing)
            if not done and state.error is None:
                state.error = "stream ended without [DONE]"
            return resp.status, headers

    def _chunk(self, data: bytes, state: StreamState, timing: _Timing) -> None:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            state.error = f"malformed stream chunk: {data[:80]!r}"
            return
        if isinstance(chunk, dict) and self._api.consume(chunk, state):
            timing.token()

    def _record(
        self,
        spec: RequestSpec,
        conv: Conversation,
        state: StreamState,
        timing: _Timing,
        status: int | None,
        headers: dict[str, str],
    ) -> RequestRecord:
        ok = state.error is None and timing.first is not None
        error = state.error or (None if ok else "no output tokens in the stream")
        return RequestRecord(
            request_id=spec.request_id,
            session_id=spec.session_id,
            turn=spec.turn,
            scheduled_s=spec.scheduled_s,
            start_s=timing.sent - self._origin,
            ok=ok,
            error=error,
            status=status,
            ttft_s=None if timing.first is None else timing.first - timing.sent,
            e2e_s=timing.end - timing.sent if ok else None,
            itl_s=tuple(timing.itl),
            sent_tokens=conv.sent_tokens(),
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            cached_tokens=state.cached_tokens,
            route=headers.get(ROUTE_HEADER),
            incremental_tokens=_int_or_none(headers.get(INCREMENTAL_HEADER)),
        )


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    raw = await resp.content.read(65536)
    try:
        data = orjson.loads(raw)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message", err) if isinstance(err, dict) else err
        return str(message)[:300]
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace").strip()[:300] or resp.reason or "error"


def _int_or_none(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
