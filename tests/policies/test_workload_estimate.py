"""EWMA estimates of rate, incremental lengths (log-normal fit), output length, bandwidth."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prfaas.common.toml_tables import FieldError
from prfaas.policies.distributions import TruncatedLogNormal, fit_truncated_lognormal
from prfaas.policies.workload_estimate import (
    EstimateConfig,
    Moments,
    PeriodObservation,
    update_estimate,
)


def test_moments_fit_the_log_normal_parameters() -> None:
    """Sufficient statistics of ln L give back mu and sigma of a large log-normal sample."""
    rng = np.random.default_rng(0)
    sample = [round(x) for x in rng.lognormal(9.9, 1.0, 20_000)]
    m = Moments.of(sample)
    assert m.n == 20_000
    assert m.mu == pytest.approx(9.9, abs=0.02) and m.sigma == pytest.approx(1.0, abs=0.02)


def test_fit_undoes_the_truncation_bias() -> None:
    """A sample of the paper's truncated log-normal has ln-moments (9.83, 0.93); the fit
    finds the parameters (9.9, 1.0) back, and they reproduce those moments."""
    true = TruncatedLogNormal(9.9, 1.0, 128, 131072)
    m, s = true.log_moments()
    assert m == pytest.approx(9.83, abs=5e-3) and s == pytest.approx(0.93, abs=5e-3)
    fit = fit_truncated_lognormal(m, s, 128, 131072)
    assert fit.mu == pytest.approx(9.9, abs=1e-6) and fit.sigma == pytest.approx(1.0, abs=1e-6)


def test_a_sample_piled_at_the_lower_bound_still_fits() -> None:
    """Every prompt almost fully cached (incremental lengths clamped to 128): the fit keeps a
    distribution the planner can use, concentrated at the bound."""
    m = Moments.of([128] * 50)
    fit = fit_truncated_lognormal(m.mu, m.sigma, 128, 131072)
    assert fit.mean() == pytest.approx(128, rel=0.1) and fit.cdf(200.0) > 0.99


def test_degenerate_samples_keep_a_valid_sigma() -> None:
    m = Moments.of([1000] * 5)
    assert m.mu == pytest.approx(math.log(1000)) and m.sigma == 0.05
    assert math.isnan(Moments().mu) and math.isnan(Moments().sigma)


def test_shifted_moments_are_those_of_the_shifted_sample() -> None:
    """Moving every ln L by d: the sums equal those of the sample multiplied by e^d."""
    sample = [300, 2_000, 9_000, 40_000]
    d = 0.25
    shifted = Moments.of(sample).shifted(d)
    direct = Moments.of([round(x * math.exp(d)) for x in sample])
    assert shifted.n == direct.n
    assert shifted.mu == pytest.approx(direct.mu, abs=1e-3)
    assert shifted.sigma == pytest.approx(direct.sigma, abs=1e-3)


def test_the_mean_lengths_standard_error_shrinks_with_the_samples() -> None:
    obs = PeriodObservation.of(60.0, [1_000, 3_000, 9_000, 27_000] * 25, [])
    small = update_estimate(EstimateConfig(), None, obs)
    assert small.samples == 100
    spread = small.lengths.spread
    assert small.log_mean_length_se == pytest.approx(spread / 10 * math.sqrt(1 + spread**2 / 2))
    bigger = update_estimate(EstimateConfig(), small, obs)
    assert bigger.log_mean_length_se < small.log_mean_length_se
    same = PeriodObservation.of(60.0, [2_000] * 100, [])
    assert update_estimate(EstimateConfig(), None, same).log_mean_length_se == pytest.approx(0)


def test_first_period_is_taken_as_is_then_blended() -> None:
    """alpha 0.5: rate 2 then 4 req/s -> 3; lengths e^8 then e^10 (equal counts) -> mu 9."""
    cfg = EstimateConfig(alpha=0.5, bandwidth_alpha=0.5)
    e1 = update_estimate(cfg, None, PeriodObservation.of(10.0, [2981] * 20, [100] * 10, 1e9))
    assert e1.rate == 2.0 and e1.periods == 1 and e1.output_tokens == 100.0
    assert e1.lengths.mu == pytest.approx(math.log(2981))
    e2 = update_estimate(cfg, e1, PeriodObservation.of(10.0, [22026] * 40, [300] * 10, 3e9))
    assert e2.rate == 3.0 and e2.periods == 2
    assert e2.capacity_bytes_per_s == 2e9
    assert e2.output_tokens == 200.0
    # counts 20 and 40 blend to 30 samples: 10 of ln 2981 (8.0) and 20 of ln 22026 (10.0)
    assert e2.lengths.n == 30.0 and e2.samples == 0.5 * 20 + 40
    assert e2.lengths.mu == pytest.approx((10 * math.log(2981) + 20 * math.log(22026)) / 30)


def test_a_step_is_followed_geometrically() -> None:
    """alpha 0.6: 60%, 84%, 93.6% of a rate step after 1, 2, 3 periods."""
    cfg = EstimateConfig(alpha=0.6)
    e = update_estimate(cfg, None, PeriodObservation.of(10.0, [100] * 10, []))
    seen = []
    for _ in range(3):
        e = update_estimate(cfg, e, PeriodObservation.of(10.0, [100] * 110, []))
        seen.append(round((e.rate - 1) / 10, 4))
    assert seen == [0.6, 0.84, 0.936]


def test_a_period_shorter_than_the_rate_window_keeps_the_rate() -> None:
    """A period a step woke right after another (no arrivals in 0.1 s) or a few seconds in
    does not move the rate; lengths and outputs it saw still count."""
    cfg = EstimateConfig(alpha=0.5)
    e = update_estimate(cfg, None, PeriodObservation.of(60.0, [1000] * 120, [50] * 100))
    empty = update_estimate(cfg, e, PeriodObservation.of(0.1, [], []))
    assert empty.rate == 2.0
    short = update_estimate(cfg, e, PeriodObservation.of(5.0, [3000] * 30, [150] * 10))
    assert short.rate == 2.0 and short.lengths.mu > e.lengths.mu
    assert short.output_tokens is not None and short.output_tokens > 50


def test_the_occupancy_stands_for_finished_answers_only_well_above_them() -> None:
    """Little's law on the decode occupancy reads within about 10% of the true answer
    length: within 20% of the finished answers it is noise (taking the larger
    of the two would bias the estimate up); well above them it is answers that have not
    finished yet; with none finished it is all there is."""

    def mean_output(finished: list[int], occupancy: float) -> float:
        obs = PeriodObservation.of(60.0, [1000] * 100, finished, occupancy_output=occupancy)
        return obs.output_tokens / obs.finished

    assert mean_output([1024] * 100, 1126) == 1024  # 10% above: within the noise
    assert mean_output([1024] * 100, 3072) == 3072
    assert mean_output([], 900) == 900


def test_bandwidth_follows_the_latest_measurement_by_default() -> None:
    e = update_estimate(EstimateConfig(), None, PeriodObservation.of(1.0, [100], [], 1e10))
    e = update_estimate(EstimateConfig(), e, PeriodObservation.of(1.0, [100], [], 1e9))
    assert e.capacity_bytes_per_s == 1e9 and e.rate == 1.0


def test_an_idle_period_keeps_the_lengths_and_outputs() -> None:
    """No request in a period: the rate falls, what was learnt about lengths stays."""
    cfg = EstimateConfig(alpha=0.5)
    e = update_estimate(cfg, None, PeriodObservation.of(10.0, [1000] * 30, [50] * 30))
    idle = update_estimate(cfg, e, PeriodObservation.of(10.0, [], []))
    assert idle.rate == 1.5 and idle.lengths == e.lengths and idle.samples == 30
    assert idle.output_tokens == 50


def test_unknown_capacity_keeps_the_last_estimate() -> None:
    cfg = EstimateConfig()
    e = update_estimate(cfg, None, PeriodObservation.of(1.0, [100], [], 5e8))
    e = update_estimate(cfg, e, PeriodObservation.of(1.0, [100], [], None))
    assert e.capacity_bytes_per_s == 5e8
    assert e.output_tokens is None


def test_distribution_needs_a_sample() -> None:
    e = update_estimate(EstimateConfig(), None, PeriodObservation.of(1.0, [], []))
    with pytest.raises(ValueError, match="no incremental length"):
        e.distribution(128, 131072)
    e = update_estimate(EstimateConfig(), None, PeriodObservation.of(1.0, [5000, 20000], []))
    d = e.distribution(128, 131072)
    assert (d.lo, d.hi) == (128, 131072)
    assert d.log_moments() == pytest.approx((math.log(10000), math.log(2)))
    assert e.to_json()["length_samples"] == 2.0


def test_bad_values_are_named() -> None:
    with pytest.raises(FieldError, match=r"alpha: must be in \(0, 1\] \(got 0.0\)"):
        EstimateConfig(alpha=0.0)
    with pytest.raises(FieldError, match=r"duration_s: must be > 0 \(got 0.0\)"):
        PeriodObservation.of(0.0, [], [])
