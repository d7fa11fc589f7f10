"""A coordinated gateway that resigns (as its drain begins) stops deciding for good: over a
real etcd and null engines, the lone replica leads, then `Gateway.resign` gives up the
election key, the scheduler follows, and a conversion of its that comes back fenced later
(its hook called after the resignation) does not make it campaign again."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from etcd_helpers import EtcdServer
from gateway_helpers import Engines, GatewayFactory, deployment

from prfaas.coordination.config import CoordinationConfig
from prfaas.coordination.etcd import EtcdClient
from prfaas.gateway.scheduling.config import SchedulerConfig

PREFIX = "/prfaas/resign-test"


async def test_a_resigned_leader_never_campaigns_again(
    null_engines: Engines, gateway_factory: GatewayFactory, case_study_path: Path, etcd: EtcdServer
) -> None:
    config = replace(
        deployment(null_engines.urls),
        scheduler=SchedulerConfig(profile=str(case_study_path), tick_s=0.05),
        coordination=CoordinationConfig(
            etcd=etcd.url, prefix=PREFIX, lease_ttl_s=1.0, publish_s=0.25
        ),
    )
    _, gateway = await gateway_factory(config)
    assert gateway.scheduler is not None
    scheduler = gateway.scheduler
    client = EtcdClient([etcd.url], timeout_s=1.0)
    try:
        deadline = time.monotonic() + 10
        while not scheduler.leading:
            assert time.monotonic() < deadline, "the lone replica never led"
            await asyncio.sleep(0.05)
        assert await client.get(f"{PREFIX}/leader") is not None
        fenced = scheduler.long.on_fenced  # what a conversion in flight would call
        assert fenced is not None

        await gateway.resign()
        assert not scheduler.leading
        assert await client.get(f"{PREFIX}/leader") is None  # another may lead at once
        assert scheduler.long.on_fenced is None

        fenced()  # a conversion of its comes back fenced after the resignation
        await asyncio.sleep(2.5)  # past a lease TTL: a new campaign would have won by now
        assert await client.get(f"{PREFIX}/leader") is None
        assert not scheduler.leading
    finally:
        await client.close()
