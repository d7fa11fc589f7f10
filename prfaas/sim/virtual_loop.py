"""A virtual-clock asyncio event loop: simulated time that jumps to the next timer.

`VirtualClockLoop.time()` is simulated seconds, not the wall clock. When no callback is
ready, the loop's selector is asked to wait until the next timer; the virtual selector does
no I/O and instead advances the clock by exactly that wait, so the timer fires at once. Code
that reads time only through the loop (`loop.time()`, `asyncio.sleep`, `loop.call_at`, as
the Router, the policies and the simulated engines do) runs unchanged, only much faster.

No real I/O may happen on this loop: sockets never become ready. If nothing is ready and no
timer is scheduled, every task is waiting for something that will never happen; the loop
raises `SimulationStalled` instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits and no timer is scheduled: the simulation would never progress."""


class _VirtualSelector(selectors.BaseSelector):
    """Keeps registrations (the loop registers its self-pipe) but never reports I/O;
    `select(timeout)` advances the virtual clock by `timeout` instead of sleeping."""

    def __init__(self, start: float) -> None:
        self.now = start
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, _fd(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimulationStalled(
                "simulation stalled: no callback is ready and no timer is scheduled "
                "(a task awaits something that can never happen)"
            )
        if timeout > 0:
            self.now += timeout
        return []

    def close(self) -> None:
        self._keys.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return dict(self._keys)


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is simulated; see the module docstring."""

    def __init__(self, start: float = 0.0) -> None:
        self._virtual = _VirtualSelector(start)
        super().__init__(selector=self._virtual)

    def time(self) -> float:
        """Simulated seconds since the loop's start value (never the wall clock)."""
        return self._virtual.now


def run_virtual(coro: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run `coro` to completion on a fresh `VirtualClockLoop`, then close the loop.

    Raises:
        SimulationStalled: the coroutine waits on something no timer will ever trigger.
    """
    loop = VirtualClockLoop(start)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
