"""Find a simulated deployment's saturation throughput by bisection on the arrival rate.

A rate is *sustained* when the run is stable: over the measurement window, the served rate
is within 2% of the offered rate (equivalently, the number of requests in the system did
not grow by more than 2% of the arrivals). Every probe uses the same seed, so the prompts
are the same and the Poisson gaps are the same draws scaled by 1/rate (common random
numbers): the comparison between rates is not blurred by resampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from prfaas.loadgen.arrivals import RateArrivals
from prfaas.sim.runner import SimResult, SimSpec

Simulate = Callable[[SimSpec], SimResult]
LOWER_STEP = 0.8  # an unsustainable low bound moves down by 20% (one noisy probe is not 2x off)


@dataclass(frozen=True)
class FindMaxOptions:
    """Bisection bounds and stopping rule."""

    low: float
    """A rate believed sustainable (checked; lowered by 20% until it is)."""
    high: float
    """A rate believed unsustainable (checked; doubled until it is)."""
    rel_tol: float = 0.01
    """Stop when (high - low) / low is below this."""
    max_probes: int = 16

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"need 0 < low < high, got low={self.low}, high={self.high}")
        if not 0 < self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in (0, 1), got {self.rel_tol}")
        if self.max_probes < 3:
            raise ValueError(f"max_probes must be >= 3, got {self.max_probes}")


@dataclass(frozen=True)
class FindMaxResult:
    """`lambda_max`: the highest sustained rate probed; `best` its run."""

    lambda_max: float
    best: SimResult
    probes: tuple[tuple[float, bool], ...]
    """(rate, sustained) in probe order."""


def find_max(base: SimSpec, simulate: Simulate, options: FindMaxOptions) -> FindMaxResult:
    """Bisect the rate of `base` (its arrivals are replaced by Poisson at each probe rate).

    Raises:
        RuntimeError: no sustainable rate found within `max_probes` (the low bound kept failing).
    """
    probes: list[tuple[float, bool]] = []

    def probe(rate: float) -> SimResult:
        result = simulate(replace(base, arrivals=RateArrivals(rate)))
        probes.append((rate, result.metrics.stable))
        return result

    low, high = options.low, options.high
    best = probe(low)
    while not best.metrics.stable:
        _budget(probes, options)
        low, high = low * LOWER_STEP, low
        best = probe(low)
    while (above := probe(high)).metrics.stable:
        _budget(probes, options)
        low, high, best = high, high * 2, above
    while (high - low) / low > options.rel_tol and len(probes) < options.max_probes:
        mid = (low + high) / 2
        result = probe(mid)
        if result.metrics.stable:
            low, best = mid, result
        else:
            high = mid
    return FindMaxResult(low, best, tuple(probes))


def _budget(probes: list[tuple[float, bool]], options: FindMaxOptions) -> None:
    if len(probes) >= options.max_probes:
        raise RuntimeError(
            f"find-max: no bracket after {len(probes)} probes ({probes}); widen --find-max bounds"
        )
