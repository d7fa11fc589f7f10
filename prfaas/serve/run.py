"""Run the gateway app on a TCP port until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Awaitable, Callable, Iterator

from prfaas.common.secret import DeploymentSecret
from prfaas.gateway.api.app import GatewayApp
from prfaas.gateway.api.assembly import Gateway
from prfaas.gateway.deployment import DeploymentConfig
from prfaas.policies.profile import DeploymentProfile

Setup = Callable[[Gateway], Awaitable[None]]


def setups(*hooks: Setup) -> Setup:
    """One `setup` hook that runs `hooks` in order."""

    async def run(gateway: Gateway) -> None:
        for hook in hooks:
            await hook(gateway)

    return run


async def wait_for_signal() -> None:
    """Return on the first SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def signals_cancel_current_task() -> Iterator[None]:
    """While starting up (engines, profiling), SIGINT/SIGTERM cancel the current task, so
    its cleanup (stopping children) runs instead of the process dying mid-way."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def serve_gateway(
    config: DeploymentConfig,
    host: str,
    port: int,
    *,
    setup: Setup | None = None,
    on_ready: Callable[[Gateway, int], None] | None = None,
    profile: DeploymentProfile | None = None,
    secret: DeploymentSecret | None = None,
    replica_id: str | None = None,
) -> None:
    """Serve until a signal arrives; `on_ready(gateway, bound_port)` runs once listening.
    `profile` feeds the schedulers (see `GatewayApp`); `secret`: the deployment secret of
    the engines (None: from the config or environment); `replica_id`: this gateway's name
    among the replicas of a `[coordination]` deployment."""
    app = GatewayApp(config, setup, profile=profile, secret=secret, replica_id=replica_id)
    bound = await app.start(host, port)
    try:
        gc.freeze()  # start-up objects never die: keep them out of every later collection
        if on_ready is not None:
            on_ready(app.gateway, bound)
        await wait_for_signal()
    finally:
        await app.stop()
