"""Prefix pull between two engines (the bandwidth-abundant regime): one exports the KV and
states of a prompt's cached prefix (`POST /kv/export`), the other pulls it into its own prefix
cache (`prefix_pull` on `/generate`) and computes only the rest, with the same greedy output
as plain `transformers`; a pull that finds nothing falls back to computing everything."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from engine_harness import RunningEngine, engine_server
from engine_helpers import hf_greedy, random_prompt
from transformers import PreTrainedModel

from prfaas.engines.reference.handoff.base import InProcessHub
from prfaas.engines.reference.model.runner import ModelRunner

GREEDY = {"temperature": 0, "ignore_eos": True}


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _pull(
    s: aiohttp.ClientSession,
    source: RunningEngine,
    target: RunningEngine,
    prompt: list[int],
    *,
    openai: bool = False,
) -> tuple[int, dict[str, Any]]:
    """Export from `source` and generate on `target` with the pull, at once (as the gateway
    does), through `/generate` or (`openai`) the OpenAI route; (exported prefix tokens, the
    target's answer)."""
    room = 41
    pull = {"host": "127.0.0.1", "port": source.service.sender.bootstrap_port, "room": room}
    export = _post(s, f"{source.url}/kv/export", {"input_ids": prompt, "room": room})
    if openai:
        path, body = "/v1/completions", {
            "model": "qwen3-next-tiny", "prompt": prompt, "max_tokens": 6, **GREEDY,
            "logprobs": 1, "prefix_pull": pull,
        }  # fmt: skip
    else:
        path, body = "/generate", {
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 6, **GREEDY},
            "prefix_pull": pull,
        }  # fmt: skip
    exported, answer = await asyncio.gather(export, _post(s, f"{target.url}{path}", body))
    return int(exported["prefix_tokens"]), answer


@asynccontextmanager
async def _source_caching(
    tiny_runner: ModelRunner, first: list[int]
) -> AsyncIterator[tuple[RunningEngine, RunningEngine, aiohttp.ClientSession]]:
    """Two engines (source, target) and a session; the source has computed `first`."""
    hub = InProcessHub()
    async with (
        engine_server(tiny_runner, hub, role="both") as a,
        engine_server(tiny_runner, hub, role="both") as b,
        aiohttp.ClientSession() as s,
    ):
        body = {"input_ids": first, "sampling_params": {"max_new_tokens": 1, **GREEDY}}
        await _post(s, f"{a.url}/generate", body)
        yield a, b, s


async def test_pulled_prefix_is_reused_and_output_matches(
    tiny_runner: ModelRunner, tiny_model: PreTrainedModel
) -> None:
    """A computes a 100-token prompt (16-token blocks: state saved at 96); B pulls that
    prefix for the prompt + 30 tokens and reports 96 cached tokens; its greedy output equals
    `transformers`' on the whole prompt, and its pool indexed the 6 pulled blocks."""
    first = random_prompt(11, 100)
    prompt = first + random_prompt(12, 30)
    async with _source_caching(tiny_runner, first) as (a, b, s):
        exported, answer = await _pull(s, a, b, prompt)
        stats = await (await s.get(f"{b.url}/stats")).json()
    assert exported == 96
    assert answer["meta_info"]["cached_tokens"] == 96
    assert answer["output_ids"] == hf_greedy(tiny_model, prompt, 6)
    assert stats["prefix_imported_tokens_total"] == 96
    assert stats["prefix_pull_failures_total"] == 0
    assert b.service.core.pool.stats().cached_blocks >= 6


async def test_nothing_cached_falls_back_to_computing(
    tiny_runner: ModelRunner, tiny_model: PreTrainedModel
) -> None:
    """The source caches nothing: the export answers 0 and aborts the room, the pull fails
    at once (logged, counted), and the target computes the whole prompt correctly."""
    hub = InProcessHub()
    prompt = random_prompt(13, 70)
    async with (
        engine_server(tiny_runner, hub, role="both") as a,
        engine_server(tiny_runner, hub, role="both") as b,
        aiohttp.ClientSession() as s,
    ):
        exported, answer = await asyncio.wait_for(_pull(s, a, b, prompt), 60)
        stats = await (await s.get(f"{b.url}/stats")).json()
    assert exported == 0
    assert answer["meta_info"]["cached_tokens"] == 0
    assert answer["output_ids"] == hf_greedy(tiny_model, prompt, 6)
    assert stats["prefix_pull_failures_total"] == 1


async def test_bad_export_and_pull_bodies_are_400(tiny_runner: ModelRunner) -> None:
    async with (
        engine_server(tiny_runner, InProcessHub(), role="both") as a,
        aiohttp.ClientSession() as s,
    ):
        for body in ({"input_ids": [1, 2]}, {"input_ids": [], "room": 1},
                     {"input_ids": [1], "room": -1}, {"input_ids": ["x"], "room": 1}):  # fmt: skip
            async with s.post(f"{a.url}/kv/export", json=body) as r:
                assert r.status == 400, body
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        for pull in ({"host": "h", "port": 1}, {"host": "h", "port": 0, "room": 1}, "h:1"):
            body = {"input_ids": [1, 2, 3], "prefix_pull": pull}
            async with s.post(f"{a.url}/generate", json=body) as r:
                assert r.status == 400, pull
                assert "prefix_pull" in (await r.json())["error"]["message"]


async def test_the_openai_route_pulls_a_prefix_too(
    tiny_runner: ModelRunner, tiny_model: PreTrainedModel
) -> None:
    """A forwarded OpenAI body (tools, grammars, ...) carries the gateway's `prefix_pull`
    like `/generate`: B reuses the 96 pulled tokens, with the same greedy output."""
    first = random_prompt(14, 100)
    prompt = first + random_prompt(15, 30)
    async with _source_caching(tiny_runner, first) as (a, b, s):
        exported, answer = await _pull(s, a, b, prompt, openai=True)
    assert exported == 96
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert len(answer["choices"][0]["logprobs"]["tokens"]) == 6
    expected = hf_greedy(tiny_model, prompt, 6)
    assert answer["choices"][0]["text"] == bytes(t for t in expected if t < 256).decode(
        errors="replace"
    )
