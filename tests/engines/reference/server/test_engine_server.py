"""The engine's HTTP API on real sockets: SGLang `/generate` (JSON and SSE), the OpenAI
routes through the `openai` client, JSON errors, disconnects, admin routes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from engine_harness import engine_server
from engine_helpers import hf_greedy, random_prompt
from transformers import PreTrainedModel

from prfaas.common.tokenizer import ByteTokenizer, ChatMessage, chat_ids
from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.model.runner import ModelRunner

GREEDY = {"temperature": 0, "ignore_eos": True}


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data) as resp:
        return resp.status, await resp.json(content_type=None)


async def sse(session: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    events: list[Any] = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        async for line in resp.content:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


async def test_generate_json_and_stream_match_transformers(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner
) -> None:
    """`/generate` returns SGLang's result object; the stream sends cumulative results, the
    last with the finish reason, then [DONE]; both equal transformers greedy."""
    prompt = random_prompt(80, 33)
    expected = hf_greedy(tiny_model, prompt, 6)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, **GREEDY}, "rid": "r1"}
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        status, result = await post(s, f"{eng.url}/generate", body)
        events = await sse(s, f"{eng.url}/generate", {**body, "stream": True, "rid": "r2"})
    assert status == 200 and result["output_ids"] == expected
    assert result["text"] == ByteTokenizer().decode(expected)
    meta = result["meta_info"]
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"]) == ("r1", 33, 6)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert events[-1] == "[DONE]" and len(events) == 7
    assert [len(e["output_ids"]) for e in events[:-1]] == [1, 2, 3, 4, 5, 6]
    assert events[-2]["output_ids"] == expected and events[-2]["meta_info"]["finish_reason"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])


async def test_openai_routes_through_the_openai_client(tiny_runner: ModelRunner) -> None:
    """`/v1/completions` and streamed `/v1/chat/completions` work with the official client
    and agree with `/generate` on the same tokens."""
    tok = ByteTokenizer()
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        client = openai.AsyncOpenAI(base_url=f"{eng.url}/v1", api_key="none", max_retries=0)
        done = await client.completions.create(
            model="qwen3-next-tiny",
            prompt="hello",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        _, ref = await post(
            s,
            f"{eng.url}/generate",
            {"text": "hello", "sampling_params": {"max_new_tokens": 5, **GREEDY}},
        )
        stream = await client.chat.completions.create(
            model="qwen3-next-tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        models = await client.models.list()
        chat = chat_ids(tok, [ChatMessage("user", "hi")])
        _, chat_ref = await post(
            s,
            f"{eng.url}/generate",
            {"input_ids": chat, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True,
                                                    **GREEDY}},
        )  # fmt: skip
    assert done.choices[0].text == ref["text"] and done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 5)
    assert done.choices[0].finish_reason == "length"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == chat_ref["text"]  # the chat's token ids are the one rule's
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in models.data] == ["qwen3-next-tiny"]


BAD_REQUESTS = [
    (b"{not json", 400, "malformed JSON"),
    ({"text": "a", "surprise": 1}, 400, "unknown field(s): surprise"),
    ({"input_ids": []}, 400, "prompt is empty"),
    ({"text": ""}, 400, "prompt is empty"),
    ({"input_ids": [1, 5000]}, 400, "outside the vocabulary"),
    ({"text": "a", "input_ids": [1]}, 400, "exactly one of text and input_ids"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "9"}}, 400, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"nope": 1}}, 400, "unknown sampling_params"),
    ({"text": "a", "bootstrap_port": 1}, 400, "bootstrap_host"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 5000}}, 413, "KV capacity"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_REQUESTS)
async def test_bad_input_gets_a_json_error(
    tiny_runner: ModelRunner, body: Any, status: int, message: str
) -> None:
    """Every bad request is an OpenAI-style error with the right status; the engine then
    still serves a good request."""
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        got, err = await post(s, f"{eng.url}/generate", body)
        ok, _ = await post(
            s, f"{eng.url}/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}
        )
    assert got == status and set(err["error"]) == {"message", "type", "param", "code"}
    assert message in err["error"]["message"]
    assert ok == 200


async def test_routing_errors_are_json(tiny_runner: ModelRunner) -> None:
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        async with s.get(f"{eng.url}/nope") as r404, s.get(f"{eng.url}/generate") as r405:
            assert (r404.status, r405.status) == (404, 405)
            assert "error" in await r404.json() and "error" in await r405.json()
        status, err = await post(
            s,
            f"{eng.url}/v1/completions",
            {"model": "qwen3-next-tiny", "prompt": "a", "echo": True},
        )
        assert status == 400 and err["error"]["param"] == "echo"


async def test_client_disconnect_aborts_and_frees_blocks(tiny_runner: ModelRunner) -> None:
    """Closing a streaming connection mid-generation ends the request and frees its KV;
    the engine keeps serving."""
    body = {
        "input_ids": random_prompt(90, 40),
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, **GREEDY},
    }
    async with engine_server(tiny_runner, InProcessHub()) as eng:
        core = eng.service.core
        async with aiohttp.ClientSession() as s, s.post(f"{eng.url}/generate", json=body) as r:
            await r.content.readline()
            assert core.pool.stats().used_blocks > 0
        for _ in range(200):
            if not core.running and core.pool.stats().used_blocks == 0:
                break
            await asyncio.sleep(0.05)
        assert not core.running and core.pool.stats().used_blocks == 0
        async with aiohttp.ClientSession() as s:
            status, _ = await post(s, f"{eng.url}/generate", {"text": "x"})
        assert status == 200


async def test_stats_flush_and_role_switch(tiny_runner: ModelRunner) -> None:
    """/stats counts prefix hits, /flush_cache empties the cache, /admin/role drains and
    switches (a prefill engine then requires bootstrap fields)."""
    prompt = random_prompt(95, 50)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        await post(s, f"{eng.url}/generate", body)
        _, second = await post(s, f"{eng.url}/generate", body)
        async with s.get(f"{eng.url}/stats") as r:
            stats = await r.json()
        async with s.post(f"{eng.url}/flush_cache") as r:
            assert r.status == 200
        _, third = await post(s, f"{eng.url}/generate", body)
        status, switched = await post(s, f"{eng.url}/admin/role", {"role": "prefill"})
        async with s.get(f"{eng.url}/server_info") as r:
            info = await r.json()
        refused, err = await post(s, f"{eng.url}/generate", body)
        bad, _ = await post(s, f"{eng.url}/admin/role", {"role": "sideways"})
    assert second["meta_info"]["cached_tokens"] == 48 and third["meta_info"]["cached_tokens"] == 0
    assert stats["prefix_hit_rate"] == pytest.approx(48 / 100)
    assert stats["kv_blocks_total"] == 256 and stats["waiting"] == stats["running"] == 0
    assert status == 200 and switched["role"] == "prefill" and switched["switch_seconds"] >= 0
    assert info["role"] == "prefill" and info["page_size"] == 16
    assert info["layer_types"][3] == "full_attention" and info["tokenizer"] == "byte-level"
    assert refused == 400 and "bootstrap" in err["error"]["message"]
    assert bad == 400


async def test_sglang_compat_abort_request_seed_alias_and_info(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner
) -> None:
    """`/abort_request` ends a running request by rid; `sampling_seed` is SGLang's seed;
    a matched stop string is cut from the text; `/server_info` has SGLang's PD keys."""
    prompt = random_prompt(97, 20)
    stop = ByteTokenizer().decode(hf_greedy(tiny_model, prompt, 3)[2:3])
    long_body = {
        "input_ids": prompt,
        "rid": "long",
        "sampling_params": {"max_new_tokens": 3000, **GREEDY},
    }
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        running = asyncio.create_task(post(s, f"{eng.url}/generate", long_body))
        for _ in range(1000):
            if eng.service.core.running:
                break
            await asyncio.sleep(0.01)
        status, aborted = await post(s, f"{eng.url}/abort_request", {"rid": "long"})
        _, result = await running
        seeded = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
        _, a = await post(
            s,
            f"{eng.url}/generate",
            {"input_ids": prompt, "sampling_params": {**seeded, "sampling_seed": 5}},
        )
        _, b = await post(
            s,
            f"{eng.url}/generate",
            {"input_ids": prompt, "sampling_params": {**seeded, "seed": 5}},
        )
        _, stopped = await post(
            s,
            f"{eng.url}/generate",
            {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "stop": stop, **GREEDY}},
        )
        async with s.get(f"{eng.url}/server_info") as r:
            info = await r.json()
    assert status == 200 and aborted == {"rid": "long", "aborted": True}
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert a["output_ids"] == b["output_ids"]
    if stop and stop != "\ufffd":
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in stopped["text"]
    assert info["disaggregation_mode"] == "null" and info["served_model_name"] == "qwen3-next-tiny"
    assert info["disaggregation_bootstrap_port"] == info["bootstrap_port"]


