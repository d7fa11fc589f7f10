"""The one engine-client interface the gateway and the simulator dispatch through.

Every engine, whatever runs it (the reference engine over HTTP, a real SGLang server, a
simulated instance on a virtual clock), is driven with SGLang's PD protocol: the same
`GenerateRequest` (with a fresh bootstrap room) goes to the chosen prefill instance and to
the decode instance at once; the prefill call completes once the KV is handed over, the
decode call streams the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["prefill", "decode", "both"]


class EngineError(RuntimeError):
    """An engine failed a request (unreachable, error status, broken stream, aborted transfer).

    `retryable` is True when nothing was streamed to the client yet and the engine never
    accepted the work, so the caller may try another instance.
    """

    def __init__(self, message: str, *, status: int = 502, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling parameters (the subset PrfaaS passes through)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")

    def to_sglang(self) -> dict[str, object]:
        body: dict[str, object] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop:
            body["stop"] = list(self.stop)
        if self.seed is not None:
            body["sampling_seed"] = self.seed
        return body


@dataclass(frozen=True)
class Bootstrap:
    """Where the decode instance fetches KV from: the prefill's bootstrap address and room."""

    host: str
    port: int
    room: int


@dataclass(frozen=True)
class GenerateRequest:
    """One `/generate` call in SGLang's PD protocol."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    bootstrap: Bootstrap | None = None


@dataclass(frozen=True)
class GenerateChunk:
    """A piece of output: new token ids and text since the previous chunk.

    `finish_reason` is set on the last chunk ("stop", "length", "abort").
    Token counts are the engine's own (`meta_info`), cumulative.
    """

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A load snapshot of one instance."""

    waiting: int = 0
    running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0


@dataclass(frozen=True)
class EngineInfo:
    """What an instance says about itself (`/server_info`)."""

    role: Role
    page_size: int
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    model: str = ""


class BaseEngineClient(ABC):
    """A client of one engine instance. Implementations: HTTP (reference engine, SGLang),
    simulated (virtual clock)."""

    instance_id: str

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        """Run `request`; yield output chunks as they come (a prefill-role instance yields
        one chunk, its first token, once its KV has been handed over).

        Does not mutate the request. Cancelling the iteration aborts the request on the
        engine.

        Raises:
            EngineError: the engine failed or could not be reached.
        """

    async def complete(self, request: GenerateRequest) -> list[GenerateChunk]:
        """`generate` for a request the caller does not stream: every chunk at once.

        Cancelling the call aborts the request on the engine. Clients override it where one
        awaitable call is cheaper than an iteration (HTTP: one response, no generator).

        Raises:
            EngineError: the engine failed or could not be reached.
        """
        async with contextlib.aclosing(self.generate(request)) as chunks:
            return [chunk async for chunk in chunks]

    def begin(self, request: GenerateRequest) -> asyncio.Future[list[GenerateChunk]]:
        """Start `complete` now and return its future (cancel it to abort on the engine).

        Lets a caller run a prefill and a decode call at once and wake once for both; the
        default runs `complete` in a task, the HTTP client sends at once with no task.
        """
        return asyncio.ensure_future(self.complete(request))

    @abstractmethod
    async def stats(self) -> EngineStats:
        """The instance's current load."""

    @abstractmethod
    async def info(self) -> EngineInfo:
        """The instance's role, page size and bootstrap address."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release client resources (connections); the engine itself keeps running."""
