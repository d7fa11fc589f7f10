"""The SGLang engine client: SGLang's `/generate` PD protocol over HTTP, for the reference
engine and real SGLang servers alike.

`/generate` goes over lean keep-alive HTTP/1.1 connections per engine (`prfaas.http.client`:
the gateway's hot path, two calls per request), parsed by the connection's protocol as bytes
arrive; the control calls (`/health`, `/get_load`, `/server_info`, `/abort_request`) use the
one `aiohttp.ClientSession` shared by every client of a gateway (its owner creates and closes
it). Every call carries explicit timeouts. Output is streamed (`stream: true`, SSE of
cumulative `text` / `output_ids`, turned into deltas here) or whole. Aborting a call that the
engine may still be working on drops its connection and posts `/abort_request` for the rid,
so the engine frees the request's slot and KV at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
from yarl import URL

from prfaas.engines.client import (
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineStats,
    QueuedCall,
    Role,
)
from prfaas.http.client import ConnectFailed, ConnectionPool, HttpCall, post
from prfaas.protocol.generate import AnswerError, GenerateChunk, GenerateRequest, parse_answer

logger = logging.getLogger(__name__)
STATS_PATHS = ("/stats", "/get_load")
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_ERROR_BODY = 4096  # bytes of an error answer kept for its message
_ROLES: dict[str, Role] = {"prefill": "prefill", "decode": "decode", "null": "both"}


@dataclass(frozen=True)
class SGLangClientConfig:
    """Timeouts of the engine calls, in seconds."""

    connect_timeout_s: float = 5.0
    """Opening a connection to an engine."""
    read_timeout_s: float = 300.0
    """Longest silence between two pieces of a generate answer (covers a long prefill)."""
    total_timeout_s: float = 3600.0
    """Whole generate call."""
    control_timeout_s: float = 5.0
    """Whole `/health`, `/server_info`, `/get_load` and `/abort_request` calls."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def control_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.control_timeout_s, connect=self.connect_timeout_s)


def _parse_load(load: Any) -> EngineStats:
    if isinstance(load, dict) and "waiting" in load:  # the reference engine's /stats
        return EngineStats(
            waiting=int(load["waiting"]),
            running=int(load.get("running", 0)),
            kv_blocks_used=int(load.get("kv_blocks_used", 0)),
            kv_blocks_total=int(load.get("kv_blocks_total", 0)),
        )
    ranks = load if isinstance(load, list) else [load or {}]  # SGLang: one entry per DP rank
    return EngineStats(
        waiting=sum(int(r.get("num_waiting_reqs", 0)) for r in ranks),
        running=sum(int(r.get("num_reqs", 0)) for r in ranks),
    )


class _GenerateCall(QueuedCall):
    """One `/generate` call: the HTTP response handler that turns the answer into chunks.

    A whole answer becomes one chunk when it is complete; a stream's `data:` events become
    delta chunks as they arrive (SGLang streams cumulative text and ids).
    """

    def __init__(self, client: SGLangClient, request: GenerateRequest) -> None:
        super().__init__()
        self.client, self.rid, self.stream = client, request.rid, request.stream
        self.status = 0
        self._body = bytearray()  # a whole answer, or a stream's unfinished line
        self._text_len = self._ids_len = 0
        self._stream_done = False
        self.http: HttpCall = client.post(request, self)

    # -- ResponseHandler -------------------------------------------------------------------

    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes) -> None:
        if self.status != 200 or not self.stream:
            if len(self._body) < MAX_ERROR_BODY or self.status == 200:
                self._body += data
            return
        self._body += data
        start = 0
        while (end := self._body.find(b"\n", start)) >= 0:
            self._line(bytes(self._body[start:end]))
            start = end + 1
        del self._body[:start]

    def on_end(self, error: BaseException | None) -> None:
        if self.ended.done():
            return
        client = self.client
        if error is not None:
            if isinstance(error, ConnectFailed):
                self.finish(EngineError(f"{client.instance_id}: unreachable: {error}",
                                        retryable=True))  # fmt: skip
                return
            if not isinstance(error, EngineError):  # a bad stream event is one already
                error = EngineError(f"{client.instance_id}: generate failed: {error!r}")
            self._fail(error)
            return
        if self.status != 200:
            detail = bytes(self._body[:300]).decode(errors="replace")
            self.finish(
                EngineError(
                    f"{client.instance_id}: /generate answered {self.status}: {detail}",
                    status=503 if self.status in (429, 503) else 502,
                    retryable=self.status in (429, 503),
                )
            )
            return
        try:
            if self.stream:
                if self._body:
                    self._line(bytes(self._body))  # a last line without its newline
            else:
                self.push(self._answer(bytes(self._body)))
        except EngineError as exc:
            self._fail(exc)
            return
        self.finish()

    # -- answers ---------------------------------------------------------------------------

    def _line(self, line: bytes) -> None:
        """One line of the SSE stream; raises EngineError for a bad event (the parser
        callback's error fails the HTTP call, which ends here through `on_end`)."""
        if self._stream_done or not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self._stream_done = True
            return
        if not payload:
            return
        whole = self._answer(payload)
        text_len, ids_len = self._text_len, self._ids_len
        self._text_len = max(text_len, len(whole.text))
        self._ids_len = max(ids_len, len(whole.token_ids))
        self.push(replace(whole, token_ids=whole.token_ids[ids_len:], text=whole.text[text_len:]))

    def _answer(self, payload: bytes) -> GenerateChunk:
        try:
            return parse_answer(orjson.loads(payload))
        except orjson.JSONDecodeError:
            message = f"{self.client.instance_id}: bad answer {payload[:80]!r}"
        except AnswerError as exc:
            message = f"{self.client.instance_id}: {exc}"
        raise EngineError(message)

    def _fail(self, error: EngineError) -> None:
        """A failure after the request was sent: the engine may still be running it."""
        if self.http.sent:
            self.client.abort_later(self.rid)
        self.finish(error)

    def _stop(self) -> None:
        if self.http.cancel() and self.http.sent:  # in flight: the engine may be computing it
            self.client.abort_later(self.rid)


