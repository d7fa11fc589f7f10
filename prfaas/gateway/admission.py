"""Bounded admission: at most `max_running` requests dispatched at once, at most
`max_queued` waiting for a slot; anything beyond is refused at once (HTTP 429), and a
waiter that gets no slot within `queue_timeout_s` gives up its place (HTTP 408, as SGLang's
gateway answers it), never having taken a slot.

Waiters are served first come, first served: a finishing request hands its slot straight to
the oldest waiter. A free slot with nobody waiting is taken without suspending (the common
case, on every request's path).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque


class QueueFull(RuntimeError):
    """Every slot is busy and the wait queue is full."""


class QueueTimeout(RuntimeError):
    """A request waited `queue_timeout_s` for a slot without getting one."""


class AdmissionManager:
    """Counts running and waiting requests; `slot()` holds one running slot."""

    def __init__(
        self, *, max_running: int, max_queued: int, queue_timeout_s: float = math.inf
    ) -> None:
        if max_running < 1 or max_queued < 0 or not queue_timeout_s > 0:
            raise ValueError(f"need max_running >= 1, max_queued >= 0, queue_timeout_s > 0: "
                             f"{max_running}, {max_queued}, {queue_timeout_s}")  # fmt: skip
        self.max_running = max_running
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.running = 0
        self.timed_out = 0
        """Waiters that gave up at the deadline, since start."""
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    def slot(self) -> _Slot:
        """`async with manager.slot():` waits for a running slot (mutates the counts).

        Raises:
            QueueFull: (on entry) no free slot and `max_queued` requests already wait.
            QueueTimeout: (on entry) no slot came within `queue_timeout_s`.
        """
        return _Slot(self)

    async def _acquire(self) -> None:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise QueueFull(f"{self.running} running and {self.waiting} queued requests")
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._waiters.append(turn)
        timeout_s = self.queue_timeout_s  # this waiter's, even if the setting changes
        deadline = None
        if timeout_s != math.inf:
            deadline = loop.call_later(timeout_s, _expire, turn)
        try:
            await turn  # a finishing request hands over its slot: `running` stays as is
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # handed a slot while being cancelled: pass it on
            elif turn in self._waiters:  # (a release may have skipped it already)
                self._waiters.remove(turn)
            raise
        except QueueTimeout:
            self.timed_out += 1
            if turn in self._waiters:
                self._waiters.remove(turn)
            raise QueueTimeout(f"waited {timeout_s:g} s for a slot ({self.running} "
                               f"running, {self.waiting} queued)") from None  # fmt: skip
        finally:
            if deadline is not None:
                deadline.cancel()

    def _release(self) -> None:
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1


def _expire(turn: asyncio.Future[None]) -> None:
    """A waiter's deadline: it gives up unless a slot reached it first (a done turn is a
    handed slot, or a cancelled wait)."""
    if not turn.done():
        turn.set_exception(QueueTimeout())


class _Slot:
    """One running slot as an async context manager (a class: cheaper per request than a
    generator-based context manager)."""

    __slots__ = ("_manager",)

    def __init__(self, manager: AdmissionManager) -> None:
        self._manager = manager

    async def __aenter__(self) -> None:
        await self._manager._acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._manager._release()
