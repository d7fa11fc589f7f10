"""The request path, independent of HTTP: hash, look up, decide, dispatch, relay, and
save what can be saved when an engine fails.

`Router` is driven by the HTTP app in production and by the simulator on a virtual clock,
so it reads time only through the running loop and does no I/O of its own beyond the engine
clients it is given. There is one dispatch path (`Dispatch`): a streamed and a whole answer
differ only in the `stream` flag the engines get (a whole answer is one chunk), and both
get the same retries (a failure before any output goes to other instances, either
cluster) and migrations (a decode that dies mid-stream: the prompt plus the tokens
already streamed go to another decode, so a greedy answer equals an unfailed run's).

A request that carries the client's OpenAI body (`ClientBody`: the engine's own OpenAI
server answers it) is retried the same way before output, but never migrated: its answer is
the engine's own rendering (tool-call parsers, grammars, log-probabilities, several
choices), which no continuation on another engine reproduces exactly, so a decode that dies
mid-stream fails the request (the client gets an error event and no `[DONE]`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NoReturn, Protocol

import msgspec

from prfaas.common.hashing import iter_block_hashes, salt_root
from prfaas.engine_clients.base import EngineError
from prfaas.gateway.attempt import Attempt, Continuation
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.policies.routing import (
    BaseRoutingPolicy,
    NoInstanceAvailable,
    Regime,
    Route,
    RouteDecision,
    RoutingSnapshot,
)
from prfaas.policies.ttft_forecast import LoadForecast
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.generate import Bootstrap, GenerateChunk, GenerateRequest, SamplingParams

logger = logging.getLogger(__name__)
WAIT_POLL_S = 0.2
"""How often a request with nowhere to go looks for a readmitted instance."""
PULL_RESULTS = ("started", "exported", "failed")


@dataclass(frozen=True)
class RetryPolicy:
    """How far the Router goes to save a request whose engine failed."""

    max_retries: int = 2
    """Re-dispatches before the first token (on other instances, either cluster)."""
    max_migrations: int = 2
    """Re-dispatches after output began: the decode died mid-stream, so the prompt plus the
    tokens already streamed go to another decode (a greedy answer then equals an unfailed
    run's)."""
    wait_s: float = 30.0
    """How long a request that must be re-dispatched waits for an instance to come back
    when none is left (a single decode restarting): it resumes on the readmitted one."""

    def __post_init__(self) -> None:
        for name in ("max_retries", "max_migrations"):
            if not 0 <= getattr(self, name) <= 10:
                raise ValueError(f"{name} must be in 0..10, got {getattr(self, name)}")
        if not 0 <= self.wait_s <= 600:
            raise ValueError(f"wait_s must be in [0, 600], got {self.wait_s}")


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
    retries: int = 0
    """Re-dispatches before the first token."""
    migrations: int = 0
    """Re-dispatches after output began."""


class RoutingObserver(Protocol):
    """What the schedulers see of the request path (`gateway/scheduling/observer.py`). Each
    method is called on the loop, synchronously, and must not block."""

    def forecast(self) -> LoadForecast | None:
        """The load forecast to put in the next request's snapshot (None: none)."""
        ...

    def dispatched(self, rid: str, decision: RouteDecision, request: str) -> None:
        """An attempt `rid` of request `request` was sent to its instances (a retry or a
        migration is a new attempt of the same request)."""
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
    `room_source` draws bootstrap rooms (63 bits from `secrets` by default; seeded in
    simulation). `detokenize` (the gateway's tokenizer) rebuilds the text of a migrated
    request from all of its output ids, so a character split across the migration point
    comes out whole; without it the engines' text is passed on as is. `observer` (optional)
    is the schedulers' view: it adds a load forecast to every snapshot and hears of every
    dispatch, prefill end, first token and finish.
    """

    instances: InstanceManager
    index: KVIndexManager
    policy: BaseRoutingPolicy
    state: RoutingState
    on_event: Callable[[RouteEvent], None] | None = None
    room_source: Callable[[], int] = field(default=lambda: secrets.randbits(63))
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    detokenize: Callable[[Sequence[int]], str] | None = None
    observer: RoutingObserver | None = None
    prefix_pulls: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(PULL_RESULTS, 0), init=False
    )
    """Prefix pulls by result: `started`, then `exported` or `failed` (the source's side)."""
    _exports: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)

    def decide(
        self,
        input_ids: Sequence[int],
        exclude: Collection[str] = (),
        *,
        salt: str | None = None,
        indexed: bool = True,
        may_pull: bool = True,
    ) -> RouteDecision:
        """Route one prompt: chained block hashes, longest cached prefix per instance, policy;
        instances in `exclude` are treated as unhealthy. A prompt whose engine keys its
        cache by a `salt` too is looked up from `salt_root(salt)`; one keyed by what the
        index does not read (not `indexed`: `ClientBody.unindexed_key`) is credited nothing.
        One whose prefix must not be pulled across clusters (not `may_pull`) is routed as in
        the bandwidth-scarce regime, on what each cluster caches itself.

        Raises:
            NoInstanceAvailable: no healthy instance for a needed role.
        """
        cached: dict[str, int] = {}
        if indexed:  # lazy hashes: the lookup stops at the first block no instance holds
            root = None if salt is None else salt_root(salt)
            hashes = iter_block_hashes(input_ids, self.index.block_size, parent=root)
            cached = self.index.longest_prefix(hashes)
        snapshot = RoutingSnapshot(
            total_tokens=len(input_ids),
            instances=self.instances.views(cached, exclude),
            threshold=self.state.threshold,
            regime=self.state.regime if may_pull else "bandwidth_scarce",
            forecast=None if self.observer is None else self.observer.forecast(),
        )
        return self.policy.decide(snapshot)

    async def dispatch(
        self,
        rid: str,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        stream: bool,
        client_body: ClientBody | None = None,
    ) -> Dispatch:
        """Decide, start the prefill and decode calls at once, and return once the first
        output chunk is in (`Dispatch.first`; with `stream=False` the engines answer in one
        piece, so it is the whole output). The caller reads the rest with `Dispatch.next`
        and must `close` it (closing early aborts the request on the engines).

        A failure before any output is retried on a fresh decision without the instance
        that failed (`RetryPolicy.max_retries`); one after output began is migrated
        (`Dispatch.next`). An instance that could not even be connected to is ejected.
        `client_body` (the client's body, for engines whose own OpenAI server answers) travels
        with every attempt; one that must run on one engine (`ClientBody.one_engine`) has
        its decode compute the prompt too.

        Raises:
            NoInstanceAvailable: nowhere to run the request.
            EngineError: the request failed on an engine and could not be retried.
        """
        routed = Dispatch(self, rid, tuple(input_ids), sampling, stream, client_body)
        try:
            await routed.start()
        except BaseException:  # cancelled too: the calls are aborted
            routed.close()
            raise
        return routed

    def bootstrap(self, prefill: InstanceState) -> Bootstrap:
        """A fresh room at `prefill`'s bootstrap address."""
        if prefill.bootstrap_host is None or prefill.bootstrap_port is None:
            raise NoInstanceAvailable(f"prefill instance {prefill.instance_id} has no bootstrap")
        return Bootstrap(prefill.bootstrap_host, prefill.bootstrap_port, self.room_source())

    def with_prefix_pull(
        self,
        decision: RouteDecision,
        prefill: InstanceState,
        request: GenerateRequest,
        on_export_failed: Callable[[EngineError], None] | None = None,
    ) -> GenerateRequest:
        """The prefill's request. When `decision` moves a cached prefix across clusters (the
        bandwidth-abundant regime) and both engines can, the source starts exporting it into
        a fresh room on its KV transport now, and the prefill is told to pull it from there
        before computing the rest; otherwise `request` itself (the prefill computes it).
        `on_export_failed` hears of an export that failed (the prefill's pull then waits in
        vain, where its engine does not give up on it by itself)."""
        source_id = decision.prefix_source
        if source_id is None or source_id not in self.instances:
            return request
        source = self.instances[source_id]
        if not (prefill.prefix_pull and source.prefix_pull) or source is prefill:
            return request
        try:
            room = self.bootstrap(source)
        except NoInstanceAvailable:  # the source has no KV transport address
            return request
        tokens = decision.cached_tokens  # the source's prefix (longer than the prefill's)
        task = asyncio.get_running_loop().create_task(
            self._export(source, request.input_ids, room.room, tokens, on_export_failed)
        )
        self._exports.add(task)
        task.add_done_callback(self._exports.discard)
        self.prefix_pulls["started"] += 1
        return replace(request, prefix_pull=room, prefix_tokens=tokens)

    async def _export(
        self,
        source: InstanceState,
        ids: Sequence[int],
        room: int,
        expected: int,
        on_failed: Callable[[EngineError], None] | None = None,
    ) -> None:
        """The source's side of a prefix pull; a failure costs only the recompute (the
        prefill's pull fails too and it computes the prefix itself, or, where a failed pull
        fails the engine's request (vLLM), the request is retried without the pull)."""
        try:
            tokens = await source.client.export_prefix(ids, room, expected)
        except EngineError as exc:
            self.prefix_pulls["failed"] += 1
            logger.warning("prefix export from %s failed: %s", source.instance_id, exc)
            if on_failed is not None:
                on_failed(exc)
            return
        self.prefix_pulls["exported" if tokens else "failed"] += 1
        logger.info("prefix export from %s: %d tokens", source.instance_id, tokens)

    async def cancel_exports(self) -> None:
        """Stop prefix exports still running (the gateway is stopping)."""
        for task in list(self._exports):
            task.cancel()
        await asyncio.gather(*self._exports, return_exceptions=True)

    def report(self, event: RouteEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
        if self.observer is not None:
            self.observer.finished(event)


def on_decode(decision: RouteDecision, cluster: Route) -> RouteDecision:
    """`decision` with its decode instance (in `cluster`) computing the prompt too."""
    return msgspec.structs.replace(
        decision, route=cluster, prefill_instance=decision.decode_instance,
        prefix_transfer_from=None, prefix_source=None,
        reason="one engine: several sequences or the prompt's log-probabilities",
    )  # fmt: skip


class Dispatch:
    """One request from its first dispatch to its end, across attempts: each attempt is a
    prefill and a decode call (`Attempt`); a failed attempt is retried (before output) or
    migrated (after output) on other instances, within the Router's `RetryPolicy`.

    Chunks handed out are the request's: token counts from the start of the request, text
    that continues what was already handed out.
    """

    def __init__(
        self,
        router: Router,
        rid: str,
        input_ids: tuple[int, ...],
        sampling: SamplingParams,
        stream: bool,
        client_body: ClientBody | None = None,
    ) -> None:
        self.router, self.rid, self.input_ids = router, rid, input_ids
        self.sampling, self.stream, self.client_body = sampling, stream, client_body
        self._one_engine = client_body is not None and client_body.one_engine() is not None
        self._salt = None if client_body is None else client_body.cache_salt()
        self._indexed = client_body is None or client_body.unindexed_key() is None
        self._resumable = client_body is None and sampling.resumable
        """Whether a cut stream may migrate: another engine continues it exactly from the
        prompt plus the output so far (not an engine's own answer, whose parsers and
        grammars hold state the gateway cannot hand over, nor output-counting penalties
        or a seeded draw)."""
        self.first: GenerateChunk | None = None
        self._decision: RouteDecision | None = None
        self.retries = self.migrations = 0
        self._attempt: Attempt | None = None
        self._attempts = 0
        self._excluded: dict[str, int] = {}  # failed instance -> its readmissions then
        self._output: list[int] = []  # ids handed out so far
        self._texts: list[str] = []  # text handed out so far (for a migration's text)
        self._base = 0  # output tokens before the current attempt began
        self._cached = 0  # cached prompt tokens the first answering engine reported
        self._continuation: Continuation | None = None
        self._began = False  # a chunk was handed out
        self._last: GenerateChunk | None = None
        self._reported = self._closed = False
        self._pulling = False  # the current attempt's prefill pulls a prefix
        self._no_pull = self._salt is not None
        """Route on what each cluster caches itself, never pulling a prefix (as in the
        scarce regime): a pull failed this request, or its prefix is salted (an export names
        the source's blocks by their tokens alone)."""

    @property
    def decision(self) -> RouteDecision:
        """The decision of the current (or last) attempt: after `dispatch` returns, the one
        that produced the first output."""
        if self._decision is None:
            raise RuntimeError("the request has not been routed yet")
        return self._decision

    async def start(self) -> None:
        """Wait for the first output chunk.

        Raises:
            EngineError: the request failed before any output and could not be retried.
            NoInstanceAvailable: no instance left to try.
        """
        first = await self.next()
        if first is None:
            self._fail(EngineError("the engine returned no output", code="engine_no_output"))
        if self.router.observer is not None:
            self.router.observer.first_token(self.rid)
        self.first = first

    async def next(self) -> GenerateChunk | None:
        """The next output chunk; None at the end.

        Raises:
            EngineError: the request failed and could not be retried or migrated.
        """
        while True:
            attempt = self._attempt or self._launch()
            try:
                chunk = await attempt.next()
            except EngineError as exc:
                await self._recover(attempt, exc)
                continue
            if chunk is None:
                self._report(None)
                return None
            return self._hand_out(chunk)

    def _launch(self) -> Attempt:
        """Start a new attempt: the prompt (plus the output so far, after a migration) on a
        fresh decision that avoids every instance that failed this request."""
        ids, sampling = self.input_ids, self.sampling
        if self._output:
            ids = (*self.input_ids, *self._output)
            sampling = self.sampling.continued(len(self._output))
        router = self.router
        decision = router.decide(
            ids,
            self._still_excluded(),
            salt=self._salt,
            indexed=self._indexed,
            may_pull=not self._no_pull,
        )
        if self._one_engine:
            decision = on_decode(decision, router.instances[decision.decode_instance].cluster)
        prefill = router.instances[decision.prefill_instance]
        decode = router.instances[decision.decode_instance]
        bootstrap = None if prefill is decode else router.bootstrap(prefill)
        rid = self.rid if not self._attempts else f"{self.rid}-{self._attempts}"
        self._attempts += 1
        request = GenerateRequest(
            rid, ids, sampling, self.stream, bootstrap, client_body=self.client_body
        )
        pull = prefill is not decode and decision.prefix_source is not None and not self._no_pull
        prefill_request = None
        if pull:
            on_failed = partial(self._export_failed, self._attempts)
            prefill_request = router.with_prefix_pull(decision, prefill, request, on_failed)
        self._pulling = prefill_request is not None and prefill_request.prefix_pull is not None
        self._decision = decision
        self._base = len(self._output)
        observer = router.observer
        over = None if observer is None else partial(observer.prefill_ended, rid, decision)
        self._attempt = Attempt(
            decision, prefill, decode, request, prefill_request, on_prefill_over=over
        )
        if observer is not None:
            observer.dispatched(rid, decision, self.rid)
        return self._attempt

    def _export_failed(self, attempt_no: int, error: EngineError) -> None:
        """The source's export for attempt `attempt_no` failed: a prefill whose engine fails
        the request on a failed pull (vLLM) would wait for the room until its transfer
        timeout, so its call is aborted now, and `_recover` computes the prefix instead."""
        attempt = self._attempt
        if attempt is None or self._attempts != attempt_no or self._began:
            return
        if attempt.prefill.client.pull_failure_fails_request:
            attempt.abort_prefill(EngineError(f"prefix export failed: {error}",
                                              code="prefix_pull_failed"))  # fmt: skip

    def _still_excluded(self) -> set[str]:
        """Instances that failed this request and were not readmitted since (a restarted
        engine that proved healthy again may take it)."""
        instances = self.router.instances
        return {i for i, n in self._excluded.items() if instances[i].readmissions == n}

    async def _recover(self, attempt: Attempt, exc: EngineError) -> None:
        """After `attempt` failed with `exc`: blame the instance that failed, then set up a
        retry or a migration (waiting up to `RetryPolicy.wait_s` for an instance when none
        is left), or raise when neither is allowed."""
        attempt.close()
        self._attempt = None
        failed = attempt.failed or attempt.decode
        if self._pulling and failed is attempt.prefill and not self._began:
            # the prefix pull failed (its source or the link): routed again on what each
            # cluster caches itself (the prefill computes the prefix its cluster lacks);
            # neither blamed nor counted as a retry
            logger.info("%s: prefix pull on %s failed (%s); computing it instead", self.rid,
                        failed.instance_id, exc.code)  # fmt: skip
            self._no_pull = True
            try:
                self._launch()
                return
            except NoInstanceAvailable:
                pass  # then as any failure
        if exc.unreachable:
            failed.eject("connection refused")
        self._excluded[failed.instance_id] = failed.readmissions
        if exc.rejected or (self._began and not self._resumable):
            self._fail(exc)  # refused anywhere, or cut mid-way where no engine can go on
        if self._output:
            self.migrations += 1
            allowed = self.migrations <= self.router.retry.max_migrations
        else:
            self.retries += 1
            allowed = self.retries <= self.router.retry.max_retries
        if not allowed:
            self._fail(exc)
        logger.info("%s: %s on %s; %s", self.rid, exc.code, failed.instance_id,
                    "migrating" if self._output else "retrying")  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.router.retry.wait_s
        while True:
            try:
                self._launch()
                return
            except NoInstanceAvailable:
                if loop.time() >= deadline:
                    self._fail(exc)  # nowhere else to go: the engine's failure is the cause
            await asyncio.sleep(WAIT_POLL_S)

    def _hand_out(self, chunk: GenerateChunk) -> GenerateChunk:
        self._began = True
        if self._base == 0 and not self._output:
            self._cached = chunk.cached_tokens
        self._output.extend(chunk.token_ids)
        if self._base:
            chunk = self._continued(chunk)
        self._texts.append(chunk.text)
        self._last = chunk
        return chunk

    def _continued(self, chunk: GenerateChunk) -> GenerateChunk:
        """A migrated attempt's chunk as the request's: counts from the request's start,
        text continuing what was handed out."""
        text = chunk.text
        detokenize = self.router.detokenize
        if detokenize is not None:
            if self._continuation is None:
                self._continuation = Continuation("".join(self._texts))
            text = self._continuation.add(chunk, self._output, detokenize)
        return GenerateChunk(
            chunk.token_ids,
            text,
            len(self.input_ids),
            self._base + chunk.completion_tokens,
            self._cached,
            chunk.finish_reason,
        )

    def _fail(self, error: EngineError) -> NoReturn:
        self._report(str(error))
        raise error

    def _report(self, error: str | None) -> None:
        if self._reported or self._decision is None:
            return
        self._reported = True
        last = self._last
        completion = last.completion_tokens if last is not None and error is None else 0
        self.router.report(
            RouteEvent(self.rid, self.decision, len(self.input_ids), completion, error,
                       self.retries, self.migrations)
        )  # fmt: skip

    def close(self) -> None:
        """End the request: calls still running are aborted on their engines; the
        instances' in-flight counts drop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._report("aborted: the request was closed before its end")  # unless it ended
        if self._attempt is not None:
            self._attempt.close()
