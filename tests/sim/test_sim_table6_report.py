"""`run_table6` end to end on a small synthetic profile (short prompts, fast runs): three
rows, ratios consistent with the exact model, JSON flagged simulated, table rendered."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from prfaas.loadgen.workloads import WorkloadOptions, create_workload
from prfaas.loadgen.workloads.lengths import LogNormalLengths
from prfaas.policies.profile import DeploymentProfile, parse_profile
from prfaas.sim.deployments import SimOptions
from prfaas.sim.report import table6_table
from prfaas.sim.table6 import Table6Options, run_table6

SMALL: dict[str, Any] = {
    "workload": {
        "input_distribution": "lognormal",
        "mu": 6.0,
        "sigma": 0.5,
        "min_tokens": 64,
        "max_tokens": 2048,
        "output_tokens": 16,
    },
    "model": {"name": "small", "kv_tokens": [64, 2048], "kv_mib": [1.0, 32.0]},
    "hardware": {
        "fast": {"prefill_tokens": [64, 2048], "prefill_seconds": [1.0, 10.0]},
        "slow": {
            "prefill_tokens": [64, 2048],
            "prefill_seconds": [2.0, 20.0],
            "decode_batch_max": 8,
            "decode_step_seconds": 0.01,
        },
    },
    "clusters": {
        "prfaas": {"hardware": "fast", "instances": 2, "egress_gbps": 100},
        "pd": {"hardware": "slow", "instances": 4},
    },
    "baselines": {
        "homogeneous": {"hardware": "slow", "instances": 6},
        "naive_heterogeneous": {
            "prefill_hardware": "fast",
            "prefill_instances": 2,
            "decode_hardware": "slow",
            "decode_instances": 4,
        },
    },
}


def _small(drop_baselines: bool = False) -> DeploymentProfile:
    data = {k: v for k, v in SMALL.items() if not (drop_baselines and k == "baselines")}
    return parse_profile(data, source="small.toml")


def test_table6_on_a_small_profile() -> None:
    """Every deployment is bisected; the capacity ratios follow the exact-expectation model
    (within 15%); bisection never lands above the capacity limit (short runs with few,
    slow requests land well below it: a queue near saturation drifts up by chance); the
    JSON and the table say SIMULATED."""
    profile = _small()
    workload = create_workload(
        "lognormal",
        WorkloadOptions(inputs=LogNormalLengths(6.0, 0.5, 64, 2048), output_tokens=16),
    )
    t6 = run_table6(profile, workload, SimOptions(), Table6Options(300.0, rel_tol=0.05))
    assert [r.name for r in t6.rows] == ["prfaas_pd", "homogeneous", "naive_heterogeneous"]
    for row in t6.rows:
        assert row.sim.best.metrics.stable
        exact = t6.ratio(row.name, "model_exact")
        assert t6.ratio(row.name, "capacity") == pytest.approx(exact, rel=0.15)
        capacity = row.at_own.metrics.lambda_capacity
        assert capacity is not None
        assert 0.6 * capacity < row.sim.lambda_max <= 1.05 * capacity
    doc = t6.to_json()
    assert doc["simulated"] is True
    assert set(doc["rows"]["prfaas_pd"]) >= {"paper", "lambda_max", "ratio", "at_common_rate"}
    console = Console(width=120, record=True)
    console.print(table6_table(t6))
    text = console.export_text()
    assert "SIMULATED" in text and "λmax sim, bisection" in text


def test_table6_needs_both_baselines() -> None:
    """Without baselines there is nothing to compare: a clear error naming the file."""
    workload = create_workload("lognormal", WorkloadOptions())
    with pytest.raises(ValueError, match=r"small.toml: --table6 needs \[baselines"):
        run_table6(_small(drop_baselines=True), workload, SimOptions(), Table6Options())
