"""The embedded default deployment of `prfaas serve` (no config file).

Starts three reference engines as child processes (PrfaaS cluster: one prefill; PD cluster:
one prefill, one decode), puts an emulated cross-DC link (paced rate, one-way delay) between
the PrfaaS prefill and the decode engine, profiles the engines, runs the planner to choose
`t`, and serves the gateway until SIGINT/SIGTERM, when everything stops, children included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from prfaas.engines.http_client import HttpEngineClient
from prfaas.gateway.config import DeploymentConfig, GatewayConfig, InstanceConfig, ModelConfig
from prfaas.gateway.engine_procs import EngineProcess, EngineSpec, free_port, start_engine
from prfaas.gateway.gateway import Gateway
from prfaas.gateway.link import LinkConfig, LinkEmulator
from prfaas.gateway.profiling import MeasuredProfile, Pair, Workload, measure, plan_threshold
from prfaas.gateway.server import serve_gateway, signals_cancel_current_task
from prfaas.gateway.summary import summary_lines

DEFAULT_LINK_MBPS = 10.0
DEFAULT_DELAY_MS = 5.0
ENGINE_MAX_BATCH = 32  # the engine CLI's default --max-batch
T_RANGE = (256.0, 4096.0)  # keep both routes in use for a newcomer's prompts


@dataclass(frozen=True)
class EmbeddedOptions:
    """What the embedded deployment takes from the command line."""

    model: str = "qwen3-next-tiny"
    link_mbps: float = DEFAULT_LINK_MBPS
    """Emulated PrfaaS egress, megabits per second."""
    link_delay_ms: float = DEFAULT_DELAY_MS
    page_size: int = 64
    threads: int = 1
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    threshold_override: float | None = None
    workload: Workload = field(default_factory=Workload)

    def __post_init__(self) -> None:
        if not self.link_mbps > 0:
            raise ValueError(f"link_mbps must be > 0, got {self.link_mbps}")
        if not 0 <= self.link_delay_ms <= 10_000:
            raise ValueError(f"link_delay_ms must be in [0, 10000], got {self.link_delay_ms}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, overrides: Mapping[str, Any]) -> EmbeddedOptions:
        gateway = replace(GatewayConfig(), **{k: v for k, v in overrides.items()})
        return cls(
            link_mbps=args.link_gbps * 1000 if args.link_gbps is not None else DEFAULT_LINK_MBPS,
            link_delay_ms=DEFAULT_DELAY_MS if args.link_delay_ms is None else args.link_delay_ms,
            gateway=gateway,
            threshold_override=overrides.get("threshold"),
        )

    @property
    def link(self) -> LinkConfig:
        return LinkConfig(self.link_mbps * 1e6 / 8, self.link_delay_ms / 1000)


@dataclass
class Cluster:
    """The started pieces, for cleanup."""

    engines: dict[str, EngineProcess]
    link: LinkEmulator | None = None


async def start_cluster(options: EmbeddedOptions, log_dir: Path) -> Cluster:
    """Start the three engines (concurrently) and the link in front of the PrfaaS prefill."""
    specs = [
        EngineSpec(name, role, options.model, options.page_size, options.threads, free_port())
        for name, role in (("prfaas-p0", "prefill"), ("pd-p0", "prefill"), ("pd-d0", "decode"))
    ]
    results = await asyncio.gather(
        *(start_engine(s, log_dir) for s in specs), return_exceptions=True
    )
    started = {r.spec.name: r for r in results if isinstance(r, EngineProcess)}
    cluster = Cluster(started)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await stop_cluster(cluster)
        raise failures[0]
    upstream = ("127.0.0.1", started["prfaas-p0"].bootstrap_port)
    cluster.link = LinkEmulator(upstream, options.link)
    await cluster.link.start()
    return cluster


async def stop_cluster(cluster: Cluster) -> None:
    if cluster.link is not None:
        await cluster.link.close()
    await asyncio.gather(*(e.stop() for e in cluster.engines.values()))


def deployment_for(
    cluster: Cluster, options: EmbeddedOptions, threshold: float
) -> DeploymentConfig:
    """The gateway's view: PrfaaS prefill reached (for KV) through the link's port."""
    e, link = cluster.engines, cluster.link
    assert link is not None
    instances = (
        InstanceConfig("prfaas-p0", "prfaas", "prefill", e["prfaas-p0"].url, "127.0.0.1",
                       link.port, e["prfaas-p0"].kv_events),
        InstanceConfig("pd-p0", "pd", "prefill", e["pd-p0"].url, "127.0.0.1",
                       e["pd-p0"].bootstrap_port, e["pd-p0"].kv_events),
        InstanceConfig("pd-d0", "pd", "decode", e["pd-d0"].url, kv_events=e["pd-d0"].kv_events),
    )  # fmt: skip
    model = ModelConfig(name=options.model, block_size=options.page_size)
    return DeploymentConfig(model, replace(options.gateway, threshold=threshold), instances)


async def profile_and_plan(cluster: Cluster, options: EmbeddedOptions) -> tuple[float, list[str]]:
    """Measure the engines, run the planner; returns `t` and summary lines."""
    e, link = cluster.engines, cluster.link
    assert link is not None
    async with aiohttp.ClientSession() as session:
        client = {n: HttpEngineClient(n, p.url, session) for n, p in e.items()}
        pd = Pair(client["pd-p0"], ("127.0.0.1", e["pd-p0"].bootstrap_port), client["pd-d0"])
        pf = Pair(client["prfaas-p0"], ("127.0.0.1", link.port), client["pd-d0"])
        measured = await measure(pd, pf, link, ENGINE_MAX_BATCH)
        for c in client.values():
            await c.close()
    planned, report = plan_threshold(measured, options.workload)
    t = min(max(planned, T_RANGE[0]), T_RANGE[1])
    lines = _profile_lines(measured)
    note = "" if t == planned else f" (planner said {planned:.0f}; clamped to {T_RANGE})"
    lines.append(
        f"  planner    t = {t:.0f} tokens{note}; Lambda_max {report.prfaas_pd.lambda_max:.2f} "
        f"req/s, bottleneck {report.prfaas_pd.bottleneck}"
    )
    return t, lines


def _profile_lines(m: MeasuredProfile) -> list[str]:
    cells = ", ".join(
        f"{n}: {p * 1000:.0f} ms / {k / 1e6:.2f} MB"
        for n, p, k in zip(m.lengths, m.prefill_s, m.kv_bytes, strict=True)
    )
    return [
        f"  profile    prefill latency / KV bytes by prompt tokens: {cells}",
        f"             decode step {m.decode_step_s * 1000:.1f} ms (measured at start-up)",
    ]


async def _telemetry(link: LinkEmulator, state: dict[str, Any], interval_s: float = 1.0) -> None:
    while True:
        rate = link.egress_rate()
        state["egress_bytes_per_s"] = rate
        state["egress_bytes_total"] = link.egress_bytes
        state["egress_utilisation"] = rate / link.config.rate_bytes_per_s
        await asyncio.sleep(interval_s)


async def serve_embedded(options: EmbeddedOptions, host: str, port: int) -> int:
    """Run the embedded deployment until a signal; returns an exit code."""
    log_dir = Path(tempfile.mkdtemp(prefix="prfaas-serve-"))
    print(f"starting 3 reference engines ({options.model}); logs in {log_dir}", flush=True)
    with signals_cancel_current_task():
        cluster = await start_cluster(options, log_dir)
    telemetry: asyncio.Task[None] | None = None
    try:
        assert cluster.link is not None
        if options.threshold_override is not None:
            t, lines = options.threshold_override, ["  planner    skipped (--threshold given)"]
        else:
            with signals_cancel_current_task():
                t, lines = await profile_and_plan(cluster, options)
        link_state: dict[str, Any] = {
            "rate_bytes_per_s": options.link.rate_bytes_per_s,
            "delay_s": options.link.delay_s,
            "relay_port": cluster.link.port,
        }
        telemetry = asyncio.get_running_loop().create_task(_telemetry(cluster.link, link_state))
        lines.insert(0, f"  link       {options.link_mbps:g} Mbit/s, {options.link_delay_ms:g} ms"
                        f" one-way (PrfaaS -> PD, relay :{cluster.link.port})")  # fmt: skip
        await serve_gateway(
            deployment_for(cluster, options, t),
            host,
            port,
            setup=_attach(link_state),
            on_ready=_printer(host, [*lines, f"  logs       {log_dir}"]),
        )
    finally:
        if telemetry is not None:
            telemetry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await telemetry
        await stop_cluster(cluster)
    return 0


def _attach(link_state: dict[str, Any]) -> Callable[[Gateway], Any]:
    async def setup(gateway: Gateway) -> None:
        gateway.link = link_state

    return setup


def _printer(host: str, extra: list[str]) -> Callable[[Gateway, int], None]:
    def ready(gateway: Gateway, port: int) -> None:
        print("\n".join(summary_lines(gateway, f"http://{host}:{port}", extra)), flush=True)

    return ready
