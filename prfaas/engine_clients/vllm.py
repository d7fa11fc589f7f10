"""The vLLM engine client: vLLM's API routes (OpenAI completions, chat and Responses,
Anthropic Messages) with PrfaaS `kv_transfer_params` (`prfaas.protocol.kv_transfer`), for
vLLM servers running our connector.

The Router hands every engine the same `GenerateRequest` (one bootstrap room) and starts the
prefill and the decode call at once; this client tells which side it is from the bootstrap
address: its own KV sender's address makes it the prefill (it computes the prompt and streams
the KV to room R), any other makes it the decode (it fetches room R from there while the
prefill still computes, then generates). Without a bootstrap it runs the request alone.

Two bodies, as vLLM's own P/D proxies build them:
- A request with the client's body (`request.client_body`) goes to the route the client
  called, whole, plus `kv_transfer_params` (each of those routes' request models takes
  them). The decode gets everything; the prefill what computing the prompt's KV needs: the
  same rendering fields, one token, one sequence, unstreamed, no grammar
  (`prefill_fields`). The decode's answer is relayed as vLLM wrote it
  (`GenerateChunk.raw`); a streamed completions or chat one is asked for its usage (and
  that event kept from a client that did not ask) so the gateway can count its tokens. An
  engine's own refusal (a 4xx but 429) keeps its status and body for the client.
- A request without one (token-id callers, migrations, the simulator) is a `/v1/completions`
  body of its token ids with answers carrying token ids (`return_token_ids`).
Aborting a call drops its connection, which vLLM turns into an abort of the request.

Prefix pulls (the bandwidth-abundant regime): the prefill's request carries the room and the
prefix length (`GenerateRequest.prefix_pull`, `prefix_tokens`) as `kv_transfer_params`'
`prefix_pull`; `export_prefix` has the source compute the prefix's first S + 1 tokens as a
prefill request of that room (its cache supplies the S, its connector sends their KV and the
states at S; vLLM holds the blocks while the request runs).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
from yarl import URL

from prfaas.engine_clients.base import (
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineReport,
    EngineStats,
    Role,
)
from prfaas.engine_clients.openai_relay import OpenAICall, usage_asked, with_usage
from prfaas.engine_clients.sglang import SGLangClientConfig
from prfaas.http.client import ConnectionPool, HttpCall, post
from prfaas.protocol.client_body import Api, ClientBody
from prfaas.protocol.generate import GenerateChunk, GenerateRequest
from prfaas.protocol.kv_transfer import PrefixPull, RemoteDecode, RemotePrefill

CHAT_PREFILL_DROPS = frozenset({
    "max_completion_tokens", "min_tokens", "n", "best_of", "stream_options", "logprobs",
    "top_logprobs", "prompt_logprobs", "echo", "return_token_ids", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "parallel_tool_calls",
})  # fmt: skip
_GAUGE = re.compile(rb"^(vllm:[a-z_]+)\{[^}]*\} ([0-9.eE+-]+)$", re.MULTILINE)
PREFILL_DROPS: dict[Api, frozenset[str]] = {
    "completions": CHAT_PREFILL_DROPS,
    "chat": CHAT_PREFILL_DROPS,
    "messages": frozenset({"stream"}),
    "responses": frozenset({"stream", "text", "include", "top_logprobs", "structured_outputs",
                            "max_tool_calls"}),
}  # fmt: skip
"""What a prefill's body leaves out: its one token is thrown away, so nothing that shapes
the output (counts, grammars, log-probabilities) is worth computing there."""
NO_TOOL_CHOICE: dict[Api, Any] = {
    "completions": "none", "chat": "none", "messages": {"type": "none"}, "responses": "none",
}  # fmt: skip
"""Each API's `tool_choice` that renders the tools without a tool grammar."""


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
        body.update(max_tokens=1, stream=False, kv_transfer_params=prefill_params(request))
        body.pop("stream_options", None)
    else:
        body["kv_transfer_params"] = RemotePrefill(boot.host, boot.port, boot.room).to_json()
    return body


def prefill_params(request: GenerateRequest) -> dict[str, Any]:
    """The prefill's `kv_transfer_params`: stream to the decode's room, after pulling the
    prefix first when the request says so."""
    assert request.bootstrap is not None
    params = RemoteDecode(request.bootstrap.room).to_json()
    pull = request.prefix_pull
    if pull is not None and request.prefix_tokens > 0:
        params.update(PrefixPull(pull.host, pull.port, pull.room, request.prefix_tokens).to_json())
    return params


