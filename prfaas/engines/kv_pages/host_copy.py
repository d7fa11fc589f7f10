"""`HostCopy` and `Fence`: the completion of copies between an engine's (device) memory and
host memory, so callers can hand bytes on, or report a request done, only once the copy is
finished, without blocking the thread that enqueued it.

Both wrap an optional event with `query()` and `synchronize()` (a `torch.cuda.Event`);
without one (host memory, where every copy is synchronous) they are complete at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np


class Event(Protocol):
    """What a completion needs from an event (`torch.cuda.Event` has both)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Fence:
    """Marks a point in a copy stream: `ready()` once everything enqueued before it ran."""

    def __init__(self, event: Event | None = None) -> None:
        self._event = event

    def ready(self) -> bool:
        """Whether the work before the fence has finished (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block until the work before the fence has finished."""
        if self._event is not None:
            self._event.synchronize()


class HostCopy:
    """Arrays being copied into host memory; read them with `arrays()` (which waits)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], fence: Fence | None = None) -> None:
        self._arrays = dict(arrays)
        self._fence = fence or Fence()

    def ready(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        return self._fence.ready()

    def arrays(self) -> dict[str, np.ndarray]:
        """The host arrays, once the copy has finished."""
        self._fence.wait()
        return self._arrays
