"""Assembly of one gateway from a deployment config: registry, KV index, router, feeds.

`Gateway` owns every long-lived part of the request path and their background tasks;
`start`/`stop` bracket them (`GatewayApp` calls both around serving).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prfaas.common.secret import DeploymentSecret
from prfaas.common.tokenizer import load_tokenizer
from prfaas.coordination.replica import CoordinationMetrics, Coordinator
from prfaas.engine_clients.base import BaseEngineClient, Role
from prfaas.engine_clients.sglang import SGLangClient, SGLangClientConfig
from prfaas.engine_clients.vllm import VLLMClient, VLLMEndpoint
from prfaas.gateway.admission import AdmissionManager
from prfaas.gateway.api.activity import ActivityRecorder
from prfaas.gateway.api.completions import CompletionService
from prfaas.gateway.api.metrics import GatewayMetrics, egress_gauges, labelled_gauge
from prfaas.gateway.deployment import (
    MAP_EVENTS,
    DeploymentConfig,
    GatewayConfig,
    InstanceConfig,
    ModelConfig,
)
from prfaas.gateway.health import HealthMonitor, HealthPolicy
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_feed import KVEventFeed
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.gateway.link import EgressMonitor
from prfaas.gateway.responses.service import ResponsesService, create_event_log, create_store
from prfaas.gateway.router import RetryPolicy, Router, RoutingState
from prfaas.gateway.scheduling.decisions import SchedulerCounters
from prfaas.gateway.scheduling.scheduler import Scheduler
from prfaas.gateway.scheduling.short_term import LinkReader
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.policies.registry import create_policy
from prfaas.policies.routing import Regime, Route
from prfaas.policies.schedule_state import ScheduleState
from prfaas.policies.ttft_forecast import LinkState
from prfaas.protocol.openai_request import ModelLimits, OpenAIMode

logger = logging.getLogger(__name__)
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
    session: aiohttp.ClientSession
    token: str | None = None
    """The deployment's control token the engine clients send (None: engines are open)."""
    link: dict[str, Any] = field(default_factory=dict)
    """Describes the cross-cluster link for `/admin/state` (embedded deployment)."""
    scheduler: Scheduler | None = None
    """Dual-timescale scheduling, when the deployment asks for it."""
    coordinator: Coordinator | None = None
    """This replica's part among several (`[coordination]`), when the deployment has it."""
    egress: EgressMonitor | None = None
    activity: ActivityRecorder = field(init=False)
    """Recent requests, the timeline and decisions, for the dashboard."""

    def __post_init__(self) -> None:
        self.activity = ActivityRecorder(self.admin_state)

    async def start(self) -> None:
        """Poll health once (so the first request sees real state), start the feeds and
        wait for their catch-up (what running engines cache already: bounded by
        `kv_sync_timeout_s`, after which routing starts without the late ones), then start
        the schedulers."""
        await self.health.poll_once()
        self.feed.start()
        late = await self.feed.synced(self.config.gateway.kv_sync_timeout_s)
        if late:
            logger.warning("no KV cache snapshot from %s in time: routing without it for now",
                           ", ".join(late))  # fmt: skip
        self.health.start()
        self.activity.start()
        if self.scheduler is not None:
            self.scheduler.start()
        if self.coordinator is not None:
            self.coordinator.start()

    async def resign(self) -> None:
        """Stop coordinating for good (a leader resigns: another leads during the drain)."""
        coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            await coordinator.stop()

    async def stop(self) -> None:
        await self.resign()
        if self.scheduler is not None:
            await self.scheduler.stop()
        await self.activity.stop()
        await self.health.stop()
        await self.feed.stop()
        await self.router.cancel_exports()
        for state in self.instances:
            await state.client.close()
        if self.service.responses is not None:
            await self.service.responses.close()

    async def relocate(
        self,
        instance_id: str,
        url: str,
        bootstrap_port: int | None,
        kv_events: str | None,
        kv_events_replay: str | None = None,
    ) -> None:
        """An engine came back (a restart, on its old addresses or new ones): point the
        instance's client, bootstrap address, KV-event subscription (and its replay
        endpoint) and egress polling at them. Its index entries are dropped, then rebuilt
        from its snapshot (what it cached before the subscription joined)."""
        state = self.instances[instance_id]
        old = state.client
        config = _client_config(self.config.gateway)
        if isinstance(old, VLLMClient):  # a vLLM instance without a KV sender keeps none
            if state.bootstrap_port is None:
                bootstrap_port = None
            port = old.endpoint.bootstrap_port if bootstrap_port is None else bootstrap_port
            endpoint = dataclasses.replace(old.endpoint, base_url=url, bootstrap_port=port)
            state.client = VLLMClient(instance_id, endpoint, self.session, config, self.token)
        else:
            sglang = isinstance(old, SGLangClient) and old.sglang_server
            state.client = SGLangClient(instance_id, url, self.session, config, self.token,
                                        sglang_server=sglang)  # fmt: skip
        if bootstrap_port is not None:
            state.bootstrap_port = bootstrap_port
        if kv_events is not None:
            self.feed.resubscribe(instance_id, kv_events, kv_events_replay)
        else:
            self.feed.resync(instance_id, "restart")
        if self.egress is not None:
            self.egress.relocate(instance_id, url)
        await old.close()

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
            "kv_index": {
                "entries": len(self.index),
                "bytes": self.index.nbytes,
                "evicted_entries": self.index.evicted_entries,
                "rejected": self.index.rejected_events,
            },
            "link": self.link,
            "scheduler": None if self.scheduler is None else self.scheduler.to_json(),
            "coordination": None if self.coordinator is None else self.coordinator.to_json(),
        }

    def gauges(self) -> list[Metric]:
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
                "1 if requests are routed to the instance (not ejected, not draining).",
                ("instance",),
                (((s.instance_id,), 1.0 if s.healthy else 0.0) for s in self.instances),
            ),
            _ejections(self.instances),
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
            GaugeMetricFamily(
                "prfaas_kv_index_bytes", "Bytes the KV index's tables hold.", self.index.nbytes
            ),
            CounterMetricFamily(
                "prfaas_kv_index_evicted_entries",
                "(instance, block) entries forgotten at the byte budget (kv_index_max_mb).",
                self.index.evicted_entries,
            ),
            CounterMetricFamily(
                "prfaas_kv_index_rejected_events",
                "Engine events the KV index ignored (each reason logged once per instance): "
                "blocks keyed by what it does not read (a LoRA adapter, a multimodal input), "
                "a block size or token count that does not fit, an unknown parent.",
                self.index.rejected_events,
            ),
            _prefix_pulls(self.router.prefix_pulls),
        ]


