"""The virtual-clock loop: time jumps to the next timer, a stalled simulation raises, and a
whole simulated run through the real Router never reads the wall clock."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from prfaas.loadgen.arrivals import RateArrivals
from prfaas.loadgen.workloads import WorkloadOptions, create_workload
from prfaas.policies.planner import plan
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.sim.deployments import Deployment, SimOptions, deployments
from prfaas.sim.runner import SimSpec, simulate
from prfaas.sim.virtual_loop import SimulationStalled, VirtualClockLoop, run_virtual

# Modules whose code runs on the loop during a simulation: none may read a wall clock.
ON_LOOP = ("prfaas.gateway.", "prfaas.policies.", "prfaas.engines.", "prfaas.loadgen.")
# The runner times the whole simulation (outside the loop) for its wall_s report.
ALLOWED = ("prfaas.sim.runner",)


def test_time_jumps_to_the_next_timer_without_waiting() -> None:
    """An hour of sleeps takes no wall time; timers fire in order at their virtual times."""
    fired: list[float] = []

    async def main() -> float:
        loop = asyncio.get_running_loop()
        for delay in (3600.0, 1.5, 30.0):
            loop.call_later(delay, lambda: fired.append(loop.time()))
        await asyncio.sleep(7200)
        return loop.time()

    wall = time.perf_counter()
    assert run_virtual(main()) == pytest.approx(7200)
    assert fired == pytest.approx([1.5, 30.0, 3600.0])
    assert time.perf_counter() - wall < 5


def test_a_stalled_simulation_raises_instead_of_hanging() -> None:
    """Awaiting a future nobody resolves, with no timer left, is an error."""

    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationStalled, match="no timer is scheduled"):
        run_virtual(main())


def test_loop_starts_at_the_given_time() -> None:
    """`time()` is the virtual clock from its start value."""
    loop = VirtualClockLoop(start=100.0)
    try:
        assert loop.time() == 100.0
    finally:
        loop.close()


@pytest.fixture(scope="module")
def case_study(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


@pytest.fixture(scope="module")
def prfaas_pd(case_study: DeploymentProfile) -> Deployment:
    return deployments(case_study, plan(case_study), SimOptions())["prfaas_pd"]


def _spy(real: Callable[[], float], calls: list[str]) -> Callable[[], float]:
    def clock() -> float:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(ON_LOOP) and caller not in ALLOWED:
            calls.append(caller)
            raise AssertionError(f"{caller} read the wall clock during a simulation")
        return real()

    return clock


def test_simulated_run_never_reads_the_wall_clock(
    monkeypatch: pytest.MonkeyPatch, case_study: DeploymentProfile, prfaas_pd: Deployment
) -> None:
    """time.time/monotonic/perf_counter raise if called from the Router, policies, simulated
    engines or loadgen code during a run; the run still completes every request."""
    calls: list[str] = []
    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(time, name, _spy(getattr(time, name), calls))
    workload = create_workload("shared-prefix", WorkloadOptions(system_len=4096))
    plan = SimSpec(prfaas_pd, workload, RateArrivals(2.0), duration_s=60.0)
    result = simulate(case_study, plan, SimOptions())
    assert calls == []
    assert result.metrics.completed == len(result.records) > 50
    assert result.metrics.failed == 0
