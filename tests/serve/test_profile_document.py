"""The start-up profile as the planner reads it: the times of engines sharing the cores, and
the `[machine]` table that tells the simulator so."""

from __future__ import annotations

from dataclasses import replace

import pytest
from profiling_helpers import MEASURED_ALONE

from prfaas.common.toml_tables import ConfigError
from prfaas.policies.profile import parse_profile
from prfaas.serve.profiling import (
    SHARED_BUSY_ENGINES,
    Workload,
    measured_profile,
    profile_document,
    profile_threshold,
)


def test_the_profile_times_include_the_shared_cores_slowdown() -> None:
    shared = replace(MEASURED_ALONE, shared_slowdown=1.5)
    cpu = measured_profile(shared, Workload()).hardware["cpu"]
    assert cpu.prefill_seconds.ys == pytest.approx([0.3, 1.05, 3.45])
    assert cpu.decode_step_seconds == pytest.approx(0.0225)
    alone = measured_profile(MEASURED_ALONE, Workload()).hardware["cpu"]
    assert alone.prefill_seconds.ys == pytest.approx([0.2, 0.7, 2.3])


def test_slower_shared_engines_carry_less() -> None:
    """The planner's capacity falls with the slowdown: the embedded deployment's scenario
    rates come from it."""
    _, alone = profile_threshold(measured_profile(MEASURED_ALONE, Workload()))
    shared_profile = measured_profile(replace(MEASURED_ALONE, shared_slowdown=1.5), Workload())
    _, shared = profile_threshold(shared_profile)
    assert shared.prfaas_pd.lambda_max < 0.9 * alone.prfaas_pd.lambda_max


def test_the_profile_says_its_engines_share_a_machine() -> None:
    machine = measured_profile(replace(MEASURED_ALONE, shared_slowdown=1.5), Workload()).machine
    assert machine is not None
    assert machine.shared_slowdown == pytest.approx(1.5)
    assert machine.busy_engines == SHARED_BUSY_ENGINES
    assert machine.cores == pytest.approx(SHARED_BUSY_ENGINES / 1.5)


@pytest.mark.parametrize(
    ("table", "key"),
    [({"shared_slowdown": 0.9, "busy_engines": 3}, "shared_slowdown"),
     ({"shared_slowdown": 1.2, "busy_engines": 0}, "busy_engines"),
     ({"shared_slowdown": 1.2, "busy_engines": 3, "cores": 2}, "cores")],
)  # fmt: skip
def test_a_bad_machine_table_is_refused_by_name(table: dict[str, float], key: str) -> None:
    document = profile_document(MEASURED_ALONE, Workload()) | {"machine": table}
    with pytest.raises(ConfigError, match=key):
        parse_profile(document)
