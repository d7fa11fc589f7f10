"""Anthropic Messages and OpenAI Responses through the gateway, with the official `anthropic`
and `openai` clients: routing headers, each API's events and errors (Anthropic's error
bodies under /v1/messages), `x-api-key`, the gateway's Responses state (stored responses,
`previous_response_id` expanded into the conversation the engine gets, background responses
and their cancel, two replicas sharing a real Redis store, the store down), the SGLang
client's refusal of fields SGLang would drop, and `/openapi.json`. Engines are null servers:
these tests are about the gateway, not model output (tests/serve/test_reference_agents.py
runs the same clients against real engines)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from gateway_helpers import Engines, GatewayFactory, deployment
from redis_helpers import RedisServer

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.gateway.deployment import DeploymentConfig
from prfaas.gateway.responses.config import ResponsesConfig
from prfaas.protocol.anthropic_messages import template_rules
from prfaas.protocol.anthropic_messages import to_chat as messages_chat
from prfaas.protocol.openai_request import chat_body_ids
from prfaas.protocol.openai_responses import to_chat as responses_chat
from prfaas.testing.null_server import NullConfig, NullServer

LONG = "x" * 300  # past the threshold of 100: the PrfaaS cluster
USER = [{"role": "user", "content": "hi"}]


def _anthropic(url: str, key: str = "none") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


def _openai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _messages_ids(body: dict[str, Any]) -> list[int]:
    tok = ByteTokenizer()
    return chat_body_ids(tok, messages_chat({"model": "tiny", **body}, template_rules(tok)))


def _responses_ids(body: dict[str, Any]) -> list[int]:
    return chat_body_ids(ByteTokenizer(), responses_chat({"model": "tiny", **body}))


async def test_messages_create_stream_and_count_tokens(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """Whole and streamed answers carry the routing headers and the prompt's tokens as the
    gateway rendered them; a long prompt goes to the PrfaaS cluster; the SDK's stream
    helper assembles the message from Anthropic's events."""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    client = _anthropic(url)
    raw = await client.messages.with_raw_response.create(model="tiny", max_tokens=3,
                                                         system="S", messages=USER)  # fmt: skip
    assert raw.headers["x-prfaas-route"] == "pd"
    prompt = _messages_ids({"system": "S", "messages": USER, "max_tokens": 3})
    assert raw.headers["x-prfaas-incremental-tokens"] == str(len(prompt))
    message = await raw.parse()
    assert message.content[0].text == " t0 t1 t2" and message.stop_reason == "max_tokens"
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == len(prompt)
    long = [{"role": "user", "content": LONG}]
    async with client.messages.stream(model="tiny", max_tokens=4, messages=long) as stream:
        texts = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == " t0 t1 t2 t3" == final.content[0].text
    assert final.usage.output_tokens == 4
    assert null_engines.servers["prfaas-p0"].served == 1  # the long prompt's prefill
    count = await client.messages.count_tokens(model="tiny", messages=USER, system="S")
    assert count.input_tokens == len(prompt)


