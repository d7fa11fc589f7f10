"""Bad input and failures: each gets an OpenAI-style JSON error with the right status, and
the gateway keeps serving afterwards."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from gateway_helpers import Engines, GatewayFactory, deployment

from prfaas.common.ports import free_port
from prfaas.testing.null_server import NullConfig, NullServer

OK_BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


async def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else None
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=data, json=None if data is not None else body, headers=headers) as r,
    ):
        return r.status, await r.json()


def _assert_error(status: int, body: Any, want: int, param: str | None = None) -> None:
    assert status == want, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param


BAD_INPUTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": 42}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, -3]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "temperature": True}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "top_k": 0}, 400, "top_k"),
    ({"model": "tiny", "prompt": "hi", "stop": [1]}, 400, "stop"),
    ({"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": "tiny", "prompt": "x" * 8190, "max_tokens": 8}, 400, "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
]


async def test_bad_inputs_get_json_errors_and_gateway_keeps_serving(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """Invalid JSON, missing/wrong-typed fields, unknown model, over-long prompts, invalid
    sampling: each a JSON error naming the parameter; nothing reaches an engine. (A field
    only the engine reads, such as `n`, is the engine's to serve or refuse.)"""
    url, _ = await gateway_factory(deployment(null_engines.urls))
    for body, want, param in BAD_INPUTS:
        status, reply = await _post(f"{url}/v1/completions", body)
        _assert_error(status, reply, want, param)
    bad_chat = [{"model": "tiny", "messages": []}, {"model": "tiny", "messages": [{"x": 1}]}]
    for body in bad_chat:
        status, reply = await _post(f"{url}/v1/chat/completions", body)
        _assert_error(status, reply, 400, "messages")
    assert sum(s.served for s in null_engines.servers.values()) == 0
    status, reply = await _post(f"{url}/v1/completions", OK_BODY)
    assert status == 200 and reply["choices"][0]["text"] == " t0 t1"


async def test_unknown_path_method_and_body_too_large(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """404 for an unknown path, 405 for a wrong method, 413 past the body limit."""
    url, _ = await gateway_factory(deployment(null_engines.urls, max_body_bytes=1024))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/nothing") as r:
            _assert_error(r.status, await r.json(), 404)
        async with s.get(f"{url}/v1/completions") as r:
            _assert_error(r.status, await r.json(), 405)
        async with s.post(f"{url}/health") as r:
            _assert_error(r.status, await r.json(), 405)
        async with s.delete(f"{url}/a/b/c") as r:
            _assert_error(r.status, await r.json(), 404)
        async with s.head(f"{url}/health") as r:
            assert r.status == 200
    status, reply = await _post(f"{url}/v1/completions", {**OK_BODY, "prompt": "y" * 4096})
    _assert_error(status, reply, 413)
    assert (await _post(f"{url}/v1/completions", OK_BODY))[0] == 200


async def test_api_keys(null_engines: Engines, gateway_factory: GatewayFactory) -> None:
    """With API keys set, a missing or wrong bearer key is 401; the right one is served."""
    url, _ = await gateway_factory(deployment(null_engines.urls, api_keys=("sekret",)))
    for headers in (None, {"Authorization": "Bearer nope"}, {"Authorization": "sekret"}):
        status, reply = await _post(f"{url}/v1/completions", OK_BODY, headers)
        _assert_error(status, reply, 401)
    status, _ = await _post(f"{url}/v1/completions", OK_BODY, {"Authorization": "Bearer sekret"})
    assert status == 200


async def test_queue_full_is_429_with_retry_after(gateway_factory: GatewayFactory) -> None:
    """One running slot, no queue: a second concurrent request is refused with Retry-After."""
    slow = NullServer(NullConfig(first_token_delay_s=0.5, model="tiny"))
    runner, slow_url = await start_app(slow.app())
    try:
        urls = dict.fromkeys(("prfaas-p0", "pd-p0", "pd-d0"), slow_url)
        config = deployment(urls, max_running=1, max_queued=0, retry_after_s=3)
        url, _ = await gateway_factory(config)
        async with aiohttp.ClientSession() as s:
            first = asyncio.ensure_future(s.post(f"{url}/v1/completions", json=OK_BODY))
            await asyncio.sleep(0.2)
            async with s.post(f"{url}/v1/completions", json=OK_BODY) as r:
                _assert_error(r.status, await r.json(), 429)
                assert r.headers["Retry-After"] == "3"
            assert (await first).status == 200
    finally:
        await runner.cleanup()


async def test_queue_deadline_is_408_with_retry_after(gateway_factory: GatewayFactory) -> None:
    """One running slot: a request that waits past `queue_timeout_s` for it is answered 408
    with Retry-After and never reaches an engine; the one running is served."""
    slow = NullServer(NullConfig(first_token_delay_s=1.0, model="tiny"))
    runner, slow_url = await start_app(slow.app())
    try:
        urls = dict.fromkeys(("prfaas-p0", "pd-p0", "pd-d0"), slow_url)
        config = deployment(urls, max_running=1, max_queued=4, queue_timeout_s=0.2,
                            retry_after_s=2)  # fmt: skip
        url, gateway = await gateway_factory(config)
        async with aiohttp.ClientSession() as s:
            first = asyncio.ensure_future(s.post(f"{url}/v1/completions", json=OK_BODY))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            async with s.post(f"{url}/v1/completions", json=OK_BODY) as r:
                _assert_error(r.status, await r.json(), 408)
                assert r.headers["Retry-After"] == "2"
            assert 0.15 < time.monotonic() - started < 0.8
            assert gateway.service.admission.timed_out == 1
            async with s.get(f"{url}/metrics") as r:
                waits = [line for line in (await r.text()).splitlines()
                         if line.startswith("prfaas_queue_wait_seconds_count")]  # fmt: skip
            assert waits == ["prfaas_queue_wait_seconds_count 2.0"], waits
            assert (await first).status == 200
        assert gateway.service.admission.running == 0
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
async def test_engines_down_is_503(gateway_factory: GatewayFactory, stream: bool) -> None:
    """Engines that do not answer: health marks them down and requests get 503, not a hang."""
    urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("prfaas-p0", "pd-p0", "pd-d0")}
    url, gateway = await gateway_factory(deployment(urls))
    assert not any(s.healthy for s in gateway.instances)
    status, reply = await _post(f"{url}/v1/completions", {**OK_BODY, "stream": stream})
    _assert_error(status, reply, 503)
    async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
        assert r.status == 503


async def test_a_prefill_that_died_between_health_checks_is_retried_elsewhere(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """The PD prefill died right after the last poll: its refused connection ejects it and
    the request is retried on the PrfaaS prefill (the other cluster), so the client never
    sees the failure."""
    urls = {**null_engines.urls, "pd-p0": f"http://127.0.0.1:{free_port()}"}
    url, gateway = await gateway_factory(deployment(urls, health_interval_s=60))
    gateway.instances["pd-p0"].status = "healthy"  # as if it died right after the last poll
    status, reply = await _post(f"{url}/v1/completions", OK_BODY)
    assert status == 200, reply
    assert gateway.instances["pd-p0"].status == "ejected"  # the Router ejected it
    assert null_engines.servers["prfaas-p0"].served == 1


async def test_unreachable_decode_is_marked_down(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """A decode engine that died between health checks is marked unhealthy by the Router
    (so a retry cannot pick it again); the client gets a JSON engine error, not a hang."""
    urls = {**null_engines.urls, "pd-d0": f"http://127.0.0.1:{free_port()}"}
    url, gateway = await gateway_factory(deployment(urls, health_interval_s=60, retry_wait_s=0))
    for stream in (False, True):
        gateway.instances["pd-d0"].status = "healthy"  # as if it died after the last poll
        status, reply = await _post(f"{url}/v1/completions", {**OK_BODY, "stream": stream})
        _assert_error(status, reply, 503)
        assert not gateway.instances["pd-d0"].healthy


async def test_late_prefill_failure_does_not_cut_an_answer(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """Decode answered (so it had the KV) and the prefill call then fails: the answer
    stands (200), and the gateway keeps serving."""

    async def failing(request: web.Request) -> web.Response:
        await asyncio.sleep(0.2)
        return web.json_response({"error": {"message": "hand-off failed"}}, status=500)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/generate", failing)
    app.router.add_get("/health", ok)
    runner, bad_url = await start_app(app)
    try:
        url, _ = await gateway_factory(deployment({**null_engines.urls, "pd-p0": bad_url}))
        status, reply = await _post(f"{url}/v1/completions", OK_BODY)
        assert status == 200 and reply["choices"][0]["text"] == " t0 t1"
        assert (await _post(f"{url}/v1/completions", {**OK_BODY, "prompt": "q" * 200}))[0] == 200
    finally:
        await runner.cleanup()
