"""Bounded admission: at most `max_running` requests dispatched at once, at most
`max_queued` waiting for a slot; anything beyond is refused at once (HTTP 429)."""

from __future__ import annotations

import asyncio


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

    def slot(self) -> _Slot:
        """`async with manager.slot():` waits for a running slot (mutates the counts).

        Raises:
            QueueFull: (on entry) no free slot and `max_queued` requests already wait.
        """
        return _Slot(self)

    async def _acquire(self) -> None:
        if self._slots.locked() and self.waiting >= self.max_queued:
            raise QueueFull(f"{self.running} running and {self.waiting} queued requests")
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1

    def _release(self) -> None:
        self.running -= 1
        self._slots.release()


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
