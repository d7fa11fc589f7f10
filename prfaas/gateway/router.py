"""The request path, independent of HTTP: hash, look up, decide, dispatch, relay.

`Router` is driven by the HTTP app in production and by the simulator on a virtual clock,
so it reads time only through the running loop and does no I/O of its own beyond the engine
clients it is given. There is one dispatch path: a streamed and a whole answer differ only
in the `stream` flag the engines get (a whole answer is one chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

from prfaas.common.hashing import iter_block_hashes
from prfaas.engines.client import EngineCall, EngineError
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.policies.routing import (
    BaseRoutingPolicy,
    NoInstanceAvailable,
    Regime,
    RouteDecision,
    RoutingSnapshot,
)
from prfaas.policies.ttft_forecast import LoadForecast
from prfaas.protocol.generate import Bootstrap, GenerateChunk, GenerateRequest, SamplingParams

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


class RoutingObserver(Protocol):
    """What the schedulers see of the request path (`gateway/scheduling/observer.py`). Each
    method is called on the loop, synchronously, and must not block."""

    def forecast(self) -> LoadForecast | None:
        """The load forecast to put in the next request's snapshot (None: none)."""
        ...

    def dispatched(self, rid: str, decision: RouteDecision) -> None:
        """A request was sent to its instances."""
        ...

    def prefill_ended(self, rid: str, decision: RouteDecision) -> None:
        """Its prefill is over (KV handed over, failed or aborted); called once."""
        ...

    def first_token(self, rid: str) -> None:
        """Its first output token arrived: it is decoding now."""
        ...

    def finished(self, event: RouteEvent) -> None:
        """The request is over (the same event `on_event` gets)."""
        ...


