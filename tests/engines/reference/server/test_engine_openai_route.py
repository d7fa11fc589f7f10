"""The reference engine's own OpenAI route on real sockets: a request whose grammar and
processors leave no token fails alone (a 400, its blocks freed, the engine's other requests
unharmed); a stop token's text is not shown; streamed text never runs past a stop string
that the whole answer cuts; stop strings wait for `min_tokens`; completions' top
log-probabilities always hold the chosen token; out-of-vocabulary `logit_bias` ids are a 400."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from engine_harness import engine_server

from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.model.runner import ModelRunner

MODEL = "qwen3-next-tiny"
USER = [{"role": "user", "content": "hi"}]


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        raw = await r.read()
    if not body.get("stream") or r.status != 200:
        return r.status, json.loads(raw)
    events = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    assert events[-1] == b"[DONE]"
    return r.status, [json.loads(e) for e in events[:-1]]


def _streamed_text(events: list[Any]) -> str:
    return "".join(c.get("text") or "" for e in events for c in e["choices"])


async def test_no_token_left_fails_that_request_alone(tiny_runner: ModelRunner) -> None:
    """A choice grammar of "a" with `min_tokens` 1 and "a" as a stop token allows nothing:
    a 400 naming why, nothing left allocated, and a long request running beside it ends
    whole."""
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        long = asyncio.ensure_future(_post(s, f"{eng.url}/v1/completions", {
            "model": MODEL, "prompt": "x", "max_tokens": 60, "temperature": 0,
            "ignore_eos": True,
        }))  # fmt: skip
        await asyncio.sleep(0.2)
        bad = {"model": MODEL, "messages": USER, "structured_outputs": {"choice": ["a"]},
               "min_tokens": 1, "stop_token_ids": [97], "temperature": 0}  # fmt: skip
        status, err = await _post(s, f"{eng.url}/v1/chat/completions", bad)
        assert status == 400 and "leave no token" in err["error"]["message"]
        status, done = await long
        assert status == 200 and done["usage"]["completion_tokens"] == 60
        assert done["choices"][0]["finish_reason"] == "length"
        core = eng.service.core
        assert core.pool.stats().used_blocks == 0 and core.pool.stats().num_requests == 0
        assert not core.running and core.prefilling is None


async def test_stop_texts_and_min_tokens(tiny_runner: ModelRunner) -> None:
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        url = f"{eng.url}/v1/completions"
        base = {"model": MODEL, "prompt": "x", "temperature": 0,
                "structured_outputs": {"regex": "abcd"}}  # fmt: skip
        _, whole = await _post(s, url, {**base, "stop_token_ids": [99]})
        assert whole["choices"][0]["text"] == "ab"  # the stop token "c" is not shown
        for stream in (False, True):
            _, answer = await _post(s, url, {**base, "stop": ["bc"], "stream": stream})
            text = _streamed_text(answer) if stream else answer["choices"][0]["text"]
            assert text == "a", stream  # nothing of the stop string, whole or streamed
        _, held = await _post(s, url, {**base, "stop": ["a"], "min_tokens": 2})
        # "a" came before min_tokens, and a stop string is looked for only in new text
        assert held["choices"][0]["text"] == "abcd"


async def test_completion_top_logprobs_hold_the_chosen_token(tiny_runner: ModelRunner) -> None:
    async with engine_server(tiny_runner, InProcessHub()) as eng, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0,
                "logprobs": 0, "logit_bias": {"122": 30}}  # fmt: skip
        _, answer = await _post(s, f"{eng.url}/v1/completions", body)
        lp = answer["choices"][0]["logprobs"]
        assert lp["tokens"] == ["z"] * 4
        assert [list(top) for top in lp["top_logprobs"]] == [["z"]] * 4
        status, err = await _post(s, f"{eng.url}/v1/completions",
                                  {**body, "logit_bias": {"100000": 5}})  # fmt: skip
        assert status == 400 and err["error"]["param"] == "logit_bias"
