"""`shared-prefix`: groups of requests sharing a system prompt, each with its own question."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from prfaas.loadgen.tokens import TokenSpace
from prfaas.loadgen.workload import Session, Turn
from prfaas.loadgen.workloads.lengths import UniformLengths


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Each request picks one of `num_groups` system prompts uniformly and adds a question.

    The system prompts are drawn once per run from the rng, so a server's prefix cache can
    reuse `system_len` tokens of every request after the first of its group.
    """

    num_groups: int = 8
    system_len: int = 2048
    questions: UniformLengths = field(default_factory=lambda: UniformLengths(256))
    outputs: UniformLengths = field(default_factory=lambda: UniformLengths(256))
    space: TokenSpace = field(default_factory=TokenSpace)

    def __post_init__(self) -> None:
        if self.num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {self.num_groups}")
        if self.system_len < 1:
            raise ValueError(f"system prompt length must be >= 1, got {self.system_len}")

    @property
    def name(self) -> str:
        return f"shared-prefix(groups={self.num_groups}, system={self.system_len})"

    @property
    def has_timestamps(self) -> bool:
        return False

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        prefixes = [self.space.random(rng, self.system_len) for _ in range(self.num_groups)]
        for sid in itertools.count():
            group = int(rng.integers(self.num_groups))
            question = self.space.random(rng, self.questions.sample(rng))
            tokens = np.concatenate([prefixes[group], question])
            yield Session(sid, (Turn(tokens, self.outputs.sample(rng)),), group=group)
