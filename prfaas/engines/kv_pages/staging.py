"""`HostBudget`: a bound on the host memory that pages copied out of an engine may hold
while they wait for a link, and the host buffers themselves (pinned when the engine's
memory is on a GPU, so device-to-host copies run asynchronously).

A buffer counts against the budget until nothing references its bytes any more: the
transport holds a message's arrays until it has written them, so the budget bounds what
a slow link lets pile up. `take` blocks while the budget is spent (back-pressure on the
forward pass that copies pages out), except that one buffer larger than the whole budget
is let through when nothing else is held, so a large layer never deadlocks.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_BUDGET_BYTES = 1 << 30


@dataclass
class BudgetStats:
    """What the budget has seen (for tests, benchmarks and the device check)."""

    held_bytes: int = 0
    peak_bytes: int = 0
    waits: int = 0
    """How many `take`s had to wait for bytes to be released."""
    waited_s: float = 0.0


class HostBudget:
    """Host buffers for copies out of engine memory, at most `capacity_bytes` held at once."""

    def __init__(self, capacity_bytes: int = DEFAULT_BUDGET_BYTES, *, pinned: bool) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the host budget must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pinned = pinned
        self.stats = BudgetStats()
        self._cond = threading.Condition()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
        """A host tensor of `shape` and `dtype`, and the numpy array over it whose lifetime
        (with every view derived from it) holds the bytes against the budget."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        with self._cond:
            if not self._fits(nbytes):
                self.stats.waits += 1
                began = time.perf_counter()
                self._cond.wait_for(lambda: self._fits(nbytes))
                self.stats.waited_s += time.perf_counter() - began
            self.stats.held_bytes += nbytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.held_bytes)
        tensor = torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        root = tensor.numpy()
        weakref.finalize(root, self._release, nbytes)
        return tensor, root

    def _fits(self, nbytes: int) -> bool:
        held = self.stats.held_bytes
        return held + nbytes <= self.capacity_bytes or held == 0

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self.stats.held_bytes -= nbytes
            self._cond.notify_all()
