"""The OpenAI API through the official `openai` client: routing headers, usage, streaming,
the incremental-length rule with a KV index fed over real ZMQ, metrics and admin state.
Engines are null servers: these tests are about the gateway, not model output."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import openai
from gateway_helpers import BLOCK, Engines, GatewayFactory, deployment
from metrics_helpers import Scrape

from prfaas.common.tokenizer import ByteTokenizer, chat_ids
from prfaas.gateway.api.assembly import Gateway
from prfaas.protocol.kv_events import BlockStored, KVEventPublisher

LONG = "x" * 300  # 300 byte-level tokens > threshold 100


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_completions_route_by_incremental_length(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """A short prompt routes pd, a long uncached one prfaas; headers and usage say so."""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    client = _client(url)
    raw = await client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=3)
    assert raw.headers["x-prfaas-route"] == "pd"
    assert raw.headers["x-prfaas-incremental-tokens"] == "2"
    done = raw.parse()
    assert done.choices[0].text == " t0 t1 t2"
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (2, 3)
    raw = await client.completions.with_raw_response.create(model="tiny", prompt=LONG, max_tokens=2)
    assert raw.headers["x-prfaas-route"] == "prfaas"
    assert raw.headers["x-prfaas-incremental-tokens"] == "300"
    assert null_engines.servers["prfaas-p0"].served == 1  # the long prompt's prefill
    assert null_engines.servers["pd-p0"].served == 1  # the short prompt's prefill
    assert null_engines.servers["pd-d0"].served == 2  # decode always in the PD cluster


async def test_streaming_chat_with_usage(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """Chat streams deltas (role first), then a usage chunk; token ids use the chat template."""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    messages = [{"role": "user", "content": "hello"}]
    expected_prompt = len(chat_ids(ByteTokenizer(), [_msg("user", "hello")]))
    async with _client(url).chat.completions.with_streaming_response.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        assert response.headers["x-prfaas-route"] == "pd"
        chunks = [c async for c in await response.parse()]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " t0 t1 t2 t3"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == expected_prompt
    assert chunks[-1].usage.completion_tokens == 4


async def test_streaming_completion_and_nonstreaming_chat(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """Streaming completions and non-streaming chat carry the same text as each other."""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    client = _client(url)
    stream = await client.completions.create(model="tiny", prompt=LONG, max_tokens=5, stream=True)
    pieces = [c.choices[0].text async for c in stream]
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert "".join(pieces) == chat.choices[0].message.content == " t0 t1 t2 t3 t4"
    assert chat.choices[0].finish_reason == "length"


def _msg(role: str, content: str):  # type: ignore[no-untyped-def]
    from prfaas.common.tokenizer import ChatMessage

    return ChatMessage(role, content)


async def _publish_until_indexed(
    publisher: KVEventPublisher, gateway: Gateway, instance: str, event: BlockStored
) -> None:
    """ZMQ subscribers join late: publish until the gateway's index holds the blocks."""
    for _ in range(200):
        publisher.publish([event])
        await asyncio.sleep(0.02)
        if instance in gateway.index.instances() and len(gateway.index) >= 1:
            return
    raise AssertionError("the gateway never indexed the published blocks")


def _stored(prompt: str, blocks: int) -> BlockStored:
    ids = tuple(ByteTokenizer().encode(prompt)[: blocks * BLOCK])
    return BlockStored(tuple(range(1, blocks + 1)), None, ids, BLOCK)


async def test_prefix_cached_in_pd_routes_pd(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """Incremental rule: a long prompt whose first 288 tokens the PD prefill caches has 12
    uncached tokens <= t, so it routes pd; usage reports the cached prefix."""
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        config = deployment(null_engines.urls, kv_events={"pd-p0": pub.endpoint})
        url, gateway = await gateway_factory(config)
        await _publish_until_indexed(pub, gateway, "pd-p0", _stored(LONG, 18))
        raw = await _client(url).completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=2
        )
    assert raw.headers["x-prfaas-route"] == "pd"
    assert raw.headers["x-prfaas-incremental-tokens"] == "12"
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == 288


