"""Input-length distributions with the partial moments the throughput model needs.

Every method is vectorised over its threshold arguments. Lengths are treated as continuous;
a request with length `l` goes to PrfaaS when `l > t` and stays in the PD cluster when
`l <= t`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

Array = NDArray[np.float64]

_erf = np.frompyfunc(math.erf, 1, 1)


def _std_normal_cdf(z: ArrayLike) -> Array:
    return 0.5 * (1.0 + np.asarray(_erf(np.asarray(z, dtype=np.float64) / math.sqrt(2.0)), float))


class LengthDistribution(Protocol):
    """What the throughput model asks of a length distribution. `cdf` and `partial_mean`
    accept any real x, ±inf included (they clamp to the support)."""

    @property
    def lo(self) -> float:
        """Smallest possible length."""
        ...

    @property
    def hi(self) -> float:
        """Largest possible length."""
        ...

    def cdf(self, x: ArrayLike) -> Array:
        """P(L <= x)."""
        ...

    def partial_mean(self, x: ArrayLike) -> Array:
        """E[L * 1{L <= x}]."""
        ...

    def mean(self) -> float:
        """E[L]."""
        ...


@dataclass(frozen=True)
class TruncatedLogNormal:
    """ln L ~ Normal(mu, sigma), conditioned on lo <= L <= hi; closed-form partial moments."""

    mu: float
    sigma: float
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if not 0 < self.lo < self.hi:
            raise ValueError(f"need 0 < min < max, got min={self.lo}, max={self.hi}")

    def _raw_cdf(self, x: Array) -> Array:
        return _std_normal_cdf((np.log(x) - self.mu) / self.sigma)

    def _raw_partial(self, x: Array) -> Array:
        scale = math.exp(self.mu + self.sigma**2 / 2)
        return scale * _std_normal_cdf((np.log(x) - self.mu - self.sigma**2) / self.sigma)

    def _norm(self) -> tuple[float, float, float, float]:
        ends = np.array([self.lo, self.hi])
        c_lo, c_hi = self._raw_cdf(ends)
        m_lo, m_hi = self._raw_partial(ends)
        return float(c_lo), float(c_hi - c_lo), float(m_lo), float(m_hi - m_lo)

    def cdf(self, x: ArrayLike) -> Array:
        c_lo, z, _, _ = self._norm()
        xc = np.clip(np.asarray(x, dtype=np.float64), self.lo, self.hi)
        return (self._raw_cdf(xc) - c_lo) / z

    def partial_mean(self, x: ArrayLike) -> Array:
        _, z, m_lo, _ = self._norm()
        xc = np.clip(np.asarray(x, dtype=np.float64), self.lo, self.hi)
        return (self._raw_partial(xc) - m_lo) / z

    def mean(self) -> float:
        _, z, _, m = self._norm()
        return m / z

    def log_moments(self) -> tuple[float, float]:
        """Mean and standard deviation of ln L (what `fit_truncated_lognormal` inverts)."""
        return _truncated_moments(self.mu, self.sigma, math.log(self.lo), math.log(self.hi))


def _std_normal_pdf(z: float) -> float:
    return math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


def _truncated_moments(mu: float, sigma: float, a: float, b: float) -> tuple[float, float]:
    """Mean and standard deviation of Normal(mu, sigma) conditioned on [a, b]."""
    alpha, beta = (a - mu) / sigma, (b - mu) / sigma
    z = float(_std_normal_cdf(beta) - _std_normal_cdf(alpha))
    if z <= 1e-12:
        return (a + b) / 2, (b - a) / math.sqrt(12)
    pa, pb = _std_normal_pdf(alpha), _std_normal_pdf(beta)
    shift = (pa - pb) / z
    var = sigma * sigma * (1 + (alpha * pa - beta * pb) / z - shift * shift)
    return mu + sigma * shift, math.sqrt(max(var, 1e-12))


def fit_truncated_lognormal(
    mean_log: float, std_log: float, lo: float, hi: float, *, iterations: int = 100
) -> TruncatedLogNormal:
    """The truncated log-normal on [lo, hi] whose ln L has this mean and standard deviation
    (moment matching). A sample drawn from a truncated log-normal has a smaller mean and
    spread of ln L than the untruncated parameters; this undoes that bias.

    Raises:
        ValueError: std_log <= 0 or a bad range.
    """
    if not std_log > 0:
        raise ValueError(f"the standard deviation of ln L must be > 0, got {std_log}")
    a, b = math.log(lo), math.log(hi)
    target_m = min(max(mean_log, a), b)
    target_s = min(std_log, (b - a) / math.sqrt(12) * 0.999)  # a uniform's is the widest
    mu, sigma = target_m, target_s
    for _ in range(iterations):
        m, sd = _truncated_moments(mu, sigma, a, b)
        if abs(m - target_m) < 1e-9 and abs(sd - target_s) < 1e-9:
            break
        sigma = min(max(sigma * target_s / sd, 1e-3), 100.0)
        # A sample piled up at a bound pushes mu toward infinity; within 3 sigma of the
        # range the truncated distribution keeps a computable mass.
        mu = min(max(mu + target_m - m, a - 3 * sigma), b + 3 * sigma)
    return TruncatedLogNormal(mu, sigma, lo, hi)
