"""Requests that survive an engine's death, and roles the gateway learns from the engines,
through a real gateway over real reference engines (in this process, on real sockets, the
deployment's control token on every call; the KV hand-off in process).

- Finding 7: a prefill that dies before the first token is retried on another prefill (the
  other cluster); a decode that dies mid-stream is migrated (prompt + tokens streamed so
  far to another decode) and the greedy output equals `transformers`' own; a stream that
  cannot be saved ends with an OpenAI error event and no `[DONE]`.
- Finding 3: a role switched on the engine (behind the gateway's back) is seen at the next
  health probe, so requests stop going to a prefill that became a decode; the scheduler's
  the scheduler's `RoleConverter` applies the new role at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import torch
from engine_harness import RunningEngine, engine_server
from engine_helpers import hf_greedy, random_prompt
from metrics_helpers import Scrape
from transformers import PreTrainedModel

from prfaas.common.secret import DeploymentSecret
from prfaas.common.tokenizer import ByteTokenizer
from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.model.presets import load_model, resolve
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.gateway.api.app import GatewayApp
from prfaas.gateway.api.assembly import Gateway
from prfaas.gateway.deployment import DeploymentConfig, GatewayConfig, InstanceConfig, ModelConfig
from prfaas.gateway.scheduling.roles import RoleConverter

pytestmark = pytest.mark.timeout(120)
SECRET = DeploymentSecret(b"g" * 32)
MODEL = "qwen3-next-tiny"
ROLES = {"prfaas-p0": ("prfaas", "prefill"), "pd-p0": ("pd", "prefill"),
         "pd-d0": ("pd", "decode"), "pd-d1": ("pd", "decode")}  # fmt: skip
GATEWAY = GatewayConfig(threshold=64, health_interval_s=0.2, health_timeout_s=0.5, eject_after=2)


@dataclass
class Model:
    hf: PreTrainedModel
    runner: ModelRunner


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    torch.set_num_threads(1)
    hf = load_model(resolve(MODEL, Path(tmp_path_factory.mktemp("models"))))
    return Model(hf, ModelRunner(hf))


@dataclass
class Cluster:
    url: str
    gateway: Gateway
    engines: dict[str, RunningEngine]
    openai: openai.AsyncOpenAI

    def client(self) -> openai.AsyncOpenAI:
        return self.openai

    async def scrape(self) -> Scrape:
        async with aiohttp.ClientSession() as s, s.get(f"{self.url}/metrics") as r:
            return Scrape.parse(await r.text())


@asynccontextmanager
async def cluster(model: Model, gateway: GatewayConfig = GATEWAY) -> AsyncIterator[Cluster]:
    """Four reference engines (one PrfaaS prefill, a PD prefill, two PD decodes) that need
    the deployment's token, and a gateway over them holding the deployment secret."""
    hub, token = InProcessHub(), SECRET.control_token()
    async with AsyncExitStack() as stack:
        engines = {
            name: await stack.enter_async_context(
                engine_server(model.runner, hub, token=token, role=role)
            )
            for name, (_, role) in ROLES.items()
        }
        instances = tuple(
            InstanceConfig(name, cluster_, role, eng.url,
                           bootstrap_port=eng.service.sender.bootstrap_port)
            for (name, (cluster_, role)), eng in zip(ROLES.items(), engines.values(), strict=True)
        )  # fmt: skip
        config = DeploymentConfig(
            ModelConfig(name=MODEL, block_size=16, context_length=4096), gateway, instances
        )
        app = GatewayApp(config, secret=SECRET)
        port = await app.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:
            yield Cluster(url, app.gateway, engines, client)
        finally:
            await client.close()
            await app.stop()


def expected(model: Model, prompt: list[int], n: int) -> str:
    return ByteTokenizer().decode(hf_greedy(model.hf, prompt, n))


