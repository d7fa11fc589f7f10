"""Deployment configuration: one TOML file -> frozen, validated dataclasses.

```toml
[model]                      # what is served
name = "qwen3-next-tiny"
tokenizer = "byte-level"     # or a directory with tokenizer.json
context_length = 8192
block_size = 64              # the engines' page size: KV-index block

[gateway]                    # optional; defaults shown in GatewayConfig
policy = "prfaas"
threshold = 1024
regime = "bandwidth_scarce"
api_keys = []               # clients' keys
admin_keys = []             # operators' keys for /admin/* (distinct from api_keys)
# secret_file = "secret.hex" # deployment secret shared with the engines
# drain_timeout_s = 30.0     # on SIGTERM: how long requests in flight may finish

[[instances]]                # running engines, and/or ...
id = "prfaas-p0"
engine = "reference"         # reference (our engine) | sglang (an SGLang server) | vllm
cluster = "prfaas"           # prfaas | pd
role = "prefill"             # prefill | decode | both
url = "http://127.0.0.1:30000"
bootstrap_port = 8998        # prefill instances: where decode fetches KV
kv_events = "tcp://127.0.0.1:5557"   # optional ZMQ KV event publisher
kv_events_replay = "tcp://127.0.0.1:5558"   # optional: its replay endpoint (catch-up)

[[launch]]                   # ... engines `prfaas serve` starts as children
id = "pd-d0"
engine = "reference"         # reference: our engine; vllm: a vLLM server (connector)
cluster = "pd"
role = "decode"
model = "qwen3-next-tiny"
# device = "cuda:0"          # reference engines: torch device (default cpu); dtype = "bfloat16"
# egress_rate_mbps = 10      # prefill roles: pace this engine's KV egress (emulated link)
# egress_delay_ms = 5        # prefill roles: added one-way delay
# transport_tls_cert = "certs/pd-d0.pem"   # KV transport TLS (reference engines; all three
# transport_tls_key = "certs/pd-d0.key"    # files, on every launched engine or none; paths
# transport_tls_ca = "certs/ca.pem"        # relative to this file)

[scheduler]                  # optional: dual-timescale scheduling (gateway/scheduling/)
profile = "profile.toml"     # planner profile (hardware, KV bytes), relative to this file
period_s = 60.0              # long-term period; tick_s = 1.0 the short-term tick

[coordination]               # optional: several gateway replicas (prfaas/coordination/)
etcd = "http://127.0.0.1:2379"
prefix = "/prfaas/default"
lease_ttl_s = 2.0

[responses]                  # optional: the Responses API's stored state (gateway/responses/)
store = "memory"             # or "redis://HOST:PORT/DB", which replicas share
ttl_s = 86400.0
max_mb = 256.0
```

The file is read by `prfaas.common.toml_tables` (unknown keys and wrong types are errors);
each dataclass validates its own values, so every error is a `ConfigError` naming the file,
the key path and the bad value (`deploy.toml: instances[1].role: must be one of ...`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlparse

from prfaas.common.toml_tables import ConfigError, build, check, load_toml
from prfaas.coordination.config import CoordinationConfig
from prfaas.engine_clients.base import Role
from prfaas.engines.reference.engine_config import DTYPES, is_device
from prfaas.gateway.responses.config import ResponsesConfig
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.policies.routing import Regime, Route

EngineKind = Literal["reference", "sglang", "vllm"]
"""What an engine is: PrfaaS's reference engine or an SGLang server (both speak SGLang's
PD protocol: `/generate`, and their OpenAI routes with `bootstrap_*`), or a vLLM server
running the PrfaaS connector (its OpenAI routes with `kv_transfer_params`)."""
MAP_EVENTS: tuple[EngineKind, ...] = ("sglang", "vllm")
"""The kinds whose engines publish KV events as tagged msgpack maps: vLLM, and SGLang (its
`KVCacheEvent` is a map since it dropped `array_like`, as in 0.5.23); the gateway's feed
reads theirs with the map-form decoder. The reference engine publishes the positional
arrays of `prfaas.protocol.kv_events.events` (SGLang's earlier layout)."""
LAUNCHED: tuple[EngineKind, ...] = ("reference", "vllm")
"""The kinds `prfaas serve` starts itself (SGLang servers run on GPU nodes of their own)."""

_ROUTES = get_args(Route)
_ROLES = get_args(Role)
_REGIMES = get_args(Regime)
_ENGINES = get_args(EngineKind)


@dataclass(frozen=True)
class ModelConfig:
    """The served model."""

    name: str = "qwen3-next-tiny"
    tokenizer: str = "byte-level"
    """`byte-level` or a directory holding the model's `tokenizer.json`."""
    context_length: int = 8192
    block_size: int = 64
    """Engines' page size; the KV index hashes blocks of this many tokens."""
    vocab_size: int | None = 260

    def __post_init__(self) -> None:
        check(bool(self.name), "name", self.name, "must not be empty")
        check(self.context_length >= 2, "context_length", self.context_length, "must be >= 2")
        check(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        ok = self.vocab_size is None or self.vocab_size >= 1
        check(ok, "vocab_size", self.vocab_size, "must be >= 1")


@dataclass(frozen=True)
class GatewayConfig:
    """The front door's policy and limits."""

    policy: str = "prfaas"
    threshold: float = 1024.0
    """Incremental-length threshold t, in tokens."""
    regime: Regime = "bandwidth_scarce"
    api_keys: tuple[str, ...] = ()
    """Accepted `Authorization: Bearer` keys of clients; empty disables authentication."""
    admin_keys: tuple[str, ...] = ()
    """Operator keys for `/admin/*` (client API keys never open it). Without any,
    `GET /admin/state` is open and every admin write is refused."""
    secret_file: str | None = None
    """The deployment secret (hex) shared with the engines (default: `$PRFAAS_SECRET` or
    `$PRFAAS_SECRET_FILE`); the gateway sends its control token to every engine."""
    max_running: int = 256
    """Requests dispatched to engines at once."""
    max_queued: int = 1024
    """Requests waiting for a slot; beyond this the gateway answers 429."""
    queue_timeout_s: float = 60.0
    """How long a request waits for a slot; past it the gateway answers 408 with
    `Retry-After` (as SGLang's gateway does; OpenAI's and Anthropic's clients retry it)."""
    max_body_bytes: int = 16 * 1024 * 1024
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    """A `/health` probe slower than this fails."""
    eject_after: int = 3
    """Failed probes in a row that eject an instance (a refused connection ejects at once)."""
    readmit_after: int = 2
    """Good probes in a row that readmit an ejected instance."""
    unresponsive_restart_s: float = 30.0
    """`prfaas serve`'s launched engines: one ejected and still not answering its probes
    this long after (a stopped or wedged process) is killed, its whole process tree, and
    started again; 0 never does."""
    max_retries: int = 2
    """Re-dispatches of a request that failed before its first token (another instance)."""
    max_migrations: int = 2
    """Re-dispatches of a request whose decode died mid-stream (prompt + tokens so far)."""
    retry_wait_s: float = 30.0
    """How long a request to be re-dispatched waits for an instance when none is left (a
    lone decode restarting); new requests are refused at once (503) meanwhile."""
    retry_after_s: int = 1
    kv_index_max_mb: float = 1024.0
    """The global KV index's memory budget (about 50 bytes per cached (instance, block);
    past it the least recently stored or used blocks are forgotten)."""
    kv_sync_timeout_s: float = 5.0
    """At start-up, how long the gateway waits for the engines' snapshots of what they cache
    (`kv_events_replay`) before it listens; also bounds each replay request."""
    drain_timeout_s: float = 30.0
    """On SIGTERM/SIGINT, how long requests in flight may run on (new ones get 503) before
    what is left ends with an error (`prfaas serve --drain-timeout` overrides)."""

    def __post_init__(self) -> None:
        check(bool(self.policy), "policy", self.policy, "must not be empty")
        check(self.threshold >= 0, "threshold", self.threshold, "must be >= 0")
        check(self.regime in _REGIMES, "regime", self.regime, f"must be one of {_REGIMES}")
        for name in ("max_running", "max_body_bytes"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.kv_index_max_mb > 0, "kv_index_max_mb", self.kv_index_max_mb, "must be > 0")
        check(self.max_queued >= 0, "max_queued", self.max_queued, "must be >= 0")
        timeout = self.queue_timeout_s
        check(0 < timeout <= 3600, "queue_timeout_s", timeout, "must be in (0, 3600]")
        for name in ("health_interval_s", "health_timeout_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for name in ("eject_after", "readmit_after"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        grace = self.unresponsive_restart_s
        check(0 <= grace <= 3600, "unresponsive_restart_s", grace, "must be in [0, 3600]")
        for name in ("max_retries", "max_migrations"):
            check(0 <= getattr(self, name) <= 10, name, getattr(self, name), "must be in 0..10")
        wait = self.retry_wait_s
        check(0 <= wait <= 600, "retry_wait_s", wait, "must be in [0, 600]")
        check(self.retry_after_s >= 1, "retry_after_s", self.retry_after_s, "must be >= 1")
        sync = self.kv_sync_timeout_s
        check(0 < sync <= 600, "kv_sync_timeout_s", sync, "must be in (0, 600]")
        drain = self.drain_timeout_s
        check(0 <= drain <= 3600, "drain_timeout_s", drain, "must be in [0, 3600]")
        for name in ("api_keys", "admin_keys"):
            ok = all(isinstance(k, str) and k for k in getattr(self, name))
            check(ok, name, "<hidden>", "must be non-empty strings")
        shared = set(self.api_keys) & set(self.admin_keys)
        check(not shared, "admin_keys", "<hidden>", "must differ from every API key")


@dataclass(frozen=True)
class InstanceConfig:
    """One running engine."""

    id: str
    cluster: Route
    role: Role
    url: str
    bootstrap_host: str | None = None
    """Defaults to the URL's host for prefill-capable instances."""
    bootstrap_port: int | None = None
    kv_events: str | None = None
    """ZMQ endpoint of the engine's KV event publisher (`tcp://host:port`)."""
    engine: EngineKind = "reference"
    kv_events_replay: str | None = None
    """Its replay endpoint (SGLang's protocol; `prfaas engine --kv-events-replay`): a
    gateway that starts beside the running engine loads what it caches from there first
    (a reference engine's snapshot; a vLLM or SGLang engine's replay buffer, best effort),
    and fills sequence gaps from it."""

    def __post_init__(self) -> None:
        check(bool(self.id), "id", self.id, "must not be empty")
        check(self.engine in _ENGINES, "engine", self.engine, f"must be one of {_ENGINES}")
        check(self.cluster in _ROUTES, "cluster", self.cluster, f"must be one of {_ROUTES}")
        check(self.role in _ROLES, "role", self.role, f"must be one of {_ROLES}")
        parsed = urlparse(self.url)
        ok = parsed.scheme in ("http", "https") and bool(parsed.hostname)
        check(ok, "url", self.url, "must be http(s)://host:port")
        port = self.bootstrap_port
        check(port is None or 0 < port < 65536, "bootstrap_port", port, "must be a port")
        if self.role != "decode":
            check(port is not None, "bootstrap_port", port, "is required for a prefill role")
        for name in ("kv_events", "kv_events_replay"):
            value = getattr(self, name)
            ok = value is None or value.startswith(("tcp://", "ipc://"))
            check(ok, name, value, "must be a tcp:// or ipc:// endpoint")
        replay = self.kv_events_replay
        check(replay is None or self.kv_events is not None, "kv_events_replay", replay,
              "needs kv_events (the publisher it replays)")  # fmt: skip

    @property
    def bootstrap_address(self) -> str | None:
        return self.bootstrap_host or urlparse(self.url).hostname


@dataclass(frozen=True)
class LaunchConfig:
    """An engine `prfaas serve` starts as a child process (page size = the model's block
    size; KV events on a free local port): a reference engine, or a vLLM server with the
    PrfaaS connector (`engine = "vllm"`)."""

    id: str
    cluster: Route
    role: Role
    model: str = "qwen3-next-tiny"
    """Preset name or local checkpoint directory (vLLM: a checkpoint directory)."""
    engine: EngineKind = "reference"
    python: str = ".venv-vllm/bin/python"
    """vLLM engines: the interpreter of the vLLM environment (relative to the working
    directory, or absolute)."""
    threads: int = 1
    device: str = "cpu"
    """Reference engines: the torch device it runs on (`cpu`, `cuda`, `cuda:N`)."""
    dtype: str | None = None
    """Reference engines: weights and KV dtype; unset: float32 on cpu, bfloat16 on a GPU."""
    kv_sender: str = "loop"
    """Where the KV transport's sender runs: on the engine's event loop (a vLLM connector's
    own loop thread) or in a process of its own (`process`: `prfaas engine --kv-sender
    process`, the vLLM connector's `sender_process`)."""
    vllm_args: tuple[str, ...] = ()
    """vLLM engines: more `vllm serve` flags (e.g. `--enable-auto-tool-choice`,
    `--tool-call-parser hermes`: the client's `tools` are the engine's to answer)."""
    vllm_standby: bool | None = None
    """vLLM engines: keep the next start's server spawned ahead of need, vLLM imported
    (about 600 MB of host memory, waiting), so a restart skips that import (a third to a
    half of a vLLM start on CPU); unset: on. Reference engines start in seconds and have
    none."""
    egress_rate_mbps: float | None = None
    """Prefill roles: cap (emulate) this engine's whole KV egress, in Mbit/s."""
    egress_delay_ms: float = 0.0
    """Prefill roles: added one-way delay of its KV transfers (emulated distance)."""
    transport_tls_cert: str | None = None
    """KV transport TLS (reference engines): this engine's certificate (PEM), served on its
    bootstrap port and presented by its fetches; with `transport_tls_key` and
    `transport_tls_ca`. Relative paths are relative to the deployment file."""
    transport_tls_key: str | None = None
    """The private key (PEM) of `transport_tls_cert`."""
    transport_tls_ca: str | None = None
    """The deployment's CA (PEM): this engine's fetches verify prefill engines against it."""
    transport_tls_verify_client: bool = False
    """Mutual TLS: this engine's bootstrap port also requires a client certificate signed
    by the CA."""

    def __post_init__(self) -> None:
        check(bool(self.id), "id", self.id, "must not be empty")
        check(self.cluster in _ROUTES, "cluster", self.cluster, f"must be one of {_ROUTES}")
        check(self.role in _ROLES, "role", self.role, f"must be one of {_ROLES}")
        check(self.engine in LAUNCHED, "engine", self.engine, f"must be one of {LAUNCHED} "
              "(list running SGLang servers under [[instances]])")  # fmt: skip
        check(self.threads >= 1, "threads", self.threads, "must be >= 1")
        check(is_device(self.device), "device", self.device, "must be cpu, cuda or cuda:N")
        check(self.device == "cpu" or self.engine == "reference", "device", self.device,
              "is for reference engines only (a vLLM build runs on its own device)")  # fmt: skip
        check(self.dtype in (None, *DTYPES), "dtype", self.dtype, f"must be one of {DTYPES}")
        check(self.kv_sender in ("loop", "process"), "kv_sender", self.kv_sender,
              "must be loop or process")  # fmt: skip
        check(self.dtype is None or self.engine == "reference", "dtype", self.dtype,
              "is for reference engines only")  # fmt: skip
        check(not self.vllm_args or self.engine == "vllm", "vllm_args", list(self.vllm_args),
              "is for vLLM engines only")  # fmt: skip
        block_flag = [a for a in self.vllm_args  # vLLM reads `_` in a flag's name as `-`
                      if a.split("=", 1)[0].replace("_", "-") == "--block-size"]  # fmt: skip
        check(not block_flag, "vllm_args", list(self.vllm_args), "must not set --block-size: "
              "vLLM engines page in [model] block_size, the KV index's")  # fmt: skip
        check(self.vllm_standby is None or self.engine == "vllm", "vllm_standby",
              self.vllm_standby, "is for vLLM engines only")  # fmt: skip
        rate = self.egress_rate_mbps
        check(rate is None or rate > 0, "egress_rate_mbps", rate, "must be > 0")
        check(self.egress_delay_ms >= 0, "egress_delay_ms", self.egress_delay_ms, "must be >= 0")
        paced = rate is not None or self.egress_delay_ms > 0
        check(not paced or self.role != "decode", "role", self.role, "has no KV egress to pace")
        files = self.tls_files()
        for key, value in files.items():
            check(value is None or bool(value), key, value, "must not be empty")
        unset = [key for key, value in files.items() if value is None]
        check(len(unset) in (0, len(files)), unset[0] if unset else "", None,
              f"is required with {', '.join(k for k in files if k not in unset)}")  # fmt: skip
        tls = not unset
        check(not tls or self.engine == "reference", "engine", self.engine,
              "has no transport TLS settings here (reference engines only)")  # fmt: skip
        check(tls or not self.transport_tls_verify_client, "transport_tls_verify_client",
              True, "needs transport_tls_cert, transport_tls_key and transport_tls_ca")  # fmt: skip

    def tls_files(self) -> dict[str, str | None]:
        """The transport TLS files by key (None where unset)."""
        return {
            "transport_tls_cert": self.transport_tls_cert,
            "transport_tls_key": self.transport_tls_key,
            "transport_tls_ca": self.transport_tls_ca,
        }

    @property
    def transport_tls(self) -> bool:
        """Whether this engine's KV transport uses TLS."""
        return self.transport_tls_cert is not None

    def engine_args(self) -> tuple[str, ...]:
        """Extra `prfaas engine` flags for the device, the KV sender, the link emulation and
        transport TLS, if any."""
        args: list[str] = []
        if self.device != "cpu":
            args += ["--device", self.device]
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        if self.kv_sender != "loop":
            args += ["--kv-sender", self.kv_sender]
        if self.egress_rate_mbps is not None:
            args += ["--egress-rate-mbps", f"{self.egress_rate_mbps:g}"]
        if self.egress_delay_ms > 0:
            args += ["--egress-delay-ms", f"{self.egress_delay_ms:g}"]
        for key, value in self.tls_files().items():
            if value is not None:
                args += ["--" + key.replace("_", "-"), value]
        if self.transport_tls_verify_client:
            args.append("--transport-tls-verify-client")
        return tuple(args)


@dataclass(frozen=True)
class DeploymentConfig:
    """A whole deployment: model, gateway, running instances and engines to launch."""

    model: ModelConfig = field(default_factory=ModelConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    instances: tuple[InstanceConfig, ...] = ()
    launch: tuple[LaunchConfig, ...] = ()
    scheduler: SchedulerConfig | None = None
    """Dual-timescale scheduling (`[scheduler]`); absent: `t` moves only by hand."""
    coordination: CoordinationConfig | None = None
    """Several gateway replicas sharing one etcd (`[coordination]`); absent: one gateway."""
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    """Where the Responses API's stored responses live (`[responses]`)."""

    def __post_init__(self) -> None:
        members: list[InstanceConfig | LaunchConfig] = [*self.instances, *self.launch]
        ids = [i.id for i in members]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        check(not dupes, "instances.id", dupes, "must be unique")
        roles = {(i.cluster, i.role) for i in members}
        has_decode = any(c == "pd" and r in ("decode", "both") for c, r in roles)
        check(has_decode or not members, "instances", ids, "need a decode role in cluster 'pd'")
        # a decode with TLS fetches from every prefill over TLS: all launched engines or none
        tls = {la.id: la.transport_tls for la in self.launch if la.engine == "reference"}
        plain = sorted(i for i, on in tls.items() if not on)
        check(len(plain) in (0, len(tls)), "launch", plain,
              "lack the transport TLS the other launched engines use")  # fmt: skip


def parse_deployment(data: dict[str, Any], source: str = "<config>") -> DeploymentConfig:
    """Build a `DeploymentConfig` from a parsed TOML document.

    Raises:
        ConfigError: unknown or invalid keys (the message names `source`, key and value).
    """
    config = build(DeploymentConfig, data, source=source)
    if not config.instances and not config.launch:
        raise ConfigError(f"{source}: [[instances]] or [[launch]] must list at least one engine")
    return config


def load_deployment(path: str | Path) -> DeploymentConfig:
    """Read and validate a deployment TOML file.

    Raises:
        ConfigError: unreadable file, bad TOML, or invalid values.
    """
    config = parse_deployment(load_toml(path), str(path))
    sched = config.scheduler
    if sched is not None and sched.profile is not None:  # relative to the deployment file
        profile = Path(path).parent / sched.profile
        config = replace(config, scheduler=replace(sched, profile=str(profile)))
    launch = tuple(_tls_files(la, Path(path), n) for n, la in enumerate(config.launch))
    return replace(config, launch=launch)


def _tls_files(launch: LaunchConfig, path: Path, index: int) -> LaunchConfig:
    """`launch` with its transport TLS files relative to the deployment file, each checked
    readable (ConfigError naming the key and the file otherwise); the engine loads them."""

    def resolve(key: str, value: str | None) -> str | None:
        if value is None:
            return None
        file = str(path.parent / value)
        try:
            with open(file, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{path}: launch[{index}].{key}: cannot read {file!r}: "
                              f"{exc.strerror or exc}") from None  # fmt: skip
        return file

    files = {key: resolve(key, value) for key, value in launch.tls_files().items()}
    return replace(
        launch,
        transport_tls_cert=files["transport_tls_cert"],
        transport_tls_key=files["transport_tls_key"],
        transport_tls_ca=files["transport_tls_ca"],
    )
