"""`lognormal`: the paper's workload, independent random prompts with log-normal lengths."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from prfaas.loadgen.tokens import TokenSpace
from prfaas.loadgen.workload import Session, Turn
from prfaas.loadgen.workloads.lengths import LogNormalLengths, UniformLengths


@dataclass(frozen=True)
class LogNormalWorkload:
    """Fresh random prompts (no shared prefixes), input ~ truncated log-normal."""

    inputs: LogNormalLengths = field(default_factory=LogNormalLengths)
    outputs: UniformLengths = field(default_factory=lambda: UniformLengths(1024))
    space: TokenSpace = field(default_factory=TokenSpace)

    @property
    def name(self) -> str:
        i = self.inputs
        return f"lognormal(mu={i.mu}, sigma={i.sigma}, min={i.lo}, max={i.hi})"

    @property
    def has_timestamps(self) -> bool:
        return False

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        for sid in itertools.count():
            tokens = self.space.random(rng, self.inputs.sample(rng))
            yield Session(sid, (Turn(tokens, self.outputs.sample(rng)),))
