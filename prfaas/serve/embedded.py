"""The embedded default deployment of `prfaas serve` (no config file).

Starts three reference engines as child processes (PrfaaS cluster: one prefill; PD cluster:
one prefill, one decode; `--pd-decodes N` gives the PD cluster N decodes, so that the
long-term loop has an instance to convert). The cross-DC link is emulated by the PrfaaS
prefill engine's own KV transport: its whole egress is paced to the link rate (a per-process
token bucket: one cluster egress link shared by every decode peer) with an added one-way
delay, so KV goes engine to engine and never through the gateway; `POST /admin/egress` on
that engine changes the rate at run time. Profiles the engines (the link's bandwidth
measured over that transport; `--profile FILE` takes a recorded profile instead), runs the
planner to choose `t`, runs the dual-timescale schedulers on that profile, polls the
transport's telemetry for `/metrics` and `/admin/state`, restarts an engine that dies
(`supervisor.Supervisor`), and serves until SIGINT/SIGTERM, when everything stops, children
included. The engines and the gateway share a deployment secret (`$PRFAAS_SECRET` when set,
else a fresh one) that the engines get in their environment.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import tomli_w

from prfaas.common.ports import free_port
from prfaas.common.secret import ENV_SECRET, DeploymentSecret
from prfaas.engine_clients.base import Role
from prfaas.engine_clients.sglang import SGLangClient
from prfaas.gateway.api.assembly import Gateway, egress_setup
from prfaas.gateway.deployment import DeploymentConfig, GatewayConfig, InstanceConfig, ModelConfig
from prfaas.gateway.link import EgressSample, fetch_sample
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.policies.routing import Route
from prfaas.policies.workload_estimate import EstimateConfig
from prfaas.serve.processes import EngineProcess, EngineSpec, start_engine
from prfaas.serve.profiling import (
    SHARED_LENGTH,
    MeasuredProfile,
    Pair,
    Workload,
    measure,
    measured_profile,
    profile_document,
    profile_threshold,
)
from prfaas.serve.run import serve_gateway, setups, signals_cancel_current_task
from prfaas.serve.summary import summary_lines
from prfaas.serve.supervisor import Supervisor, restart_policy

DEFAULT_LINK_MBPS = 10.0
DEFAULT_DELAY_MS = 5.0
ENGINE_MAX_BATCH = 32  # the engine CLI's default --max-batch
T_RANGE = (256.0, 4096.0)
"""The start-up set-point's range: a newcomer's first prompts see both routes. The
schedulers then move it from `T_RANGE[0]` up as far as the planner says (a cap of 4096 held
the set-point on the steep, link-bound side of Lambda_max when prompts grew: 0.98 req/s
there against 1.61 at the optimum, 4,800, on the live scenario's longer-prompt phase)."""
MAX_PD_DECODES = 4
LINK_CHUNK_KIB = 64  # frame size = pacing burst: small, so a slow link is paced smoothly
SCHEDULER_PERIOD_S = 30.0  # long-term period of the embedded deployment


def default_scheduler() -> SchedulerConfig:
    """The embedded deployment's schedulers: set-points from `T_RANGE[0]` up; a handful of
    requests per period is enough to re-plan on (a laptop's load is light). Offloads are
    conditional, as in any deployment: both clusters run on this same CPU and the emulated
    link is slow, so at light load a long prompt stays local (its KV would take longer to
    cross than the PD prefill takes to compute it), and offloads begin once the PD prefill
    is saturated, where the threshold governs."""
    return SchedulerConfig(
        period_s=SCHEDULER_PERIOD_S,
        min_threshold=T_RANGE[0],
        estimate=EstimateConfig(min_samples=5.0),
    )


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
    scheduler: SchedulerConfig | None = field(default_factory=default_scheduler)
    """Dual-timescale scheduling on the measured (or recorded) profile (None: off; also off
    when `--threshold` skips the profiling)."""
    profile_out: Path | None = None
    """Where to write the measured profile (TOML; None: nowhere)."""
    recorded: DeploymentProfile | None = None
    """A profile measured before (`--profile`: what `--profile-out` wrote) to plan and
    schedule on, in place of start-up profiling (None: measure). Deployments compared with
    each other share one profile so that only what is compared differs: start-up's
    shared-cores factor scatters from one start to the next."""
    pd_decodes: int = 1
    """The PD cluster's decode instances (with two or more the long-term loop can convert
    one to prefill; one is the least a cluster keeps)."""

    def __post_init__(self) -> None:
        if not 1 <= self.pd_decodes <= MAX_PD_DECODES:
            raise ValueError(f"pd_decodes must be in [1, {MAX_PD_DECODES}], got {self.pd_decodes}")
        if not self.link_mbps > 0:
            raise ValueError(f"link_mbps must be > 0, got {self.link_mbps}")
        if not 0 <= self.link_delay_ms <= 10_000:
            raise ValueError(f"link_delay_ms must be in [0, 10000], got {self.link_delay_ms}")
        if self.profile_out is not None and self.threshold_override is not None:
            raise ValueError("--profile-out: --threshold skips the start-up profiling, so "
                             "there is no profile to write")  # fmt: skip
        if self.recorded is not None:
            if self.threshold_override is not None or self.profile_out is not None:
                raise ValueError("--profile: a recorded profile replaces the start-up "
                                 "profiling, so it takes neither --threshold nor "
                                 "--profile-out")  # fmt: skip
            self._check_recorded(self.recorded)

    def _check_recorded(self, profile: DeploymentProfile) -> None:
        """A recorded profile fits this deployment's clusters and the planner finds a `t`
        on it, so that a bad one is refused before any engine starts."""
        sizes = {"PrfaaS": (profile.prfaas.instances, 1),
                 "PD": (profile.pd.instances, self.pd_instances)}  # fmt: skip
        for name, (recorded, running) in sizes.items():
            if recorded != running:
                raise ValueError(f"--profile {profile.source}: its {name} cluster has "
                                 f"{recorded} instances, this deployment {running} (PD: one "
                                 "prefill and --pd-decodes decodes)")  # fmt: skip
        profile_threshold(profile)

    @classmethod
    def from_args(cls, args: argparse.Namespace, overrides: Mapping[str, Any]) -> EmbeddedOptions:
        gateway = replace(GatewayConfig(), **{k: v for k, v in overrides.items()})
        scheduler: SchedulerConfig | None = None
        if not args.no_scheduler:
            period = args.scheduler_period
            scheduler = default_scheduler()
            if period is not None:
                scheduler = replace(scheduler, period_s=period)
        return cls(
            link_mbps=args.link_gbps * 1000 if args.link_gbps is not None else DEFAULT_LINK_MBPS,
            link_delay_ms=DEFAULT_DELAY_MS if args.link_delay_ms is None else args.link_delay_ms,
            gateway=gateway,
            threshold_override=overrides.get("threshold"),
            scheduler=scheduler,
            profile_out=None if args.profile_out is None else Path(args.profile_out),
            recorded=None if args.profile is None else load_profile(args.profile),
            pd_decodes=args.pd_decodes,
        )

    def link_args(self) -> tuple[str, ...]:
        """`prfaas engine` flags that make the PrfaaS prefill's transport the link."""
        return ("--egress-rate-mbps", f"{self.link_mbps:g}",
                "--egress-delay-ms", f"{self.link_delay_ms:g}",
                "--transfer-chunk-kib", str(LINK_CHUNK_KIB))  # fmt: skip

    def engines(self) -> list[tuple[str, Route, Role]]:
        """(name, cluster, role) of each engine: the PrfaaS prefill (`prfaas-p0`, which paces
        the link), the PD prefill (`pd-p0`), the PD decodes (`pd-d0`, ...)."""
        decodes: list[tuple[str, Route, Role]] = [
            (f"pd-d{i}", "pd", "decode") for i in range(self.pd_decodes)
        ]
        return [("prfaas-p0", "prfaas", "prefill"), ("pd-p0", "pd", "prefill"), *decodes]

    @property
    def pd_instances(self) -> int:
        return 1 + self.pd_decodes

    def link_state(self) -> dict[str, Any]:
        """The emulated link's settings, for `/admin/state`."""
        return {
            "emulated_rate_bytes_per_s": self.link_mbps * 1e6 / 8,
            "delay_s": self.link_delay_ms / 1000,
            "paced_by": "prfaas-p0 KV transport (per-process token bucket)",
        }


@dataclass
class Cluster:
    """The started pieces, for cleanup, and the deployment secret they hold."""

    engines: dict[str, EngineProcess]
    secret: DeploymentSecret

    @property
    def env(self) -> dict[str, str]:
        """What an engine of this cluster gets in its environment."""
        return {ENV_SECRET: self.secret.hex()}


async def start_cluster(
    options: EmbeddedOptions, log_dir: Path, secret: DeploymentSecret | None = None
) -> Cluster:
    """Start the engines concurrently; the PrfaaS prefill paces its own egress."""
    secret = secret or DeploymentSecret.from_env() or DeploymentSecret.generate()
    env = {ENV_SECRET: secret.hex()}
    specs = [
        EngineSpec(name, role, options.model, options.page_size, options.threads, free_port(),
                   options.link_args() if name == "prfaas-p0" else (),
                   kv_replay_port=free_port())
        for name, _, role in options.engines()
    ]  # fmt: skip
    results = await asyncio.gather(
        *(start_engine(s, log_dir, env=env) for s in specs), return_exceptions=True
    )
    started = {r.spec.name: r for r in results if isinstance(r, EngineProcess)}
    cluster = Cluster(started, secret)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await stop_cluster(cluster)
        raise failures[0]
    return cluster


async def stop_cluster(cluster: Cluster) -> None:
    await asyncio.gather(*(e.stop() for e in cluster.engines.values()))


def deployment_for(
    cluster: Cluster,
    options: EmbeddedOptions,
    threshold: float,
    scheduler: SchedulerConfig | None = None,
) -> DeploymentConfig:
    """The gateway's view: every engine at its own HTTP and bootstrap address."""
    e = cluster.engines
    instances = tuple(
        InstanceConfig(name, kind, role, e[name].url, "127.0.0.1", e[name].bootstrap_port,
                       e[name].kv_events, kv_events_replay=e[name].kv_events_replay)
        for name, kind, role in options.engines()
    )  # fmt: skip
    model = ModelConfig(name=options.model, block_size=options.page_size)
    gateway = replace(options.gateway, threshold=threshold)
    return DeploymentConfig(model, gateway, instances, scheduler=scheduler)


async def profile_and_plan(
    cluster: Cluster, options: EmbeddedOptions
) -> tuple[float, list[str], DeploymentProfile]:
    """Measure the engines, run the planner; returns `t`, summary lines and the measured
    profile (the schedulers' predictions and re-solves use it), written to
    `options.profile_out` when set."""
    e, token = cluster.engines, cluster.secret.control_token()
    async with aiohttp.ClientSession() as session:
        client = {n: SGLangClient(n, p.url, session, token=token) for n, p in e.items()}
        pd = Pair(client["pd-p0"], ("127.0.0.1", e["pd-p0"].bootstrap_port), client["pd-d0"])
        pf = Pair(client["prfaas-p0"], ("127.0.0.1", e["prfaas-p0"].bootstrap_port),
                  client["pd-d0"])  # fmt: skip

        def stats() -> Awaitable[EgressSample]:
            return fetch_sample(session, e["prfaas-p0"].url, client["prfaas-p0"].auth_headers)

        measured = await measure(pd, pf, stats, ENGINE_MAX_BATCH)
        for c in client.values():
            await c.close()
    profile = measured_profile(measured, options.workload, options.pd_instances)
    lines = _profile_lines(measured)
    if options.profile_out is not None:
        document = profile_document(measured, options.workload, options.pd_instances)
        options.profile_out.write_text(tomli_w.dumps(document))
        lines.append(f"             written to {options.profile_out}")
    t, planner = _planned(profile)
    return t, [*lines, planner], profile


def recorded_plan(profile: DeploymentProfile) -> tuple[float, list[str]]:
    """`t` from a profile recorded before (no profiling), and the summary lines."""
    t, planner = _planned(profile)
    link = profile.prfaas.egress_gbps
    machine = profile.machine
    said = [] if link is None else [f"link {link * 1000:.2f} Mbit/s"]
    if machine is not None:
        said.append(f"sharing the cores x{machine.shared_slowdown:.2f}")
    what = f"; {', '.join(said)}" if said else ""
    return t, [f"  profile    recorded: {profile.source} (not measured at this start{what})",
               planner]  # fmt: skip


def _planned(profile: DeploymentProfile) -> tuple[float, str]:
    """The planner's `t` for `profile`, clamped to `T_RANGE`, and its summary line."""
    planned, report = profile_threshold(profile)
    t = min(max(planned, T_RANGE[0]), T_RANGE[1])
    note = "" if t == planned else f" (planner said {planned:.0f}; clamped to {T_RANGE})"
    best = report.prfaas_pd
    return t, (f"  planner    t = {t:.0f} tokens{note}; Lambda_max {best.lambda_max:.2f} req/s, "
               f"bottleneck {best.bottleneck}")  # fmt: skip


def _profile_lines(m: MeasuredProfile) -> list[str]:
    cells = ", ".join(
        f"{n}: {p * 1000:.0f} ms / {k / 1e6:.2f} MB"
        for n, p, k in zip(m.lengths, m.prefill_s, m.kv_bytes, strict=True)
    )
    return [
        f"  profile    prefill latency (alone) / KV bytes by prompt tokens: {cells}",
        f"             decode step {m.decode_step_s * 1000:.1f} ms (alone, measured at start-up)",
        f"             sharing the cores: x{m.shared_slowdown:.2f} (a {SHARED_LENGTH}-token PD "
        "prefill while the PrfaaS prefill and the decode work; the profile's times include it)",
        f"             link {m.link_bytes_per_s * 8 / 1e6:.2f} Mbit/s (measured: a cached "
        "prompt's KV over the paced transport)",
    ]


async def serve_embedded(options: EmbeddedOptions, host: str, port: int) -> int:
    """Run the embedded deployment until a signal; returns an exit code."""
    log_dir = Path(tempfile.mkdtemp(prefix="prfaas-serve-"))
    count = len(options.engines())
    print(f"starting {count} reference engines ({options.model}); logs in {log_dir}", flush=True)
    secret = DeploymentSecret.from_env(path=options.gateway.secret_file)
    with signals_cancel_current_task():
        cluster = await start_cluster(options, log_dir, secret)
    policy = restart_policy(options.gateway)
    supervisor = Supervisor(cluster.engines, log_dir, cluster.env, policy)
    supervisor.start()
    try:
        profile: DeploymentProfile | None = None
        if options.threshold_override is not None:
            t, lines = options.threshold_override, ["  planner    skipped (--threshold given)"]
        elif options.recorded is not None:
            profile = options.recorded
            t, lines = recorded_plan(profile)
        else:
            with signals_cancel_current_task():
                t, lines, profile = await profile_and_plan(cluster, options)
        scheduler = options.scheduler if profile is not None else None
        lines.append(_scheduler_line(scheduler, recorded=options.recorded is not None))
        lines.insert(0, f"  link       {options.link_mbps:g} Mbit/s, {options.link_delay_ms:g} ms"
                        " one-way (PrfaaS -> PD, paced by prfaas-p0's KV transport)")  # fmt: skip
        await serve_gateway(
            deployment_for(cluster, options, t, scheduler),
            host,
            port,
            setup=setups(egress_setup(options.link_state()), supervisor.attach),
            on_ready=_printer(host, [*lines, f"  logs       {log_dir}"]),
            profile=profile,
            secret=cluster.secret,
        )
    finally:
        await supervisor.stop()
    return 0


def _scheduler_line(scheduler: SchedulerConfig | None, *, recorded: bool) -> str:
    if scheduler is None:
        return "  scheduler  off (t and PD roles move only by POST /admin/state)"
    which = "recorded" if recorded else "measured"
    return (
        f"  scheduler  dual-timescale on the {which} profile: tick {scheduler.tick_s:g} s, "
        f"period {scheduler.period_s:g} s (GET /admin/state shows its decisions)"
    )


def _printer(host: str, extra: list[str]) -> Callable[[Gateway, int], None]:
    def ready(gateway: Gateway, port: int) -> None:
        print("\n".join(summary_lines(gateway, f"http://{host}:{port}", extra)), flush=True)

    return ready
