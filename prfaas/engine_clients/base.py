"""The one engine-client interface the gateway and the simulator dispatch through.

Every engine, whatever runs it (the reference engine or a real SGLang server over HTTP, a
simulated instance on a virtual clock), is driven with SGLang's PD protocol: the same
`GenerateRequest` (with a fresh bootstrap room) goes to the chosen prefill instance and to
the decode instance at once; the prefill call ends once the KV is handed over, the decode
call produces the output.

A call is one `EngineCall` object, streaming or not (`GenerateRequest.stream` says whether
the engine answers in pieces or in one): `next()` gives its output chunks, `ended` resolves
when it is over, `abort()` stops it.
"""

from __future__ import annotations

import asyncio
import collections
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from prfaas.http.client import ConnectFailed
from prfaas.protocol.generate import GenerateChunk, GenerateRequest

Role = Literal["prefill", "decode", "both"]


class EngineError(RuntimeError):
    """An engine failed a request (unreachable, error status, broken stream, aborted transfer).

    `retryable` is True when the engine never accepted the work (unreachable, or it refused
    with 429/503), so the caller may try another instance. `unreachable` says no connection
    could be opened at all (the process is not listening: not a stall). `rejected` says the
    engine judged the request itself invalid (a 4xx other than 429): another instance would
    refuse it too. `code` is a short, safe word for clients (never the engine's free text,
    which may name bootstrap rooms); the message is for logs. `answer` is an OpenAI engine's
    own refusal of the client's body (its error JSON, with `status`): the engine answered
    the client, so the client gets it as written.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        retryable: bool = False,
        unreachable: bool = False,
        rejected: bool = False,
        code: str = "engine_error",
        answer: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.answer = answer
        self.status = status
        self.retryable = retryable
        self.unreachable = unreachable
        self.rejected = rejected
        self.code = code


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
    start_id: str | None = None


@dataclass(frozen=True)
class EngineReport:
    """One health probe of an instance, from the engine's own answer: whether it answered,
    and what it says about itself (None where the engine does not say)."""

    alive: bool
    refused: bool = False
    """No connection could be opened (the process is gone), as opposed to a slow answer."""
    role: Role | None = None
    start_id: str | None = None
    """Changes when the engine restarts (its caches are then empty)."""
    draining: bool = False
    """A role switch is draining it: it takes no new requests for now."""
    prefix_pull: bool = False
    """It exports cached prefixes (`export_prefix`) and pulls them (`prefix_pull` requests)."""


class EngineCall(ABC):
    """One `/generate` call in flight on one engine (started when created)."""

    @abstractmethod
    async def next(self) -> GenerateChunk | None:
        """The next output chunk; None once the call has ended well (a call the engine
        answers in one piece gives one chunk). Not safe for two concurrent callers.

        Raises:
            EngineError: the call failed, or was aborted (with the error given to `abort`).
        """

    @property
    @abstractmethod
    def ended(self) -> asyncio.Future[None]:
        """Resolves when the call is over: to None after its last chunk arrived, or to its
        `EngineError`. Never cancelled: watch it with a done callback."""

    @abstractmethod
    def abort(self, error: EngineError | None = None) -> None:
        """Stop the call. The engine is told to drop the request if it may still be working
        on it; `next` (pending or later) raises `error` (default: "aborted"). No-op once
        the call has ended."""


class BaseEngineClient(ABC):
    """A client of one engine instance. Implementations: HTTP (`SGLangClient`: the
    reference engine and SGLang servers), simulated (virtual clock)."""

    instance_id: str
    pull_failure_fails_request: bool = False
    """A failed prefix pull fails the engine's request (vLLM's `kv_load_failure_policy`
    "fail"), instead of the engine computing the prefix itself: the gateway then runs it
    again without the pull."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> EngineCall:
        """Start `request` now and return its call. Does not mutate the request.

        A prefill-role instance gives one chunk (its first token) once its KV has been
        handed over. Failures, including an unreachable engine, surface through the call.
        """

    @abstractmethod
    async def stats(self) -> EngineStats:
        """The instance's current load."""

    @abstractmethod
    async def info(self) -> EngineInfo:
        """The instance's role, page size and bootstrap address."""

    async def export_prefix(
        self, input_ids: Sequence[int], room: int, tokens: int | None = None
    ) -> int:
        """Have the engine send the KV of the longest prefix of `input_ids` it caches into
        `room` on its KV transport, for another engine to pull (`GenerateRequest.prefix_pull`).
        `tokens`: the prefix's length as the gateway's KV index has it (an engine that must
        export exactly what the puller expects, vLLM, exports that many).

        Returns:
            The prefix's length in tokens, once delivered (0: nothing cached).

        Raises:
            EngineError: no prefix export on this engine, or the export failed.
        """
        raise EngineError(f"{self.instance_id}: this engine cannot export a prefix", status=501)

    async def set_role(self, role: Role, *, timeout_s: float = 300.0, epoch: int = 0) -> float:
        """Switch the instance to `role` through the engine's role API: the engine refuses new
        work, lets what it runs finish, then switches. Mutates the engine, not the client.
        The caller stops routing to the instance first (`gateway/scheduling/roles.py`).
        `epoch`: the converting leader's (`prfaas.engines.role_fence`).

        Returns:
            The seconds the engine took (its drain included).

        Raises:
            EngineError: no role API, a refusal (code `fenced`, status 409: a newer leader
                has announced itself), or no drain within `timeout_s`.
        """
        raise EngineError(f"{self.instance_id}: this engine has no role API", status=501)

    async def fence(self, epoch: int) -> int:
        """Announce a new gateway leader's `epoch`: the engine refuses conversions from older
        ones from now on. Returns the engine's floor.

        Raises:
            EngineError: no role API, or the call failed.
        """
        raise EngineError(f"{self.instance_id}: this engine has no role API", status=501)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release client resources (connections); the engine itself keeps running."""


class QueuedCall(EngineCall):
    """An `EngineCall` its implementation feeds: `push` each chunk as it arrives, then
    `finish` once. Subclasses say in `_stop` how to stop the work on `abort`."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._chunks: collections.deque[GenerateChunk] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: EngineError | None = None
        self._ended: asyncio.Future[None] = self._loop.create_future()

    @property
    def ended(self) -> asyncio.Future[None]:
        return self._ended

    async def next(self) -> GenerateChunk | None:
        while True:
            if self._chunks:
                return self._chunks.popleft()
            if self._ended.done():
                if self._error is not None:
                    raise self._error
                return None
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def push(self, chunk: GenerateChunk) -> None:
        """A chunk arrived (ignored once the call has ended)."""
        if not self._ended.done():
            self._chunks.append(chunk)
            self._wake()

    def finish(self, error: EngineError | None = None) -> None:
        """The call is over: well (None) or with `error`. Only the first call counts."""
        if self._ended.done():
            return
        self._error = error
        if error is None:
            self._ended.set_result(None)
        else:
            self._ended.set_exception(error)
            self._ended.exception()  # retrieved: a watcher is optional
        self._wake()

    def abort(self, error: EngineError | None = None) -> None:
        if self._ended.done():
            return
        self._stop()
        self.finish(error or EngineError("the call was aborted"))

    @abstractmethod
    def _stop(self) -> None:
        """Stop the work behind the call (called once, before `finish`, by `abort`)."""

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


