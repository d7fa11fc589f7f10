"""vLLM engines as child processes for `[[launch]]` entries with `engine = "vllm"`: a vLLM
OpenAI server from the vLLM environment with the PrfaaS connector, ready once `/health`
answers (vLLM prints no ready line of ours). It runs under `reaper.py` (not `exec`): vLLM's
API server starts an EngineCore process that outlives a killed server unless someone kills it.
A restart (`supervisor.Supervisor`) passes the ports it had."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from prfaas.engines.vllm.launch import VLLMServer
from prfaas.engines.vllm.role import ENV_ROLE
from prfaas.gateway.deployment import LaunchConfig
from prfaas.serve.processes import (
    EngineProcess,
    EngineSpec,
    free_port,
    ipc_events,
    spawn,
    stop_process,
)

START_TIMEOUT_S = 300.0


def vllm_server(
    launch: LaunchConfig,
    served_name: str,
    bootstrap_port: int,
    events: str,
    replay: str | None = None,
    port: int = 0,
    env: Mapping[str, str] | None = None,
) -> VLLMServer:
    """The server a `[[launch]]` entry describes (prefill roles pace their egress as set;
    `events`, `replay`: where its KV events and their replay are served, see
    `VLLMServer.kv_events`; `port`: its HTTP port, 0 for any free one; `env`: added to its
    environment).

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
    return VLLMServer(
        python=Path(launch.python),
        model=Path(launch.model),
        port=port or free_port(),
        served_name=served_name,
        connector=connector,
        kv_events=events,
        kv_events_replay=replay,
        threads=launch.threads,
        extra_args=launch.vllm_args,
        environment={**(env or {}), ENV_ROLE: launch.role},
    )


async def start_vllm(
    launch: LaunchConfig,
    served_name: str,
    log_dir: Path,
    ports: EngineSpec | None = None,
    log_name: str | None = None,
    env: Mapping[str, str] | None = None,
) -> EngineProcess:
    """Start one vLLM server and wait until it answers `/health`. `ports`: the HTTP,
    bootstrap, KV-event and replay ports to use (a restart's; 0 or None: a free one);
    output goes to `log_dir/<log_name or id>.log`; `env` adds to its environment (the
    deployment secret: never on its command line).

    Raises:
        RuntimeError: it exited or was not ready within START_TIMEOUT_S (names its log).
    """
    ports = ports or EngineSpec(launch.id, launch.role, launch.model)
    bootstrap = ports.bootstrap_port or free_port()
    events, replay = ipc_events(str(log_dir), launch.id)  # log_dir is private (mkdtemp)
    server = vllm_server(launch, served_name, bootstrap, events, replay, ports.port, env)
    log = log_dir / f"{log_name or launch.id}.log"
    with log.open("wb") as out:
        process = await spawn(
            server.command(),
            exec_=False,
            env=server.env(),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    url = f"http://{server.host}:{server.port}"
    try:
        await asyncio.wait_for(_healthy(process, url), START_TIMEOUT_S)
    except (TimeoutError, EOFError):
        await stop_process(process)
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vLLM engine {launch.id} did not start (log {log}):\n{tail}") from None
    except BaseException:
        await asyncio.shield(stop_process(process))
        raise
    spec = EngineSpec(
        launch.id, launch.role, launch.model, kv_events_ipc=str(log_dir), port=server.port,
        bootstrap_port=bootstrap,
    )  # fmt: skip
    reaper = asyncio.get_running_loop().create_task(_reap(process))  # output goes to the log
    return EngineProcess(spec, process, url, bootstrap, log, reaper)


async def _healthy(process: asyncio.subprocess.Process, url: str) -> None:
    async with aiohttp.ClientSession() as session:
        while process.returncode is None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise EOFError("vLLM exited before it was ready")


async def _reap(process: asyncio.subprocess.Process) -> None:
    await process.wait()
