"""Assemble and run one reference engine: model, core, service, hand-off endpoints, KV events
and the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web

from prfaas.common.secret import DeploymentSecret
from prfaas.common.tokenizer import BYTE_LEVEL, load_tokenizer
from prfaas.engines.reference.engine_config import (
    DTYPES,
    EngineConfig,
    TransferConfig,
    default_dtype,
    is_device,
)
from prfaas.engines.reference.handoff.transport import TransportReceiver, TransportSender
from prfaas.engines.reference.model.presets import load_model, resolve
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.engines.reference.server.app_keys import ModelInfo
from prfaas.engines.reference.server.routes import create_app
from prfaas.engines.reference.server.service import EngineService
from prfaas.engines.reference.step.core import EngineCore
from prfaas.engines.transport import ReceiverConfig, TlsConfig
from prfaas.protocol.kv_events import KVEvent, KVEventPublisher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchOptions:
    """Everything `prfaas engine` takes."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 0
    kv_events: str | None = None
    kv_events_replay: str | None = None
    """Replay endpoint of the KV event publisher: recent batches, and snapshots of what is
    cached (`prfaas.protocol.kv_events`)."""
    cache_dir: Path | None = None
    threads: int | None = None
    device: str = "cpu"
    """The torch device of the weights, the KV pool and the sampling (`cpu`, `cuda[:N]`)."""
    dtype: str | None = None
    """Weights and KV dtype (`DTYPES`); None: the device's default (`default_dtype`)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    """KV transport of the prefill side (connections, egress pacing and delay)."""
    secret: DeploymentSecret | None = None
    """The deployment secret: with it, every route but `/health` needs its control token
    and KV transport peers must prove they hold it; without it both are open."""
    tls: TlsConfig | None = None
    """KV transport TLS, both ways: the bootstrap listener serves it, fetches from prefill
    engines verify it; None: plain TCP."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(f"bootstrap_port must be in 0..65535, got {self.bootstrap_port}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("--kv-events-replay needs --kv-events")
        if not is_device(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")


def build_app(options: LaunchOptions) -> tuple[web.Application, EngineService]:
    """Load the model and wire the engine; nothing starts until the app runs."""
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    source = resolve(options.model, options.cache_dir)
    dtype = getattr(torch, options.dtype or default_dtype(options.device))
    model = load_model(source, torch.device(options.device), dtype)
    logger.info("model %s on %s in %s", source.name, options.device, dtype)
    runner = ModelRunner(model)
    # A checkpoint without tokenizer.json (the tiny presets) is served byte-level.
    has_json = (source.path / "tokenizer.json").is_file()
    tokenizer = load_tokenizer(source.path if has_json else BYTE_LEVEL)
    core = EngineCore(runner, options.engine, tokenizer.decode)
    secret = options.secret
    key = secret.transport_key() if secret is not None else b""
    if secret is None:
        logger.warning("no deployment secret: control routes and the KV transport are open")
    sender = TransportSender(
        options.transfer.sender_config(options.host, options.bootstrap_port, key, options.tls),
        queued=core.copier.asynchronous,
        process=options.transfer.sender_process,
    )
    receiver = TransportReceiver(ReceiverConfig(auth_key=key, tls=options.tls))
    service = EngineService(core, sender, receiver)
    info = ModelInfo(
        model=source.name,
        model_path=str(source.path),
        architecture=runner.shape.model_type,
        layer_types=runner.shape.layer_types,
        vocab_size=runner.shape.vocab_size,
        tokenizer=tokenizer.name,
    )
    app = create_app(service, tokenizer, info, secret.control_token() if secret else None)
    if options.kv_events:
        app.cleanup_ctx.append(_kv_events(service, options.kv_events, options.kv_events_replay))
    return app, service


def _kv_events(
    service: EngineService, endpoint: str, replay: str | None
) -> Callable[[web.Application], AsyncIterator[None]]:
    """Publish the pool's KV events on `endpoint` (ZMQ PUB) from the event loop thread;
    with `replay`, serve recent batches and snapshots there too. The publisher exists
    before any request runs, so its record of the cache (the snapshots) misses nothing."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        publisher = KVEventPublisher(endpoint, replay_endpoint=replay)
        loop = asyncio.get_running_loop()

        def sink(events: list[KVEvent]) -> None:
            loop.call_soon_threadsafe(publisher.publish, events)

        service.core.event_sink = sink
        logger.info("publishing KV events on %s", publisher.endpoint)
        yield
        service.core.event_sink = None
        publisher.close()

    return ctx


async def serve(options: LaunchOptions) -> None:
    """Run the engine until SIGINT/SIGTERM."""
    app, service = build_app(options)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    port = runner.addresses[0][1]
    print(f"prfaas engine ready: http://{options.host}:{port} role={service.core.role} "
          f"bootstrap_port={service.sender.bootstrap_port}", flush=True)  # fmt: skip
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