async def test_regime_decides_use_of_prfaas_cache(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """A prefix cached only in the PrfaaS cluster: the scarce regime measures 300 uncached
    tokens against the PD cache and routes prfaas (which then computes only 12); the abundant
    regime counts the PrfaaS cache, 12 <= t, and routes pd with the prefix transferred."""
    with KVEventPublisher("tcp://127.0.0.1:*") as pub:
        events = {"prfaas-p0": pub.endpoint}
        config = deployment(null_engines.urls, kv_events=events, admin_keys=("op",))
        url, gateway = await gateway_factory(config)
        await _publish_until_indexed(pub, gateway, "prfaas-p0", _stored(LONG, 18))
        client = _client(url)
        scarce = await client.completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=1
        )
        async with aiohttp.ClientSession() as s:
            admin = {"Authorization": "Bearer op"}
            body = {"regime": "bandwidth_abundant"}
            r = await s.post(f"{url}/admin/state", json=body, headers=admin)
            assert (await r.json())["regime"] == "bandwidth_abundant"
        abundant = await client.completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=1
        )
    assert (scarce.headers["x-prfaas-route"], scarce.headers["x-prfaas-incremental-tokens"]) == (
        "prfaas",
        "12",
    )
    assert abundant.headers["x-prfaas-route"] == "pd"
    assert abundant.headers["x-prfaas-incremental-tokens"] == "12"


async def test_models_metrics_and_admin_state(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """`/v1/models` lists the model; `/metrics` counts requests by route and status and
    histograms TTFT; `/admin/state` shows clusters, instances and the threshold."""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    client = _client(url)
    assert [m.id async for m in client.models.list()] == ["tiny"]
    await client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    await client.completions.create(model="tiny", prompt=LONG, max_tokens=1)
    async with aiohttp.ClientSession() as s:
        metrics = Scrape.parse(await (await s.get(f"{url}/metrics")).text())
        state = await (await s.get(f"{url}/admin/state")).json()
        health = await s.get(f"{url}/health")
    for route in ("pd", "prfaas"):
        ok = {"api": "completions", "route": route, "status": "200"}
        assert metrics.value("prfaas_requests_total", **ok) == 1
    assert metrics.value("prfaas_ttft_seconds_count", route="prfaas") == 1
    assert metrics.value("prfaas_incremental_tokens_bucket", route="prfaas", le="256.0") == 0
    assert metrics.value("prfaas_incremental_tokens_bucket", route="prfaas", le="512.0") == 1
    assert metrics.value("prfaas_threshold_tokens") == 100
    assert state["threshold"] == 100 and state["policy"] == "prfaas"
    assert [i["id"] for i in state["clusters"]["pd"]] == ["pd-p0", "pd-d0"]
    assert all(i["healthy"] for i in state["clusters"]["prfaas"])
    assert health.status == 200


async def test_aggregated_instance_gets_one_call(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """When the PD cluster's prefill and decode are one `both` instance, the request goes
    to it once, without a hand-off; long prompts still prefill in PrfaaS."""
    urls = null_engines.urls
    config = deployment(urls)
    pd_both = replace(config.instances[2], id="pd-b0", role="both", bootstrap_port=9003)
    config = replace(config, instances=(config.instances[0], pd_both))
    url, _ = await gateway_factory(config)
    client = _client(url)
    raw = await client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
    assert raw.headers["x-prfaas-route"] == "pd"
    assert raw.parse().choices[0].text == " t0 t1"
    assert null_engines.servers["pd-d0"].served == 1
    assert null_engines.servers["prfaas-p0"].served == 0
    raw = await client.completions.with_raw_response.create(model="tiny", prompt=LONG, max_tokens=2)
    assert raw.headers["x-prfaas-route"] == "prfaas"
    assert null_engines.servers["prfaas-p0"].served == 1
    assert null_engines.servers["pd-d0"].served == 2