def export_body(input_ids: Sequence[int], room: int, tokens: int, model: str) -> dict[str, Any]:
    """The source's side of a prefix pull: a prefill request of the prompt's first
    `tokens` + 1 tokens into `room` (its handoff point is `tokens`; its prefix cache
    supplies them, else it computes them)."""
    return {"model": model, "prompt": list(input_ids[: tokens + 1]), "max_tokens": 1,
            "temperature": 0, "stream": False,
            "kv_transfer_params": RemoteDecode(room).to_json()}  # fmt: skip


def prefill_fields(body: ClientBody) -> dict[str, Any]:
    """A prefill's copy of the client's body: the same prompt rendering (messages or input,
    system or instructions, tools, template kwargs, prompt, cache salt), one token, one
    sequence, unstreamed, unstored, no grammar (tools are rendered with the API's `tool_choice`
    none, so no tool grammar either; a Messages body keeps its `output_config` effort, which
    renders, but not its format)."""
    api = body.api
    fields = {k: v for k, v in body.fields.items() if k not in PREFILL_DROPS[api]}
    if api == "responses":
        fields.update(max_output_tokens=1, stream=False, store=False, background=False)
    else:
        fields.update(max_tokens=1, stream=False)
    config = fields.get("output_config")
    if api == "messages" and isinstance(config, dict) and "format" in config:
        fields["output_config"] = {k: v for k, v in config.items() if k != "format"}
    if fields.get("tool_choice") is not None:
        fields["tool_choice"] = NO_TOOL_CHOICE[api]
    return fields


def engine_body(request: GenerateRequest, endpoint: VLLMEndpoint) -> dict[str, Any]:
    """The body of a request that carries the client's body (`request.client_body`) on
    `endpoint`: the prefill's (`prefill_fields`), the decode's or the lone engine's (the
    client's, whole)."""
    assert request.client_body is not None
    boot = request.bootstrap
    if boot is not None and (boot.host, boot.port) == (endpoint.bootstrap_host,
                                                       endpoint.bootstrap_port):  # fmt: skip
        return {**prefill_fields(request.client_body), "model": endpoint.model,
                "kv_transfer_params": prefill_params(request)}  # fmt: skip
    body = {**request.client_body.fields, "model": endpoint.model}
    if boot is not None:
        body["kv_transfer_params"] = RemotePrefill(boot.host, boot.port, boot.room).to_json()
    return with_usage(body, request.client_body.api)


class _CompletionCall(OpenAICall):
    """One call of vLLM's OpenAI API: relayed (a forwarded body), or read as token chunks."""

    def __init__(self, client: VLLMClient, request: GenerateRequest) -> None:
        forwarded = request.client_body
        if forwarded is None:
            body, path = completion_body(request, client.endpoint), "/v1/completions"
        else:
            body, path = engine_body(request, client.endpoint), forwarded.path
        super().__init__(client.instance_id, path, bool(body.get("stream")),
                         len(request.input_ids), relay=forwarded is not None,
                         usage_asked=usage_asked(request),
                         api=forwarded.api if forwarded else "completions")  # fmt: skip
        self.http = client.post(path, orjson.dumps(body), self)

    def _event(self, event: dict[str, Any]) -> None:
        self._check(event)
        for choice in event.get("choices") or ():
            ids = tuple(choice.get("token_ids") or ())
            self._completion += len(ids)
            self.push(GenerateChunk(ids, choice.get("text") or "", self.prompt_tokens,
                                    self._completion, 0, choice.get("finish_reason")))  # fmt: skip