async def test_messages_errors_are_anthropics_and_the_gateway_keeps_serving(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    url, _ = await gateway_factory(deployment(null_engines.urls))
    client = _anthropic(url)
    bad: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": [{"type": "bogus"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": USER, "tools": [{"name": "f"}]},
        {"messages": [{"role": "user", "content": "x" * 9000}]},  # over the context
    ]
    for body in bad:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model="tiny", max_tokens=3, **body)
        assert caught.value.body["type"] == "error"  # type: ignore[index]
        assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="nope", max_tokens=3, messages=USER)  # type: ignore[arg-type]
    async with aiohttp.ClientSession() as session:
        for path, method, status in (("/v1/messages/nope", "POST", 404),
                                     ("/v1/messages", "GET", 405)):  # fmt: skip
            async with session.request(method, url + path) as r:
                body = await r.json()
                assert r.status == status and body["type"] == "error", body
        async with session.post(url + "/v1/messages", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        huge = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "'
        async with session.post(url + "/v1/messages", data=huge + b"x" * 2**23 + b'"}]}') as r:
            assert r.status == 413  # refused from its Content-Length, before it is read
            assert (await r.json())["error"]["type"] == "request_too_large"
        async with session.post(url + "/v1/messages", data=b"{}",
                                headers={"Transfer-Encoding": "gzip, chunked"}) as r:  # fmt: skip
            body = await r.json()  # the HTTP server's own refusal, in the route's dialect
            assert r.status == 400 and body["type"] == "error", body
    ok = await client.messages.create(model="tiny", max_tokens=2, messages=USER)
    assert ok.stop_reason == "max_tokens"


async def test_anthropic_clients_authenticate_with_x_api_key(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    config = deployment(null_engines.urls)
    config = replace(config, gateway=replace(config.gateway, api_keys=("k1",)))
    url, _ = await gateway_factory(config)
    assert (await _anthropic(url, "k1").messages.create(model="tiny", max_tokens=1,
                                                        messages=USER)).content  # fmt: skip
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await _anthropic(url, "wrong").messages.create(model="tiny", max_tokens=1, messages=USER)
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_responses_create_stream_and_previous_response_id(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """A follow-up's prompt is the whole conversation (the previous input, its output, the
    new input; not its instructions), counted whole for routing, and the answer names the
    previous response; a streamed follow-up is stored too."""
    url, gw = await gateway_factory(deployment(null_engines.urls))
    client = _openai(url)
    first = await client.responses.create(model="tiny", input="hi", instructions="S",
                                          max_output_tokens=3)  # fmt: skip
    assert first.output_text == " t0 t1 t2" and first.previous_response_id is None
    raw = await client.responses.with_raw_response.create(
        model="tiny", input="more", previous_response_id=first.id, max_output_tokens=2
    )
    second = raw.parse()
    conversation = [{"role": "user", "content": "hi"},
                    {"type": "message", "role": "assistant", "content": [
                        {"type": "output_text", "text": " t0 t1 t2"}]},
                    {"role": "user", "content": "more"}]  # fmt: skip
    want = _responses_ids({"input": conversation})
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens == len(want)
    assert int(raw.headers["x-prfaas-incremental-tokens"]) == len(want)
    async with client.responses.stream(model="tiny", input="again", max_output_tokens=2,
                                       previous_response_id=second.id) as stream:  # fmt: skip
        kinds = [event.type async for event in stream]
        third = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert third.previous_response_id == second.id
    assert (await client.responses.retrieve(third.id)).output_text == third.output_text
    assert gw.service.responses is not None
    assert len(gw.service.responses.store) == 3  # type: ignore[arg-type]
    unstored = await client.responses.create(model="tiny", input="x", store=False,
                                             max_output_tokens=1)  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_stored_responses_get_delete_cancel_and_bad_ids(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    url, _ = await gateway_factory(deployment(null_engines.urls))
    client = _openai(url)
    done = await client.responses.create(model="tiny", input="hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        await client.responses.cancel(done.id)  # not running in the background
    await client.responses.delete(done.id)
    follow_up = client.responses.create(model="tiny", input="x", previous_response_id=done.id)
    for call in (client.responses.retrieve(done.id), client.responses.delete(done.id), follow_up):
        with pytest.raises(openai.NotFoundError):
            await call
    async with aiohttp.ClientSession() as session:
        for path in ("/v1/responses/" + "x" * 300, "/v1/responses/a/b", "/v1/responses/"):
            async with session.get(url + path) as r:
                assert r.status == 404, path
        async with session.post(url + "/v1/responses", json={"model": "tiny", "input": 3}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "input"


async def test_background_responses_complete_or_are_cancelled(
    gateway_factory: GatewayFactory,
) -> None:
    """A background response is answered queued, then stored when the engine is done; one
    cancelled while it runs is aborted and recorded cancelled; background needs `store`."""
    from aiohttp_helpers import start_app

    servers, runners, urls = {}, [], {}
    for name in ("prfaas-p0", "pd-p0", "pd-d0"):
        servers[name] = NullServer(NullConfig(block_size=16, model="tiny", token_delay_s=0.02))
        runner, urls[name] = await start_app(servers[name].app())
        runners.append(runner)
    try:
        url, _ = await gateway_factory(deployment(urls))
        client = _openai(url)
        queued = await client.responses.create(model="tiny", input="hi", max_output_tokens=3,
                                               background=True)  # fmt: skip
        assert queued.status == "queued" and queued.background
        for _ in range(100):
            got = await client.responses.retrieve(queued.id)
            if got.status == "completed" or got.status == "incomplete":
                break
            await asyncio.sleep(0.05)
        assert got.output_text == " t0 t1 t2" and got.id == queued.id and got.background
        slow = await client.responses.create(model="tiny", input="hi", max_output_tokens=500,
                                             background=True)  # fmt: skip
        await asyncio.sleep(0.3)
        with pytest.raises(openai.BadRequestError):  # a follow-up must wait for it
            await client.responses.create(model="tiny", input="x", previous_response_id=slow.id)
        cancelled = await client.responses.cancel(slow.id)
        assert cancelled.status == "cancelled"
        assert (await client.responses.retrieve(slow.id)).status == "cancelled"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="tiny", input="x", background=True, store=False)
        assert "store" in caught.value.message
    finally:
        for runner in runners:
            await runner.cleanup()


async def _slow_engines(runners: list[Any]) -> dict[str, str]:
    """Null engines that send a token every 20 ms (their runners appended to `runners`)."""
    from aiohttp_helpers import start_app

    urls = {}
    for name in ("prfaas-p0", "pd-p0", "pd-d0"):
        null = NullServer(NullConfig(block_size=16, model="tiny", token_delay_s=0.02))
        runner, urls[name] = await start_app(null.app())
        runners.append(runner)
    return urls


async def _completed(client: openai.AsyncOpenAI, response_id: str) -> Any:
    for _ in range(200):
        got = await client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"{response_id} still running")


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def test_a_streamed_background_response_is_read_again_from_where_it_left_off(
    gateway_factory: GatewayFactory,
) -> None:
    """`background` with `stream`: the client reads a few events and goes away, the response
    still completes, and `GET ?stream=true&starting_after=N` gives the events after N (to
    the end), the whole stream without it; a response whose events are not kept is a 400,
    an unknown one a 404, a bad `starting_after` a 400."""
    runners: list[Any] = []
    try:
        url, _ = await gateway_factory(deployment(await _slow_engines(runners)))
        client = _openai(url)
        stream = await client.responses.create(model="tiny", input="hi", max_output_tokens=6,
                                               background=True, stream=True)  # fmt: skip
        seen = []
        async for event in stream:
            seen.append(event)
            if len(seen) == 4:
                break
        await stream.close()  # the client goes away: the response runs on
        response_id = seen[0].response.id
        assert seen[0].response.background and seen[0].type == "response.created"
        done = await _completed(client, response_id)
        assert done.status == "incomplete" and done.output_text == " t0 t1 t2 t3 t4 t5"
        after = seen[-1].sequence_number
        rest = [e async for e in await client.responses.retrieve(
            response_id, stream=True, starting_after=after)]  # fmt: skip
        assert rest[0].sequence_number == after + 1
        assert rest[-1].type == "response.completed" and rest[-1].response.id == response_id
        assert rest[-1].response.background and _text(seen + rest) == done.output_text
        whole = [e async for e in await client.responses.retrieve(response_id, stream=True)]
        assert [e.sequence_number for e in whole] == list(range(len(whole)))
        assert [e.type for e in whole] == [e.type for e in seen + rest]
        foreground = await client.responses.create(model="tiny", input="hi", max_output_tokens=1)
        async with aiohttp.ClientSession() as session:
            for path, status, param in (
                (f"/v1/responses/{foreground.id}?stream=true", 400, "stream"),
                ("/v1/responses/resp_unknown?stream=true", 404, "response_id"),
                (f"/v1/responses/{response_id}?stream=true&starting_after=-1", 400,
                 "starting_after"),
                (f"/v1/responses/{response_id}?stream=maybe", 400, "stream"),
            ):  # fmt: skip
                async with session.get(url + path) as r:
                    assert r.status == status, path
                    assert (await r.json())["error"]["param"] == param, path
            # stream=false (or absent) is the stored object, whatever starting_after says
            async with session.get(url + f"/v1/responses/{response_id}?stream=false&"
                                   "starting_after=3") as r:  # fmt: skip
                assert r.status == 200 and (await r.json())["status"] == "incomplete"
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_cancelled_streamed_background_response_ends_its_stream_with_an_error(
    gateway_factory: GatewayFactory,
) -> None:
    """A streamed background response cancelled while its client reads: the stream ends
    with the `error` event (not `response.completed`), the stored status is cancelled, and
    a reader that comes later gets the same events."""
    runners: list[Any] = []
    try:
        url, _ = await gateway_factory(deployment(await _slow_engines(runners)))
        client = _openai(url)
        stream = await client.responses.create(model="tiny", input="hi", max_output_tokens=500,
                                               background=True, stream=True)  # fmt: skip
        seen = []
        async for event in stream:
            seen.append(event)
            if len(seen) == 5:
                await client.responses.cancel(seen[0].response.id)
        assert seen[-1].type == "error" and seen[-1].code == "response_cancelled"
        assert seen[-1].sequence_number == len(seen) - 1
        response_id = seen[0].response.id
        assert (await client.responses.retrieve(response_id)).status == "cancelled"
        again = [e async for e in await client.responses.retrieve(response_id, stream=True)]
        assert [e.type for e in again] == [e.type for e in seen]
    finally:
        for runner in runners:
            await runner.cleanup()


def _redis_deployment(urls: dict[str, str], store: str) -> DeploymentConfig:
    return replace(deployment(urls), responses=ResponsesConfig(store=store))


async def test_two_gateways_share_the_conversation_through_redis(
    null_engines: Engines, gateway_factory: GatewayFactory, redis: RedisServer
) -> None:
    """A follow-up reaches the other replica: with a shared Redis store it continues the
    conversation there; with each replica's memory store it is answered 404."""
    a, _ = await gateway_factory(_redis_deployment(null_engines.urls, redis.url))
    b, _ = await gateway_factory(_redis_deployment(null_engines.urls, redis.url))
    first = await _openai(a).responses.create(model="tiny", input="hi", max_output_tokens=2)
    second = await _openai(b).responses.create(model="tiny", input="more", max_output_tokens=2,
                                               previous_response_id=first.id)  # fmt: skip
    assert second.previous_response_id == first.id
    assert (await _openai(a).responses.retrieve(second.id)).id == second.id
    alone_a, _ = await gateway_factory(deployment(null_engines.urls))
    alone_b, _ = await gateway_factory(deployment(null_engines.urls))
    mine = await _openai(alone_a).responses.create(model="tiny", input="hi", max_output_tokens=1)
    elsewhere = _openai(alone_b).responses
    with pytest.raises(openai.NotFoundError):
        await elsewhere.create(model="tiny", input="x", previous_response_id=mine.id)


async def test_a_cancel_through_another_replica_stops_the_engine_work(
    gateway_factory: GatewayFactory, redis: RedisServer
) -> None:
    """A background response runs on replica A; its cancel reaches replica B, which records
    it in the shared store; A reads that within `cancel_poll_s` and stops the engine work
    (its request to the engines cancelled: about 10 s of tokens left) and keeps the status."""
    from aiohttp_helpers import start_app

    runners, urls = [], {}
    for name in ("prfaas-p0", "pd-p0", "pd-d0"):
        null = NullServer(NullConfig(block_size=16, model="tiny", token_delay_s=0.02))
        runner, urls[name] = await start_app(null.app())
        runners.append(runner)
    try:
        shared = ResponsesConfig(store=redis.url, cancel_poll_s=0.1)
        config = replace(deployment(urls), responses=shared)
        a, gw_a = await gateway_factory(config)
        b, _ = await gateway_factory(config)
        slow = await _openai(a).responses.create(
            model="tiny", input="hi", max_output_tokens=500, background=True
        )
        service = gw_a.service.responses
        assert service is not None
        await asyncio.sleep(0.3)
        assert slow.id in service._running  # A runs it
        cancelled = await _openai(b).responses.cancel(slow.id)
        assert cancelled.status == "cancelled"
        for _ in range(40):
            if slow.id not in service._running:
                break
            await asyncio.sleep(0.05)
        assert slow.id not in service._running  # stopped within about one poll, not 10 s
        assert (await _openai(a).responses.retrieve(slow.id)).status == "cancelled"
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_streamed_background_response_is_read_again_through_another_replica(
    gateway_factory: GatewayFactory, redis: RedisServer
) -> None:
    """With a shared Redis store, the events of a streamed background response running on
    replica A are read from replica B, from where the client left off, as they come."""
    runners: list[Any] = []
    try:
        config = _redis_deployment(await _slow_engines(runners), redis.url)
        a, _ = await gateway_factory(config)
        b, _ = await gateway_factory(config)
        stream = await _openai(a).responses.create(
            model="tiny", input="hi", max_output_tokens=30, background=True, stream=True
        )
        seen = []
        async for event in stream:
            seen.append(event)
            if len(seen) == 3:
                break
        await stream.close()
        response_id = seen[0].response.id
        rest = [e async for e in await _openai(b).responses.retrieve(
            response_id, stream=True, starting_after=seen[-1].sequence_number)]  # fmt: skip
        assert [e.sequence_number for e in seen + rest] == list(range(len(seen) + len(rest)))
        assert rest[-1].type == "response.completed" and rest[-1].response.id == response_id
        assert _text(seen + rest) == (await _completed(_openai(b), response_id)).output_text
        assert len(_text(seen + rest).split()) == 30
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_with_the_store_down_follow_ups_are_503_and_answers_still_arrive(
    null_engines: Engines, gateway_factory: GatewayFactory, redis: RedisServer
) -> None:
    url, gw = await gateway_factory(_redis_deployment(null_engines.urls, redis.url))
    client = _openai(url)
    first = await client.responses.create(model="tiny", input="hi", max_output_tokens=1)
    redis.kill()
    with pytest.raises(openai.InternalServerError) as caught:
        await client.responses.create(model="tiny", input="x", previous_response_id=first.id)
    assert caught.value.status_code == 503
    answered = await client.responses.create(model="tiny", input="y", max_output_tokens=2)
    assert answered.output_text == " t0 t1"  # answered; not stored, and counted
    assert gw.metrics.response_store_errors._value.get() == 1


async def test_sglang_servers_get_bootstrap_fields_and_unknown_fields_are_refused(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """SGLang's Messages and Responses models take `bootstrap_*` (so bodies go whole), and
    drop fields they do not declare: those are refused by name, in each API's dialect."""
    config = deployment(null_engines.urls)
    instances = tuple(replace(i, engine="sglang") for i in config.instances)
    url, _ = await gateway_factory(replace(config, instances=instances))
    message = await _anthropic(url).messages.create(model="tiny", max_tokens=2, messages=USER)
    assert message.content[0].text == " t0 t1"  # type: ignore[union-attr]
    with pytest.raises(anthropic.BadRequestError) as caught:
        await _anthropic(url).messages.create(model="tiny", max_tokens=2, messages=USER,
                                              extra_body={"cache_salt": "s"})  # fmt: skip
    assert "cache_salt" in caught.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        await _openai(url).responses.create(model="tiny", input="x",
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert refused.value.body["param"] == "ignore_eos"  # type: ignore[index]


async def test_openapi_describes_every_route(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    from prfaas.gateway.api.app import ROUTES

    url, _ = await gateway_factory(deployment(null_engines.urls))
    async with aiohttp.ClientSession() as session, session.get(url + "/openapi.json") as r:
        doc = await r.json()
    assert r.status == 200 and doc["openapi"].startswith("3.1")
    paths = doc["paths"]
    for path, methods in ROUTES.items():
        assert {m.lower() for m in methods} <= set(paths[path]), path
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert set(paths["/v1/responses/{response_id}/cancel"]) == {"post"}
    assert "text/event-stream" in paths["/v1/messages"]["post"]["responses"]["200"]["content"]