@dataclass
class Router:
    """Routes and dispatches requests with SGLang's PD protocol.

    `on_event` (optional) receives a `RouteEvent` per finished or failed request.
    `room_source` draws bootstrap rooms (random 63-bit by default; seeded in simulation).
    `observer` (optional) is the schedulers' view: it adds a load forecast to every snapshot
    and hears of every dispatch, prefill end and finish.
    """

    instances: InstanceManager
    index: KVIndexManager
    policy: BaseRoutingPolicy
    state: RoutingState
    on_event: Callable[[RouteEvent], None] | None = None
    room_source: Callable[[], int] = field(default=lambda: secrets.randbits(63))
    observer: RoutingObserver | None = None

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
            forecast=None if self.observer is None else self.observer.forecast(),
        )
        return self.policy.decide(snapshot)

    async def dispatch(
        self, rid: str, input_ids: Sequence[int], sampling: SamplingParams, *, stream: bool
    ) -> Dispatch:
        """Decide, start the prefill and decode calls at once, and return once the first
        output chunk is in (`Dispatch.first`; with `stream=False` the engines answer in one
        piece, so it is the whole output). The caller reads the rest with `Dispatch.next`
        and must `close` it (closing early aborts the request on the engines).

        A failure before any output retries once on a fresh decision, with an instance that
        refused the work marked unhealthy.

        Raises:
            NoInstanceAvailable: nowhere to run the request.
            EngineError: the request failed on an engine and could not be retried.
        """
        ids = tuple(input_ids)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            decision = self.decide(ids)
            prefill = self.instances[decision.prefill_instance]
            decode = self.instances[decision.decode_instance]
            bootstrap = None if prefill is decode else self._bootstrap(prefill)
            request = GenerateRequest(rid, ids, sampling, stream, bootstrap)
            routed = Dispatch(self, decision, prefill, decode, request)
            if self.observer is not None:
                self.observer.dispatched(rid, decision)
            try:
                await routed.start()
            except BaseException as exc:  # cancelled too: the calls are aborted
                routed.close()
                if not isinstance(exc, EngineError) or not routed.retryable:
                    raise
                if attempt == MAX_ATTEMPTS:
                    raise
                continue
            return routed
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _bootstrap(self, prefill: InstanceState) -> Bootstrap:
        if prefill.bootstrap_host is None or prefill.bootstrap_port is None:
            raise NoInstanceAvailable(f"prefill instance {prefill.instance_id} has no bootstrap")
        return Bootstrap(prefill.bootstrap_host, prefill.bootstrap_port, self.room_source())

    def report(self, event: RouteEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
        if self.observer is not None:
            self.observer.finished(event)


class Dispatch:
    """One routed request in flight: its prefill call and its decode call (one call when a
    "both" instance does both), the decode's output, and the accounting of both instances.

    The prefill call is watched, not read: if it fails, the decode call is aborted with the
    prefill's error (the decode would only wait for KV that never comes); if the decode
    call fails, the prefill call is aborted. When both fail, the prefill's error wins.
    """

    def __init__(
        self,
        router: Router,
        decision: RouteDecision,
        prefill: InstanceState,
        decode: InstanceState,
        request: GenerateRequest,
    ) -> None:
        self.router, self.decision, self.request = router, decision, request
        self.prefill, self.decode = prefill, decode
        self.first: GenerateChunk | None = None
        self.retryable = False
        self._last: GenerateChunk | None = None
        self._closed = self._reported = self._prefill_over = False
        prefill.in_flight += 1
        decode.in_flight += 1
        self._decode_call = decode.client.generate(request)
        self._prefill_call: EngineCall | None = None
        if prefill is not decode:
            self._prefill_call = prefill.client.generate(request)
            self._prefill_call.ended.add_done_callback(self._prefill_ended)

    def _prefill_ended(self, ended: asyncio.Future[None]) -> None:
        self._prefill_done()
        error = self._prefill_error()
        if error is not None:
            self._decode_call.abort(error)

    def _prefill_done(self) -> None:
        """Tell the observer, once, that this request's prefill is over."""
        if self._prefill_over:
            return
        self._prefill_over = True
        observer = self.router.observer
        if observer is not None:
            observer.prefill_ended(self.request.rid, self.decision)

    def _prefill_error(self) -> EngineError | None:
        """The prefill call's error, with a refusal marked, if it has failed."""
        call = self._prefill_call
        if call is None or not call.ended.done():
            return None
        error = call.ended.exception()
        if not isinstance(error, EngineError):
            return None
        _mark_refusal(self.prefill, error)
        return error

    async def start(self) -> None:
        """Wait for the first output chunk.

        Raises:
            EngineError: the request failed before any output (`retryable` tells whether
                another instance may take it).
        """
        first = await self.next()
        if first is None:
            self._fail(EngineError("the engine returned no output"))
        if self._prefill_call is None:
            self._prefill_done()  # one instance does both: its first token ends the prefill
        if self.router.observer is not None:
            self.router.observer.first_token(self.request.rid)
        self.first = first

    async def next(self) -> GenerateChunk | None:
        """The next decode chunk; None at the end (after the prefill call is seen to have
        ended well).

        Raises:
            EngineError: either call failed (the prefill's error when both did).
        """
        try:
            chunk = await self._decode_call.next()
        except EngineError as exc:
            self._fail(self._prefill_error() or _refused(self.decode, exc))
        if chunk is not None:
            self._last = chunk
            return chunk
        prefill = self._prefill_call
        if prefill is not None:
            if not prefill.ended.done():  # shielded: a cancelled wait must not cancel it
                with contextlib.suppress(EngineError):
                    await asyncio.shield(prefill.ended)
            error = self._prefill_error()
            if error is not None:
                self._fail(error)
        self._report(None)
        return None

    def _fail(self, error: EngineError) -> NoReturn:
        self.retryable = error.retryable and self._last is None
        self._report(str(error))
        raise error

    def _report(self, error: str | None) -> None:
        if self._reported:
            return
        self._reported = True
        last, request = self._last, self.request
        completion = last.completion_tokens if last is not None and error is None else 0
        self.router.report(
            RouteEvent(request.rid, self.decision, len(request.input_ids), completion, error)
        )

    def close(self) -> None:
        """End the request: calls still running are aborted on their engines; the
        instances' in-flight counts drop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._prefill_done()
        self._decode_call.abort()
        if self._prefill_call is not None:
            self._prefill_call.abort()
        self.prefill.in_flight -= 1
        self.decode.in_flight -= 1


def _mark_refusal(instance: InstanceState, exc: EngineError) -> None:
    """An engine that refused the work (unreachable: retryable) is marked unhealthy until the
    health poll sees it again, so the retry goes elsewhere."""
    if exc.retryable:
        instance.healthy = False


def _refused(instance: InstanceState, exc: EngineError) -> EngineError:
    _mark_refusal(instance, exc)
    return exc