async def collect(
    call: EngineCall, on_chunk: Callable[[GenerateChunk], None] | None = None
) -> list[GenerateChunk]:
    """Every chunk of `call` (each also given to `on_chunk` as it arrives); the call is
    aborted if the wait is cancelled or fails.

    Raises:
        EngineError: the call failed.
    """
    chunks: list[GenerateChunk] = []
    try:
        while (chunk := await call.next()) is not None:
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
    finally:
        call.abort()  # a no-op once it has ended
    return chunks


MAX_ERROR_BODY = 4096
"""Bytes of an error answer kept for its message."""


def call_failure(name: str, what: str, error: BaseException) -> EngineError:
    """An engine call's transport failure as the gateway reads it: unreachable (503, go
    elsewhere and eject), timed out (504), or the connection lost (an `EngineError` raised
    by the answer's own reading stays as it is)."""
    if isinstance(error, ConnectFailed):
        return EngineError(f"{name}: unreachable: {error}", status=503, retryable=True,
                           unreachable=True, code="engine_unreachable")  # fmt: skip
    if isinstance(error, TimeoutError):
        return EngineError(f"{name}: {what} timed out: {error}", status=504,
                           code="engine_timeout")  # fmt: skip
    if isinstance(error, EngineError):
        return error
    return EngineError(f"{name}: {what} failed: {error!r}", code="engine_connection_lost")


class AnsweredCall(QueuedCall):
    """A `QueuedCall` fed by one HTTP answer (the `ResponseHandler` that
    `prfaas.http.client.post` drives): it keeps the status and the body of a whole or failed
    answer (an error's first `MAX_ERROR_BODY` bytes), and hands each complete line of a
    streamed 200 answer to `_line`."""

    def __init__(self, stream: bool) -> None:
        super().__init__()
        self.stream = stream
        self.status = 0
        self._body = bytearray()  # a whole answer, or a stream's unfinished line

    def on_head(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes) -> None:
        if self.status != 200 or not self.stream:
            if self.status == 200 or len(self._body) < MAX_ERROR_BODY:
                self._body += data
            return
        self._body += data
        start = 0
        while (end := self._body.find(b"\n", start)) >= 0:
            self._line(bytes(self._body[start:end]))
            start = end + 1
        del self._body[:start]

    @abstractmethod
    def _line(self, line: bytes) -> None:
        """One complete line of a streamed answer (without its newline)."""
