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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
from yarl import URL

from prfaas.engine_clients.base import (
    MAX_ERROR_BODY,
    AnsweredCall,
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineReport,
    EngineStats,
    QueuedCall,
    Role,
    call_failure,
)
from prfaas.engine_clients.control import ROLES, ControlPlane, error_code
from prfaas.engine_clients.openai_relay import OpenAICall, usage_asked, with_usage
from prfaas.http.client import ConnectionPool, HttpCall, post
from prfaas.protocol.client_body import Api, ClientBody
from prfaas.protocol.errors import dialect_of, invalid
from prfaas.protocol.generate import AnswerError, GenerateChunk, GenerateRequest, parse_answer
from prfaas.protocol.openai_request import HARMLESS_FIELDS

logger = logging.getLogger(__name__)
STATS_PATHS = ("/stats", "/get_load")


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
    """Whole `/server_info`, `/get_load` and `/abort_request` calls."""
    health_timeout_s: float = 2.0
    """Whole `/health` probe (a slower answer counts as a failed probe)."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def control_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.control_timeout_s, connect=self.connect_timeout_s)

    def control_plane(
        self, instance_id: str, base_url: str, session: aiohttp.ClientSession,
        headers: dict[str, str],
    ) -> ControlPlane:  # fmt: skip
        """The engine's control routes with these timeouts."""
        health = aiohttp.ClientTimeout(total=self.health_timeout_s, connect=self.connect_timeout_s)
        return ControlPlane(instance_id, base_url, session, headers,
                            control_timeout=self.control_timeout(), health_timeout=health,
                            connect_timeout_s=self.connect_timeout_s)  # fmt: skip


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


