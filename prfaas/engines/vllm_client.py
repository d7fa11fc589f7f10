"""The vLLM engine client: vLLM's OpenAI `/v1/completions` with PrfaaS `kv_transfer_params`
(`prfaas.protocol.kv_transfer`), for vLLM servers running our connector.

The Router hands every engine the same `GenerateRequest` (one bootstrap room) and starts the
prefill and the decode call at once; this client tells which side it is from the bootstrap
address: its own KV sender's address makes it the prefill (it computes the prompt and streams
the KV to room R), any other makes it the decode (it fetches room R from there while the
prefill still computes, then generates). Without a bootstrap it runs the request alone.
Prompts travel as token ids and answers carry token ids (`return_token_ids`); aborting a
call drops its connection, which vLLM turns into an abort of the request (blocks freed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from yarl import URL

from prfaas.engines.client import (
    AnsweredCall,
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineStats,
    Role,
)
from prfaas.engines.sglang_client import SGLangClientConfig
from prfaas.http.client import ConnectFailed, ConnectionPool, HttpCall, post
from prfaas.protocol.generate import GenerateChunk, GenerateRequest
from prfaas.protocol.kv_transfer import RemoteDecode, RemotePrefill

_GAUGE = re.compile(rb"^(vllm:[a-z_]+)\{[^}]*\} ([0-9.eE+-]+)$", re.MULTILINE)


@dataclass(frozen=True)
class VLLMEndpoint:
    """Where one vLLM instance is: its HTTP base URL, its KV sender, its served name."""

    base_url: str
    role: Role
    model: str
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    page_size: int = 1


def completion_body(request: GenerateRequest, endpoint: VLLMEndpoint) -> dict[str, Any]:
    """The `/v1/completions` body of `request` on `endpoint` (prefill, decode or alone)."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": endpoint.model,
        "prompt": list(request.input_ids),
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": s.skip_special_tokens,
        "stream": request.stream,
        "return_token_ids": True,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    boot = request.bootstrap
    if boot is None:
        return body
    if (boot.host, boot.port) == (endpoint.bootstrap_host, endpoint.bootstrap_port):
        body.update(
            max_tokens=1, stream=False, kv_transfer_params=RemoteDecode(boot.room).to_json()
        )
        body.pop("stream_options", None)
    else:
        body["kv_transfer_params"] = RemotePrefill(boot.host, boot.port, boot.room).to_json()
    return body


class _CompletionCall(AnsweredCall):
    """One `/v1/completions` call; its answer (whole, or SSE deltas) becomes chunks."""

    def __init__(self, client: VLLMClient, request: GenerateRequest) -> None:
        body = completion_body(request, client.endpoint)
        super().__init__(bool(body["stream"]))
        self.client, self.prompt_tokens = client, len(request.input_ids)
        self._completion = 0
        self.http: HttpCall = client.post(orjson.dumps(body), self)

    def on_end(self, error: BaseException | None) -> None:
        if self.ended.done():
            return
        name = self.client.instance_id
        if isinstance(error, ConnectFailed):
            self.finish(EngineError(f"{name}: unreachable: {error}", retryable=True))
        elif error is not None:
            self.finish(error if isinstance(error, EngineError)
                        else EngineError(f"{name}: completion failed: {error!r}"))  # fmt: skip
        elif self.status != 200:
            detail = bytes(self._body[:300]).decode(errors="replace")
            refused = self.status in (429, 503)
            self.finish(EngineError(f"{name}: /v1/completions answered {self.status}: {detail}",
                                    status=503 if refused else 502, retryable=refused))  # fmt: skip
        else:
            try:
                if self.stream and self._body:
                    self._line(bytes(self._body))
                elif not self.stream:
                    self._event(orjson.loads(self._body))
            except (EngineError, orjson.JSONDecodeError) as exc:
                self.finish(exc if isinstance(exc, EngineError) else EngineError(str(exc)))
                return
            self.finish()

    def _line(self, line: bytes) -> None:
        """One SSE line; raises EngineError for an error event (ends the HTTP call)."""
        payload = line[5:].strip() if line.startswith(b"data:") else b""
        if payload and payload != b"[DONE]":
            self._event(orjson.loads(payload))

    def _event(self, event: dict[str, Any]) -> None:
        name = self.client.instance_id
        if "error" in event:
            raise EngineError(f"{name}: {event['error'].get('message', event['error'])}")
        for choice in event.get("choices") or ():
            if choice.get("finish_reason") == "error":
                raise EngineError(f"{name}: the request failed in the engine (KV load?)")
            ids = tuple(choice.get("token_ids") or ())
            self._completion += len(ids)
            self.push(GenerateChunk(ids, choice.get("text") or "", self.prompt_tokens,
                                    self._completion, 0, choice.get("finish_reason")))  # fmt: skip

    def _stop(self) -> None:
        self.http.cancel()  # vLLM aborts a request whose connection closes


class VLLMClient(BaseEngineClient):
    """A client of one vLLM server running the PrfaaS connector."""

    def __init__(
        self,
        instance_id: str,
        endpoint: VLLMEndpoint,
        session: aiohttp.ClientSession,
        config: SGLangClientConfig | None = None,
    ) -> None:
        self.instance_id, self.endpoint = instance_id, endpoint
        self.base_url = endpoint.base_url.rstrip("/")
        url = URL(self.base_url)
        if url.scheme not in ("http", "https") or url.host is None or url.port is None:
            raise ValueError(f"engine URL must be http(s)://host[:port], got {self.base_url!r}")
        self._path = f"{url.path.rstrip('/')}/v1/completions"
        self._pool = ConnectionPool(url.host, url.port, tls=url.scheme == "https")
        self._session = session
        self._config = config or SGLangClientConfig()

    def generate(self, request: GenerateRequest) -> EngineCall:
        return _CompletionCall(self, request)

    def post(self, body: bytes, call: _CompletionCall) -> HttpCall:
        cfg = self._config
        return post(self._pool, self._path, body, call, connect_s=cfg.connect_timeout_s,
                    read_s=cfg.read_timeout_s, total_s=cfg.total_timeout_s)  # fmt: skip

    async def _get(self, path: str) -> bytes:
        try:
            async with self._session.get(
                f"{self.base_url}{path}", timeout=self._config.control_timeout()
            ) as resp:
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"{self.instance_id}: {path} failed: {exc!r}") from exc
        if resp.status != 200:
            raise EngineError(f"{self.instance_id}: {path} answered {resp.status}")
        return raw

    async def health(self) -> bool:
        """True when `/health` answers 200 within the control timeout."""
        try:
            await self._get("/health")
        except EngineError:
            return False
        return True

    async def stats(self) -> EngineStats:
        """Load from vLLM's Prometheus gauges (`/metrics`)."""
        gauges = {
            m.group(1).decode(): float(m.group(2))
            for m in _GAUGE.finditer(await self._get("/metrics"))
        }
        return EngineStats(
            waiting=int(gauges.get("vllm:num_requests_waiting", 0)),
            running=int(gauges.get("vllm:num_requests_running", 0)),
            kv_blocks_used=round(1000 * gauges.get("vllm:kv_cache_usage_perc", 0.0)),
            kv_blocks_total=1000,
        )

    async def info(self) -> EngineInfo:
        e = self.endpoint
        return EngineInfo(e.role, e.page_size, e.bootstrap_host, e.bootstrap_port, e.model)

    async def close(self) -> None:
        self._pool.close()
