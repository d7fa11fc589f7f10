"""The long-term loop's early wake on a step of answer length, on the virtual clock with the
real Router and schedulers over simulated engines (the case study's 25 ms decode step)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest

from prfaas.gateway.router import Router
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.scheduler import Scheduler
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.protocol.generate import SamplingParams
from prfaas.sim.cluster import SimCluster
from prfaas.sim.deployments import Deployment, SimOptions
from prfaas.sim.virtual_loop import run_virtual

_rid = itertools.count()
PERIOD_S = 20.0


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


def _deployment(profile: DeploymentProfile) -> Deployment:
    pd = profile.pd.hardware
    return Deployment("test", "prfaas", 1, profile.prfaas.hardware, 2, 2, pd, pd, 8000.0, 100.0)


async def _request(router: Router, out: int) -> None:
    ids = tuple(np.random.default_rng(next(_rid)).integers(1, 50_000, 2_000).tolist())
    routed = await router.dispatch(f"r{next(_rid)}", ids, SamplingParams(max_new_tokens=out),
                                   stream=True)  # fmt: skip
    try:
        while await routed.next() is not None:
            pass
    finally:
        routed.close()


def _output_estimates(profile: DeploymentProfile, step_at: float) -> dict[float, float | None]:
    """Two requests a second answering 100 tokens (2.5 s), from `step_at` on 600 (15 s); the
    estimated output length each second."""

    async def main() -> dict[float, float | None]:
        cluster = SimCluster(profile, _deployment(profile), SimOptions())
        scheduler = Scheduler(SchedulerConfig(period_s=PERIOD_S), profile, cluster.router,
                              cluster.instances)  # fmt: skip
        scheduler.start()
        loop = asyncio.get_running_loop()
        start, seen, tasks = loop.time(), {}, []
        try:
            while (now := loop.time() - start) < step_at + 20:
                out = 100 if now < step_at else 600
                tasks.append(asyncio.create_task(_request(cluster.router, out)))
                await asyncio.sleep(0.5)
                estimate = scheduler.long.estimate
                seen[round(now + 0.5, 1)] = None if estimate is None else estimate.output_tokens
            await asyncio.gather(*tasks)
        finally:
            await scheduler.stop()
        return seen

    return run_virtual(main())


def test_longer_answers_wake_the_long_term_loop_before_its_period_ends(
    profile: DeploymentProfile,
) -> None:
    """Answers step from 100 to 600 tokens at 45 s: within 15 s (the requests decoding now
    outlive the old answers; 5 ticks confirm), before the period due at 60 s, a period runs
    and takes the longer answers (unblended); without the wake the estimate would still be
    the 100 tokens that the periods at 20 and 40 s saw."""
    seen = _output_estimates(profile, step_at=45.0)
    before = seen[44.0]
    assert before is not None and 80 <= before <= 130
    after = seen[58.0]
    assert after is not None and after >= 1.5 * before, (before, after)
