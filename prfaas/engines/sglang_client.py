"""HTTP engine client: SGLang's `/generate` PD protocol, for the reference engine and real
SGLang servers alike.

`/generate` goes over a lean keep-alive HTTP/1.1 connection pool per engine
(`http_wire.py`: the gateway's hot path, two calls per request); the control calls
(`/health`, `/get_load`, `/server_info`, `/abort_request`) use the one `aiohttp.ClientSession`
shared by every client of a gateway (its owner creates and closes it). Every call carries
explicit timeouts. Output is streamed (`stream: true`) or whole; SGLang streams cumulative
`text` / `output_ids`, which this client turns into deltas. Cancelling a `generate`
iteration closes its connection and posts `/abort_request` for the rid, so the engine frees
the request's slot and KV at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
from yarl import URL

from prfaas.engines.client import (
    BaseEngineClient,
    EngineError,
    EngineInfo,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
    Role,
)
from prfaas.http.wire import ConnectFailed, WireError, WirePool, WireResponse
from prfaas.http.wire_whole import Outcome, WholeResponse, post_whole

logger = logging.getLogger(__name__)
STATS_PATHS = ("/stats", "/get_load")
JSON_HEADERS = {"Content-Type": "application/json"}
_ROLES: dict[str, Role] = {"prefill": "prefill", "decode": "decode", "null": "both"}


@dataclass(frozen=True)
class SGLangClientConfig:
    """Timeouts of the engine calls, in seconds."""

    connect_timeout_s: float = 5.0
    """Opening a connection to an engine."""
    read_timeout_s: float = 300.0
    """Longest silence between two chunks of a generate stream (covers a long prefill)."""
    total_timeout_s: float = 3600.0
    """Whole generate call."""
    control_timeout_s: float = 5.0
    """Whole `/health`, `/server_info`, `/get_load` and `/abort_request` calls."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def generate_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=self.total_timeout_s,
            connect=self.connect_timeout_s,
            sock_read=self.read_timeout_s,
        )

    def control_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.control_timeout_s, connect=self.connect_timeout_s)


def request_body(request: GenerateRequest) -> dict[str, Any]:
    """The `/generate` body: identical for the prefill and the decode instance."""
    body: dict[str, Any] = {
        "rid": request.rid,
        "input_ids": request.input_ids,  # a tuple: orjson writes it as an array, no copy
        "sampling_params": request.sampling.to_sglang(),
        "stream": request.stream,
    }
    if request.bootstrap is not None:
        body["bootstrap_host"] = request.bootstrap.host
        body["bootstrap_port"] = request.bootstrap.port
        body["bootstrap_room"] = request.bootstrap.room
    return body


class _BodyCache:
    """The encoded `/generate` body of the latest request: the prefill and the decode call
    of one request send the same body, so it is encoded once (an identity check; requests
    are immutable)."""

    def __init__(self) -> None:
        self._request: GenerateRequest | None = None
        self._body = b""

    def encode(self, request: GenerateRequest) -> bytes:
        if request is not self._request:
            self._request, self._body = request, orjson.dumps(request_body(request))
        return self._body


_BODIES = _BodyCache()


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


def _whole_chunk(obj: dict[str, Any]) -> GenerateChunk:
    """One SGLang `/generate` answer object as a chunk: all of its text and ids."""
    if "error" in obj:
        raise EngineError(f"engine reported an error: {str(obj['error'])[:300]}")
    meta = obj.get("meta_info") or {}
    ids = tuple(map(int, obj.get("output_ids") or ()))
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    return GenerateChunk(
        ids,
        str(obj.get("text") or ""),
        int(meta.get("prompt_tokens") or 0),
        int(meta.get("completion_tokens") or len(ids)),
        int(meta.get("cached_tokens") or 0),
        str(reason) if reason is not None else None,
    )


