"""Wire the real gateway request path to simulated engines for one deployment.

`SimCluster` owns, on the running loop: the bootstrap rooms, the cross-cluster link (PrfaaS
prefill -> PD decode, `egress_gbps`, one-way delay) and the intra-cluster RDMA link (PD-P ->
PD-D), one `SimulatedPrefillEngine` per PrfaaS instance and one switchable
`SimulatedPDInstance` (prefill or decode, the role API the schedulers convert through) per
PD instance, registered in the gateway's real `InstanceManager`, the real `KVIndexManager`
fed by the simulated caches' KV events, and the real `Router` with the deployment's routing
policy. In the abundant regime (read from the Router's state at each request, so a
scheduler may switch it), a prefill instance pulls a longer prefix the other cluster caches.
Its engines compute on cores of their own, or share one machine's when the profile says its
engines did (`prfaas.sim.cores`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from prfaas.engine_clients.base import Role
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.gateway.router import RouteEvent, Router, RoutingState
from prfaas.policies.profile import DeploymentProfile, HardwareProfile
from prfaas.policies.registry import create_policy
from prfaas.policies.routing import Route
from prfaas.protocol.kv_events import KVEvent
from prfaas.sim.cache import SimPrefixCache
from prfaas.sim.cores import cores_for
from prfaas.sim.deployments import Deployment, SimOptions
from prfaas.sim.engines import (
    PrefillTiming,
    SimRooms,
    SimulatedDecodeEngine,
    SimulatedPrefillEngine,
)
from prfaas.sim.link import LinkConfig, SimLink
from prfaas.sim.pd_instance import SimulatedPDInstance


class SimCluster:
    """One deployment, simulated. Build inside the loop that will run it."""

    def __init__(
        self,
        profile: DeploymentProfile,
        deployment: Deployment,
        options: SimOptions,
        seed: int = 0,
        *,
        drain: bool = True,
    ) -> None:
        """`drain`: PD instances drain before switching roles (False: switch at once)."""
        loop = asyncio.get_running_loop()
        self.deployment, self.options = deployment, options
        self.rooms = SimRooms(loop)
        self.egress = self._egress_links(loop, deployment, options)
        self.ingress = SimLink(
            LinkConfig(deployment.egress_gbps, options.link_delay_s, "cross-cluster reverse"), loop
        )
        self.intra = SimLink(LinkConfig(options.intra_gbps, 0.0, "pd-rdma"), loop)
        self.cores = cores_for(profile.machine)
        self.index = KVIndexManager(block_size=options.block_size)
        self.instances = InstanceManager()
        self.prefill: dict[str, SimulatedPrefillEngine] = {}
        """Every prefill engine, PD instances' included whatever their current role."""
        self.pd: dict[str, SimulatedPDInstance] = {}
        self.route_events: list[RouteEvent] = []
        self._drain = drain
        self._add_prefills(profile, deployment)
        self._add_pd(profile, deployment)
        rooms = random.Random(seed)
        self.router = Router(
            instances=self.instances,
            index=self.index,
            policy=create_policy(deployment.policy),
            state=RoutingState(threshold=deployment.threshold, regime=options.regime),
            on_event=self.route_events.append,
            room_source=lambda: rooms.getrandbits(63),
        )

    @staticmethod
    def _egress_links(
        loop: asyncio.AbstractEventLoop, d: Deployment, options: SimOptions
    ) -> list[SimLink]:
        """One shared cross-cluster link, or one 1/N slice per PrfaaS instance."""
        if not (options.partition_egress and d.n_prfaas > 1):
            return [SimLink(LinkConfig(d.egress_gbps, options.link_delay_s, "cross-cluster"), loop)]
        share = LinkConfig(d.egress_gbps / d.n_prfaas, options.link_delay_s, "cross-cluster/N")
        return [SimLink(share, loop) for _ in range(d.n_prfaas)]

    @property
    def egress_bytes(self) -> float:
        """Bytes sent over the cross-cluster link so far."""
        return sum(link.bytes_sent for link in self.egress)

    def _add_prefills(self, profile: DeploymentProfile, d: Deployment) -> None:
        if d.n_prfaas:
            assert d.prfaas_hw is not None  # validated by Deployment
            for i in range(d.n_prfaas):
                link = self.egress[i % len(self.egress)]
                iid = f"prfaas-p{i}"
                engine = self._prefill_engine(iid, "prfaas", d.prfaas_hw, link, profile)
                self.instances.add(
                    InstanceState(iid, "prfaas", "prefill", engine, iid, 0, prefix_pull=True)
                )

    def _prefill_engine(
        self,
        iid: str,
        cluster: Route,
        hw: HardwareProfile,
        link: SimLink,
        profile: DeploymentProfile,
    ) -> SimulatedPrefillEngine:
        timing = PrefillTiming(hw.prefill_seconds, profile.model.kv_bytes, self.options.pipelined)
        cache = SimPrefixCache(self.options.block_size, self.options.cache_blocks)
        engine = SimulatedPrefillEngine(
            iid,
            timing=timing,
            link=link,
            cache=cache,
            rooms=self.rooms,
            publish=self._publish,
            pull_link=self._pull_link(cluster),
            cores=self.cores,
        )
        self.prefill[iid] = engine
        return engine

    def _add_pd(self, profile: DeploymentProfile, d: Deployment) -> None:
        """N_p instances starting as prefill (pd-p*), N_d as decode (pd-d*); each can switch."""
        hw = d.decode_hw
        assert hw.decode_batch_max is not None and hw.decode_step_seconds is not None
        layout: tuple[tuple[Role, str, int], ...] = (
            ("prefill", "pd-p", d.n_p),
            ("decode", "pd-d", d.n_d),
        )
        for role, prefix, count in layout:
            for i in range(count):
                iid = f"{prefix}{i}"
                prefill = self._prefill_engine(iid, "pd", d.pd_hw, self.intra, profile)
                decode = SimulatedDecodeEngine(
                    iid,
                    batch_max=hw.decode_batch_max,
                    step_s=hw.decode_step_seconds,
                    rooms=self.rooms,
                    page_size=self.options.block_size,
                    cores=self.cores,
                )
                instance = SimulatedPDInstance(
                    iid, role, prefill=prefill, decode=decode, publish=self._publish,
                    drain=self._drain,
                )  # fmt: skip
                self.pd[iid] = instance
                host, port = (iid, 0) if role == "prefill" else (None, None)
                self.instances.add(
                    InstanceState(iid, "pd", role, instance, host, port, prefix_pull=True)
                )

    def _pull_link(self, cluster: Route) -> SimLink:
        """The link a prefix pulled into `cluster` comes over: from PrfaaS to PD on the
        egress link, from PD to PrfaaS on the reverse direction."""
        return self.egress[0] if cluster == "pd" else self.ingress

    def _publish(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        if events:
            self.index.apply(instance_id, events)

    def prefills_in(self, cluster: Route) -> list[SimulatedPrefillEngine]:
        """The prefill engines of one cluster's instances that prefill now."""
        return [
            e
            for iid, e in self.prefill.items()
            if self.instances[iid].cluster == cluster
            and (iid not in self.pd or self.pd[iid].role == "prefill")
        ]

    def decodes(self) -> list[SimulatedDecodeEngine]:
        """The decode engines of the instances that decode now."""
        return [p.decode for p in self.pd.values() if p.role == "decode"]