def _ejections(instances: InstanceManager) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "prfaas_instance_ejections", "Times an instance was ejected.", labels=["instance"]
    )
    for s in instances:
        family.add_metric([s.instance_id], s.ejections)
    return family


def _prefix_pulls(pulls: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "prfaas_prefix_pulls",
        "Cached prefixes pulled across clusters (bandwidth-abundant regime), by result.",
        labels=["result"],
    )
    for result, n in pulls.items():
        family.add_metric([result], n)
    return family


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
        "bootstrap_port": s.bootstrap_port,
        "healthy": s.healthy,
        "status": s.status,
        "draining": s.draining,
        "ejections": s.ejections,
        "in_flight": s.in_flight,
        "queued": s.queued,
    }


def _client_config(g: GatewayConfig) -> SGLangClientConfig:
    return SGLangClientConfig(health_timeout_s=g.health_timeout_s)


def _client(
    cfg: InstanceConfig,
    model: ModelConfig,
    session: aiohttp.ClientSession,
    g: GatewayConfig,
    token: str | None,
) -> BaseEngineClient:
    """The engine client of an instance, by its engine kind (each gets the deployment's
    control token)."""
    if cfg.engine == "vllm":
        host = cfg.bootstrap_address if cfg.bootstrap_port is not None else None
        endpoint = VLLMEndpoint(
            cfg.url, cfg.role, model.name, host, cfg.bootstrap_port, model.block_size
        )
        return VLLMClient(cfg.id, endpoint, session, _client_config(g), token)
    return SGLangClient(cfg.id, cfg.url, session, _client_config(g), token,
                        sglang_server=cfg.engine == "sglang")  # fmt: skip


def _instance(
    cfg: InstanceConfig,
    model: ModelConfig,
    session: aiohttp.ClientSession,
    g: GatewayConfig,
    token: str | None,
) -> InstanceState:
    client = _client(cfg, model, session, g, token)
    has_bootstrap = cfg.bootstrap_port is not None
    return InstanceState(
        instance_id=cfg.id,
        cluster=cfg.cluster,
        role=cfg.role,
        client=client,
        bootstrap_host=cfg.bootstrap_address if has_bootstrap else None,
        bootstrap_port=cfg.bootstrap_port,
    )


