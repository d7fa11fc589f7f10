"""A scenario's requests: arrival times and lengths that follow its phases.

Each session carries its arrival time (`timestamp_s`), so the load generator replays it with
`TraceArrivals` and every variant of a scenario (static, dual-timescale, oracle) sees the
very same requests at the very same instants. Within a phase, gaps are gamma-distributed at
the phase's rate and burstiness (Poisson by default); a scenario with an instantaneous rate
(diurnal) is drawn by thinning a Poisson process at its peak rate. Input lengths are the
phase's truncated log-normal, output lengths its fixed length.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from prfaas.loadgen.tokens import TokenSpace
from prfaas.loadgen.workload import Session, Turn
from prfaas.loadgen.workloads.lengths import LogNormalLengths
from prfaas.sim.scenarios import Phase, Scenario

THINNING_GRID = 1000  # points on which the peak of an instantaneous rate is looked for


@dataclass(frozen=True)
class ScenarioWorkload:
    """Timestamped log-normal sessions following `scenario`'s phases, lengths in [lo, hi]."""

    scenario: Scenario
    lo: int = 128
    hi: int = 131_072
    space: TokenSpace = field(default_factory=TokenSpace)

    @property
    def name(self) -> str:
        return f"scenario:{self.scenario.name}"

    @property
    def has_timestamps(self) -> bool:
        return True

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        for sid, at in enumerate(self._times(rng)):
            c = self.scenario.phase_at(at).conditions
            lengths = LogNormalLengths(c.mu, c.sigma, self.lo, self.hi)
            tokens = self.space.random(rng, lengths.sample(rng))
            yield Session(sid, (Turn(tokens, c.output_tokens),), timestamp_s=at)

    def _times(self, rng: np.random.Generator) -> Iterator[float]:
        if self.scenario.rate_at is not None:
            yield from self._thinned(rng)
            return
        t = 0.0
        for phase in self.scenario.phases:
            t = max(t, phase.start_s)
            for gap in _gaps(rng, phase):
                if t >= phase.end_s:
                    break
                yield t
                t += gap

    def _thinned(self, rng: np.random.Generator) -> Iterator[float]:
        rate_at = self.scenario.rate_at
        assert rate_at is not None
        end = self.scenario.duration_s
        peak = max(rate_at(end * i / THINNING_GRID) for i in range(THINNING_GRID + 1))
        t = float(rng.exponential(1.0 / peak))
        while t < end:
            if rng.random() * peak <= rate_at(t):
                yield t
            t += float(rng.exponential(1.0 / peak))


def _gaps(rng: np.random.Generator, phase: Phase) -> Iterator[float]:
    c = phase.conditions
    scale = 1.0 / (c.rate * c.burstiness)
    for _ in itertools.count():
        yield float(rng.gamma(c.burstiness, scale))
