"""Bounded admission: at most `max_running` requests dispatched at once, at most
`max_queued` waiting for a slot; anything beyond is refused at once (HTTP 429)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class QueueFull(RuntimeError):
    """Every slot is busy and the wait queue is full."""


class AdmissionManager:
    """Counts running and waiting requests; `slot()` holds one running slot."""

    def __init__(self, *, max_running: int, max_queued: int) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"need max_running >= 1, max_queued >= 0: {max_running}, {max_queued}")
        self.max_running = max_running
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for a running slot (mutates the counts).

        Raises:
            QueueFull: no free slot and `max_queued` requests already wait.
        """
        if self._slots.locked() and self.waiting >= self.max_queued:
            raise QueueFull(f"{self.running} running and {self.waiting} queued requests")
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
