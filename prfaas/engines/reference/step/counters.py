"""Engine counters and windowed token rates for `/stats`."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class CounterSnapshot:
    """Totals since start and rates over the last `window_s` seconds."""

    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class EngineCounters:
    """Thread-safe counters written by the engine thread and read by `/stats`.

    Rates use a monotonic clock: they are measurements, not scheduling inputs.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._prompt = self._cached = self._generated = 0
        self._events: deque[tuple[float, int, int]] = deque()  # (t, computed prompt, gen)

    def prefilled(self, prompt_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self._prompt += prompt_tokens
            self._cached += cached_tokens
            self._record(prompt_tokens - cached_tokens, 0)

    def generated(self, tokens: int) -> None:
        with self._lock:
            self._generated += tokens
            self._record(0, tokens)

    def snapshot(self) -> CounterSnapshot:
        with self._lock:
            now = time.monotonic()
            self._trim(now)
            prompt = sum(e[1] for e in self._events)
            gen = sum(e[2] for e in self._events)
            return CounterSnapshot(
                self._prompt, self._cached, self._generated,
                prompt / self.window_s, gen / self.window_s,
            )  # fmt: skip

    def _record(self, prompt: int, gen: int) -> None:
        now = time.monotonic()
        self._events.append((now, prompt, gen))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
