"""The streaming client against real loopback servers: metrics from real streams, faults."""

from __future__ import annotations

import time

import aiohttp
import numpy as np
import pytest
from loadgen_helpers import FIRST_DELAY_S, TOKEN_DELAY_S, Script

from prfaas.common.ports import free_port
from prfaas.loadgen.apis import create_api
from prfaas.loadgen.client import RequestSpec, StreamingClient
from prfaas.loadgen.conversation import Conversation
from prfaas.loadgen.records import RequestRecord


def _conv(n: int = 12) -> Conversation:
    conv = Conversation()
    conv.add("user", np.arange(100, 100 + n, dtype=np.int64))
    return conv


async def _send(
    url: str,
    model: str,
    *,
    api: str = "completions",
    max_tokens: int = 5,
    timeout_s: float = 5.0,
    conv: Conversation | None = None,
) -> RequestRecord:
    async with aiohttp.ClientSession() as http:
        client = StreamingClient(
            http, url, create_api(api), model=model, timeout_s=timeout_s, origin=time.perf_counter()
        )
        record, _ = await client.send(RequestSpec("r1", 0, 0, 0.0, max_tokens), conv or _conv())
    return record


async def test_metrics_come_from_the_real_stream(scripted: tuple[str, Script]) -> None:
    """TTFT covers the server's first-token delay; ITLs its token delay; counts from usage."""
    url, script = scripted
    rec = await _send(url, "ok", max_tokens=5)
    assert rec.ok and rec.error is None and rec.status == 200
    assert rec.ttft_s is not None and FIRST_DELAY_S <= rec.ttft_s < FIRST_DELAY_S + 0.5
    assert len(rec.itl_s) == 4 and all(x >= TOKEN_DELAY_S * 0.9 for x in rec.itl_s)
    assert rec.e2e_s is not None and rec.e2e_s >= FIRST_DELAY_S + 4 * TOKEN_DELAY_S
    # 5 chunks carried 10 tokens: only the server's usage knows that
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (7, 10, 3)
    assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 9)
    assert rec.route == "prfaas" and rec.incremental_tokens == 12 and rec.sent_tokens == 12
    body = script.bodies[0]
    assert body["prompt"] == list(range(100, 112)) and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 5


async def test_http_error_is_a_failed_record(scripted: tuple[str, Script]) -> None:
    rec = await _send(scripted[0], "http500")
    assert not rec.ok and rec.status == 500
    assert rec.error == "HTTP 500: engine exploded"
    assert rec.ttft_s is None and rec.e2e_s is None


async def test_timeout_is_a_failed_record(scripted: tuple[str, Script]) -> None:
    start = time.perf_counter()
    rec = await _send(scripted[0], "hang", timeout_s=0.3)
    assert time.perf_counter() - start < 5
    assert not rec.ok and rec.error == "timeout after 0.3s"


async def test_midstream_error_and_truncated_stream_fail(scripted: tuple[str, Script]) -> None:
    rec = await _send(scripted[0], "midstream-error")
    assert not rec.ok and rec.error == "decode died" and rec.ttft_s is not None
    rec = await _send(scripted[0], "truncated")
    assert not rec.ok and rec.error == "stream ended without [DONE]"


async def test_unreachable_server_is_a_failed_record() -> None:
    port = free_port()  # nobody listens there
    rec = await _send(f"http://127.0.0.1:{port}", "ok")
    assert not rec.ok and rec.error is not None and rec.error.startswith("connection error")


@pytest.mark.parametrize("api", ["completions", "chat", "generate"])
async def test_every_api_against_the_null_server(null_url: str, api: str) -> None:
    """Each API's stream parses; a repeated prompt reports cached tokens (block size 4).
    The 12 token ids go as they are, except through chat (text, byte-level, templated)."""
    first = await _send(null_url, "null", api=api, max_tokens=6)
    again = await _send(null_url, "null", api=api, max_tokens=6)
    prompt = first.prompt_tokens or 0
    for rec in (first, again):
        assert rec.ok, rec.error
        assert (rec.prompt_tokens, rec.completion_tokens) == (prompt, 6)
        assert len(rec.itl_s) == 5
    assert prompt == 12 if api != "chat" else prompt > 12
    assert (first.cached_tokens, again.cached_tokens) == (0, prompt // 4 * 4)


def test_token_events_in_chunks() -> None:
    """Empty text mid-stream is a token (half a UTF-8 char); preambles and finish-only are not."""
    from prfaas.loadgen.apis import StreamState

    comp, chat, state = create_api("completions"), create_api("chat"), StreamState()
    assert comp.consume({"choices": [{"text": "", "finish_reason": None}]}, state)
    assert not comp.consume({"choices": [{"text": "", "finish_reason": "length"}]}, state)
    assert not comp.consume({"choices": [], "usage": {"completion_tokens": 3}}, state)
    assert state.completion_tokens == 3
    preamble = {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert not chat.consume(preamble, state)
    assert chat.consume({"choices": [{"delta": {"content": ""}, "finish_reason": None}]}, state)
    assert chat.consume({"choices": [{"delta": {"reasoning_content": "hm"}}]}, state)
    gen, state = create_api("generate"), StreamState()
    assert gen.consume({"text": "a", "meta_info": {"completion_tokens": 1}}, state)
    assert not gen.consume({"text": "a", "meta_info": {"completion_tokens": 1}}, state)
