"""The start-up profile as the planner reads it: the times of engines sharing the cores."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prfaas.serve.profiling import MeasuredProfile, Workload, measured_profile, plan_threshold

ALONE = MeasuredProfile(
    lengths=(256, 1024, 3072),
    prefill_s=(0.2, 0.7, 2.3),
    kv_bytes=(770_000, 2_350_000, 6_550_000),
    decode_step_s=0.015,
    decode_batch_max=32,
    link_bytes_per_s=10e6 / 8,
)


def test_the_profile_times_include_the_shared_cores_slowdown() -> None:
    shared = replace(ALONE, shared_slowdown=1.5)
    cpu = measured_profile(shared, Workload()).hardware["cpu"]
    assert cpu.prefill_seconds.ys == pytest.approx([0.3, 1.05, 3.45])
    assert cpu.decode_step_seconds == pytest.approx(0.0225)
    alone = measured_profile(ALONE, Workload()).hardware["cpu"]
    assert alone.prefill_seconds.ys == pytest.approx([0.2, 0.7, 2.3])


def test_slower_shared_engines_carry_less() -> None:
    """The planner's capacity falls with the slowdown: the embedded deployment's scenario
    rates come from it."""
    _, alone = plan_threshold(ALONE, Workload())
    _, shared = plan_threshold(replace(ALONE, shared_slowdown=1.5), Workload())
    assert shared.prfaas_pd.lambda_max < 0.9 * alone.prfaas_pd.lambda_max
