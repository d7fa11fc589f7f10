"""The engine step: admit one request (start its prefill, or take a received hand-off), run
one prefill piece (at most `max_prefill_tokens`), then one batched decode step over every
running request. Runs on one worker thread; other threads only `submit`, set
`Request.aborted`, queue `flush`, and read counters.

Capacity is reserved up front for prompt + `max_new_tokens`, so a running request never runs
out of KV mid-decode: when the pool cannot hold a new request, it waits (back-pressure).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

from prfaas.common.hashing import hash_blocks
from prfaas.engines.kv_pages.device_copy import DeviceCopier
from prfaas.engines.reference.cache.block_pool import BlockPool, BlockPoolConfig, OutOfKVCapacity
from prfaas.engines.reference.cache.storage import KVStorage
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.handoff.base import HandoffError
from prfaas.engines.reference.model.hybrid_cache import HybridCache, SeqState
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.engines.reference.step.counters import EngineCounters
from prfaas.engines.reference.step.prefill import PrefillRun, send_meta, state_from_handoff
from prfaas.engines.reference.step.request import Phase, Request, TokenEvent
from prfaas.engines.reference.step.sampling import Choice, NoTokenLeft, choose
from prfaas.engines.reference.step.stopping import stop_reason
from prfaas.protocol.kv_events import KVEvent

Detokenize = Callable[[list[int]], str]


class EngineCore:
    """Scheduler + executor of one engine. `step()` only on the engine thread."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, detokenize: Detokenize) -> None:
        self.runner, self.config, self.detokenize = runner, config, detokenize
        self.role = config.role
        pool_config = BlockPoolConfig(config.num_blocks, config.block_size, config.num_state_slots)
        self.pool = BlockPool(pool_config)
        self.storage = KVStorage(config.num_blocks, config.block_size, config.num_state_slots)
        self.copier = DeviceCopier(runner.device)
        """Hand-off copies between the model's device and the host."""
        self.counters = EngineCounters()
        self.event_sink: Callable[[list[KVEvent]], None] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Request | None = None  # one prompt at a time, a piece per step
        self._inbox: deque[Request] = deque()
        self._flush = threading.Event()
        self._batch: HybridCache | None = None
        self._batch_reqs: list[Request] = []

    # --- any thread ------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue a request (thread-safe); it is admitted at a later step."""
        self._inbox.append(req)

    def request_flush(self) -> None:
        """Clear the prefix cache at the start of the next step (thread-safe)."""
        self._flush.set()

    def has_work(self) -> bool:
        busy = self.waiting or self.running or self.prefilling is not None
        return bool(self._inbox or busy or self._flush.is_set())

    # --- engine thread ---------------------------------------------------------------------

    def step(self) -> None:
        """Admit at most one request, run one prefill piece, then one decode step."""
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        if self._flush.is_set():
            self._flush.clear()
            self.pool.clear()
        self._reap_aborted()
        room = len(self.running) < self.config.max_batch
        if self.prefilling is None and self.waiting and room:
            self._admit(self.waiting[0])
        if self.prefilling is not None:
            self._prefill_step(self.prefilling)
        if self.running:
            self._decode_step()
        events = self.pool.take_events()
        if events and self.event_sink is not None:
            self.event_sink(events)

    def fail_all(self, message: str) -> None:
        """End every request with an abort event after a failed step (engine thread idle)."""
        prefilling = [self.prefilling] if self.prefilling is not None else []
        reqs = [*self._inbox, *self.waiting, *prefilling, *self.running]
        self.prefilling = None
        self._inbox.clear()
        self.waiting.clear()
        self.running.clear()
        self._batch, self._batch_reqs = None, []
        for req in reqs:
            if self.pool.has_request(req.rid):
                self.pool.free(req.rid)
            if req.outbox is not None:
                req.outbox.abort(message)
            req.phase = Phase.FINISHED
            req.emit(TokenEvent((), {"type": "abort", "message": message, "status_code": 500}))

    def _reap_aborted(self) -> None:
        prefilling = [self.prefilling] if self.prefilling is not None else []
        aborted = [r for r in (*self.waiting, *prefilling, *self.running) if r.aborted]
        for req in aborted:
            if req in self.waiting:
                self.waiting.remove(req)
            if req is self.prefilling:
                self.prefilling, req.prefill = None, None
            self._finish(req, cache=False)
            if req.outbox is not None:
                req.outbox.abort("request aborted")
            req.emit(TokenEvent((), {"type": "abort", "message": "request aborted"}))

    def _admit(self, req: Request) -> None:
        try:
            admitted = self._admit_handoff(req) if req.received else self._admit_prefill(req)
        except HandoffError as exc:
            self.waiting.popleft()
            req.phase = Phase.FINISHED
            message = f"KV hand-off failed: {exc}"
            req.emit(TokenEvent((), {"type": "abort", "message": message, "status_code": 502}))
            return
        if admitted:
            self.waiting.popleft()

    def _admit_prefill(self, req: Request) -> bool:
        """Reserve blocks (reusing the longest cached prefix) and start the prefill."""
        bs, prompt = self.config.block_size, req.prompt
        match = self.pool.match_prefix(hash_blocks(prompt[:-1], bs))
        extra = 0 if req.outbox is not None else req.params.max_new_tokens
        try:
            self.pool.allocate(req.rid, len(prompt) + extra, match)
        except OutOfKVCapacity:
            return False
        prefix = (match.block_ids, match.state_slot)
        budget = self.config.max_prefill_tokens
        req.prefill = PrefillRun(self.storage, prompt, prefix, req.outbox, budget, self.copier)
        req.prompt_blocks_written = len(match.block_ids)
        req.cached_tokens = match.num_tokens
        self.counters.prefilled(len(prompt), match.num_tokens)
        self.prefilling = req
        return True

    def _prefill_step(self, req: Request) -> None:
        """One piece of the current prefill; index its full blocks and save its state."""
        assert req.prefill is not None
        run, bs = req.prefill, self.config.block_size
        with torch.inference_mode():
            _, end = run.step(self.runner)
        full, first = end // bs, req.prompt_blocks_written
        if full > first:
            table = self.pool.block_table(req.rid)
            self.storage.write_blocks(run.state, table[first:full], first)
            req.prompt_blocks_written = full
            self.pool.cache_full_blocks(req.rid, req.prompt[: full * bs])
        if end % bs == 0:
            self._save_state(req, end, run.state)
        if run.done:
            self.prefilling, req.prefill = None, None
            assert run.logits is not None
            chosen = self._choose(req, run.logits)
            if chosen is not None:
                self._first_token(req, run.state, chosen)

    def _choose(self, req: Request, logits: torch.Tensor) -> Choice | None:
        """`req`'s next token; None when none is left (the request was failed alone)."""
        eos = self.runner.shape.eos_token_id
        context = (req.prompt, req.output)
        try:
            return choose(logits, req.params, req.seed, context, eos, req.constraint)
        except NoTokenLeft as exc:
            self._refuse(req, str(exc))
            return None

    def _refuse(self, req: Request, message: str) -> None:
        """End `req` alone with a client error (its blocks freed, its hand-off aborted);
        the engine's other requests go on."""
        self._finish(req, cache=False)
        if req.outbox is not None:
            req.outbox.abort(message)
        req.emit(TokenEvent((), {"type": "abort", "message": message, "status_code": 400}))

    def _first_token(self, req: Request, state: SeqState, first: Choice) -> None:
        if req.outbox is None:
            req.state = state
            self._start_decoding(req, first)
            return
        send_meta(req.outbox, first, len(req.prompt), req.cached_tokens)
        req.outbox.finish()
        req.output.append(first.token)
        self._finish(req, cache=False)
        req.emit(TokenEvent.of(first, {"type": "length", "length": 1}, req.cached_tokens))

    def _admit_handoff(self, req: Request) -> bool:
        assert req.received is not None
        handed = state_from_handoff(req.received, self.runner.shape.layer_types, self.copier)
        if handed.state.length != len(req.prompt):
            raise HandoffError(f"{handed.state.length} tokens received for a prompt of "
                               f"{len(req.prompt)}")  # fmt: skip
        try:
            self.pool.allocate(req.rid, len(req.prompt) + req.params.max_new_tokens, transfer=True)
        except OutOfKVCapacity:
            return False
        req.state, req.cached_tokens, req.received = handed.state, handed.cached_tokens, None
        if req.constraint is not None:  # the prefill drew it under the same grammar
            try:
                req.constraint.accept(handed.first.token)
            except ValueError:
                self._refuse(req, "the prefill's first token is outside the output grammar")
                return True
        self._start_decoding(req, handed.first)
        return True

    def _start_decoding(self, req: Request, first: Choice) -> None:
        req.output.append(first.token)
        reason = stop_reason(req, self.runner.shape.eos_token_id, self.detokenize)
        if reason is None:
            req.phase = Phase.RUNNING
            self.running.append(req)
        else:
            self._finish(req, cache=True)  # before the event: a reply implies freed blocks
        req.emit(TokenEvent.of(first, reason, req.cached_tokens))

    def _decode_step(self) -> None:
        if self._batch_reqs != self.running:
            self._rebatch()
        assert self._batch is not None
        batch, reqs = self._batch, list(self.running)
        ids = torch.tensor([[r.output[-1]] for r in reqs])
        logits = self.runner.forward(batch, ids)
        self.counters.generated(len(reqs))
        eos, bs = self.runner.shape.eos_token_id, self.config.block_size
        for i, req in enumerate(reqs):
            choice = self._choose(req, logits[i])
            if choice is None:
                continue
            req.output.append(choice.token)
            if batch.lengths[i] % bs == 0:
                req.boundary = _linear_row(batch, i)
            reason = stop_reason(req, eos, self.detokenize)
            if reason is not None:
                self._finish(req, cache=True)
            req.emit(TokenEvent.of(choice, reason, req.cached_tokens))

    def _rebatch(self) -> None:
        """Re-stack the decode batch after requests joined or left."""
        if self._batch is not None:
            for i, req in enumerate(self._batch_reqs):
                if req.phase is Phase.RUNNING and req.state is None:
                    req.state = self._batch.row(i)
        states = [r.state for r in self.running]
        self._batch = HybridCache([s for s in states if s is not None])
        for req in self.running:
            req.state = None  # the batch holds it now
        self._batch_reqs = list(self.running)

    def _finish(self, req: Request, *, cache: bool) -> None:
        """Take `req` out of the batch and free its blocks (indexing them first if `cache`)."""
        if req in self.running:
            if req.state is None and self._batch is not None and req in self._batch_reqs:
                req.state = self._batch.row(self._batch_reqs.index(req))
            self.running.remove(req)
        req.phase = Phase.FINISHED
        if self.pool.has_request(req.rid):
            if cache and req.state is not None:
                self._cache_finished(req, req.state)
            self.pool.free(req.rid)
        req.state = None

    def _cache_finished(self, req: Request, state: SeqState) -> None:
        """Index the blocks decode filled, and the latest block-aligned linear state."""
        bs = self.config.block_size
        full = state.length // bs
        table = self.pool.block_table(req.rid)
        first = req.prompt_blocks_written
        if full > first:
            self.storage.write_blocks(state, table[first:full], first)
        self.pool.cache_full_blocks(req.rid, req.tokens_with_kv()[: full * bs])
        if req.boundary is not None and req.boundary.length > first * bs:
            self._save_state(req, req.boundary.length, req.boundary)

    def _save_state(self, req: Request, num_tokens: int, state: SeqState) -> None:
        slot = self.pool.save_state(req.rid, num_tokens)
        if slot is not None:
            self.storage.save_state(slot, state)


def _linear_row(batch: HybridCache, i: int) -> SeqState:
    """Copy of row i's linear states (no KV), tagged with its length."""
    return SeqState(
        length=batch.lengths[i],
        conv={k: v[i : i + 1].clone() for k, v in batch.conv.items()},
        rec={k: v[i : i + 1].clone() for k, v in batch.rec.items()},
    )
