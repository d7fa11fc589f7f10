"""What a workload hands the runner: sessions of one or more turns.

A *session* is what an arrival process starts: one request for single-shot workloads, a
whole conversation for `multi-turn`. Each turn carries only its *new* prompt tokens; the
runner keeps the conversation history (previous prompts and the server's answers) and sends
history + new tokens, so follow-up turns extend the previous prompt exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from prfaas.loadgen.tokens import TokenArray


@dataclass(frozen=True, eq=False)
class Turn:
    """One request of a session."""

    tokens: TokenArray
    """New prompt tokens, appended to the conversation history."""
    max_tokens: int
    """Output tokens to ask for (sent with ignore_eos so servers produce exactly this)."""
    think_time_s: float = 0.0
    """Pause after the previous turn's answer before this turn is sent."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")
        if len(self.tokens) == 0:
            raise ValueError("a turn needs at least one prompt token")


@dataclass(frozen=True, eq=False)
class Session:
    """A unit of arrival: one request, or a conversation whose turns run one after another."""

    session_id: int
    turns: tuple[Turn, ...]
    timestamp_s: float | None = None
    """Arrival time in the source trace (seconds from the trace start), if any."""
    group: int | None = None
    """Prefix group (shared-prefix) or trace line, for reports; None when meaningless."""

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.session_id} has no turns")


class Workload(Protocol):
    """A source of sessions. Implementations are pure given the rng: same seed, same prompts."""

    @property
    def name(self) -> str:
        """Short label for reports, e.g. `lognormal` or `mooncake:trace.jsonl`."""
        ...

    @property
    def has_timestamps(self) -> bool:
        """True when sessions carry `timestamp_s` (trace replay can time arrivals by it)."""
        ...

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        """Yield sessions in arrival order; may be infinite. Does not mutate the workload."""
        ...
