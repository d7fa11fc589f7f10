"""`VLLMClient`: the side of a request it plays (from the bootstrap address), its
`/v1/completions` bodies, and answers of a real HTTP server in vLLM's shape (whole, streamed
with token ids, failed) turned into chunks or errors. Real vLLM servers drive it in
`tests/engines/vllm/`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import orjson
import pytest
from aiohttp import web

from prfaas.engine_clients.base import EngineError, collect
from prfaas.engine_clients.vllm import (
    VLLMClient,
    VLLMEndpoint,
    completion_body,
    engine_body,
    export_body,
)
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.generate import Bootstrap, GenerateRequest, SamplingParams

PREFILL = VLLMEndpoint("http://127.0.0.1:1", "prefill", "tiny", "10.0.0.5", 8998)
DECODE = VLLMEndpoint("http://127.0.0.1:2", "decode", "tiny")


def test_the_bootstrap_address_tells_each_instance_its_side() -> None:
    """The instance whose own KV sender is the bootstrap prefills (one token, unstreamed,
    room R); any other decodes from that address; without a bootstrap it runs alone."""
    sampling = SamplingParams(max_new_tokens=9, temperature=0.0, stop_token_ids=(5,))
    boot = Bootstrap("10.0.0.5", 8998, 42)
    request = GenerateRequest("r1", (1, 2, 3), sampling, True, boot)
    pre, dec = completion_body(request, PREFILL), completion_body(request, DECODE)
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "room": 42}
    assert (pre["max_tokens"], pre["stream"], "stream_options" in pre) == (1, False, False)
    assert dec["kv_transfer_params"] == {
        "do_remote_prefill": True, "remote_host": "10.0.0.5", "remote_port": 8998, "room": 42,
    }  # fmt: skip
    assert (dec["max_tokens"], dec["stream"], dec["stop_token_ids"]) == (9, True, [5])
    assert dec["prompt"] == [1, 2, 3] and dec["model"] == "tiny" and dec["return_token_ids"]
    alone = completion_body(GenerateRequest("r2", (1,), sampling, False), DECODE)
    assert "kv_transfer_params" not in alone


def _event(ids: list[int], text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    if body["prompt"] == [0]:
        return web.json_response({"error": {"message": "bad prompt"}}, status=400)
    if not body.get("stream"):
        choice = {"text": "ab", "token_ids": [7, 8], "finish_reason": "length"}
        return web.json_response({"choices": [choice], "usage": {"prompt_tokens": 2}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_event([7], "a"))
    if body["prompt"] == [9]:  # the KV load failed: vLLM ends the request with an error
        await resp.write(_event([], "", "error"))
    else:
        await resp.write(_event([8], "b", "length"))
        usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
    return resp


@pytest.fixture
async def client() -> AsyncIterator[VLLMClient]:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as session:
        endpoint = VLLMEndpoint(f"http://127.0.0.1:{port}", "decode", "tiny")
        vllm = VLLMClient("d0", endpoint, session)
        yield vllm
        await vllm.close()
    await runner.cleanup()


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CLIENT_BODY = {
    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
    "tool_choice": "required", "response_format": {"type": "json_object"}, "n": 1,
    "max_completion_tokens": 30, "logprobs": True, "top_logprobs": 2, "stream": True,
    "logit_bias": {"5": 3}, "chat_template_kwargs": {"x": 1}, "cache_salt": "s",
}  # fmt: skip


def test_a_forwarded_body_reaches_the_decode_whole_and_the_prefill_as_a_prompt() -> None:
    """The decode gets the client's body whole plus `kv_transfer_params` (and its stream's
    usage, for the gateway's counts); the prefill the same rendering fields (messages, tools
    with `tool_choice` none, template kwargs, cache salt) for one unstreamed token without
    grammar, several choices or log-probabilities."""
    boot = Bootstrap("10.0.0.5", 8998, 42)
    forwarded = ClientBody("chat", CLIENT_BODY)
    request = GenerateRequest("r1", (1, 2, 3), SamplingParams(), True, boot, client_body=forwarded)
    dec, pre = engine_body(request, DECODE), engine_body(request, PREFILL)
    assert {k: v for k, v in dec.items() if k not in ("kv_transfer_params", "stream_options")} == (
        CLIENT_BODY
    )
    # the usage the gateway counts from, without the continuous usage the client never asked
    assert dec["kv_transfer_params"]["do_remote_prefill"] and dec["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": False
    }  # fmt: skip
    assert pre == {
        "model": "tiny", "messages": CLIENT_BODY["messages"], "tools": TOOLS,
        "tool_choice": "none", "logit_bias": {"5": 3}, "chat_template_kwargs": {"x": 1},
        "cache_salt": "s", "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "room": 42},
    }  # fmt: skip
    assert "stream_options" not in CLIENT_BODY  # the client's body is never mutated


async def test_forwarded_answers_are_relayed_as_written(client: VLLMClient) -> None:
    """A forwarded call's chunks carry the engine's own events (`raw`); the usage event the
    gateway asked for is counted but not relayed; a refusal keeps the engine's status and
    body."""
    streamed = await collect(client.generate(_forwarded({"prompt": "x", "stream": True})))
    raws = [c.raw for c in streamed]
    assert [orjson.loads(r)["choices"][0]["text"] for r in raws[:2] if r] == ["a", "b"]
    assert raws[2] == b"" and streamed[-1].completion_tokens == 2
    whole = await collect(client.generate(_forwarded({"prompt": "x"})))
    assert [orjson.loads(c.raw or b"")["choices"][0]["text"] for c in whole] == ["ab"]
    with pytest.raises(EngineError) as refused:
        await collect(client.generate(_forwarded({"prompt": [0]})))
    assert refused.value.status == 400 and refused.value.rejected
    assert orjson.loads(refused.value.answer or b"") == {"error": {"message": "bad prompt"}}


def _forwarded(fields: dict[str, object]) -> GenerateRequest:
    body = ClientBody("completions", {"model": "tiny", **fields})
    return GenerateRequest("f", (1,), SamplingParams(), body.stream, client_body=body)


async def test_streamed_and_whole_answers_become_chunks(client: VLLMClient) -> None:
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
    streamed = await collect(client.generate(GenerateRequest("s", (1, 2), sampling, True)))
    assert [(c.token_ids, c.text, c.completion_tokens, c.finish_reason) for c in streamed] == [
        ((7,), "a", 1, None),
        ((8,), "b", 2, "length"),
    ]
    whole = await collect(client.generate(GenerateRequest("w", (1, 2), sampling, False)))
    assert [(c.token_ids, c.text, c.finish_reason) for c in whole] == [((7, 8), "ab", "length")]


async def test_failures_are_engine_errors(client: VLLMClient) -> None:
    """An error status and a request vLLM ends with `finish_reason: error` (a failed KV
    load) fail the call with a message naming the instance."""
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
    with pytest.raises(EngineError, match="d0: /v1/completions answered 400"):
        await collect(client.generate(GenerateRequest("e", (0,), sampling, True)))
    with pytest.raises(EngineError, match="d0: the request failed in the engine"):
        await collect(client.generate(GenerateRequest("f", (9,), sampling, True)))


def test_a_prefix_pull_goes_to_the_prefill_only_and_the_export_is_its_prefix() -> None:
    """The prefill's `kv_transfer_params` carry the pull (room and length) beside its own
    room, in token-id and forwarded bodies alike; the decode's never do. The source's export
    is a prefill request of the prefix plus one token into the pull's room."""
    boot, pull = Bootstrap("10.0.0.5", 8998, 42), Bootstrap("10.0.0.9", 7000, 43)
    request = GenerateRequest("r1", tuple(range(1, 11)), SamplingParams(), True, boot,
                              prefix_pull=pull, prefix_tokens=4)  # fmt: skip
    want = {"do_remote_decode": True, "room": 42,
            "prefix_pull": {"host": "10.0.0.9", "port": 7000, "room": 43, "tokens": 4}}  # fmt: skip
    assert completion_body(request, PREFILL)["kv_transfer_params"] == want
    assert "prefix_pull" not in completion_body(request, DECODE)["kv_transfer_params"]
    forwarded = replace(request, client_body=ClientBody("chat", CLIENT_BODY))
    assert engine_body(forwarded, PREFILL)["kv_transfer_params"] == want
    assert export_body(request.input_ids, 43, 4, "tiny") == {
        "model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1, "temperature": 0,
        "stream": False, "kv_transfer_params": {"do_remote_decode": True, "room": 43},
    }  # fmt: skip