async def test_a_rid_in_use_is_refused(tiny_runner: ModelRunner) -> None:
    """A second request with the rid of a running one gets a 400; the first is unaffected."""
    body = {
        "input_ids": [1, 2, 3],
        "rid": "dup",
        "sampling_params": {"max_new_tokens": 40, **GREEDY},
    }
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, f"{eng.url}/generate", body))
        for _ in range(1000):
            if eng.service.core.running:
                break
            await asyncio.sleep(0.01)
        status, err = await post(s, f"{eng.url}/generate", body)
        done, result = await first
        again, _ = await post(
            s, f"{eng.url}/generate", {**body, "sampling_params": {"max_new_tokens": 1}}
        )
    assert status == 400 and "already in use" in err["error"]["message"]
    assert done == 200 and len(result["output_ids"]) == 40
    assert again == 200


async def test_role_switch_drains_running_work_first(tiny_runner: ModelRunner) -> None:
    """`/admin/role` waits for the running request to finish (it completes normally), new
    requests meanwhile get 503, and the reported switch time covers the drain."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 60, **GREEDY}}
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        running = asyncio.create_task(post(s, f"{eng.url}/generate", body))
        for _ in range(1000):
            if eng.service.core.running:
                break
            await asyncio.sleep(0.01)
        switch = asyncio.create_task(post(s, f"{eng.url}/admin/role", {"role": "decode"}))
        await asyncio.sleep(0.05)
        refused, err = await post(s, f"{eng.url}/generate", body)
        (status, result), (switched, report) = await asyncio.gather(running, switch)
    assert status == 200 and len(result["output_ids"]) == 60
    assert refused == 503 and "switching" in err["error"]["message"]
    assert switched == 200 and report == {
        "role": "decode",
        "switch_seconds": report["switch_seconds"],
    }
    assert report["switch_seconds"] > 0.04 and eng.service.core.role == "decode"


async def test_role_conversions_are_fenced_by_leader_epoch(tiny_runner: ModelRunner) -> None:
    """A leader's `/admin/fence` epoch refuses (409 `fenced`) conversions from older epochs,
    before the drain and at its end: a conversion whose drain outlasts a newer leader's
    announcement does not switch."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 60, **GREEDY}}
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        role = eng.service.core.role
        other = "decode" if role != "decode" else "prefill"
        assert await post(s, f"{eng.url}/admin/fence", {"epoch": 5}) == (200, {"epoch": 5})
        assert await post(s, f"{eng.url}/admin/fence", {"epoch": 3}) == (200, {"epoch": 5})
        old, err = await post(s, f"{eng.url}/admin/role", {"role": other, "epoch": 4})
        assert old == 409 and err["error"]["code"] == "fenced"
        assert eng.service.core.role == role
        bad, _ = await post(s, f"{eng.url}/admin/fence", {"epoch": -1})
        assert bad == 400
        # a conversion of epoch 5 drains a running request; epoch 7 announces itself meanwhile
        running = asyncio.create_task(post(s, f"{eng.url}/generate", body))
        for _ in range(1000):
            if eng.service.core.running:
                break
            await asyncio.sleep(0.01)
        switch = asyncio.create_task(post(s, f"{eng.url}/admin/role", {"role": other, "epoch": 5}))
        await asyncio.sleep(0.05)
        assert await post(s, f"{eng.url}/admin/fence", {"epoch": 7}) == (200, {"epoch": 7})
        (status, _), (switched, err) = await asyncio.gather(running, switch)
        assert status == 200
        assert switched == 409 and err["error"]["code"] == "fenced"
        assert eng.service.core.role == role and not eng.service.draining
        ok, _ = await post(s, f"{eng.url}/admin/role", {"role": other, "epoch": 7})
    assert ok == 200 and eng.service.core.role == other
