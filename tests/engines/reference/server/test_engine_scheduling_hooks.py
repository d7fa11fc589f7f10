"""The engine controls the schedulers use, on real sockets: a role switch also waits for a
decode request still fetching its KV (no request is lost to a switch), and
`POST /admin/egress` re-paces the KV transport (the emulated link) at run time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from engine_harness import engine_server
from engine_helpers import random_prompt

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.handoff.transport import TransportReceiver, TransportSender
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.engines.reference.server.app_keys import ModelInfo
from prfaas.engines.reference.server.routes import create_app
from prfaas.engines.reference.server.service import EngineService
from prfaas.engines.reference.step.core import EngineCore
from prfaas.engines.transport import ProcessSender, SenderConfig

GREEDY = {"temperature": 0, "ignore_eos": True}


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, data=orjson.dumps(body)) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_switch_waits_for_a_decode_still_fetching_its_kv(tiny_runner: ModelRunner) -> None:
    """A decode request waits for KV its prefill has not produced yet (it is not in the core
    yet). `/admin/role` must not switch under it: once the prefill runs, the request
    completes normally, and only then does the engine switch."""
    hub = InProcessHub()
    prompt = random_prompt(40, 7)
    sampling = {"max_new_tokens": 4, **GREEDY}
    async with (
        engine_server(tiny_runner, hub, role="prefill") as prefill,
        engine_server(tiny_runner, hub, role="decode") as decode,
        aiohttp.ClientSession() as s,
    ):
        port = prefill.service.sender.bootstrap_port
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 5}
        body = {"input_ids": prompt, "sampling_params": sampling, "rid": "d1", **room}
        waiting = asyncio.create_task(_post(s, f"{decode.url}/generate", body))
        for _ in range(500):
            if decode.service._active:  # the request is registered, waiting for KV
                break
            await asyncio.sleep(0.01)
        switch = asyncio.create_task(_post(s, f"{decode.url}/admin/role", {"role": "prefill"}))
        await asyncio.sleep(0.3)
        assert not switch.done() and decode.service.core.role == "decode"
        done = await _post(s, f"{prefill.url}/generate", {**body, "rid": "p1"})
        (status, result), (switched, report) = await asyncio.gather(waiting, switch)
    assert done[0] == 200
    assert status == 200 and len(result["output_ids"]) == 4
    assert switched == 200 and report["role"] == "prefill" and report["switch_seconds"] > 0.3


@contextlib.asynccontextmanager
async def _paced_engine(
    runner: ModelRunner, rate: float, *, process: bool = False
) -> AsyncIterator[tuple[str, EngineService]]:
    """A prefill engine whose KV transport paces its whole egress at `rate` bytes/s (with
    `process`, from a sender process); its URL and its service."""
    core = EngineCore(runner, EngineConfig(block_size=16, kv_capacity_tokens=4096,
                                           role="prefill"), ByteTokenizer().decode)  # fmt: skip
    config = SenderConfig(host="127.0.0.1", port=0, process_rate_bytes_per_s=rate)
    service = EngineService(core, TransportSender(config, process=process), TransportReceiver())
    shape = runner.shape
    info = ModelInfo("tiny", "-", shape.model_type, shape.layer_types, shape.vocab_size, "byte")
    app_runner = web.AppRunner(create_app(service, ByteTokenizer(), info), access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{app_runner.addresses[0][1]}", service
    finally:
        await app_runner.cleanup()


@pytest.mark.parametrize("process", [False, True], ids=["loop", "sender-process"])
async def test_admin_egress_repaces_the_transport(tiny_runner: ModelRunner, process: bool) -> None:
    """10 Mbit/s at start; `POST /admin/egress {"rate_mbps": 2}` makes the pacing rate and
    the telemetry's capacity 2 Mbit/s; bad bodies are 400s naming the expected body. So too
    with the sender in a process of its own (its telemetry a snapshot: read after one)."""
    paced = _paced_engine(tiny_runner, 10e6 / 8, process=process)
    async with paced as (url, _), aiohttp.ClientSession() as s:
        async with s.get(f"{url}/transfer_stats") as resp:
            before = await resp.json()
        status, answer = await _post(s, f"{url}/admin/egress", {"rate_mbps": 2})
        await asyncio.sleep(0.6 if process else 0)  # the sender process's next snapshot
        async with s.get(f"{url}/transfer_stats") as resp:
            after = await resp.json()
        bad = [await _post(s, f"{url}/admin/egress", b) for b in
               ({"rate_mbps": 0}, {"rate": 2}, {"rate_mbps": True}, [2])]  # fmt: skip
    assert before["egress_rate_bytes_per_s"] == before["capacity_bytes_per_s"] == 10e6 / 8
    assert status == 200 and answer == {"egress_rate_bytes_per_s": 2e6 / 8}
    assert after["egress_rate_bytes_per_s"] == after["capacity_bytes_per_s"] == 2e6 / 8
    assert [code for code, _ in bad] == [400, 400, 400, 400]
    assert "rate" in bad[0][1]["error"]["message"]
    assert bad[1][1]["error"]["message"] == 'the body must be {"rate_mbps": <number > 0>}'


async def test_health_fails_while_no_sender_process_runs(tiny_runner: ModelRunner) -> None:
    """A prefill whose KV sender process died answers `/health` with a 503 naming it (the
    gateway ejects it: no hand-off of it could succeed) until the next process serves, and
    200 again then."""
    paced = _paced_engine(tiny_runner, 10e6 / 8, process=True)
    async with paced as (url, service), aiohttp.ClientSession() as s:
        async with s.get(f"{url}/health") as resp:
            assert resp.status == 200
        sender = service.sender
        assert isinstance(sender, TransportSender)
        transport = sender.transport
        assert isinstance(transport, ProcessSender) and transport._child is not None
        child = transport._child.process
        assert child is not None
        child.kill()
        await child.wait()
        async with s.get(f"{url}/health") as resp:  # the next starts 0.5 s later at the soonest
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "kv_sender_gone"
        for _ in range(300):
            async with s.get(f"{url}/health") as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert resp.status == 200 and transport.restarts == 1


async def test_admin_egress_without_a_transport_is_404(tiny_runner: ModelRunner) -> None:
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        status, err = await _post(s, f"{eng.url}/admin/egress", {"rate_mbps": 2})
    assert status == 404 and err["error"]["code"] == "no_transport"
