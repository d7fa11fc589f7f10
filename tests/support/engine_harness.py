"""Start reference engines in this process on real sockets (tests only)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from prfaas.common.tokenizer import ByteTokenizer, Tokenizer
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.handoff.base import InProcessHub, InProcessReceiver, InProcessSender
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.engines.reference.server.app_keys import ModelInfo
from prfaas.engines.reference.server.routes import create_app
from prfaas.engines.reference.server.service import EngineService
from prfaas.engines.reference.step.core import EngineCore


@dataclass
class RunningEngine:
    url: str
    service: EngineService
    runner: web.AppRunner | None = None

    def crash(self) -> None:
        """As if the process died: stop listening and cut every open connection (its
        running handlers are cancelled, so the engine drops their requests)."""
        assert self.runner is not None and self.runner.server is not None
        for site in self.runner.sites:
            server = site._server  # the listening socket, closed at once
            if server is not None:
                server.close()
        for handler in self.runner.server.connections:
            if handler.transport is not None:
                handler.transport.abort()

    @property
    def busy(self) -> bool:
        """Whether a request is running or queued on it."""
        return self.service.core.has_work()


@asynccontextmanager
async def engine_server(
    runner: ModelRunner,
    hub: InProcessHub,
    tokenizer: Tokenizer | None = None,
    token: str | None = None,
    **config: object,
) -> AsyncIterator[RunningEngine]:
    """An engine on 127.0.0.1:<ephemeral> with the in-process hand-off (byte-level unless
    `tokenizer` is given; routes but `/health` need `token` when given); cleaned up on
    exit."""
    tok = tokenizer or ByteTokenizer()
    settings = {"block_size": 16, "kv_capacity_tokens": 4096, **config}
    core = EngineCore(runner, EngineConfig(**settings), tok.decode)  # type: ignore[arg-type]
    service = EngineService(core, InProcessSender(hub), InProcessReceiver(hub))
    info = ModelInfo(
        "qwen3-next-tiny",
        "-",
        runner.shape.model_type,
        runner.shape.layer_types,
        runner.shape.vocab_size,
        tok.name,
    )
    app = create_app(service, tok, info, token)
    app_runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, "127.0.0.1", 0)
    await site.start()
    port = app_runner.addresses[0][1]
    try:
        yield RunningEngine(f"http://127.0.0.1:{port}", service, app_runner)
    finally:
        await app_runner.cleanup()
