"""vLLM engines as child processes for `[[launch]]` entries with `engine = "vllm"`: a vLLM
OpenAI server from the vLLM environment with the PrfaaS connector, ready once `/health`
answers (vLLM prints no ready line of ours). It runs under `reaper.py` (not `exec`): vLLM's
API server starts an EngineCore process that outlives a killed server unless someone kills it.
A restart (`supervisor.Supervisor`) passes the ports it had."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from prfaas.common.ports import free_port
from prfaas.common.secret import DeploymentSecret
from prfaas.engines.vllm.launch import VLLMServer
from prfaas.engines.vllm.role import ENV_ROLE
from prfaas.engines.vllm.standby import GO
from prfaas.gateway.deployment import LaunchConfig, ModelConfig
from prfaas.serve.processes import (
    EngineProcess,
    EngineSpec,
    ipc_events,
    spawn,
    stop_process,
)

START_TIMEOUT_S = 300.0
logger = logging.getLogger(__name__)


def vllm_server(
    launch: LaunchConfig,
    served: ModelConfig,
    bootstrap_port: int,
    events: str,
    replay: str | None = None,
    port: int = 0,
    env: Mapping[str, str] | None = None,
    role: str | None = None,
) -> VLLMServer:
    """The server a `[[launch]]` entry describes, serving the deployment's model `served`
    under its name and paging in its block size (the KV index's: vLLM's own choice for a
    hybrid model depends on its version and the Mamba state's dtype), its connector pacing
    the KV it sends as the launch sets; `events`, `replay`: where its KV events and their
    replay are served, see `VLLMServer.kv_events`; `port`: its HTTP port, 0 for any free
    one; `env`: added to its environment; `role`: the role it starts in, None for the
    launch's).

    Raises:
        RuntimeError: the vLLM environment's interpreter does not exist.
    """
    if not os.path.exists(launch.python):
        raise RuntimeError(
            f"{launch.id}: no vLLM environment at {launch.python} (create it: make vllm-env)"
        )
    connector: dict[str, object] = {"bootstrap_port": bootstrap_port}
    if launch.egress_rate_mbps is not None:
        connector["egress_rate_mbps"] = launch.egress_rate_mbps
    if launch.egress_delay_ms > 0:
        connector["egress_delay_ms"] = launch.egress_delay_ms
    if launch.kv_sender == "process":
        connector["sender_process"] = True
    return VLLMServer(
        python=Path(launch.python),
        model=Path(launch.model),
        port=port or free_port(),
        served_name=served.name,
        block_size=served.block_size,
        connector=connector,
        kv_events=events,
        kv_events_replay=replay,
        threads=launch.threads,
        extra_args=launch.vllm_args,
        environment={**(env or {}), ENV_ROLE: role or launch.role},
    )


async def start_vllm(
    launch: LaunchConfig,
    served: ModelConfig,
    log_dir: Path,
    ports: EngineSpec | None = None,
    log_name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> EngineProcess:
    """Start one vLLM server of `served` (see `vllm_server`) and wait until it answers
    `/health`. `ports`: the HTTP,
    bootstrap, KV-event and replay ports to use (a restart's; 0 or None: a free one);
    output goes to `log_dir/<log_name or id>.log`; `env` adds to its environment (the
    deployment secret: never on its command line).

    Raises:
        RuntimeError: it exited or was not ready within START_TIMEOUT_S (names its log).
    """
    server, bootstrap = _server(launch, served, log_dir, ports, env)
    log = log_dir / f"{log_name or launch.id}.log"
    process = await _spawn(server, log, standby=False)
    return await _ready(launch, server, bootstrap, process, log)


def _server(
    launch: LaunchConfig,
    served: ModelConfig,
    log_dir: Path,
    ports: EngineSpec | None,
    env: Mapping[str, str] | None,
) -> tuple[VLLMServer, int]:
    """The server to start on `ports` in their role (None: the launch's, on free ports),
    and its bootstrap port."""
    ports = ports or EngineSpec(launch.id, launch.role, launch.model)
    bootstrap = ports.bootstrap_port or free_port()
    events, replay = ipc_events(str(log_dir), launch.id)  # log_dir is private (mkdtemp)
    server = vllm_server(launch, served, bootstrap, events, replay, ports.port, env, ports.role)
    return server, bootstrap


async def _spawn(server: VLLMServer, log: Path, standby: bool) -> asyncio.subprocess.Process:
    with log.open("wb") as out:
        return await spawn(
            server.command(standby),
            exec_=False,
            env=server.env(),
            stdin=asyncio.subprocess.PIPE if standby else asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )


async def _ready(
    launch: LaunchConfig,
    server: VLLMServer,
    bootstrap: int,
    process: asyncio.subprocess.Process,
    log: Path,
) -> EngineProcess:
    """The started engine once it answers `/health` and pages in the block size it was
    given (else stopped).

    Raises:
        RuntimeError: it exited or was not ready within START_TIMEOUT_S (names its log), or
            vLLM chose another block size (names both).
    """
    url = f"http://{server.host}:{server.port}"
    try:
        await asyncio.wait_for(_healthy(process, url), START_TIMEOUT_S)
        paged = await _paged_block_size(server, url)
    except (TimeoutError, EOFError):
        await stop_process(process)
        tail = (await asyncio.to_thread(log.read_text, errors="replace"))[-2000:]
        raise RuntimeError(f"vLLM engine {launch.id} did not start (log {log}):\n{tail}") from None
    except BaseException:
        await asyncio.shield(stop_process(process))
        raise
    if paged is None and server.block_size is not None:
        logger.warning("vLLM engine %s does not say its block size (no cache_config_info in "
                       "/metrics, e.g. --disable-log-stats): not checked against %d",
                       launch.id, server.block_size)  # fmt: skip
    elif server.block_size is not None and paged != server.block_size:
        await asyncio.shield(stop_process(process))
        raise RuntimeError(
            f"vLLM engine {launch.id} pages in {paged}-token blocks, not the deployment's "
            f"[model] block_size {server.block_size} (vLLM raises one its attention backend "
            f"or the model's Mamba state cannot use), so the KV index could not read its "
            f"events: set block_size = {paged} (log {log})"
        )
    role = server.environment.get(ENV_ROLE, launch.role)
    spec = EngineSpec(
        launch.id, role, launch.model, kv_events_ipc=str(log.parent), port=server.port,
        bootstrap_port=bootstrap,
    )  # fmt: skip
    reaper = asyncio.get_running_loop().create_task(_reap(process))  # output goes to the log
    return EngineProcess(spec, process, url, bootstrap, log, reaper)


@dataclass
class Standby:
    """A vLLM server spawned ahead of need (`prfaas.engines.vllm.standby`): vLLM imported,
    waiting for `go` on its stdin, on the ports of the engine it would replace."""

    launch: LaunchConfig
    server: VLLMServer
    bootstrap_port: int
    process: asyncio.subprocess.Process
    log: Path

    def serves(self, ports: EngineSpec) -> bool:
        """Whether it is alive on the ports a restart asks for (in whatever role: it takes
        the role at `go`)."""
        return (
            self.process.returncode is None
            and ports.port == self.server.port
            and ports.bootstrap_port == self.bootstrap_port
        )

    async def go(self, log: Path, role: str) -> EngineProcess:
        """Serve in `role` (the engine's now: a conversion may have changed it since the
        standby was spawned), and wait until it answers `/health`; its output goes on into
        `log`.

        Raises:
            RuntimeError: it had exited, or did not become ready (names its log).
        """
        try:
            self.log.rename(log)
        except OSError:  # it goes on writing where it was
            log = self.log
        assert self.process.stdin is not None
        server = replace(self.server, environment={**self.server.environment, ENV_ROLE: role})
        try:
            self.process.stdin.write(f"{GO} {role}\n".encode())
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            await stop_process(self.process)
            raise RuntimeError(f"the standby of vLLM engine {self.launch.id} had exited "
                               f"(log {log})") from None  # fmt: skip
        return await _ready(self.launch, server, self.bootstrap_port, self.process, log)

    async def stop(self) -> None:
        await stop_process(self.process)


class VLLMRestarts:
    """Starts one launched vLLM engine again for the supervisor (a `supervisor.Starter`):
    from the standby spawned after its last start (`launch.vllm_standby`) when that one is
    alive on the ports asked for, else (or when it fails to start) afresh on those ports.
    Owns the standby: `stop` ends it. Called by one watcher at a time, after `prepare` for
    the engine's first start."""

    def __init__(
        self, launch: LaunchConfig, served: ModelConfig, log_dir: Path, env: Mapping[str, str]
    ) -> None:
        self.launch = launch
        self._served = served
        self._log_dir = log_dir
        self._env = dict(env)
        self._standby: Standby | None = None
        self._spawned = 0  # standbys so far: each logs to a file of its own

    @property
    def standby(self) -> Standby | None:
        """The standby waiting for the engine's next start, if any."""
        return self._standby

    async def prepare(self, engine: EngineProcess) -> None:
        """Spawn the standby for the next start of `engine` (on its ports); one that cannot
        be spawned is logged, never raised (the engine serves either way)."""
        if self.launch.vllm_standby is False:
            return
        await self.stop()
        self._spawned += 1
        log = self._log_dir / f"{self.launch.id}.standby.{self._spawned}.log"
        try:
            server, bootstrap = _server(
                self.launch, self._served, self._log_dir, engine.spec, self._env
            )
            process = await _spawn(server, log, standby=True)
        except (OSError, RuntimeError) as exc:  # the next start is a cold one
            logger.warning("engine %s: no standby (%s)", self.launch.id, exc)
            return
        self._standby = Standby(self.launch, server, bootstrap, process, log)

    async def __call__(self, ports: EngineSpec, log_name: str) -> EngineProcess:
        standby, self._standby = self._standby, None
        engine = None
        if standby is not None and standby.serves(ports):
            logger.warning("engine %s starts from its standby (vLLM imported ahead)",
                           self.launch.id)  # fmt: skip
            try:
                engine = await standby.go(self._log_dir / f"{log_name}.log", ports.role)
            except RuntimeError as exc:
                logger.warning("engine %s: its standby did not start (%s); starting afresh",
                               self.launch.id, exc)  # fmt: skip
        elif standby is not None:
            await standby.stop()
        if engine is None:
            engine = await start_vllm(
                self.launch, self._served, self._log_dir, ports, log_name, self._env
            )
        try:
            await self.prepare(engine)
        except BaseException:  # cancelled: the started engine is nobody's else
            await asyncio.shield(engine.stop())
            raise
        return engine

    async def stop(self) -> None:
        """End the standby, if any."""
        standby, self._standby = self._standby, None
        if standby is not None:
            await standby.stop()


async def _healthy(process: asyncio.subprocess.Process, url: str) -> None:
    async with aiohttp.ClientSession() as session:
        while process.returncode is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise EOFError("vLLM exited before it was ready")


async def _paged_block_size(server: VLLMServer, url: str) -> int | None:
    """The block size a started vLLM server pages in (its `/metrics`), None if it does not
    say."""
    secret = DeploymentSecret.from_env(server.environment)
    headers = {} if secret is None else {"Authorization": f"Bearer {secret.control_token()}"}
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(30)) as r,
        ):
            return cache_block_size(await r.text()) if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


def cache_block_size(metrics: str) -> int | None:
    """`block_size` of vLLM's `vllm:cache_config_info` gauge in Prometheus text, if any
    (what the engine pages in after its own adjustments)."""
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            found = re.search(r'[{,]block_size="(\d+)"', line)
            return int(found.group(1)) if found else None
    return None


async def _reap(process: asyncio.subprocess.Process) -> None:
    await process.wait()
