"""The engine's async face: runs `EngineCore.step` on one worker thread, validates and submits
requests, relays their token events, and drives hand-offs and role switches.

Threading: the event loop owns everything here; the worker thread runs `core.step()` only.
Requests reach the core through its thread-safe inbox; token events come back through
`loop.call_soon_threadsafe`. The loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor

from prfaas.engines.reference.handoff.base import HandoffError, HandoffReceiver, HandoffSender
from prfaas.engines.reference.step.core import EngineCore
from prfaas.engines.reference.step.prefix_transfer import (
    export_prefix,
    import_prefix,
    prefix_from_received,
    send_prefix,
)
from prfaas.engines.reference.step.request import Request, TokenEvent
from prfaas.engines.reference.step.sampling import Constraint, resolve_seed
from prfaas.engines.role_fence import RoleFence
from prfaas.protocol.errors import APIError, InvalidRequest
from prfaas.protocol.generate import Bootstrap, SamplingParams

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 0.01


class CapacityError(APIError):
    """The request can never fit the engine (HTTP 413)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message, param="prompt", code="context_length_exceeded")


class Unavailable(APIError):
    """The engine does not take new requests now (draining for a role switch; HTTP 503)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="unavailable")


def _no_emit(event: TokenEvent) -> None:
    raise RuntimeError("request emitted before it was started")


class EngineService:
    """Async engine: `generate` yields `TokenEvent`s; `switch_role`, `flush` and stats."""

    def __init__(self, core: EngineCore, sender: HandoffSender, receiver: HandoffReceiver) -> None:
        self.core, self.sender, self.receiver = core, sender, receiver
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prfaas-engine")
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._draining = False
        self._active: dict[str, Request] = {}
        self.last_switch_s: float | None = None
        self.fence = RoleFence()
        """The newest gateway leader's epoch seen (conversions from older ones are refused)."""
        self.start_id = secrets.token_hex(8)
        """Names this process's life: a restarted engine reports another one, so the
        gateway knows its prefix cache (and KV-index entries) are gone."""
        self.prefix_exported_tokens = self.prefix_imported_tokens = self.prefix_pull_failures = 0
        """Prefix pulls (`export_prefix` here, `prefix_pull` of requests), for `/stats`."""

    @property
    def draining(self) -> bool:
        """Whether a role switch is draining the engine (new requests are refused)."""
        return self._draining

    async def start(self) -> None:
        """Start the hand-off endpoint and the step loop."""
        await self.sender.start()
        self._task = asyncio.create_task(self._run(), name="prfaas-engine-loop")

    async def close(self) -> None:
        """Stop the step loop, then close the hand-off endpoints."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
        await self.sender.close()
        await self.receiver.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.core.has_work():
                self._wake.clear()
                self._idle.set()
                await self._wake.wait()
                self._idle.clear()
            try:
                await loop.run_in_executor(self._executor, self.core.step)
            except Exception:
                logger.exception("engine step failed; aborting its requests")
                self.core.fail_all("internal engine error")

    def validate(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise `InvalidRequest` / `CapacityError` for a request the engine cannot run."""
        vocab = self.core.runner.shape.vocab_size
        if not prompt:
            raise InvalidRequest("the prompt is empty")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})")
        pool = self.core.pool
        total = len(prompt) + params.max_new_tokens
        if pool.blocks_for_tokens(total) > pool.config.num_blocks:
            raise CapacityError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the KV capacity of {pool.config.num_blocks * pool.config.block_size}"
            )

    def generate(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        bootstrap: Bootstrap | None,
        prefix_pull: Bootstrap | None = None,
        constraint: Constraint | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Check and start one request; iterate the result for its events, the last one with
        a finish reason. Closing the iteration early (client gone) aborts the request and
        frees its blocks. With `prefix_pull` (prefill roles), the prompt's cached prefix is
        first fetched from that engine's `export_prefix` into this engine's prefix cache; a
        failed pull is logged and the prefix computed here instead. `constraint` is a
        grammar the output must follow (it becomes the request's: one per request).

        Raises:
            InvalidRequest, CapacityError: bad input (at once). Unavailable: draining.
            HandoffError: from the iteration, when a decode engine gets no KV.
        """
        if self._draining:
            raise Unavailable("engine is switching roles")
        self.validate(prompt, params)
        if rid in self._active:
            raise InvalidRequest(f"rid {rid!r} is already in use by a running request")
        role = self.core.role
        if role == "prefill" and bootstrap is None:
            raise InvalidRequest(  # a decode alone computes the prompt too (several sequences)
                "a prefill engine needs bootstrap_host, bootstrap_port and bootstrap_room"
            )
        req = Request(rid, prompt, params, emit=_no_emit, seed=resolve_seed(params),
                      constraint=constraint)  # fmt: skip
        self._active[rid] = req  # released when the iteration ends (callers always iterate)
        return self._events(req, role, bootstrap, prefix_pull if role != "decode" else None)

    async def _events(
        self, req: Request, role: str, bootstrap: Bootstrap | None, prefix_pull: Bootstrap | None
    ) -> AsyncGenerator[TokenEvent, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def emit(event: TokenEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        req.emit = emit
        finished = False
        try:
            if role == "prefill" and bootstrap is not None:
                try:
                    req.outbox = self.sender.open(bootstrap.room)
                except ValueError as exc:  # room already open (or out of range)
                    raise InvalidRequest(f"bootstrap_room {bootstrap.room}: {exc}") from exc
            elif role == "decode" and bootstrap is not None:
                req.received = await self.receiver.fetch(
                    bootstrap.host, bootstrap.port, bootstrap.room,
                    timeout_s=self.core.config.handoff_timeout_s,
                )  # fmt: skip
            if prefix_pull is not None:
                await self._pull_prefix(req, prefix_pull)
            self._submit(req)
            while not finished:
                event = await queue.get()
                if event.finish_reason is not None and req.outbox is not None:
                    await req.outbox.wait()  # SGLang's prefill answers once KV is delivered
                finished = event.finish_reason is not None
                yield event
        finally:
            if self._active.get(req.rid) is req:
                del self._active[req.rid]
            if not finished:
                req.aborted = True
                if req.outbox is not None:
                    req.outbox.abort("request aborted")
                self._poke()

    async def export_prefix(self, prompt: list[int], room: int) -> int:
        """Send the KV and states of `prompt`'s longest cached prefix into `room` on this
        engine's bootstrap endpoint (the importer fetches it); returns its length in tokens
        once delivered. With nothing cached the room is aborted at once (the importer stops
        waiting) and 0 is returned.

        Raises:
            InvalidRequest: the room is already open. HandoffError: delivery failed.
        """
        try:
            outbox = self.sender.open(room)
        except ValueError as exc:
            raise InvalidRequest(f"room {room}: {exc}") from exc
        try:
            core = self.core
            loop = asyncio.get_running_loop()
            state = await loop.run_in_executor(  # between steps: the pool is the engine's
                self._executor, export_prefix, core.pool, core.storage, prompt
            )
            if state is None:
                outbox.abort("no prefix of this prompt is cached here")
                return 0
            send_prefix(outbox, state, core.pool.config.block_size, core.copier)
            await outbox.wait()
        except BaseException:
            outbox.abort("the prefix export failed")
            raise
        self.prefix_exported_tokens += state.length
        return state.length

    async def _pull_prefix(self, req: Request, source: Bootstrap) -> None:
        """Fetch `req`'s prompt prefix from `source` into the prefix cache (best effort)."""
        core = self.core
        try:
            received = await self.receiver.fetch(
                source.host, source.port, source.room, timeout_s=core.config.pull_timeout_s
            )
            shape, bs = core.runner.shape, core.pool.config.block_size
            state = prefix_from_received(received, shape.layer_types, bs, core.copier)
            loop = asyncio.get_running_loop()
            added = await loop.run_in_executor(
                self._executor, import_prefix, core.pool, core.storage, req.prompt, state
            )
        except HandoffError as exc:
            self.prefix_pull_failures += 1
            logger.warning("request %s: prefix pull from %s:%d failed (%s); computing it here",
                           req.rid, source.host, source.port, exc)  # fmt: skip
            return
        self.prefix_imported_tokens += added
        logger.info("request %s: pulled a %d-token prefix from %s:%d (%d new here)",
                    req.rid, state.length, source.host, source.port, added)  # fmt: skip

    def abort(self, rid: str) -> bool:
        """Abort the running or queued request `rid` (SGLang's `/abort_request`); False if
        there is none."""
        req = self._active.get(rid)
        if req is None:
            return False
        req.aborted = True
        self._poke()
        return True

    def _submit(self, req: Request) -> None:
        self.core.submit(req)
        self._poke()

    def _poke(self) -> None:
        """There is work: wake the step loop (and mark it not idle until it looks)."""
        self._idle.clear()
        self._wake.set()

    def flush_cache(self) -> None:
        """Drop the prefix cache (at the next step)."""
        self.core.request_flush()
        self._poke()

    async def switch_role(self, role: str, timeout_s: float = 600.0, *, epoch: int = 0) -> float:
        """Drain running work, then switch role; returns the switch time in seconds. `epoch`:
        the converting leader's (`RoleFence`), checked before the drain and again before the
        switch. The drain waits for decodes still waiting for their KV too, so `timeout_s`
        (the gateway's default `drain_timeout_s`) outlasts `handoff_timeout_s`.

        Raises:
            InvalidRequest: unknown role. TimeoutError: work did not drain in time.
            Fenced: a newer leader has announced itself (the role is unchanged).
        """
        if role not in ("prefill", "decode", "both"):
            raise InvalidRequest(f"role must be prefill, decode or both, got {role!r}")
        self.fence.admit(epoch)
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._draining = True
        try:
            async with asyncio.timeout(timeout_s):
                # Requests still being set up (a decode waiting for its KV) are not in the
                # core yet but belong to the old role: wait for them too.
                while self.core.has_work() or self._active:
                    if self.core.has_work():
                        await self._idle.wait()
                    else:
                        await asyncio.sleep(DRAIN_POLL_S)
            self.fence.admit(epoch)
            self.core.role = role
        finally:
            self._draining = False
        self.last_switch_s = loop.time() - start
        return self.last_switch_s
