"""`SGLangClient.generate` against a real aiohttp engine stand-in: whole and streamed
answers become chunks, an answer of the wrong shape fails the call instead of hanging it,
and a call that times out or is aborted after it was sent is aborted on the engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from prfaas.engine_clients.base import EngineError, collect
from prfaas.engine_clients.sglang import SGLangClient, SGLangClientConfig
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.generate import GenerateRequest, SamplingParams


class _Engine:
    """`/generate` answers per `mode`; `/abort_request` rids are recorded."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        return app

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if self.mode == "hang":  # until the client aborts the request
            await asyncio.wait_for(self.abort_seen.wait(), 10)
        if self.mode == "bad-shape":
            return web.json_response({"text": "a", "output_ids": ["x"], "meta_info": []})
        if self.mode == "busy":
            return web.json_response({"error": "queue full"}, status=503)
        if not body["stream"]:
            return web.json_response(_answer("ab", [97, 98], "length"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text, ids, finish in (("a", [97], None), ("ab", [97, 98], "length")):
            await resp.write(b"data: " + orjson.dumps(_answer(text, ids, finish)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def abort(self, request: web.Request) -> web.Response:
        self.aborted.append(orjson.loads(await request.read())["rid"])
        self.abort_seen.set()
        return web.json_response({})


def _answer(text: str, ids: list[int], finish: str | None) -> dict[str, object]:
    reason = None if finish is None else {"type": finish}
    meta = {"prompt_tokens": 3, "completion_tokens": len(ids), "finish_reason": reason}
    return {"text": text, "output_ids": ids, "meta_info": meta}


@pytest.fixture
async def engine() -> AsyncIterator[tuple[_Engine, SGLangClient]]:
    stand_in = _Engine()
    runner = web.AppRunner(stand_in.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = SGLangClientConfig(read_timeout_s=0.3, control_timeout_s=2)
    async with aiohttp.ClientSession() as session:
        client = SGLangClient("e0", f"http://127.0.0.1:{port}", session, config)
        yield stand_in, client
        await client.close()
    await runner.cleanup()


def _request(rid: str, stream: bool = False) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingParams(max_new_tokens=2), stream=stream)


async def _aborted(stand_in: _Engine) -> list[str]:
    for _ in range(100):
        if stand_in.aborted:
            break
        await asyncio.sleep(0.02)
    return stand_in.aborted


async def test_whole_and_streamed_answers_become_chunks(
    engine: tuple[_Engine, SGLangClient],
) -> None:
    """A whole answer is one chunk; a stream of cumulative answers becomes deltas. Neither
    call is aborted (both ended)."""
    stand_in, client = engine
    [whole] = await collect(client.generate(_request("w")))
    assert (whole.token_ids, whole.text, whole.finish_reason) == ((97, 98), "ab", "length")
    streamed = await collect(client.generate(_request("s", stream=True)))
    assert [(c.token_ids, c.text, c.completion_tokens) for c in streamed] == [
        ((97,), "a", 1),
        ((98,), "b", 2),
    ]
    await asyncio.sleep(0.05)
    assert stand_in.aborted == []


async def test_an_answer_of_the_wrong_shape_fails_the_call(
    engine: tuple[_Engine, SGLangClient],
) -> None:
    stand_in, client = engine
    stand_in.mode = "bad-shape"
    with pytest.raises(EngineError, match="meta_info must be an object"):
        await asyncio.wait_for(collect(client.generate(_request("r1"))), 2)


async def test_a_refusal_is_retryable_and_not_aborted(
    engine: tuple[_Engine, SGLangClient],
) -> None:
    stand_in, client = engine
    stand_in.mode = "busy"
    with pytest.raises(EngineError, match="answered 503") as caught:
        await collect(client.generate(_request("busy")))
    assert caught.value.retryable and caught.value.status == 503
    await asyncio.sleep(0.05)
    assert stand_in.aborted == []


async def test_a_call_that_times_out_is_aborted_on_the_engine(
    engine: tuple[_Engine, SGLangClient],
) -> None:
    stand_in, client = engine
    stand_in.mode = "hang"
    with pytest.raises(EngineError, match="timed out"):
        await asyncio.wait_for(collect(client.generate(_request("slow"))), 5)
    assert await _aborted(stand_in) == ["slow"]


async def test_an_aborted_call_raises_the_given_error_and_aborts_on_the_engine(
    engine: tuple[_Engine, SGLangClient],
) -> None:
    stand_in, client = engine
    stand_in.mode = "hang"
    call = client.generate(_request("gone"))
    await asyncio.sleep(0.1)  # sent, the engine is working on it
    call.abort(EngineError("prefill failed first"))
    with pytest.raises(EngineError, match="prefill failed first"):
        await call.next()
    assert call.ended.done() and await _aborted(stand_in) == ["gone"]


async def test_an_unreachable_engine_is_retryable() -> None:
    async with aiohttp.ClientSession() as session:
        client = SGLangClient("e9", "http://127.0.0.1:9", session, SGLangClientConfig())
        with pytest.raises(EngineError, match="unreachable") as caught:
            await collect(client.generate(_request("x")))
        assert caught.value.retryable
        await client.close()


async def test_an_sglang_server_client_refuses_by_name_what_sglang_would_ignore() -> None:
    """SGLang's OpenAI server ignores fields it does not declare: the client of a real
    SGLang server refuses such a field with a 400 naming it, before sending anything (a
    reference engine's client forwards it: that engine refuses by name itself)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "structured_outputs": {"regex": "a+"}}  # fmt: skip
    request = GenerateRequest("r", (1, 2), client_body=ClientBody("chat", body))
    async with aiohttp.ClientSession() as session:
        client = SGLangClient("s", "http://127.0.0.1:9", session, sglang_server=True)
        with pytest.raises(EngineError) as err:
            await collect(client.generate(request))
        assert err.value.status == 400 and err.value.rejected and err.value.answer
        assert orjson.loads(err.value.answer)["error"]["param"] == "structured_outputs"
        await client.close()