class VLLMClient(BaseEngineClient):
    """A client of one vLLM server running the PrfaaS connector."""

    pull_failure_fails_request = True
    """The connector runs vLLM's `kv_load_failure_policy` "fail" (a decode whose KV did not
    arrive must not answer), which fails a request whose prefix pull failed too."""

    def __init__(
        self,
        instance_id: str,
        endpoint: VLLMEndpoint,
        session: aiohttp.ClientSession,
        config: SGLangClientConfig | None = None,
        token: str | None = None,
    ) -> None:
        """`token`: the deployment's control token, sent as `Authorization: Bearer` on every
        call (the server's `auth.ControlTokenMiddleware` checks it)."""
        self.instance_id, self.endpoint = instance_id, endpoint
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = endpoint.base_url.rstrip("/")
        url = URL(self.base_url)
        if url.scheme not in ("http", "https") or url.host is None or url.port is None:
            raise ValueError(f"engine URL must be http(s)://host[:port], got {self.base_url!r}")
        self._root = url.path.rstrip("/")
        self._pool = ConnectionPool(
            url.host, url.port, tls=url.scheme == "https", headers=self._auth
        )
        self._session = session
        self._config = config or SGLangClientConfig()
        self.control = self._config.control_plane(instance_id, self.base_url, session, self._auth)

    def generate(self, request: GenerateRequest) -> EngineCall:
        return _CompletionCall(self, request)

    def post(self, path: str, body: bytes, call: OpenAICall) -> HttpCall:
        cfg = self._config
        return post(self._pool, self._root + path, body, call, connect_s=cfg.connect_timeout_s,
                    read_s=cfg.read_timeout_s, total_s=cfg.total_timeout_s)  # fmt: skip

    async def _get(self, path: str) -> bytes:
        try:
            async with self._session.get(
                f"{self.base_url}{path}", headers=self._auth, timeout=self._config.control_timeout()
            ) as resp:
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"{self.instance_id}: {path} failed: {exc!r}") from exc
        if resp.status != 200:
            raise EngineError(f"{self.instance_id}: {path} answered {resp.status}")
        return raw

    async def relay(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """`method path` (with a JSON `body` for POST) on the server: its status and body,
        whatever they are (the gateway relays the engine's own answer).

        Raises:
            EngineError: no answer within the control timeout.
        """
        try:
            async with self._session.request(
                method,
                f"{self.base_url}{path}",
                data=body or None,
                headers={**self._auth, **({"Content-Type": "application/json"} if body else {})},
                timeout=self._config.control_timeout(),
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"{self.instance_id}: {path} failed: {exc!r}") from exc

    async def health(self) -> bool:
        """True when `/health` answers 200 within the health timeout."""
        return (await self.control.probe()).alive

    async def probe(self) -> EngineReport:
        """`/health`, with the role, start id and drain that PrfaaS's role middleware adds to
        vLLM's answer (`prfaas.engines.vllm.role`; None without it); an instance with a KV
        sender exports and pulls prefixes (its connector does both)."""
        return replace(await self.control.probe(), prefix_pull=self.prefix_pull)

    @property
    def prefix_pull(self) -> bool:
        """Whether it exports and pulls prefixes: with a KV sender, its connector does."""
        return self.endpoint.bootstrap_port is not None

    async def export_prefix(
        self, input_ids: Sequence[int], room: int, tokens: int | None = None
    ) -> int:
        """Send the KV of `input_ids`' first `tokens` tokens (and the linear states there)
        into `room` on this instance's KV sender: `export_body` as a `/v1/completions`
        request; answers `tokens` once vLLM has computed it (its pages copied out for the
        sender, which keeps them until the puller has them or its register timeout).

        Raises:
            EngineError: no length given, or the request failed.
        """
        if not tokens or tokens >= len(input_ids):
            raise EngineError(f"{self.instance_id}: a vLLM export needs a prefix length "
                              f"shorter than the prompt, got {tokens!r}", status=501)  # fmt: skip
        body = orjson.dumps(export_body(input_ids, room, tokens, self.endpoint.model))
        headers = {**self._auth, "Content-Type": "application/json"}
        limits = aiohttp.ClientTimeout(total=self._config.total_timeout_s,
                                       connect=self._config.connect_timeout_s)  # fmt: skip
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", data=body,
                                          headers=headers, timeout=limits) as resp:  # fmt: skip
                status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"{self.instance_id}: prefix export failed: {exc!r}") from exc
        if status != 200:
            raise EngineError(f"{self.instance_id}: prefix export answered {status}: "
                              f"{raw[:300]!r}", status=status)  # fmt: skip
        return tokens

    async def set_role(self, role: Role, *, timeout_s: float = 300.0, epoch: int = 0) -> float:
        """The role middleware's `POST /admin/role`: the server drains the requests it holds,
        then takes `role` (where the gateways send work; the connector runs `kv_both`)."""
        seconds = await self.control.set_role(role, timeout_s=timeout_s, epoch=epoch)
        self.endpoint = replace(self.endpoint, role=role)
        return seconds

    async def fence(self, epoch: int) -> int:
        """The role middleware's `POST /admin/fence`."""
        return await self.control.fence(epoch)

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
        """The role the server reports (the configured one without the role middleware),
        and the configured KV sender."""
        report = await self.control.probe()
        e = self.endpoint
        role = report.role or e.role
        return EngineInfo(role, e.page_size, e.bootstrap_host, e.bootstrap_port, e.model,
                          report.start_id)  # fmt: skip

    async def close(self) -> None:
        self._pool.close()
