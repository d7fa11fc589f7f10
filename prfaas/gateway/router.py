"""The request path, independent of HTTP: hash, look up, decide, dispatch, relay.

`Router` is driven by the HTTP app in production and by the simulator on a virtual clock,
so it reads time only through the running loop and does no I/O of its own beyond the engine
clients it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from prfaas.common.hashing import iter_block_hashes
from prfaas.engines.client import (
    Bootstrap,
    EngineError,
    GenerateChunk,
    GenerateRequest,
    SamplingParams,
)
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.policies.routing import (
    BaseRoutingPolicy,
    NoInstanceAvailable,
    Regime,
    RouteDecision,
    RoutingSnapshot,
)

MAX_ATTEMPTS = 2


@dataclass
class RoutingState:
    """The knobs the schedulers move: threshold on incremental tokens and bandwidth regime."""

    threshold: float
    regime: Regime = "bandwidth_scarce"


@dataclass(frozen=True)
class RouteEvent:
    """What the Router reports about one finished request (for metrics and the simulator)."""

    rid: str
    decision: RouteDecision
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass
class Router:
    """Routes and dispatches requests with SGLang's PD protocol.

    `on_event` (optional) receives a `RouteEvent` per finished or failed request.
    `room_source` draws bootstrap rooms (random 63-bit by default; seeded in simulation).
    """

    instances: InstanceManager
    index: KVIndexManager
    policy: BaseRoutingPolicy
    state: RoutingState
    on_event: Callable[[RouteEvent], None] | None = None
    room_source: Callable[[], int] = field(default=lambda: random.getrandbits(63))

    def decide(self, input_ids: Sequence[int]) -> RouteDecision:
        """Route one prompt: chained block hashes, longest cached prefix per instance, policy.

        Raises:
            NoInstanceAvailable: no healthy instance for a needed role.
        """
        # Lazy hashes: the lookup stops at the first block no instance holds.
        cached = self.index.longest_prefix(iter_block_hashes(input_ids, self.index.block_size))
        snapshot = RoutingSnapshot(
            total_tokens=len(input_ids),
            instances=self.instances.views(cached),
            threshold=self.state.threshold,
            regime=self.state.regime,
        )
        return self.policy.decide(snapshot)

    async def generate(
        self, rid: str, input_ids: Sequence[int], sampling: SamplingParams, *, stream: bool = True
    ) -> AsyncIterator[tuple[RouteDecision, GenerateChunk]]:
        """Decide, dispatch to the prefill and decode instances at once, yield decode output.

        With `stream=False` the engines answer in one piece (one chunk per call): cheaper
        when the client does not stream either.

        A failure before any output retries once on a fresh decision with the failed
        instance marked unhealthy; after output has started, it raises.

        Raises:
            NoInstanceAvailable: nowhere to run the request.
            EngineError: the request failed on an engine and could not be retried.
        """
        ids = tuple(input_ids)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            decision = self.decide(ids)
            started = False
            try:
                async for chunk in self._dispatch(rid, ids, sampling, decision, stream):
                    started = True
                    yield decision, chunk
                return
            except EngineError as exc:
                self._report(rid, decision, len(ids), 0, str(exc))
                if started or not exc.retryable or attempt == MAX_ATTEMPTS:
                    raise

    async def complete(
        self, rid: str, input_ids: Sequence[int], sampling: SamplingParams
    ) -> tuple[RouteDecision, list[GenerateChunk]]:
        """`generate` for a client that does not stream: the engines answer in one piece and
        all output comes back at once, with no generator between the caller and the
        dispatch (cheaper per request). Same routing, retry and errors as `generate`."""
        ids = tuple(input_ids)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            decision = self.decide(ids)
            try:
                chunks = await self._dispatch_whole(rid, ids, sampling, decision)
            except EngineError as exc:
                self._report(rid, decision, len(ids), 0, str(exc))
                if not exc.retryable or attempt == MAX_ATTEMPTS:
                    raise
                continue
            return decision, chunks
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _dispatch(
        self,
        rid: str,
        ids: tuple[int, ...],
        sampling: SamplingParams,
        decision: RouteDecision,
        stream: bool = True,
    ) -> AsyncGenerator[GenerateChunk, None]:
        prefill, decode, request = self._request(rid, ids, sampling, decision, stream)
        aggregated = prefill is decode  # one "both" instance: no hand-off, one call
        prefill.in_flight += 1
        decode.in_flight += 1
        last: GenerateChunk | None = None
        chunks = decode.client.generate(request) if aggregated else _relay(prefill, decode, request)
        try:
            async for chunk in chunks:
                last = chunk
                yield chunk
        except EngineError as exc:
            if aggregated:
                _mark_refusal(decode, exc)
            raise
        finally:
            try:
                await chunks.aclose()  # closing aborts on the engines at once
            finally:
                prefill.in_flight -= 1
                decode.in_flight -= 1
        self._report(rid, decision, len(ids), last.completion_tokens if last else 0, None)

    async def _dispatch_whole(
        self, rid: str, ids: tuple[int, ...], sampling: SamplingParams, decision: RouteDecision
    ) -> list[GenerateChunk]:
        """`_dispatch` of a non-streaming request as plain awaits (no generators): the
        gateway's hot path. Cancelling it aborts on the engines like closing `_dispatch`."""
        prefill, decode, request = self._request(rid, ids, sampling, decision, False)
        prefill.in_flight += 1
        decode.in_flight += 1
        try:
            if prefill is decode:  # one "both" instance: no hand-off, one call
                try:
                    chunks = await decode.client.complete(request)
                except EngineError as exc:
                    _mark_refusal(decode, exc)
                    raise
            else:
                chunks = await _complete_pd(prefill, decode, request)
        finally:
            prefill.in_flight -= 1
            decode.in_flight -= 1
        self._report(rid, decision, len(ids), chunks[-1].completion_tokens if chunks else 0, None)
        return chunks

    def _request(
        self,
        rid: str,
        ids: tuple[int, ...],
        sampling: SamplingParams,
        decision: RouteDecision,
        stream: bool,
    ) -> tuple[InstanceState, InstanceState, GenerateRequest]:
        prefill = self.instances[decision.prefill_instance]
        decode = self.instances[decision.decode_instance]
        bootstrap = None if prefill is decode else self._bootstrap(prefill)
        return prefill, decode, GenerateRequest(rid, ids, sampling, stream, bootstrap)

    def _bootstrap(self, prefill: InstanceState) -> Bootstrap:
        if prefill.bootstrap_host is None or prefill.bootstrap_port is None:
            raise NoInstanceAvailable(f"prefill instance {prefill.instance_id} has no bootstrap")
        return Bootstrap(prefill.bootstrap_host, prefill.bootstrap_port, self.room_source())

    def _report(
        self, rid: str, decision: RouteDecision, prompt: int, completion: int, error: str | None
    ) -> None:
        if self.on_event is not None:
            self.on_event(RouteEvent(rid, decision, prompt, completion, error))


