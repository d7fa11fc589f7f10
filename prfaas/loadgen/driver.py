"""Drives sessions through a client: open-loop or closed-loop, with a request/time budget.

Scheduling reads the event loop's clock (`loop.time()`, `asyncio.sleep`), so this module
runs unchanged under a virtual-clock loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from prfaas.loadgen.arrivals import ClosedLoop, timed_sessions
from prfaas.loadgen.client import Answer, RequestSpec
from prfaas.loadgen.conversation import Conversation
from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.spec import BenchSpec, Progress
from prfaas.loadgen.workload import Session


class Sender(Protocol):
    """Sends one request (the streaming client, or a stand-in in the simulator)."""

    async def send(self, spec: RequestSpec, conv: Conversation) -> tuple[RequestRecord, Answer]:
        """Send and measure; failures come back as records."""
        ...


def spec_rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent (workload, arrivals) generators: a new rate keeps the same prompts."""
    workload_seq, arrival_seq = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(workload_seq), np.random.default_rng(arrival_seq)


class Driver:
    """Runs one spec once. Mutates its own records list; not reusable."""

    def __init__(
        self,
        spec: BenchSpec,
        sender: Sender,
        progress: Progress,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """`on_start` is called at the instant schedule time 0 is taken (to align clocks)."""
        self._spec = spec
        self._sender = sender
        self._progress = progress
        self._on_start = on_start
        self._left = spec.num_requests  # requests not yet reserved; None = unlimited
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        self.records: list[RequestRecord] = []

    async def run(self) -> list[RequestRecord]:
        """Send the spec's requests; returns records in completion order."""
        workload_rng, arrival_rng = spec_rngs(self._spec.seed)
        sessions = self._spec.workload.sessions(workload_rng)
        self._start = self._loop.time()
        if self._on_start is not None:
            self._on_start()
        if isinstance(self._spec.arrivals, ClosedLoop):
            await self._closed(sessions, self._spec.arrivals.concurrency)
        else:
            await self._open(timed_sessions(self._spec.arrivals, sessions, arrival_rng))
        return self.records

    def _now(self) -> float:
        return self._loop.time() - self._start

    def _past_deadline(self, at: float) -> bool:
        return self._spec.duration_s is not None and at > self._spec.duration_s

    def _reserve(self, wanted: int) -> int:
        """How many turns of a session may run (0: the request budget is spent)."""
        if self._left is None:
            return wanted
        granted = min(wanted, self._left)
        self._left -= granted
        return granted

    async def _open(self, timed: Iterator[tuple[float, Session]]) -> None:
        tasks: set[asyncio.Task[None]] = set()
        for at, session in timed:
            if self._past_deadline(at) or (granted := self._reserve(len(session.turns))) == 0:
                break
            delay = at - self._now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._session(session, at, granted))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _closed(self, sessions: Iterator[Session], concurrency: int) -> None:
        async def worker() -> None:
            for session in sessions:  # shared iterator: each session goes to one worker
                at = self._now()
                if self._past_deadline(at) or (granted := self._reserve(len(session.turns))) == 0:
                    return
                await self._session(session, at, granted)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _session(self, session: Session, at: float, granted: int) -> None:
        conv = Conversation()
        for index, turn in enumerate(session.turns[:granted]):
            if index > 0:
                await asyncio.sleep(turn.think_time_s)
                at = self._now()
                if self._past_deadline(at):
                    break
            conv.add("user", turn.tokens)
            rid = f"bench-{self._spec.seed}-{session.session_id}-{index}"
            spec = RequestSpec(rid, session.session_id, index, at, turn.max_tokens)
            record, answer = await self._sender.send(spec, conv)
            self.records.append(record)
            self._progress.done(record)
            if not record.ok:
                break  # a conversation cannot go on without its answer
            conv.add("assistant", _answer_content(answer))


def _answer_content(answer: Answer) -> np.ndarray | str:
    if answer.output_ids is not None:
        return np.asarray(answer.output_ids, dtype=np.int64)
    return answer.text