class _Deltas:
    """Turns SGLang's cumulative stream objects into `GenerateChunk` deltas."""

    def __init__(self) -> None:
        self.text_len = 0
        self.ids_len = 0

    def chunk(self, obj: dict[str, Any]) -> GenerateChunk:
        whole = _whole_chunk(obj)
        text_len, ids_len = self.text_len, self.ids_len
        self.text_len = max(text_len, len(whole.text))
        self.ids_len = max(ids_len, len(whole.token_ids))
        return replace(whole, token_ids=whole.token_ids[ids_len:], text=whole.text[text_len:])


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
        self._wire = WirePool(url.host, url.port, tls=url.scheme == "https")
        self._session = session
        self._config = config or SGLangClientConfig()
        self._aborts: set[asyncio.Task[None]] = set()
        self._stats_path: str | None = None
        self._control_timeout = self._config.control_timeout()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        # Abort unless the call finished or the engine refused it: a call cancelled while
        # the engine computes (no response head yet) is aborted too.
        refused = finished = False
        resp: WireResponse | None = None
        try:
            resp = await self._post_generate(request)
            refused = resp.status != 200
            await self._check_status(resp)
            if not request.stream:  # one piece: no line splitting, no inner generator
                chunk = _whole_chunk(self._json(await resp.read()))
                finished = chunk.finish_reason is not None
                yield chunk
                return
            async for chunk in self._stream(resp):
                finished = chunk.finish_reason is not None
                yield chunk
        except ConnectFailed as exc:
            refused = True
            raise self._unreachable(exc) from exc
        except (WireError, OSError, TimeoutError) as exc:
            raise self._failed(exc) from exc
        finally:
            if resp is not None:
                resp.close()  # no-op once the body was read to its end
            if not (refused or finished):
                self._abort_later(request.rid)

    async def complete(self, request: GenerateRequest) -> list[GenerateChunk]:
        """A non-streaming request (`request.stream` False) in one awaitable call. Same
        errors and abort-on-cancel as `generate`."""
        if request.stream:
            return await super().complete(request)
        return await self.begin(request)

    def begin(self, request: GenerateRequest) -> asyncio.Future[list[GenerateChunk]]:
        """Send a non-streaming `/generate` now; the future gets the output or the
        `EngineError`. The connection's protocol reads the response (no task, no read
        loop): the gateway's hot path. As with `generate`, `/abort_request` is posted when
        the engine may still be working on it: the future is cancelled before the answer,
        or the call failed after it was sent (timeout, cut-off response)."""
        if request.stream:
            return super().begin(request)
        out: asyncio.Future[list[GenerateChunk]] = asyncio.get_running_loop().create_future()

        def done(outcome: Outcome) -> None:
            if out.done():
                return
            if isinstance(outcome, WholeResponse):
                try:
                    out.set_result(self._whole_output(outcome))
                except EngineError as exc:
                    out.set_exception(exc)
                except Exception as exc:  # an answer of the wrong shape (bad ids, counts)
                    error = EngineError(f"{self.instance_id}: bad /generate answer: {exc!r}")
                    error.__cause__ = exc
                    out.set_exception(error)
            elif isinstance(outcome, ConnectFailed):
                error = self._unreachable(outcome)
                error.__cause__ = outcome
                out.set_exception(error)
            else:
                error = self._failed(outcome)
                error.__cause__ = outcome
                out.set_exception(error)
                self._abort_later(request.rid)  # it may still be computing the request

        cfg = self._config
        call = post_whole(
            self._wire,
            self._generate_path,
            _BODIES.encode(request),
            connect_s=cfg.connect_timeout_s,
            read_s=cfg.read_timeout_s,
            total_s=cfg.total_timeout_s,
            on_done=done,
        )

        def cancelled(future: asyncio.Future[list[GenerateChunk]]) -> None:
            if future.cancelled() and call.cancel():  # the engine may be computing it
                self._abort_later(request.rid)

        out.add_done_callback(cancelled)
        return out

    def _whole_output(self, resp: WholeResponse) -> list[GenerateChunk]:
        if resp.status != 200:
            raise self._status_error(resp.status, resp.body)
        return [_whole_chunk(self._json(resp.body))]

    def _status_error(self, status: int, body: bytes) -> EngineError:
        detail = body[:300].decode(errors="replace")
        return EngineError(
            f"{self.instance_id}: /generate answered {status}: {detail}",
            status=503 if status in (429, 503) else 502,
            retryable=status in (429, 503),
        )

    def _unreachable(self, exc: BaseException) -> EngineError:
        return EngineError(f"{self.instance_id}: unreachable: {exc}", retryable=True)

    def _failed(self, exc: BaseException) -> EngineError:
        return EngineError(f"{self.instance_id}: generate failed: {exc!r}")

    def _post_generate(self, request: GenerateRequest) -> Awaitable[WireResponse]:
        cfg = self._config
        return self._wire.post(
            self._generate_path,
            _BODIES.encode(request),
            connect_s=cfg.connect_timeout_s,
            read_s=cfg.read_timeout_s,
            total_s=cfg.total_timeout_s,
        )

    async def _check_status(self, resp: WireResponse) -> None:
        if resp.status != 200:
            raise self._status_error(resp.status, await resp.read())

    async def _stream(self, resp: WireResponse) -> AsyncGenerator[GenerateChunk, None]:
        deltas = _Deltas()
        done = False
        async for line in resp.lines():  # read to the body's end: the connection is reused
            if done or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            done = payload == b"[DONE]"
            if not done:
                yield deltas.chunk(self._json(payload))

    def _json(self, payload: bytes) -> dict[str, Any]:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"{self.instance_id}: bad response {payload[:80]!r}") from exc
        if not isinstance(obj, dict):
            raise EngineError(f"{self.instance_id}: response is not an object: {payload[:80]!r}")
        return obj

    def _abort_later(self, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, rid: str) -> None:
        # RuntimeError: the shared session closed first (gateway shutting down).
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, EngineError, RuntimeError):
            await self._control("POST", "/abort_request", {"rid": rid})

    async def _control(self, method: str, path: str, body: Any = None) -> Any:
        async with self._session.request(
            method,
            f"{self.base_url}{path}",
            data=None if body is None else orjson.dumps(body),
            headers=JSON_HEADERS,
            timeout=self._control_timeout,
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

    async def close(self) -> None:
        """Wait for pending aborts, close pooled generate connections; the shared session
        belongs to the caller."""
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        self._wire.close()