def build_gateway(
    config: DeploymentConfig,
    session: aiohttp.ClientSession,
    secret: DeploymentSecret | None = None,
    profile: DeploymentProfile | None = None,
    replica_id: str | None = None,
) -> Gateway:
    """Wire a gateway for `config`; engines are reached through `session` (caller owns it)
    with the control token of `secret` (None: the engines are open). With a `[scheduler]`
    table the schedulers run on `profile` (e.g. `prfaas serve`'s measured one), else on the
    file the table names. With `[coordination]` too, this gateway is the replica
    `replica_id` (None: HOSTNAME:PID) of several that share one leader.

    Raises:
        ValueError: unknown policy, unusable tokenizer, or a scheduler without a profile
            (ConfigError for an invalid profile file).
    """
    g, m = config.gateway, config.model
    token = secret.control_token() if secret is not None else None
    instances = InstanceManager()
    for cfg in config.instances:
        instances.add(_instance(cfg, config.model, session, g, token))
    index = KVIndexManager(block_size=m.block_size, max_index_mb=g.kv_index_max_mb)
    metrics = GatewayMetrics()
    tokenizer = load_tokenizer(m.tokenizer)
    router = Router(
        instances,
        index,
        create_policy(g.policy),
        RoutingState(g.threshold, g.regime),
        on_event=metrics.route_event,
        retry=RetryPolicy(g.max_retries, g.max_migrations, g.retry_wait_s),
        detokenize=tokenizer.decode,
    )
    store = create_store(config.responses)
    service = CompletionService(
        router=router,
        tokenizer=tokenizer,
        limits=ModelLimits(m.name, m.context_length, m.vocab_size),
        admission=AdmissionManager(
            max_running=g.max_running, max_queued=g.max_queued, queue_timeout_s=g.queue_timeout_s
        ),
        metrics=metrics,
        api_keys=frozenset(g.api_keys),
        responses=ResponsesService(
            store,
            metrics.response_store_errors.inc,
            cancel_poll_s=config.responses.cancel_poll_s,
            events=create_event_log(config.responses, store),
        ),
        retry_after_s=g.retry_after_s,
        mode=openai_mode(config),
    )
    endpoints = {c.id: c.kv_events for c in config.instances if c.kv_events}
    replay = {c.id: c.kv_events_replay for c in config.instances if c.kv_events_replay}
    map_events = frozenset(c.id for c in config.instances if c.engine in MAP_EVENTS)
    feed = KVEventFeed(
        index,
        endpoints,
        lambda i, why: metrics.kv_resyncs.labels(i, why).inc(),
        map_events,
        replay,
        g.kv_sync_timeout_s,
    )
    policy = HealthPolicy(g.health_interval_s, g.eject_after, g.readmit_after)
    health = HealthMonitor(instances, policy, on_restart=feed.restarted)
    gateway = Gateway(
        config, instances, index, router, service, feed, health, metrics, session, token
    )
    service.activity = gateway.activity
    metrics.add_gauges(gateway.gauges)
    if config.scheduler is not None:
        sched = config.scheduler
        if profile is None and sched.profile is None:
            raise ValueError('[scheduler] needs a planner profile: profile = "profile.toml"')
        chosen = profile if profile is not None else load_profile(str(sched.profile))
        counters = SchedulerCounters(metrics.registry)
        gateway.scheduler = Scheduler(sched, chosen, router, instances, counters)
        metrics.add_gauges(gateway.scheduler.gauges)
        gateway.scheduler.board.listeners.append(_dashboard_reporter(gateway))
    if config.coordination is not None and not config.responses.shared:
        logger.warning("[coordination] with the memory response store: a Responses follow-up "
                       "that reaches another replica is answered 404 (share a Redis store: "
                       "[responses] store = \"redis://...\")")  # fmt: skip
    if config.coordination is not None:
        if gateway.scheduler is None:
            logger.warning("[coordination] without a scheduler: this replica runs alone")
        else:
            name = replica_id or f"{socket.gethostname()}:{os.getpid()}"
            gateway.coordinator = Coordinator(
                config.coordination,
                name,
                gateway.scheduler,
                CoordinationMetrics(metrics.registry),
            )
    return gateway


def openai_mode(config: DeploymentConfig) -> OpenAIMode:
    """`forward` when every engine is a vLLM server (their own OpenAI servers answer the
    client's body), else `generate` (reference engines and SGLang servers: `/generate` for
    what it expresses, their own OpenAI routes for the rest)."""
    engines = {c.engine for c in config.instances}
    return "forward" if engines == {"vllm"} else "generate"


def _dashboard_reporter(gateway: Gateway) -> Callable[[ScheduleState], None]:
    """A decision-board listener: each change of `t`, regime or roles becomes a dashboard
    decision, with the loop that made it as its source."""
    assert gateway.scheduler is not None
    previous = [gateway.scheduler.board.state]

    def report(new: ScheduleState) -> None:
        old, previous[0] = previous[0], new
        source, _, reason = new.cause.partition(": ")
        record = gateway.activity.decision
        if new.threshold != old.threshold:
            record("threshold", reason, old.threshold, new.threshold, source.replace("-", "_"))
        if new.regime != old.regime:
            record("regime", reason, old.regime, new.regime, source.replace("-", "_"))
        if new.roles != old.roles:
            record("roles", reason, old.role_map(), new.role_map(), source.replace("-", "_"))

    return report


def monitor_link(monitor: EgressMonitor) -> LinkReader:
    """The egress monitor's latest sums as the schedulers' link measurement (None until an
    instance reports a capacity)."""

    def read() -> LinkState | None:
        state = monitor.state
        capacity = state.get("capacity_bytes_per_s")
        if not capacity:
            return None
        return LinkState(
            capacity_bytes_per_s=float(capacity),
            egress_bytes_per_s=float(state.get("egress_bytes_per_s") or 0.0),
            active_transfers=int(state.get("active_transfers") or 0),
        )

    return read


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
        token = gateway.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        monitor = EgressMonitor(urls, static, headers)
        gateway.link, gateway.egress = monitor.state, monitor
        gateway.metrics.add_gauges(lambda: egress_gauges(monitor))
        gateway.health.add_poller(monitor)
        if gateway.scheduler is not None:
            gateway.scheduler.attach_link(monitor_link(monitor))

    return setup
