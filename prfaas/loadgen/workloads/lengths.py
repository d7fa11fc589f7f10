"""Length samplers shared by the synthetic workloads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prfaas.policies.distributions import TruncatedLogNormal


@dataclass(frozen=True)
class LogNormalLengths:
    """Integer lengths with ln L ~ Normal(mu, sigma), truncated to [lo, hi] by rejection.

    The paper's workload is mu=9.90, sigma=1.00, lo=128, hi=131072 (mean about 27K tokens).
    """

    mu: float = 9.90
    sigma: float = 1.00
    lo: int = 128
    hi: int = 131_072

    def __post_init__(self) -> None:
        self.distribution()  # validates sigma > 0 and 0 < lo < hi, naming the bad value

    def distribution(self) -> TruncatedLogNormal:
        """The continuous distribution (for the planner's closed-form moments)."""
        return TruncatedLogNormal(self.mu, self.sigma, float(self.lo), float(self.hi))

    def sample(self, rng: np.random.Generator) -> int:
        """One length; rejection keeps the truncated shape exact."""
        while True:
            value = round(float(rng.lognormal(self.mu, self.sigma)))
            if self.lo <= value <= self.hi:
                return value


@dataclass(frozen=True)
class UniformLengths:
    """Integer lengths uniform in [mean*(1-range_ratio), mean*(1+range_ratio)], at least 1.

    `range_ratio=0` gives the fixed length `mean` (the paper's 1024 output tokens).
    """

    mean: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    def sample(self, rng: np.random.Generator) -> int:
        """One length."""
        if self.range_ratio == 0.0:
            return self.mean
        low = max(1, round(self.mean * (1 - self.range_ratio)))
        high = max(low, round(self.mean * (1 + self.range_ratio)))
        return int(rng.integers(low, high + 1))
