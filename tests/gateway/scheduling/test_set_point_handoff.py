"""The long-term loop's set-point move as the Router sees it, with the real schedulers over
simulated engines on the virtual clock: a move on the blended estimate alone leaves `t`
where the trimmer raised it for a congested link (and says so), a move on a measured step
takes `t` with it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.scheduler import Scheduler
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.policies.rebalance import RebalanceDecision, RebalanceState
from prfaas.sim.cluster import SimCluster
from prfaas.sim.deployments import Deployment, SimOptions
from prfaas.sim.virtual_loop import run_virtual


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


def _moved(
    profile: DeploymentProfile, *, drifted: bool, pinned: bool = False
) -> tuple[float, float, str, float | None]:
    """`t` raised from 10,000 to 12,500 for a congested link (remembered), then a period
    that moves the set-point to 11,000 (`pinned`: the operator pinned `t` to 9,000 and
    released it before the period): the Router's threshold, the board's set-point, the
    change's reason and the trimmer's memory of the congested `t`."""
    pd = profile.pd.hardware
    deployment = Deployment("test", "prfaas", 1, profile.prfaas.hardware, 1, 1, pd, pd,
                            10_000.0, 1.0)  # fmt: skip

    async def main() -> tuple[float, float, str, float | None]:
        cluster = SimCluster(profile, deployment, SimOptions())
        scheduler = Scheduler(SchedulerConfig(), profile, cluster.router, cluster.instances)
        short = scheduler.short
        short.trim = replace(short.trim, threshold=12_500.0, congested_at=10_000.0,
                             remember_until=1e9)  # fmt: skip
        if pinned:
            scheduler.pin(threshold=9_000.0, regime=None)
            scheduler.release()
        decision = RebalanceDecision(RebalanceState(), "hold", "balanced", 11_000.0,
                                     set_point_drifted=drifted)  # fmt: skip
        scheduler.long._apply(decision, {})
        change = [d for d in scheduler.board.recent if d.kind == "set_point"][-1]
        return (cluster.router.state.threshold, scheduler.board.state.set_point, change.reason,
                short.trim.congested_at)  # fmt: skip

    return run_virtual(main())


def test_a_drifted_set_point_keeps_the_trimmers_t(profile: DeploymentProfile) -> None:
    assert _moved(profile, drifted=True) == (
        12_500.0,
        11_000.0,
        "re-solved t 10000 -> 11000; t kept at 12500 by the trimmer",
        10_000.0,
    )


def test_a_measured_set_point_takes_t_with_it(profile: DeploymentProfile) -> None:
    assert _moved(profile, drifted=False) == (
        11_000.0,
        11_000.0,
        "re-solved t 10000 -> 11000",
        None,
    )


def test_a_pin_forgets_the_trimmers_t(profile: DeploymentProfile) -> None:
    """After a pin and its release the trimmer starts from what the operator set: a drifted
    move then takes `t` with it (the raise from before the pin is not brought back)."""
    assert _moved(profile, drifted=True, pinned=True) == (
        11_000.0,
        11_000.0,
        "re-solved t 9000 -> 11000",
        None,
    )
