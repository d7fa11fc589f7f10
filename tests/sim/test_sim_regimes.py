"""Both bandwidth regimes through the real Router and simulated cluster (simulated times):
a prompt extending a prefix cached only in PrfaaS is recomputed in PrfaaS in the scarce
regime, and served by PD after pulling the prefix across the link in the abundant one; with
the schedulers' predictions, a pull slower than recomputing the prefix is not made."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from prfaas.gateway.router import Router
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.scheduler import Scheduler
from prfaas.policies.planner import plan
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.policies.routing import Regime, RouteDecision
from prfaas.policies.ttft_forecast import LinkState
from prfaas.protocol.generate import GenerateChunk, SamplingParams
from prfaas.sim.cluster import SimCluster
from prfaas.sim.deployments import SimOptions, deployments
from prfaas.sim.virtual_loop import run_virtual

THRESHOLD = 8000.0
PREFIX = 39 * 512  # 19,968 tokens: whole blocks
TAIL = 1000


async def _two_requests(
    profile: DeploymentProfile, regime: Regime, link_gbps: float | None = None
) -> tuple[SimCluster, list[tuple[RouteDecision, GenerateChunk, float]]]:
    """A 19,968-token prompt (to PrfaaS: > t, nothing cached), then the same plus 1,000 new
    tokens; returns each request's decision, last chunk and TTFT. With `link_gbps`, the
    schedulers' predictions (their loops off, the regime held) over a link measured at that
    capacity."""
    options = SimOptions(threshold=THRESHOLD, regime=regime)
    deployment = deployments(profile, plan(profile), options)["prfaas_pd"]
    cluster = SimCluster(profile, deployment, options)
    if link_gbps is not None:
        config = SchedulerConfig(short_term=False, long_term=False, conditional=False)
        scheduler = Scheduler(config, profile, cluster.router, cluster.instances)
        scheduler.observer.measured(LinkState(link_gbps * 1e9 / 8))
    rng = np.random.default_rng(0)
    first = tuple(rng.integers(100, 10_000, PREFIX).tolist())
    second = first + tuple(rng.integers(100, 10_000, TAIL).tolist())
    out = [await _one(cluster.router, f"r{i}", ids) for i, ids in enumerate((first, second))]
    return cluster, out


async def _one(
    router: Router, rid: str, ids: tuple[int, ...]
) -> tuple[RouteDecision, GenerateChunk, float]:
    loop = asyncio.get_running_loop()
    start, ttft = loop.time(), None
    routed = await router.dispatch(rid, ids, SamplingParams(max_new_tokens=4), stream=True)
    ttft = loop.time() - start
    last = routed.first
    while (chunk := await routed.next()) is not None:
        last = chunk
    routed.close()
    assert last is not None
    return routed.decision, last, ttft


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


def test_scarce_regime_keeps_the_request_where_the_prefix_is(profile: DeploymentProfile) -> None:
    """Bandwidth-scarce: PD caches nothing, so 20,968 uncached > t: PrfaaS, where affinity
    finds the prefix; nothing but the new KV crosses the link."""
    cluster, ((d1, _, _), (d2, last, _)) = run_virtual(_two_requests(profile, "bandwidth_scarce"))
    assert d1.route == d2.route == "prfaas"
    assert d2.prefill_instance == d1.prefill_instance
    assert d2.incremental_tokens == TAIL and last.cached_tokens == PREFIX
    assert sum(e.counters.prefix_fetches for e in cluster.prefill.values()) == 0


def test_abundant_regime_moves_the_prefix_to_pd(profile: DeploymentProfile) -> None:
    """Bandwidth-abundant: only 1,000 tokens are uncached anywhere (<= t), so PD prefills;
    the PD prefill instance pulls the 19,968-token prefix over the link first and computes
    only the tail: TTFT ~ T_h20(1,000) + fetch, far below T_h20(20,968)."""
    cluster, (_, (d2, last, ttft)) = run_virtual(_two_requests(profile, "bandwidth_abundant"))
    assert d2.route == "pd" and d2.prefix_transfer_from == "prfaas"
    assert d2.incremental_tokens == TAIL
    assert last.cached_tokens == PREFIX
    engine = cluster.prefill[d2.prefill_instance]
    assert engine.counters.prefix_fetches == 1
    pd_hw = profile.pd.hardware.prefill_seconds
    kv = profile.model.kv_bytes
    fetch_s = float(kv(PREFIX)) / (100e9 / 8) + SimOptions().link_delay_s  # the whole prefix
    expected = float(pd_hw(TAIL)) + fetch_s + 0.025  # plus one decode step
    assert ttft == pytest.approx(expected, rel=0.02)
    assert ttft < 0.5 * float(pd_hw(PREFIX + TAIL))


def test_abundant_regime_skips_a_pull_slower_than_the_recompute(
    profile: DeploymentProfile,
) -> None:
    """The same over a link measured at 0.1 Gbit/s: moving the 19,968-token prefix takes
    longer than computing it on the PD prefill, so nothing is pulled and the request is
    routed as in the scarce regime (to PrfaaS, where the prefix is)."""
    cluster, (_, (d2, last, _)) = run_virtual(
        _two_requests(profile, "bandwidth_abundant", link_gbps=0.1)
    )
    assert d2.pull is not None and not d2.pull.pays and d2.pull.tokens == PREFIX
    assert (d2.route, d2.prefix_transfer_from) == ("prfaas", None)
    assert last.cached_tokens == PREFIX  # affinity: the instance that caches it
    assert sum(e.counters.prefix_fetches for e in cluster.prefill.values()) == 0


def test_regime_option_is_validated() -> None:
    """An unknown regime is an error naming it."""
    with pytest.raises(ValueError, match="'bandwidth_infinite'"):
        replace(SimOptions(), regime="bandwidth_infinite")  # type: ignore[arg-type]
