"""`prfaas serve --config` with `[[launch]]` entries: start those engines (reference engines,
or vLLM servers for `engine = "vllm"`) as child processes (reference engines with the
deployment secret in their environment: the configured one, else a fresh one), add them to
the deployment as running instances, serve (with the PrfaaS prefill instances' egress
telemetry polled, `assembly.egress_setup`), restart any of them that dies or stops
answering (`supervisor.Supervisor`; a vLLM engine from a standby spawned ahead of need,
`vllm_engines.VLLMRestarts`), stop them all on exit."""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from prfaas.common.ports import free_port
from prfaas.common.secret import ENV_SECRET, DeploymentSecret
from prfaas.gateway.api.assembly import Gateway, egress_setup
from prfaas.gateway.deployment import DeploymentConfig, InstanceConfig, LaunchConfig
from prfaas.serve.processes import EngineProcess, EngineSpec, start_engine
from prfaas.serve.run import serve_gateway, setups, signals_cancel_current_task
from prfaas.serve.supervisor import Starter, Supervisor, restart_policy
from prfaas.serve.vllm_engines import VLLMRestarts, start_vllm


def _spec(launch: LaunchConfig, page_size: int) -> EngineSpec:
    return EngineSpec(
        launch.id,
        launch.role,
        launch.model,
        page_size,
        launch.threads,
        free_port(),
        extra_args=launch.engine_args(),
        kv_replay_port=free_port(),
    )


def _instance(launch: LaunchConfig, engine: EngineProcess) -> InstanceConfig:
    # every launched engine serves KV at its bootstrap port whatever its role (vLLM's
    # connector runs kv_both): a decode switched to prefill later needs it
    return InstanceConfig(
        launch.id,
        launch.cluster,
        launch.role,
        engine.url,
        "127.0.0.1",
        engine.bootstrap_port,
        engine.kv_events,
        launch.engine,
        engine.kv_events_replay,
    )


def launch_secret(config: DeploymentConfig) -> DeploymentSecret:
    """The deployment's secret (config file or environment), else a fresh one."""
    return DeploymentSecret.from_env(path=config.gateway.secret_file) or DeploymentSecret.generate()


def _start(
    launch: LaunchConfig, config: DeploymentConfig, log_dir: Path, secret: DeploymentSecret
) -> Coroutine[Any, Any, EngineProcess]:
    """The start of one `[[launch]]` engine, by its engine kind."""
    env = {ENV_SECRET: secret.hex()}
    if launch.engine == "vllm":
        return start_vllm(launch, config.model, log_dir, env=env)
    return start_engine(_spec(launch, config.model.block_size), log_dir, env=env)


async def start_launched(
    config: DeploymentConfig, log_dir: Path, secret: DeploymentSecret
) -> list[EngineProcess]:
    """Start every `[[launch]]` engine concurrently; on any failure stop the others."""
    results = await asyncio.gather(
        *(_start(launch, config, log_dir, secret) for launch in config.launch),
        return_exceptions=True,
    )
    engines = [r for r in results if isinstance(r, EngineProcess)]
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(*(e.stop() for e in engines))
        raise failures[0]
    return engines


async def serve_launched(
    config: DeploymentConfig,
    host: str,
    port: int,
    on_ready: Callable[[Gateway, int], None] | None = None,
) -> int:
    """Start the `[[launch]]` engines, serve the whole deployment, restart engines that die
    or stop answering, stop every engine on exit."""
    log_dir = Path(tempfile.mkdtemp(prefix="prfaas-serve-"))
    print(f"starting {len(config.launch)} engine(s); logs in {log_dir}", flush=True)
    secret = launch_secret(config)
    with signals_cancel_current_task():
        engines = await start_launched(config, log_dir, secret)
    env = {ENV_SECRET: secret.hex()}
    restarts = {
        la.id: VLLMRestarts(la, config.model, log_dir, env)
        for la in config.launch
        if la.engine == "vllm"
    }
    starters: dict[str, Starter] = dict(restarts)
    supervisor = Supervisor(
        {e.spec.name: e for e in engines}, log_dir, env, restart_policy(config.gateway), starters
    )
    for engine in engines:  # each vLLM engine's next start, ahead of need
        if (restart := restarts.get(engine.spec.name)) is not None:
            await restart.prepare(engine)
    supervisor.start()
    try:
        started = tuple(_instance(la, e) for la, e in zip(config.launch, engines, strict=True))
        full = dataclasses.replace(config, instances=config.instances + started, launch=())
        setup = setups(egress_setup(), supervisor.attach)
        await serve_gateway(full, host, port, setup=setup, on_ready=on_ready, secret=secret)
    finally:
        await supervisor.stop()
        await asyncio.gather(*(r.stop() for r in restarts.values()))
    return 0
