"""Simulated engines sharing one machine's cores: processor sharing on the virtual clock, an
engine counted once whatever it runs, a cancelled computation's share given back."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from profiling_helpers import MEASURED_ALONE

from prfaas.policies.profile import DeploymentProfile, SharedMachine
from prfaas.protocol.generate import SamplingParams
from prfaas.serve.profiling import Workload, measured_profile
from prfaas.sim.cluster import SimCluster
from prfaas.sim.cores import Cores, DedicatedCores, SharedCores, cores_for
from prfaas.sim.deployments import Deployment, SimOptions
from prfaas.sim.virtual_loop import run_virtual

# three engines working at once ran 1.5x slower: the machine has two cores' worth
MACHINE = SharedMachine(shared_slowdown=1.5, busy_engines=3)


async def _finish_times(cores: SharedCores, jobs: list[tuple[float, str, float]]) -> list[float]:
    """When each (start, owner, profile seconds) computation ended."""
    loop = asyncio.get_running_loop()

    async def one(start: float, owner: str, profile_s: float) -> float:
        await asyncio.sleep(start)
        await cores.compute(owner, profile_s)
        return loop.time()

    return list(await asyncio.gather(*(one(*job) for job in jobs)))


def test_an_engine_alone_runs_at_its_alone_time() -> None:
    ends = run_virtual(_finish_times(SharedCores(MACHINE), [(0.0, "a", 3.0)]))
    assert ends == pytest.approx([2.0])  # the profile's 3 s were measured 1.5x slowed


def test_as_many_engines_as_cores_do_not_slow_each_other() -> None:
    ends = run_virtual(_finish_times(SharedCores(MACHINE), [(0.0, "a", 3.0), (0.0, "b", 3.0)]))
    assert ends == pytest.approx([2.0, 2.0])


def test_every_engine_working_takes_the_profiles_time() -> None:
    jobs = [(0.0, owner, 3.0) for owner in "abc"]
    assert run_virtual(_finish_times(SharedCores(MACHINE), jobs)) == pytest.approx([3.0] * 3)


def test_speed_follows_who_works_as_computations_come_and_go() -> None:
    # a: 2 s alone, 1 s done by t=1; then three work at 2/3 speed: a's last 1 s ends at 2.5;
    # b and c did 1 s of their 2 by then, and finish alone-speed at 3.5
    jobs = [(0.0, "a", 3.0), (1.0, "b", 3.0), (1.0, "c", 3.0)]
    ends = run_virtual(_finish_times(SharedCores(MACHINE), jobs))
    assert ends == pytest.approx([2.5, 3.5, 3.5])


def test_an_engines_concurrent_computations_count_it_once() -> None:
    """A decode's batch: one engine working, however many requests it steps."""
    jobs = [(0.0, "decode", 3.0), (0.0, "decode", 3.0), (0.0, "decode", 3.0), (0.0, "a", 3.0)]
    assert run_virtual(_finish_times(SharedCores(MACHINE), jobs)) == pytest.approx([2.0] * 4)


def test_a_cancelled_computation_gives_its_share_back() -> None:
    async def scenario() -> tuple[float, float]:
        cores = SharedCores(MACHINE)
        loop = asyncio.get_running_loop()
        waiting = [loop.create_task(cores.compute(o, 3.0)) for o in "ab"]
        timed = loop.create_task(_finish_times(cores, [(0.0, "c", 3.0)]))
        await asyncio.sleep(1.5)  # c has 1 of its 2 alone seconds done
        for task in waiting:
            task.cancel()
        (end,) = await timed
        return end, cores.expected_s("c", 3.0)

    end, expected = run_virtual(scenario())
    assert end == pytest.approx(2.5)  # its last second alone
    assert expected == pytest.approx(2.0)  # nothing else works now


def test_expected_time_counts_the_asker_in() -> None:
    async def scenario() -> tuple[float, float]:
        cores = SharedCores(MACHINE)
        loop = asyncio.get_running_loop()
        busy = [loop.create_task(cores.compute(o, 30.0)) for o in "ab"]
        await asyncio.sleep(0)
        got = cores.expected_s("c", 3.0), cores.expected_s("a", 3.0)
        for task in busy:
            task.cancel()
        return got

    assert run_virtual(scenario()) == pytest.approx((3.0, 2.0))


def test_a_profile_without_a_machine_gets_dedicated_cores() -> None:
    assert isinstance(cores_for(None), DedicatedCores)
    assert isinstance(cores_for(MACHINE), SharedCores)
    assert run_virtual(_dedicated()) == pytest.approx(3.0)


async def _dedicated() -> float:
    loop = asyncio.get_running_loop()
    cores = DedicatedCores()
    await asyncio.gather(*(cores.compute(o, 3.0) for o in "abcd"))
    return loop.time()


MEASURED = replace(MEASURED_ALONE, shared_slowdown=1.5)


def _one_local_request(profile: DeploymentProfile) -> tuple[float, Cores]:
    """A 1,024-token request alone through the twin of `profile` (every prompt local): its
    time, and what the engines computed on (all of them on the same)."""

    async def run() -> tuple[float, Cores]:
        hw = profile.pd.hardware
        deployment = Deployment("twin", "prfaas", 1, hw, 1, 1, hw, hw, 1e9, 0.01)
        cluster = SimCluster(profile, deployment, SimOptions())
        used = [e.cores for e in cluster.prefill.values()]
        used += [p.decode.cores for p in cluster.pd.values()]
        assert all(c is cluster.cores for c in used)
        loop = asyncio.get_running_loop()
        routed = await cluster.router.dispatch(
            "r0", tuple(range(1, 1025)), SamplingParams(max_new_tokens=1), stream=True
        )
        try:
            while await routed.next() is not None:
                pass
        finally:
            routed.close()
        return loop.time(), cluster.cores

    return run_virtual(run())


def test_the_twin_of_a_shared_machine_runs_a_lone_request_at_its_alone_time() -> None:
    """The start-up profile of the embedded deployment, simulated: every engine computes on
    the one machine, and a request with nothing else running takes its alone time, not the
    profile's (which is the all-working time)."""
    took, cores = _one_local_request(measured_profile(MEASURED, Workload()))
    assert isinstance(cores, SharedCores)
    # 1,024 tokens: 0.7 s alone plus a decode step and the hand-off; the profile says 1.05
    assert 0.7 <= took < 0.8


def test_without_a_machine_table_the_twin_takes_the_profiles_times() -> None:
    profile = replace(measured_profile(MEASURED, Workload()), machine=None)
    took, cores = _one_local_request(profile)
    assert isinstance(cores, DedicatedCores)
    assert 1.05 <= took < 1.15


def test_computations_ending_together_end_in_the_order_they_began() -> None:
    async def scenario() -> list[str]:
        cores, order = SharedCores(MACHINE), []

        async def one(owner: str, start: float, profile_s: float) -> None:
            await asyncio.sleep(start)
            await cores.compute(owner, profile_s)
            order.append(owner)

        # alone 2 s from 0 and 1 s from 1: both end at 2 (two owners: full speed)
        await asyncio.gather(one("late", 1.0, 1.5), one("early", 0.0, 3.0))
        return order

    assert run_virtual(scenario()) == ["early", "late"]


def test_a_short_computation_arriving_later_ends_first() -> None:
    jobs = [(0.0, "long", 6.0), (1.0, "short", 0.75)]  # alone 4 s and 0.5 s
    assert run_virtual(_finish_times(SharedCores(MACHINE), jobs)) == pytest.approx([4.0, 1.5])