class SGLangClient(BaseEngineClient):
    """A client of one SGLang-compatible engine at `base_url` (no trailing slash)."""

    def __init__(
        self,
        instance_id: str,
        base_url: str,
        session: aiohttp.ClientSession,
        config: SGLangClientConfig | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.base_url = base_url.rstrip("/")
        url = URL(self.base_url)
        if url.scheme not in ("http", "https") or url.host is None or url.port is None:
            raise ValueError(f"engine URL must be http(s)://host[:port], got {base_url!r}")
        self._generate_path = f"{url.path.rstrip('/')}/generate"
        self._pool = ConnectionPool(url.host, url.port, tls=url.scheme == "https")
        self._session = session
        self._config = config or SGLangClientConfig()
        self._aborts: set[asyncio.Task[None]] = set()
        self._stats_path: str | None = None
        self._control_timeout = self._config.control_timeout()

    def generate(self, request: GenerateRequest) -> EngineCall:
        return _GenerateCall(self, request)

    def post(self, request: GenerateRequest, call: _GenerateCall) -> HttpCall:
        """Send `request`'s `/generate` now; `call` handles the answer. The prefill and the
        decode call of one request carry the same body (`GenerateRequest.body`, encoded once)."""
        cfg = self._config
        return post(
            self._pool,
            self._generate_path,
            request.body,
            call,
            connect_s=cfg.connect_timeout_s,
            read_s=cfg.read_timeout_s,
            total_s=cfg.total_timeout_s,
        )

    def abort_later(self, rid: str) -> None:
        """Post `/abort_request` for `rid` in the background (best effort)."""
        task = asyncio.get_running_loop().create_task(self._abort(rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, rid: str) -> None:
        # RuntimeError: the shared session closed first (gateway shutting down).
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, EngineError, RuntimeError):
            await self._control("POST", "/abort_request", {"rid": rid})

    async def _control(
        self,
        method: str,
        path: str,
        body: Any = None,
        limit: aiohttp.ClientTimeout | None = None,
    ) -> Any:
        async with self._session.request(
            method,
            f"{self.base_url}{path}",
            data=None if body is None else orjson.dumps(body),
            headers=JSON_HEADERS,
            timeout=limit or self._control_timeout,
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise EngineError(f"{self.instance_id}: {path} answered {resp.status}")
            return orjson.loads(raw) if raw else None

    async def health(self) -> bool:
        """True when `/health` answers 200 within the control timeout."""
        try:
            await self._control("GET", "/health")
        except (aiohttp.ClientError, TimeoutError, EngineError, orjson.JSONDecodeError):
            return False
        return True

    async def stats(self) -> EngineStats:
        """Load from `/stats` (reference engine) or `/get_load` (SGLang), whichever answers."""
        paths = [self._stats_path] if self._stats_path else list(STATS_PATHS)
        for path in paths:
            try:
                load = await self._control("GET", path)
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
                raise EngineError(f"{self.instance_id}: {path} failed: {exc!r}") from exc
            except EngineError:
                continue
            self._stats_path = path
            return _parse_load(load)
        raise EngineError(f"{self.instance_id}: no load endpoint among {paths}")

    async def info(self) -> EngineInfo:
        try:
            info = await self._control("GET", "/server_info")
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise EngineError(f"{self.instance_id}: /server_info failed: {exc!r}") from exc
        mode = str(info.get("disaggregation_mode") or "null")
        port = info.get("disaggregation_bootstrap_port")
        return EngineInfo(
            role=_ROLES.get(mode, "both"),
            page_size=int(info.get("page_size") or 1),
            bootstrap_host=info.get("disaggregation_bootstrap_host") or info.get("host"),
            bootstrap_port=int(port) if port is not None else None,
            model=str(info.get("served_model_name") or info.get("model_path") or ""),
        )

    async def set_role(self, role: Role, *, timeout_s: float) -> float:
        """`POST /admin/role` (the reference engine's role API: it drains, then switches)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=self._config.connect_timeout_s)
        try:
            answer = await self._control("POST", "/admin/role", {"role": role}, timeout)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise EngineError(f"{self.instance_id}: /admin/role failed: {exc!r}") from exc
        return float(answer.get("switch_seconds") or 0.0) if isinstance(answer, dict) else 0.0

    async def close(self) -> None:
        """Wait for pending aborts, close pooled generate connections; the shared session
        belongs to the caller."""
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        self._pool.close()