async def eventually(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


async def stream_text(
    c: Cluster, prompt: list[int], n: int, on_chunk: Callable[[int], Awaitable[None]]
) -> str:
    """The streamed answer's text; `on_chunk(i)` runs after the i-th chunk arrived."""
    stream = await c.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts = []
    async for i, chunk in _enumerate(stream):
        texts.append(chunk.choices[0].text)
        await on_chunk(i)
    return "".join(texts)


async def _enumerate(stream: Any) -> AsyncIterator[tuple[int, Any]]:
    i = 0
    async for item in stream:
        yield i, item
        i += 1


async def _nothing(i: int) -> None:
    return None


async def test_a_prefill_that_dies_before_the_first_token_is_retried_elsewhere(
    model: Model,
) -> None:
    """Finding 7: the PrfaaS prefill dies while computing a long prompt: the request is
    retried on the PD prefill (the other cluster) and the answer is whole and exact."""
    prompt = random_prompt(11, 2000)
    async with cluster(model) as c:
        victim = c.engines["prfaas-p0"]
        answer = asyncio.ensure_future(stream_text(c, prompt, 8, _nothing))
        await eventually(lambda: victim.busy)
        victim.crash()
        text = await answer
        scrape = await c.scrape()
        assert c.gateway.instances["prfaas-p0"].status == "ejected"
    assert text == expected(model, prompt, 8)
    assert scrape.value("prfaas_request_retries_total") == 1
    assert scrape.value("prfaas_request_migrations_total") == 0


async def test_a_decode_that_dies_mid_stream_is_migrated(model: Model) -> None:
    """Finding 7: the decode dies after 10 streamed chunks: the prompt plus the streamed
    tokens go to the other decode, and the client's text equals an unfailed greedy run."""
    prompt = random_prompt(12, 120)
    async with cluster(model) as c:

        async def kill_decode(i: int) -> None:
            if i == 10:
                busy = [e for n, e in c.engines.items() if n.startswith("pd-d") and e.busy]
                assert len(busy) == 1
                busy[0].crash()

        text = await stream_text(c, prompt, 40, kill_decode)
        scrape = await c.scrape()
    assert text == expected(model, prompt, 40)
    assert scrape.value("prfaas_request_migrations_total") == 1


async def test_a_stream_that_cannot_be_saved_ends_with_an_error_event_and_no_done(
    model: Model,
) -> None:
    """Finding 7: with migrations off, a decode dying mid-stream ends the stream with an
    OpenAI-style error event and no `data: [DONE]` (which would pass a cut-off answer for
    a whole one)."""
    prompt = random_prompt(13, 50)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    async with cluster(model, replace(GATEWAY, max_migrations=0, retry_wait_s=0)) as c:
        events: list[Any] = []
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{c.url}/v1/completions", json=body) as r,
        ):
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                events.append(data.decode() if data == b"[DONE]" else orjson.loads(data))
                if len(events) == 5:
                    next(e for n, e in c.engines.items() if n.startswith("pd-d") and e.busy).crash()
    assert r.status == 200 and "[DONE]" not in events
    assert events[-1]["error"]["code"] == "engine_error"
    assert "room" not in events[-1]["error"]["message"]
    assert all("choices" in e for e in events[:-1])


async def test_a_role_switched_on_the_engine_is_seen_by_the_gateway(model: Model) -> None:
    """Finding 3: the PD prefill is switched to decode on the engine itself (with the
    deployment's token): the gateway sees the new role at the next probe and short prompts
    go to the PrfaaS prefill instead of waiting for KV that never comes. The scheduler's
    `RoleConverter` switches it back and the gateway's view changes at once."""
    prompt = random_prompt(14, 40)
    async with cluster(model) as c:
        headers = {"Authorization": f"Bearer {SECRET.control_token()}"}
        url = f"{c.engines['pd-p0'].url}/admin/role"
        async with (
            aiohttp.ClientSession() as s,
            s.post(url, json={"role": "decode"}, headers=headers) as r,
        ):
            assert r.status == 200
        await eventually(lambda: c.gateway.instances["pd-p0"].role == "decode", 5)
        raw = await asyncio.wait_for(
            c.client().completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True},
            ),
            10,
        )  # fmt: skip
        assert raw.headers["x-prfaas-route"] == "prfaas"
        assert raw.parse().choices[0].text == expected(model, prompt, 4)
        converter = RoleConverter(c.gateway.instances, drain_timeout_s=60)
        result = await converter.convert("pd-p0", "prefill")
        assert result.ok and c.gateway.instances["pd-p0"].role == "prefill"
        again = await c.client().completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert again.headers["x-prfaas-route"] == "pd"
