"""The short-term loop's regime choice with the profile's KV production rate, on the virtual
clock with the real Router and schedulers over simulated engines: an idle link slower than
`Phi_kv` stays scarce (pulls over it would cost more than the recompute they save), a fast
idle one turns abundant, and the decision names both rates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.scheduler import Scheduler, prefill_costs
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.policies.ttft_forecast import LinkState
from prfaas.sim.cluster import SimCluster
from prfaas.sim.deployments import Deployment, SimOptions
from prfaas.sim.virtual_loop import run_virtual

GBIT = 1e9 / 8


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


def _idle_regime(profile: DeploymentProfile, link_gbps: float) -> tuple[str, list[str]]:
    """The regime after 30 idle ticks on a link of `link_gbps`, and the regime decisions."""
    pd = profile.pd.hardware
    deployment = Deployment("test", "prfaas", 1, profile.prfaas.hardware, 1, 1, pd, pd, 8000.0,
                            link_gbps)  # fmt: skip

    async def main() -> tuple[str, list[str]]:
        cluster = SimCluster(profile, deployment, SimOptions())
        scheduler = Scheduler(SchedulerConfig(long_term=False), profile, cluster.router,
                              cluster.instances)  # fmt: skip
        scheduler.attach_link(lambda: LinkState(link_gbps * GBIT))
        scheduler.start()
        try:
            await asyncio.sleep(30.0)
        finally:
            await scheduler.stop()
        reasons = [d.reason for d in scheduler.board.recent if d.kind == "regime"]
        return scheduler.board.state.regime, reasons

    return run_virtual(main())


def test_an_idle_link_slower_than_kv_production_stays_scarce(profile: DeploymentProfile) -> None:
    """The case study's lowest KV production rate is about 0.88 Gbit/s (PD hardware, 128K
    tokens): an idle 0.5 Gbit/s link never turns abundant."""
    assert 0.5 * GBIT < prefill_costs(profile).min_kv_rate() < 2 * GBIT
    regime, reasons = _idle_regime(profile, 0.5)
    assert (regime, reasons) == ("bandwidth_scarce", [])


def test_an_idle_link_faster_than_kv_production_turns_abundant(profile: DeploymentProfile) -> None:
    regime, reasons = _idle_regime(profile, 2.0)
    assert regime == "bandwidth_abundant"
    assert reasons == ["bandwidth_abundant: egress utilisation 0.00 < 0.4, spare 2000.0 Mbit/s "
                       "> KV production 875.2 Mbit/s for 10 ticks"]  # fmt: skip
