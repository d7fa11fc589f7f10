"""The simulator's `Sender`: hands each request straight to the real `Router` on the virtual
clock and measures it the way the streaming client does (TTFT, E2E, tokens, route)."""

from __future__ import annotations

import asyncio

import numpy as np

from prfaas.engine_clients.base import EngineError
from prfaas.gateway.router import Router
from prfaas.loadgen.client import Answer, RequestSpec
from prfaas.loadgen.conversation import Conversation
from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.tokens import TokenArray
from prfaas.policies.routing import NoInstanceAvailable, RouteDecision
from prfaas.protocol.generate import GenerateChunk, SamplingParams
from prfaas.sim.engines import SIM_TOKEN


class TokenInterner:
    """Prompts as tuples of shared int objects, one per token id.

    A 27K-token prompt made by `ndarray.tolist()` is 27K fresh int objects scattered over
    the heap; every later pass over it (the Router's block hashes, the simulated cache, the
    KV index re-hashing its events) then misses the CPU cache on each token and costs ~8x
    more. Mapping ids to one shared object per id keeps those passes cache-friendly. Equal
    ids give equal ints, so hashes and every result are unchanged.
    """

    def __init__(self) -> None:
        self._table = np.empty(0, dtype=object)

    def tokens(self, ids: TokenArray) -> tuple[int, ...]:
        """`ids` as a tuple of shared ints (ids must be >= 0)."""
        if ids.size == 0:
            return ()
        top = int(ids.max())
        if top >= self._table.size:
            grown = np.empty(max(top + 1, 2 * self._table.size), dtype=object)
            grown[:] = range(grown.size)
            self._table = grown
        return tuple(self._table[ids].tolist())


class SimSender:
    """Sends to a `Router` in-process. Times are the loop's (virtual) clock, from `origin`.

    Simulated decode engines stream the first token, then the rest in one chunk, so records
    carry TTFT, E2E and TPOT but no per-token gaps (`itl_s` is empty).
    """

    def __init__(self, router: Router, origin: float) -> None:
        self._router = router
        self._origin = origin
        self._loop = asyncio.get_running_loop()
        self._interner = TokenInterner()

    async def send(self, spec: RequestSpec, conv: Conversation) -> tuple[RequestRecord, Answer]:
        """Route and run one request; failures become records, never exceptions."""
        ids = conv.token_ids()
        tokens = () if ids is None else self._interner.tokens(ids)
        sent = self._loop.time()
        first: float | None = None
        decision: RouteDecision | None = None
        last: GenerateChunk | None = None
        error: str | None = None
        try:
            sampling = SamplingParams(max_new_tokens=spec.max_tokens)
            routed = await self._router.dispatch(spec.request_id, tokens, sampling, stream=True)
            try:
                first, decision = self._loop.time(), routed.decision
                chunk = routed.first
                while chunk is not None:
                    last, chunk = chunk, await routed.next()
            finally:
                routed.close()
        except (EngineError, NoInstanceAvailable) as exc:
            error = f"{type(exc).__name__}: {exc}"
        end = self._loop.time()
        ok = error is None and first is not None
        record = RequestRecord(
            request_id=spec.request_id,
            session_id=spec.session_id,
            turn=spec.turn,
            scheduled_s=spec.scheduled_s,
            start_s=sent - self._origin,
            ok=ok,
            error=error if error or ok else "no output tokens",
            status=None,
            ttft_s=None if first is None else first - sent,
            e2e_s=end - sent if ok else None,
            itl_s=(),
            sent_tokens=len(tokens),
            prompt_tokens=len(tokens),
            completion_tokens=last.completion_tokens if last else None,
            cached_tokens=last.cached_tokens if last else None,
            route=decision.route if decision else None,
            incremental_tokens=decision.incremental_tokens if decision else None,
        )
        n = last.completion_tokens if last else 0
        return record, Answer("", [SIM_TOKEN] * n)
