"""EWMA estimates of the served workload, one update per long-term period.

What the throughput model needs about the traffic: the arrival rate, the distribution of
*incremental* lengths (after prefix matching; fitted as a log-normal through the EWMA of
the sufficient statistics of ln L, truncated to the profile's range), the mean output
length, and the link bandwidth. Each period's observation is blended in with weight
`alpha` (the older estimate keeps `1 - alpha`), so a step in the traffic shows up as
alpha, 1 - (1 - alpha)^2, ... of its size after 1, 2, ... periods. The bandwidth, a
measurement rather than a sample of random requests, has its own weight
(`bandwidth_alpha`, 1 by default: the period's mean measurement as it is). A period without
requests leaves the length and output estimates as they were (it only lowers the rate).

Pure: observation in, estimate out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prfaas.common.toml_tables import check
from prfaas.policies.distributions import TruncatedLogNormal, fit_truncated_lognormal

MIN_SIGMA = 0.05  # a degenerate sample (every length equal) still gives a valid log-normal
OCCUPANCY_MARGIN = 1.2
"""The occupancy's answer length stands for the finished requests' only this much above
theirs: a period's occupancy reads within about 10% of the true length (measured in the
simulator), and taking the larger of two noisy estimates every period would bias the
estimate up (by 3-5%, enough to hold a conversion the model wants by 5%)."""


@dataclass(frozen=True)
class EstimateConfig:
    alpha: float = 0.3
    """Weight of the newest period (rate, lengths, output). A step of the link, answer or
    incremental length wakes the loop, which then takes the new values unblended, so the
    blend need not follow steps: it smooths the noise of steady traffic (one period of ~150
    requests puts mu within about 0.07, enough to swing a knife-edge move by 5%). The
    arrival rate has no wake: it follows a step by 30%, 51%, 66% after 1, 2, 3 periods; the
    load tests (`busy_load`, the losing pool's margin) read that lagging rate, while
    Lambda_max and the set-point do not depend on it (`prfaas/sim/SCHEDULING.md` tells how
    0.3 was chosen)."""
    bandwidth_alpha: float = 1.0
    """Weight of the newest period's mean measured link capacity."""
    min_samples: float = 20.0
    """Length samples (`WorkloadEstimate.samples`) below which the estimate is too thin to
    re-plan on."""
    rate_window_s: float = 10.0
    """A period shorter than this (one a step woke early) leaves the arrival rate as it was:
    a few seconds of arrivals tell it poorly, and none (a step right after a period) would
    read as a rate of zero. The long-term loop uses at most half its period."""

    def __post_init__(self) -> None:
        check(0 < self.alpha <= 1, "alpha", self.alpha, "must be in (0, 1]")
        check(self.rate_window_s >= 0, "rate_window_s", self.rate_window_s, "must be >= 0")
        ok = 0 < self.bandwidth_alpha <= 1
        check(ok, "bandwidth_alpha", self.bandwidth_alpha, "must be in (0, 1]")
        check(self.min_samples >= 1, "min_samples", self.min_samples, "must be >= 1")


@dataclass(frozen=True)
class Moments:
    """Sufficient statistics of ln L: count, sum, sum of squares (weights may be fractional)."""

    n: float = 0.0
    s1: float = 0.0
    s2: float = 0.0

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Moments:
        logs = [math.log(max(x, 1)) for x in lengths]
        return cls(float(len(logs)), sum(logs), sum(v * v for v in logs))

    def blend(self, new: Moments, alpha: float) -> Moments:
        k = 1.0 - alpha
        return Moments(
            k * self.n + alpha * new.n, k * self.s1 + alpha * new.s1, k * self.s2 + alpha * new.s2
        )

    def shifted(self, d: float) -> Moments:
        """The same sample with every ln L moved by `d` (its mean moves by `d`, its spread
        stays)."""
        return Moments(self.n, self.s1 + self.n * d, self.s2 + 2 * d * self.s1 + self.n * d * d)

    @property
    def mu(self) -> float:
        return self.s1 / self.n if self.n > 0 else math.nan

    @property
    def spread(self) -> float:
        """The sample's standard deviation of ln L (0 when every length is equal)."""
        if self.n <= 0:
            return math.nan
        return math.sqrt(max(self.s2 / self.n - self.mu**2, 0.0))

    @property
    def sigma(self) -> float:
        """The spread the fit uses: at least `MIN_SIGMA`."""
        return max(self.spread, MIN_SIGMA) if self.n > 0 else math.nan


@dataclass(frozen=True)
class PeriodObservation:
    """What one long-term period saw."""

    duration_s: float
    arrivals: int
    """Requests routed in the period."""
    lengths: Moments
    """ln of the incremental (uncached) lengths routed in the period."""
    output_tokens: float
    """Output tokens of the requests that finished in it."""
    finished: int
    capacity_bytes_per_s: float | None = None
    """Mean measured link capacity over the period (None: unknown)."""

    def __post_init__(self) -> None:
        check(self.duration_s > 0, "duration_s", self.duration_s, "must be > 0")

    @classmethod
    def of(
        cls,
        duration_s: float,
        incremental: Sequence[int],
        outputs: Sequence[int],
        capacity_bytes_per_s: float | None = None,
        *,
        occupancy_output: float | None = None,
    ) -> PeriodObservation:
        """`occupancy_output`: the output length the decode occupancy implies (Little's law:
        mean requests decoding / (arrival rate x decode step)). Finished requests tell the
        output length only once they end (a 3,072-token answer takes over a minute), so
        when the occupancy implies `OCCUPANCY_MARGIN` times more than they do (or none has
        finished), it stands for them."""
        total, count = float(sum(outputs)), len(outputs)
        if occupancy_output is not None and (
            count == 0 or occupancy_output * count > OCCUPANCY_MARGIN * total
        ):
            count = max(count, 1)
            total = occupancy_output * count
        return cls(
            duration_s,
            len(incremental),
            Moments.of(incremental),
            total,
            count,
            capacity_bytes_per_s,
        )


@dataclass(frozen=True)
class WorkloadEstimate:
    """The blended estimate after some periods."""

    rate: float
    """Arrivals per second."""
    lengths: Moments
    output_sum: float
    output_n: float
    capacity_bytes_per_s: float | None
    periods: int
    samples: float = 0.0
    """Lengths observed, older periods' discounted by (1 - alpha) per period: how much the
    length estimate rests on (at light load, several periods' worth)."""

    @property
    def log_mean_length_se(self) -> float:
        """The standard error of ln E[L] = mu + sigma^2 / 2 (the log of the log-normal's
        mean length, which the prefill work follows), by the delta method: spread /
        sqrt(n) x sqrt(1 + spread^2 / 2), n = `samples` (0 when every length is equal). The
        spread's error counts: at sigma 0.9 it adds a fifth to the mean's. For a blend of
        periods this overstates it: the blend rests on up to (2 - alpha) times `samples`
        (1.7 at weight 0.3), so the error is up to 1.3x too large (on the cautious side)."""
        spread = self.lengths.spread
        return spread / math.sqrt(max(self.samples, 1.0)) * math.sqrt(1 + spread * spread / 2)

    @property
    def output_tokens(self) -> float | None:
        return self.output_sum / self.output_n if self.output_n > 0 else None

    def distribution(self, lo: float, hi: float) -> TruncatedLogNormal:
        """The fitted incremental-length distribution on [lo, hi] (the sample's moments of
        ln L matched by a log-normal truncated there; lengths outside are to be clamped
        into [lo, hi] before they are observed).

        Raises:
            ValueError: no length observed yet.
        """
        if self.lengths.n <= 0:
            raise ValueError("no incremental length observed yet")
        return fit_truncated_lognormal(self.lengths.mu, self.lengths.sigma, lo, hi)

    def to_json(self) -> dict[str, float | int | None]:
        n = self.lengths.n
        return {
            "rate": self.rate,
            "length_mu": self.lengths.mu if n > 0 else None,
            "length_sigma": self.lengths.sigma if n > 0 else None,
            "length_samples": self.samples,
            "output_tokens": self.output_tokens,
            "capacity_bytes_per_s": self.capacity_bytes_per_s,
            "periods": self.periods,
        }


def update_estimate(
    config: EstimateConfig, estimate: WorkloadEstimate | None, obs: PeriodObservation
) -> WorkloadEstimate:
    """Blend one period into the estimate (the first period is taken as it is)."""
    rate = obs.arrivals / obs.duration_s
    capacity = obs.capacity_bytes_per_s
    if estimate is None:
        return WorkloadEstimate(
            rate, obs.lengths, obs.output_tokens, float(obs.finished), capacity, 1,
            obs.lengths.n,
        )  # fmt: skip
    a, k = config.alpha, 1.0 - config.alpha
    old_cap = estimate.capacity_bytes_per_s
    if capacity is not None and old_cap is not None:
        capacity = (1.0 - config.bandwidth_alpha) * old_cap + config.bandwidth_alpha * capacity
    elif capacity is None:
        capacity = old_cap
    seen, done = obs.lengths.n > 0, obs.finished > 0  # an idle period teaches nothing new
    if obs.duration_s < config.rate_window_s:
        rate = estimate.rate
    return WorkloadEstimate(
        rate=k * estimate.rate + a * rate,
        lengths=estimate.lengths.blend(obs.lengths, a) if seen else estimate.lengths,
        output_sum=k * estimate.output_sum + a * obs.output_tokens if done else estimate.output_sum,
        output_n=k * estimate.output_n + a * obs.finished if done else estimate.output_n,
        capacity_bytes_per_s=capacity,
        periods=estimate.periods + 1,
        samples=k * estimate.samples + obs.lengths.n if seen else estimate.samples,
    )
