"""`multi-turn`: conversations; each next prompt is the previous prompt + answer + a new turn."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from prfaas.loadgen.tokens import TokenSpace
from prfaas.loadgen.workload import Session, Turn
from prfaas.loadgen.workloads.lengths import UniformLengths


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Conversations of `turns` requests; the runner carries the history between turns.

    Think time before each follow-up turn is exponential with mean `think_time_s` (0 sends
    the next turn as soon as the answer is complete).
    """

    turns: int = 4
    first: UniformLengths = field(default_factory=lambda: UniformLengths(1024))
    follow_up: UniformLengths = field(default_factory=lambda: UniformLengths(256))
    outputs: UniformLengths = field(default_factory=lambda: UniformLengths(256))
    think_time_s: float = 1.0
    space: TokenSpace = field(default_factory=TokenSpace)

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if self.think_time_s < 0:
            raise ValueError(f"think time must be >= 0, got {self.think_time_s}")

    @property
    def name(self) -> str:
        return f"multi-turn(turns={self.turns}, think={self.think_time_s}s)"

    @property
    def has_timestamps(self) -> bool:
        return False

    def _think(self, rng: np.random.Generator) -> float:
        return float(rng.exponential(self.think_time_s)) if self.think_time_s > 0 else 0.0

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        for sid in itertools.count():
            turns = [Turn(self.space.random(rng, self.first.sample(rng)), self.outputs.sample(rng))]
            for _ in range(self.turns - 1):
                tokens = self.space.random(rng, self.follow_up.sample(rng))
                turns.append(Turn(tokens, self.outputs.sample(rng), self._think(rng)))
            yield Session(sid, tuple(turns))
