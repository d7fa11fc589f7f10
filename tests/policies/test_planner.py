"""The planner on the paper's case study (acceptance against the published Table 6), the
bandwidth-bound regime, Eq. 7/8 structure, and the ends of the threshold range."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prfaas.policies import throughput as tp
from prfaas.policies.planner import PlanGrid, PlanReport, best_for_split, plan, robust_threshold
from prfaas.policies.profile import DeploymentProfile, load_profile


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


@pytest.fixture(scope="module")
def report(profile: DeploymentProfile) -> PlanReport:
    return plan(profile)


@pytest.fixture(scope="module")
def paper(paper_results_path: Path) -> dict[str, Any]:
    return tomllib.loads(paper_results_path.read_text())["table6"]


def test_prfaas_pd_optimum_matches_paper(report: PlanReport, paper: dict[str, Any]) -> None:
    """t* within 18.5K-20.5K, split (4, 3, 5), Lambda_max within 3% of the paper's 3.24."""
    best, want = report.prfaas_pd, paper["prfaas_pd"]
    assert best.threshold_tokens is not None and 18_500 <= best.threshold_tokens <= 20_500
    assert (best.n_prfaas, best.n_p, best.n_d) == (want["n_prfaas"], want["n_p"], want["n_d"])
    assert best.lambda_max == pytest.approx(want["lambda_max"], rel=0.03)
    assert best.theta_prfaas == pytest.approx(want["theta_prfaas"], rel=0.03)
    assert best.theta_pd_p == pytest.approx(want["theta_pd_p"], rel=0.03)
    assert best.theta_pd_d == pytest.approx(want["theta_pd_d"], rel=0.03)
    assert best.egress_gbps is not None and 11.0 <= best.egress_gbps <= 14.0


def test_baselines_match_paper(report: PlanReport, paper: dict[str, Any]) -> None:
    """Homogeneous PD picks 9 prefill + 3 decode at ~2.11 req/s; naive heterogeneous ~2.45."""
    homo, naive = report.homogeneous, report.naive_heterogeneous
    assert homo is not None and naive is not None
    want_h, want_n = paper["homogeneous_pd"], paper["naive_heterogeneous_pd"]
    assert (homo.n_p, homo.n_d) == (want_h["n_p"], want_h["n_d"])
    assert homo.lambda_max == pytest.approx(want_h["lambda_max"], rel=0.03)
    assert naive.lambda_max == pytest.approx(want_n["lambda_max"], rel=0.03)
    assert naive.theta_pd_d == pytest.approx(want_n["theta_pd_d"], rel=0.01)
    assert report.ratio_vs_homogeneous == pytest.approx(want_h and 1.54, rel=0.03)


def test_optimum_balances_prefill_bounds(report: PlanReport) -> None:
    """Eq. 7: at the optimal t the PrfaaS bound and the PD-prefill bound meet (within one
    grid step), and both bounds are monotone in t, so the crossing is unique."""
    g, best = report.grid, report.prfaas_pd
    k = best.n_p - 1
    j = int(np.flatnonzero(g.thresholds == best.threshold_tokens)[0])
    assert np.all(np.diff(g.prfaas_bound[np.isfinite(g.prfaas_bound)]) >= -1e-12)
    finite = np.isfinite(g.pd_prefill_bound[k])
    assert np.all(np.diff(g.pd_prefill_bound[k][finite]) <= 1e-12)
    gap = g.prfaas_bound[j] - g.pd_prefill_bound[k, j]
    neighbour = g.prfaas_bound[j + 1] - g.pd_prefill_bound[k, j + 1]
    assert abs(gap) < abs(neighbour) or np.sign(gap) != np.sign(neighbour)
    assert best.lambda_max == pytest.approx(min(g.prfaas_bound[j], g.pd_prefill_bound[k, j]))


def test_split_follows_eq8(report: PlanReport) -> None:
    """Eq. 8: the chosen N_p is the last split where prefill capacity does not exceed decode
    capacity; one more prefill instance would starve decode below the current optimum."""
    best, g = report.prfaas_pd, report.grid
    assert best.theta_prfaas is not None and best.theta_pd_p is not None
    assert best.theta_prfaas + best.theta_pd_p <= best.theta_pd_d
    assert g.decode_bound[best.n_p] < best.lambda_max  # N_p + 1: decode-bound, worse


