"""Assembly of one gateway from a deployment config: registry, KV index, router, feeds.

`Gateway` owns every long-lived part of the request path and their background tasks;
`start`/`stop` bracket them (`GatewayApp` calls both around serving).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

import aiohttp
from prometheus_client.core import GaugeMetricFamily

from prfaas.common.tokenizer import load_tokenizer
from prfaas.engines.client import BaseEngineClient, Role
from prfaas.engines.sglang_client import SGLangClient, SGLangClientConfig
from prfaas.engines.vllm_client import VLLMClient, VLLMEndpoint
from prfaas.gateway.admission import AdmissionManager
from prfaas.gateway.api.activity import ActivityRecorder
from prfaas.gateway.api.completions import CompletionService
from prfaas.gateway.api.metrics import GatewayMetrics, egress_gauges, labelled_gauge
from prfaas.gateway.deployment import DeploymentConfig, InstanceConfig, ModelConfig
from prfaas.gateway.health import HealthMonitor
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_feed import KVEventFeed
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.gateway.link import EgressMonitor
from prfaas.gateway.router import Router, RoutingState
from prfaas.policies.registry import create_policy
from prfaas.policies.routing import Regime, Route
from prfaas.protocol.openai_request import ModelLimits

ROUTES: tuple[str, ...] = get_args(Route)
ROLES: tuple[str, ...] = get_args(Role)
REGIMES: tuple[str, ...] = get_args(Regime)


@dataclass
class Gateway:
    """Everything one gateway process routes with."""

    config: DeploymentConfig
    instances: InstanceManager
    index: KVIndexManager
    router: Router
    service: CompletionService
    feed: KVEventFeed
    health: HealthMonitor
    metrics: GatewayMetrics
    link: dict[str, Any] = field(default_factory=dict)
    """Describes the cross-cluster link for `/admin/state` (embedded deployment)."""
    activity: ActivityRecorder = field(init=False)
    """Recent requests, the timeline and decisions, for the dashboard."""

    def __post_init__(self) -> None:
        self.activity = ActivityRecorder(self.admin_state)

    async def start(self) -> None:
        """Poll health once (so the first request sees real state), then start the feeds."""
        await self.health.poll_once()
        self.feed.start()
        self.health.start()
        self.activity.start()

    async def stop(self) -> None:
        await self.activity.stop()
        await self.health.stop()
        await self.feed.stop()
        for state in self.instances:
            await state.client.close()

    def admin_state(self) -> dict[str, Any]:
        """JSON for `GET /admin/state`."""
        admission = self.service.admission
        return {
            "model": self.config.model.name,
            "policy": self.router.policy.name,
            "threshold": self.router.state.threshold,
            "regime": self.router.state.regime,
            "clusters": {
                cluster: [_instance_json(s) for s in self.instances if s.cluster == cluster]
                for cluster in ("prfaas", "pd")
            },
            "queue": {"running": admission.running, "waiting": admission.waiting},
            "kv_index": {"entries": len(self.index), "rejected": self.index.rejected_events},
            "link": self.link,
        }

    def gauges(self) -> list[GaugeMetricFamily]:
        """Gauges sampled for `/metrics` (link telemetry adds its own, `egress_setup`)."""
        adm = self.service.admission
        return [
            GaugeMetricFamily(
                "prfaas_threshold_tokens", "Current threshold t.", self.router.state.threshold
            ),
            GaugeMetricFamily("prfaas_queue_running", "Requests dispatched now.", adm.running),
            GaugeMetricFamily("prfaas_queue_waiting", "Requests waiting for a slot.", adm.waiting),
            labelled_gauge(
                "prfaas_instance_in_flight",
                "In-flight requests per instance.",
                ("instance", "cluster"),
                (((s.instance_id, s.cluster), s.in_flight) for s in self.instances),
            ),
            labelled_gauge(
                "prfaas_instance_healthy",
                "1 if the instance answers health checks.",
                ("instance",),
                (((s.instance_id,), 1.0 if s.healthy else 0.0) for s in self.instances),
            ),
            labelled_gauge(
                "prfaas_instances",
                "Healthy instances per cluster and role (the role split).",
                ("cluster", "role"),
                _role_counts(self.instances),
            ),
            labelled_gauge(
                "prfaas_bandwidth_regime",
                "1 for the routing regime in force, 0 for the other.",
                ("regime",),
                (((r,), 1.0 if r == self.router.state.regime else 0.0) for r in REGIMES),
            ),
            GaugeMetricFamily(
                "prfaas_kv_index_entries", "(instance, block) entries.", len(self.index)
            ),
        ]


def _role_counts(instances: InstanceManager) -> list[tuple[tuple[str, str], float]]:
    """Healthy instances per (cluster, role), every cluster and role listed (0 if none), so a
    role that empties reads 0 rather than vanishing."""
    counts = {(c, r): 0.0 for c in ROUTES for r in ROLES}
    for s in instances:
        if s.healthy:
            counts[s.cluster, s.role] += 1
    return list(counts.items())


def _instance_json(s: InstanceState) -> dict[str, Any]:
    url = s.client.base_url if isinstance(s.client, SGLangClient | VLLMClient) else None
    return {
        "id": s.instance_id,
        "role": s.role,
        "url": url,
        "healthy": s.healthy,
        "in_flight": s.in_flight,
        "queued": s.queued,
    }


def _client(
    cfg: InstanceConfig, model: ModelConfig, session: aiohttp.ClientSession
) -> BaseEngineClient:
    """The engine client of an instance, by its engine kind."""
    if cfg.engine == "vllm":
        host = cfg.bootstrap_address if cfg.role != "decode" else None
        endpoint = VLLMEndpoint(
            cfg.url, cfg.role, model.name, host, cfg.bootstrap_port, model.block_size
        )
        return VLLMClient(cfg.id, endpoint, session, SGLangClientConfig())
    return SGLangClient(cfg.id, cfg.url, session, SGLangClientConfig())


def _instance(
    cfg: InstanceConfig, model: ModelConfig, session: aiohttp.ClientSession
) -> InstanceState:
    client = _client(cfg, model, session)
    return InstanceState(
        instance_id=cfg.id,
        cluster=cfg.cluster,
        role=cfg.role,
        client=client,
        bootstrap_host=cfg.bootstrap_address if cfg.role != "decode" else None,
        bootstrap_port=cfg.bootstrap_port,
    )


def build_gateway(config: DeploymentConfig, session: aiohttp.ClientSession) -> Gateway:
    """Wire a gateway for `config`; engines are reached through `session` (caller owns it).

    Raises:
        ValueError: unknown policy or unusable tokenizer.
    """
    g, m = config.gateway, config.model
    instances = InstanceManager()
    for cfg in config.instances:
        instances.add(_instance(cfg, config.model, session))
    index = KVIndexManager(block_size=m.block_size, max_blocks=g.kv_index_max_blocks)
    metrics = GatewayMetrics()
    router = Router(instances, index, create_policy(g.policy), RoutingState(g.threshold, g.regime))
    service = CompletionService(
        router=router,
        tokenizer=load_tokenizer(m.tokenizer),
        limits=ModelLimits(m.name, m.context_length, m.vocab_size),
        admission=AdmissionManager(max_running=g.max_running, max_queued=g.max_queued),
        metrics=metrics,
        api_keys=frozenset(g.api_keys),
        retry_after_s=g.retry_after_s,
    )
    endpoints = {c.id: c.kv_events for c in config.instances if c.kv_events}
    vllm = frozenset(c.id for c in config.instances if c.engine == "vllm")
    feed = KVEventFeed(
        index, endpoints, lambda i, why: metrics.kv_resyncs.labels(i, why).inc(), vllm
    )
    health = HealthMonitor(
        instances, g.health_interval_s, on_down=lambda i: feed.resync(i, "instance_down")
    )
    gateway = Gateway(config, instances, index, router, service, feed, health, metrics)
    service.activity = gateway.activity
    metrics.add_gauges(gateway.gauges)
    return gateway


def egress_setup(static: Mapping[str, Any] | None = None) -> Callable[[Gateway], Awaitable[None]]:
    """A `serve_gateway(setup=...)` hook: poll the egress telemetry of every prefill-capable
    PrfaaS-cluster instance on the health cadence, publish it as the gateway's `link` state
    (with the `static` facts, e.g. the emulated rate) and as `/metrics` gauges."""

    async def setup(gateway: Gateway) -> None:
        urls = {
            s.instance_id: s.client.base_url
            for s in gateway.instances
            if s.cluster == "prfaas" and s.role != "decode" and isinstance(s.client, SGLangClient)
        }
        monitor = EgressMonitor(urls, static)
        gateway.link = monitor.state
        gateway.metrics.add_gauges(lambda: egress_gauges(monitor))
        gateway.health.add_poller(monitor)

    return setup
