"""Eq. 1-8 building blocks and the length distributions' closed forms, against direct
numerical integration and sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from prfaas.policies import throughput as tp
from prfaas.policies.distributions import TruncatedLogNormal
from prfaas.policies.tables import PiecewiseLinear

DIST = TruncatedLogNormal(mu=9.9, sigma=1.0, lo=128, hi=131072)
CONVEX = PiecewiseLinear((1024, 8192, 32768, 131072), (0.44, 0.72, 1.84, 7.40))


def _pdf(x: float) -> float:
    z = stats.norm.cdf(math.log(DIST.hi) - 9.9) - stats.norm.cdf(math.log(DIST.lo) - 9.9)
    return float(stats.lognorm.pdf(x, s=1.0, scale=math.exp(9.9)) / z)


@pytest.mark.parametrize("x", [128, 1000, 19_400, 60_000, 131_072])
def test_truncated_lognormal_matches_integration(x: float) -> None:
    """cdf and partial mean equal the integrals of the truncated density."""
    cdf, _ = integrate.quad(_pdf, DIST.lo, x, limit=200)
    pm, _ = integrate.quad(lambda v: v * _pdf(v), DIST.lo, x, limit=200)
    assert float(DIST.cdf(x)) == pytest.approx(cdf, abs=1e-9)
    assert float(DIST.partial_mean(x)) == pytest.approx(pm, rel=1e-7, abs=1e-6)


def test_truncated_lognormal_clamps_outside_support() -> None:
    """Below the support nothing is counted; above it everything is."""
    assert float(DIST.cdf(10)) == 0.0 and float(DIST.cdf(1e9)) == pytest.approx(1.0)
    assert float(DIST.partial_mean(1e9)) == pytest.approx(DIST.mean())


def test_paper_offload_fraction() -> None:
    """The paper's p = 49.6% at t = 19.4K (this is why max is 131072, not 128000)."""
    assert 1 - float(DIST.cdf(19_400)) == pytest.approx(0.496, abs=0.001)


def test_partial_cost_matches_sampling() -> None:
    """E[T(L) 1{L <= x}] in closed form equals the mean over a large sample."""
    rng = np.random.default_rng(7)
    raw = rng.lognormal(9.9, 1.0, 400_000)
    sample = raw[(raw >= 128) & (raw <= 131072)]
    for x in (5_000, 19_400, 131_072):
        expected = float(np.mean(CONVEX(sample) * (sample <= x)))
        assert float(tp.partial_cost(DIST, CONVEX, x)) == pytest.approx(expected, rel=0.01)


def test_piecewise_linear_extrapolates() -> None:
    """Interpolation between knots, linear extrapolation past both ends."""
    f = PiecewiseLinear((0.0, 10.0, 20.0), (0.0, 10.0, 30.0))
    assert list(f([5, 15, -10, 30])) == [5.0, 20.0, -10.0, 50.0]
    with pytest.raises(ValueError, match="strictly increasing"):
        PiecewiseLinear((1.0, 1.0), (1.0, 2.0))


def test_eq3_pipelined_min_vs_sequential_harmonic() -> None:
    """Pipelined PrfaaS throughput is min(compute, link); without pipelining it is their
    harmonic combination 1 / (1/compute + 1/link)."""
    t, s, link = np.array([2.0]), np.array([1e9]), 1e9  # 2 s compute, 1 GB per request
    compute, link_rate = 4 / 2.0, link / 1e9
    assert float(tp.theta_prfaas(4, t, link, s)[0]) == min(compute, link_rate)
    seq = float(tp.theta_prfaas_sequential(4, t, link, s)[0])
    assert seq == pytest.approx(1 / (1 / compute + 1 / link_rate))


def test_eq6_lambda_handles_empty_classes() -> None:
    """p = 0 removes the PrfaaS bound, p = 1 removes the PD-prefill bound."""
    p = np.array([0.0, 0.5, 1.0])
    lam = tp.lambda_max(np.array([np.nan, 1.0, 2.0]), np.array([3.0, 1.0, np.nan]), 10.0, p)
    assert list(lam) == [3.0, 2.0, 2.0]


def test_eq1_eq2_kv_throughput_and_egress() -> None:
    """Phi_kv = S_kv / T_prefill; N busy instances emit N * Phi_kv."""
    kv = PiecewiseLinear((0.0, 1.0), (0.0, 4.0))
    lat = PiecewiseLinear((0.0, 1.0), (1.0, 1.0))
    phi = tp.kv_throughput(kv, lat, [0.5])
    assert float(phi[0]) == 2.0 and float(tp.egress_needed(3, phi)[0]) == 6.0
