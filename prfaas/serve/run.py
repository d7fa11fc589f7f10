"""Run the gateway app on a TCP port until SIGINT/SIGTERM, then drain it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
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


@contextlib.contextmanager
def on_signals(callback: Callable[[], None]) -> Iterator[None]:
    """While inside, each SIGINT or SIGTERM calls `callback` on the loop (instead of the
    default action, which would kill the process and orphan its engines)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, callback)
    try:
        yield
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
    """Serve until SIGINT or SIGTERM, then drain and return; `on_ready(gateway,
    bound_port)` runs once listening. `profile` feeds the schedulers (see `GatewayApp`);
    `secret`: the deployment secret of the engines (None: from the config or environment);
    `replica_id`: this gateway's name among the replicas of a `[coordination]` deployment.

    The drain (`GatewayApp.stop`): the listening socket closes, new requests on open
    connections and `/health` get 503, requests in flight finish within the deployment's
    `gateway.drain_timeout_s`, and what is left then ends with an error (an OpenAI error
    event on a stream, 503 on a whole answer). A second signal during the drain ends it at
    once, the same way. The callers stop their engines only after this returns, so the
    engines serve the requests in flight to the end."""
    app = GatewayApp(config, setup, profile=profile, secret=secret, replica_id=replica_id)
    with signals_cancel_current_task():  # e.g. while it waits for the engines' snapshots
        bound = await app.start(host, port)
    try:
        gc.freeze()  # start-up objects never die: keep them out of every later collection
        if on_ready is not None:
            on_ready(app.gateway, bound)
        signalled = asyncio.Event()

        def on_signal() -> None:
            if signalled.is_set():
                app.cut_drain()  # a second signal: stop at once
            signalled.set()

        with on_signals(on_signal):
            await signalled.wait()
            drain_s = config.gateway.drain_timeout_s
            print(f"prfaas serve: draining (up to {drain_s:g} s; a second signal stops at once)",
                  file=sys.stderr, flush=True)  # fmt: skip
            await app.stop(drain_s)
    finally:
        await app.stop()