async def _drain_prefill(prefill: InstanceState, request: GenerateRequest) -> None:
    async for _ in prefill.client.generate(request):
        pass


def _mark_refusal(instance: InstanceState, exc: EngineError) -> None:
    """An engine that refused the work (unreachable: retryable) is marked unhealthy until the
    health poll sees it again, so the retry goes elsewhere."""
    if exc.retryable:
        instance.healthy = False


def _prefill_error(prefill: InstanceState, exc: BaseException) -> EngineError:
    """The error to raise for a failed prefill call (marks the instance unhealthy when
    the failure says it never accepted the work)."""
    if isinstance(exc, EngineError):
        _mark_refusal(prefill, exc)
        return exc
    error = EngineError(f"prefill on {prefill.instance_id} failed: {exc!r}")
    error.__cause__ = exc
    return error


class _PrefillWatch:
    """Watches the prefill task while the consumer awaits decode output.

    If prefill fails during such a wait, the waiting task is cancelled (as `asyncio.timeout`
    does) and the cancellation turned into the prefill's error: decode would only wait for
    KV that never comes. This costs one callback per request instead of a future per chunk.
    """

    def __init__(self, prefill: InstanceState, task: asyncio.Task[None]) -> None:
        self.prefill, self.task = prefill, task
        self._consumer: asyncio.Task[object] | None = None
        self._interrupted = False
        task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        if self._consumer is not None and not task.cancelled() and task.exception() is not None:
            self._interrupted = True
            self._consumer.cancel()

    @property
    def failed(self) -> bool:
        """Whether the prefill call has failed."""
        task = self.task
        return task.done() and not task.cancelled() and task.exception() is not None

    def check(self) -> None:
        """Raise the prefill's error if it has failed."""
        if self.failed:
            raise _prefill_error(self.prefill, self.task.exception())  # type: ignore[arg-type]

    async def next(self, stream: AsyncIterator[GenerateChunk]) -> GenerateChunk:
        """The next decode chunk. Raises StopAsyncIteration at its end, or the prefill error."""
        self.check()
        self._consumer = asyncio.current_task()
        try:
            return await anext(stream)
        except asyncio.CancelledError:
            if self._interrupted and self._consumer is not None:
                self._interrupted = False
                if self._consumer.uncancel() == 0:  # nobody else cancelled: prefill failed
                    self.check()
            raise
        finally:
            self._consumer = None