class _GenerateCall(AnsweredCall):
    """One `/generate` call: the HTTP response handler that turns the answer into chunks.

    A whole answer becomes one chunk when it is complete; a stream's `data:` events become
    delta chunks as they arrive (SGLang streams cumulative text and ids).
    """

    def __init__(self, client: SGLangClient, request: GenerateRequest) -> None:
        super().__init__(request.stream)
        self.client, self.rid = client, request.rid
        self._text_len = self._ids_len = 0
        self._stream_done = False
        self.http: HttpCall = client.post(request, self)

    # -- ResponseHandler -------------------------------------------------------------------

    def on_end(self, error: BaseException | None) -> None:
        if self.ended.done():
            return
        client = self.client
        if error is not None:
            failure = call_failure(client.instance_id, "generate", error)
            if failure.unreachable:  # never reached the engine: nothing to abort there
                self.finish(failure)
            else:
                self._fail(failure)
            return
        if self.status != 200:
            body = bytes(self._body[:MAX_ERROR_BODY])
            busy = self.status in (429, 503)
            self.finish(
                EngineError(
                    f"{client.instance_id}: /generate answered {self.status}: "
                    f"{body[:300].decode(errors='replace')}",
                    status=503 if busy else 502,
                    retryable=busy,
                    rejected=400 <= self.status < 500 and not busy,
                    code=error_code(body, "engine_busy" if busy else "engine_error"),
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


SGLANG_CHAT_FIELDS = frozenset({
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "cache_salt", "chat_template_kwargs",
    "continue_final_message", "custom_logit_processor", "custom_params", "data_parallel_rank",
    "disagg_prefill_dp_rank", "ebnf", "extra_key", "frequency_penalty", "ignore_eos",
    "images_config", "input_ids", "logit_bias", "logprobs", "lora_path",
    "max_completion_tokens", "max_dynamic_patch", "max_tokens", "messages",
    "min_dynamic_patch", "min_p", "min_tokens", "mm_processor_kwargs", "model", "n",
    "no_stop_trim", "parallel_tool_calls", "presence_penalty", "priority", "reasoning_effort",
    "regex", "repetition_penalty", "response_format", "return_cached_tokens_details",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_hidden_states", "return_input_ids_in_sglext", "return_meta_info",
    "return_output_ids_in_sglext", "return_prompt_token_ids", "return_routed_experts",
    "return_sampling_mask", "return_spec_tokens_details", "return_token_ids", "rid",
    "routed_dp_rank", "routed_experts_start_len", "sampling_logprobs_mode", "seed",
    "separate_reasoning", "session_id", "session_params", "skip_special_tokens", "stop",
    "stop_regex", "stop_token_ids", "stream", "stream_options", "stream_reasoning", "task",
    "temperature", "thinking", "tool_choice", "tools", "top_k", "top_logprobs", "top_p",
    "use_audio_in_video", "user", "video_config", "watermark",
})  # fmt: skip
"""The fields sglang 0.5.23's `ChatCompletionRequest` declares (it ignores any other)."""
SGLANG_COMPLETION_FIELDS = frozenset({
    "best_of", "bootstrap_host", "bootstrap_port", "bootstrap_room", "cache_salt",
    "custom_labels", "custom_logit_processor", "custom_params", "data_parallel_rank",
    "disagg_prefill_dp_rank", "ebnf", "echo", "extra_key", "frequency_penalty", "ignore_eos",
    "images_config", "json_schema", "logit_bias", "logprobs", "lora_path", "max_tokens",
    "min_p", "min_tokens", "mm_processor_kwargs", "model", "n", "no_stop_trim",
    "presence_penalty", "priority", "prompt", "regex", "repetition_penalty", "response_format",
    "return_cached_tokens_details", "return_hidden_states", "return_routed_experts",
    "return_spec_tokens_details", "return_token_ids", "rid", "routed_dp_rank",
    "routed_experts_start_len", "seed", "session_id", "session_params", "skip_special_tokens",
    "stop", "stop_regex", "stop_token_ids", "stream", "stream_options", "suffix",
    "temperature", "top_k", "top_p", "user", "watermark",
})  # fmt: skip
"""The fields sglang 0.5.23's `CompletionRequest` declares (it ignores any other)."""
SGLANG_MESSAGES_FIELDS = frozenset({
    "betas", "bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank",
    "max_tokens", "messages", "metadata", "model", "output_config", "routed_dp_rank",
    "stop_sequences", "stream", "system", "temperature", "thinking", "tool_choice", "tools",
    "top_k", "top_p",
})  # fmt: skip
"""The fields sglang 0.5.23's `AnthropicMessagesRequest` declares (it ignores any other)."""
SGLANG_RESPONSES_FIELDS = frozenset({
    "background", "bootstrap_host", "bootstrap_port", "bootstrap_room", "cache_salt",
    "chat_template_kwargs", "data_parallel_rank", "disagg_prefill_dp_rank", "extra_key",
    "frequency_penalty", "include", "input", "instructions", "max_output_tokens",
    "max_tool_calls", "metadata", "min_p", "model", "parallel_tool_calls", "presence_penalty",
    "previous_response_id", "priority", "reasoning", "repetition_penalty", "request_id",
    "routed_dp_rank", "service_tier", "session_id", "stop", "store", "stream", "temperature",
    "text", "tool_choice", "tools", "top_k", "top_logprobs", "top_p", "truncation", "user",
})  # fmt: skip
"""The fields sglang 0.5.23's `ResponsesRequest` declares (it ignores any other)."""
SGLANG_OPENAI_FIELDS: dict[Api, frozenset[str]] = {
    "chat": SGLANG_CHAT_FIELDS, "completions": SGLANG_COMPLETION_FIELDS,
    "messages": SGLANG_MESSAGES_FIELDS, "responses": SGLANG_RESPONSES_FIELDS,
}  # fmt: skip


def unknown_to_sglang(body: ClientBody) -> str | None:
    """The first field of a client's body that SGLang's server would silently ignore on
    its route (fields that cannot change an answer aside), or None."""
    known = SGLANG_OPENAI_FIELDS[body.api] | HARMLESS_FIELDS
    return next((key for key in sorted(body.fields) if key not in known), None)


def forwarded_body(request: GenerateRequest) -> dict[str, Any]:
    """The client's body plus SGLang's PD fields (`bootstrap_host`, `bootstrap_port`,
    `bootstrap_room`: sglang 0.5.23's `PDRoutingFields`, which its completions, chat,
    Messages and Responses requests all take), the same for the prefill and the decode call,
    as SGLang's own PD router sends it (and a prefix pull, for engines that say they take
    one); a streamed completions or chat one asks for its usage."""
    assert request.client_body is not None
    body = request.client_body
    return with_usage({**body.fields, **request.pd_fields()}, body.api)


class _ForwardedCall(OpenAICall):
    """A client's body on the engine's own API route, its answer relayed."""

    def __init__(self, client: SGLangClient, request: GenerateRequest) -> None:
        assert request.client_body is not None
        body, path = forwarded_body(request), request.client_body.path
        super().__init__(client.instance_id, path, bool(body.get("stream")),
                         len(request.input_ids), relay=True,
                         usage_asked=usage_asked(request),
                         api=request.client_body.api)  # fmt: skip
        self.http = client.post_openai(path, orjson.dumps(body), self)


class _Refused(QueuedCall):
    """A call refused before it was sent (nothing to stop)."""

    def __init__(self, error: EngineError) -> None:
        super().__init__()
        self.finish(error)

    def _stop(self) -> None:
        pass


class SGLangClient(BaseEngineClient):
    """A client of one SGLang-compatible engine at `base_url` (no trailing slash)."""

    def __init__(
        self,
        instance_id: str,
        base_url: str,
        session: aiohttp.ClientSession,
        config: SGLangClientConfig | None = None,
        token: str | None = None,
        *,
        sglang_server: bool = False,
    ) -> None:
        """`token`: the deployment's control token, sent as `Authorization: Bearer` on every
        call (the reference engine's routes need it when it has a secret; SGLang's
        `--api-key` checks the same header). `sglang_server`: the engine is a real SGLang
        server, whose OpenAI routes ignore fields they do not declare: this client refuses
        such a field by name instead (a reference engine refuses them itself)."""
        self.sglang_server = sglang_server
        self.instance_id = instance_id
        self.base_url = base_url.rstrip("/")
        url = URL(self.base_url)
        if url.scheme not in ("http", "https") or url.host is None or url.port is None:
            raise ValueError(f"engine URL must be http(s)://host[:port], got {base_url!r}")
        self._root = url.path.rstrip("/")
        self._generate_path = f"{self._root}/generate"
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.auth_headers: dict[str, str] = auth
        """What every call to this engine carries (for other pollers of it)."""
        self._pool = ConnectionPool(url.host, url.port, tls=url.scheme == "https", headers=auth)
        self._session = session
        self._config = config or SGLangClientConfig()
        self._aborts: set[asyncio.Task[None]] = set()
        self._stats_path: str | None = None
        self.control = self._config.control_plane(instance_id, self.base_url, session, auth)

    def generate(self, request: GenerateRequest) -> EngineCall:
        """`/generate` from token ids, or the client's body on the engine's own route
        when the request carries one."""
        if request.client_body is None:
            return _GenerateCall(self, request)
        body = request.client_body
        unknown = unknown_to_sglang(body) if self.sglang_server else None
        if unknown is not None:
            error = invalid(f"'{unknown}' is not supported by SGLang's server on {body.path}",
                            unknown)  # fmt: skip
            return _Refused(EngineError(f"{self.instance_id}: {error.message}", status=400,
                                        rejected=True, code="engine_refused",
                                        answer=error.encode(dialect_of(body.path))))  # fmt: skip
        return _ForwardedCall(self, request)

    def post_openai(self, path: str, body: bytes, call: OpenAICall) -> HttpCall:
        """Send an OpenAI body to `path` now; `call` handles the answer."""
        cfg = self._config
        return post(self._pool, self._root + path, body, call, connect_s=cfg.connect_timeout_s,
                    read_s=cfg.read_timeout_s, total_s=cfg.total_timeout_s)  # fmt: skip

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
            await self.control.request("POST", "/abort_request", {"rid": rid})

    async def health(self) -> bool:
        """True when `/health` answers 200 within the control timeout."""
        return (await self.control.probe()).alive

    async def probe(self) -> EngineReport:
        """`/health`, with what the engine says about itself (the reference engine reports
        its role, start id and whether it drains; SGLang's empty answer leaves them None)."""
        return await self.control.probe()

    async def export_prefix(
        self, input_ids: Sequence[int], room: int, tokens: int | None = None
    ) -> int:
        """`POST /kv/export` (a reference engine's; SGLang servers have none): the longest
        prefix it caches, whatever `tokens` says."""
        body = {"input_ids": list(input_ids), "room": room}
        limits = aiohttp.ClientTimeout(total=self._config.total_timeout_s)
        try:
            answer = await self.control.request("POST", "/kv/export", body, limits)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise EngineError(f"{self.instance_id}: /kv/export failed: {exc!r}") from exc
        return int(answer["prefix_tokens"])

    async def set_role(self, role: Role, *, timeout_s: float = 300.0, epoch: int = 0) -> float:
        """The reference engine's role API (`ControlPlane.set_role`)."""
        return await self.control.set_role(role, timeout_s=timeout_s, epoch=epoch)

    async def fence(self, epoch: int) -> int:
        """The reference engine's `POST /admin/fence` (`ControlPlane.fence`)."""
        return await self.control.fence(epoch)

    async def stats(self) -> EngineStats:
        """Load from `/stats` (reference engine) or `/get_load` (SGLang), whichever answers."""
        paths = [self._stats_path] if self._stats_path else list(STATS_PATHS)
        for path in paths:
            try:
                load = await self.control.request("GET", path)
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
                raise EngineError(f"{self.instance_id}: {path} failed: {exc!r}") from exc
            except EngineError:
                continue
            self._stats_path = path
            return _parse_load(load)
        raise EngineError(f"{self.instance_id}: no load endpoint among {paths}")

    async def info(self) -> EngineInfo:
        try:
            info = await self.control.request("GET", "/server_info")
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            raise EngineError(f"{self.instance_id}: /server_info failed: {exc!r}") from exc
        mode = str(info.get("disaggregation_mode") or "null")
        port = info.get("disaggregation_bootstrap_port")
        return EngineInfo(
            role=ROLES.get(mode, "both"),
            page_size=int(info.get("page_size") or 1),
            bootstrap_host=info.get("disaggregation_bootstrap_host") or info.get("host"),
            bootstrap_port=int(port) if port is not None else None,
            model=str(info.get("served_model_name") or info.get("model_path") or ""),
            start_id=info.get("start_id") if isinstance(info.get("start_id"), str) else None,
        )

    async def close(self) -> None:
        """Wait for pending aborts, close pooled generate connections; the shared session
        belongs to the caller."""
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        self._pool.close()