def test_bandwidth_bound_regime(profile: DeploymentProfile) -> None:
    """With a 5 Gbps link PrfaaS is link-bound: Theta_prfaas == B_out / S_kv(l_long)."""
    slow = dataclasses.replace(profile, prfaas=dataclasses.replace(profile.prfaas, egress_gbps=5))
    best = plan(slow).prfaas_pd
    assert best.l_long is not None and best.theta_prfaas is not None
    link_rate = tp.gbps_to_bytes_per_s(5) / float(profile.model.kv_bytes(best.l_long))
    compute_rate = 4 / float(profile.prfaas.hardware.prefill_seconds(best.l_long))
    assert link_rate < compute_rate
    assert best.theta_prfaas == pytest.approx(link_rate, rel=1e-9)
    assert best.egress_gbps is not None and best.egress_gbps <= 5.0 + 1e-9
    assert best.lambda_max < plan(profile).prfaas_pd.lambda_max


def test_threshold_range_ends(report: PlanReport) -> None:
    """t = min sends everything to PrfaaS (p = 1, PD-prefill bound infinite); t = max sends
    nothing (p = 0, PrfaaS bound infinite); Lambda_max stays finite at both ends."""
    g = report.grid
    assert g.thresholds[0] == 128 and g.thresholds[-1] == 131072
    assert np.isinf(g.pd_prefill_bound[:, 0]).all() and np.isfinite(g.prfaas_bound[0])
    assert np.isinf(g.prfaas_bound[-1]) and np.isfinite(g.pd_prefill_bound[:, -1]).all()
    assert np.isfinite(g.lambda_max[:, [0, -1]]).all()


def test_exact_expectation_is_more_pessimistic(profile: DeploymentProfile) -> None:
    """Prefill latency is convex, so E[T(L)] >= T(E[L]): exact-mode throughputs are lower."""
    rep, exact = plan(profile), plan(profile, exact=True)
    assert exact.exact_expectation and not rep.exact_expectation
    assert exact.prfaas_pd.lambda_max < rep.prfaas_pd.lambda_max
    assert exact.homogeneous and rep.homogeneous
    assert exact.homogeneous.lambda_max < rep.homogeneous.lambda_max


def test_json_shape(report: PlanReport) -> None:
    """The JSON object has the three deployments with the documented keys, nulls for stages
    that do not exist, and the two ratios on prfaas_pd."""
    doc = report.to_json()
    keys = {
        "lambda_max",
        "theta_prfaas",
        "theta_pd_p",
        "theta_pd_d",
        "n_prfaas",
        "n_p",
        "n_d",
        "threshold_tokens",
        "p_offload",
        "l_long",
        "l_short",
        "egress_gbps",
        "bottleneck",
    }
    for name in ("prfaas_pd", "homogeneous", "naive_heterogeneous"):
        assert keys <= set(doc[name])
    assert doc["homogeneous"]["theta_prfaas"] is None
    assert doc["homogeneous"]["threshold_tokens"] is None
    assert doc["naive_heterogeneous"]["theta_pd_p"] is None
    assert doc["prfaas_pd"]["ratio_vs_naive"] == pytest.approx(
        doc["prfaas_pd"]["lambda_max"] / doc["naive_heterogeneous"]["lambda_max"]
    )


def test_robust_threshold_errs_toward_the_gentle_side() -> None:
    """On a lopsided Lambda_max (steep below the optimum, gentle above, as where the link
    binds), the threshold best in the worst of three estimates lies above the point
    optimum of each; with no other estimate it is the point optimum."""
    t = np.arange(1000.0, 9000.0, 100.0)

    def grid(peak: float) -> PlanGrid:
        lam = np.where(t <= peak, 2.0 - 0.002 * (peak - t), 2.0 - 0.0002 * (t - peak))
        return PlanGrid(t, np.array([1.0]), lam[None, :], np.full_like(t, np.inf),
                        np.full((1, len(t)), 3.0), np.array([5.0]))  # fmt: skip

    centre, low, high = grid(4800.0), grid(4300.0), grid(5300.0)
    assert best_for_split(centre, 1).threshold_tokens == 4800.0
    assert robust_threshold(centre, [], 1) == 4800.0
    robust = robust_threshold(centre, [low, high], 1)
    assert 5200.0 <= robust <= 5300.0  # where the high and low estimates cross (5,209)
    worst = np.fmin.reduce([g.lambda_max[0] for g in (centre, low, high)])
    assert worst[t == robust][0] == worst.max() > worst[t == 4800.0][0] + 0.5
    with pytest.raises(ValueError, match="outside the searched splits"):
        robust_threshold(centre, [low], 2)