async def _complete_pd(
    prefill: InstanceState, decode: InstanceState, request: GenerateRequest
) -> list[GenerateChunk]:
    """The non-streaming relay: both calls sent back to back, then one wait on the decode
    call. A prefill that fails first cancels that wait (decode only waits for its KV, and
    the cancelled call is aborted on the engine) and its error wins; a decode that refused
    the work is marked unhealthy; a prefill failure after decode finished still fails the
    request."""
    prefill_call, decode_call = prefill.client.begin(request), decode.client.begin(request)
    prefill_call.add_done_callback(lambda call: _stop_on_failure(call, decode_call))
    try:
        chunks = await decode_call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        failed = _failure(prefill_call)
        if failed is None or (task is not None and task.cancelling()):
            prefill_call.cancel()
            raise
        raise _prefill_error(prefill, failed) from None  # it cancelled the decode call
    except BaseException as exc:
        failed = _failure(prefill_call)
        if failed is not None and isinstance(exc, Exception):  # both failed: prefill's wins
            raise _prefill_error(prefill, failed) from None
        prefill_call.cancel()
        if isinstance(exc, EngineError):
            _mark_refusal(decode, exc)
        raise
    try:
        await prefill_call  # done by now as a rule: no suspension
    except Exception as exc:
        raise _prefill_error(prefill, exc)  # noqa: B904 - the cause is set inside
    return chunks


def _failure(call: asyncio.Future[list[GenerateChunk]]) -> BaseException | None:
    return call.exception() if call.done() and not call.cancelled() else None


def _stop_on_failure(
    call: asyncio.Future[list[GenerateChunk]], other: asyncio.Future[list[GenerateChunk]]
) -> None:
    if _failure(call) is not None:
        other.cancel()


async def _relay(
    prefill: InstanceState, decode: InstanceState, request: GenerateRequest
) -> AsyncGenerator[GenerateChunk, None]:
    """Yield the decode stream while the prefill call runs in its own task; if prefill
    fails first, abort decode and raise the prefill's error; once decode ends, surface a
    late prefill failure."""
    watch = _PrefillWatch(prefill, asyncio.ensure_future(_drain_prefill(prefill, request)))
    stream = decode.client.generate(request)
    try:
        while True:
            try:
                chunk = await watch.next(stream)
            except StopAsyncIteration:
                break
            except EngineError as exc:
                if not watch.failed:  # the decode call itself failed
                    _mark_refusal(decode, exc)
                raise
            yield chunk
        try:
            await watch.task
        except Exception as exc:
            raise _prefill_error(prefill, exc)  # noqa: B904 - the cause is set inside
    finally:
        watch.task.cancel()
        with contextlib.suppress(BaseException):
            await watch.task
        await stream.aclose()
