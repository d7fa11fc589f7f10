"""Acceptance: separate engine processes. A prefill engine streams KV over the real TCP
transport to a decode engine; the result equals the aggregated `both` engine and plain
transformers, for several prompt lengths, with and without prefix hits. KV events arrive
over ZMQ in SGLang's format."""

from __future__ import annotations

import asyncio
import random
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from engine_helpers import hf_greedy, random_prompt
from transformers import PreTrainedModel

from prfaas.common.ports import free_port
from prfaas.protocol.kv_events import BlockStored, KVEventSubscriber

READY = re.compile(r"prfaas engine ready: (http://\S+) role=(\w+) bootstrap_port=(\d+)")
GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class EngineProc:
    url: str
    bootstrap_port: int
    proc: subprocess.Popen[str]


def launch(role: str, log: Path, *extra: str) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "prfaas.cli.main",
        "engine",
        "--role",
        role,
        "--port",
        "0",
        "--page-size",
        "16",
        "--threads",
        "1",
        "--kv-capacity-tokens",
        "8192",
        *extra,
    ]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)


def wait_ready(proc: subprocess.Popen[str], log: Path) -> EngineProc:
    """Wait for the engine's ready line (it prints one once it listens)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    match = READY.search(line)
    if match is None:
        proc.kill()
        raise RuntimeError(f"engine did not start: {line!r}\n{log.read_text()[-2000:]}")
    return EngineProc(match[1], int(match[3]), proc)


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def engines(
    tiny_model: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """prefill, decode and both engines, and a prefill whose transport runs in a process of
    its own (`--kv-sender process`), started in parallel once the model is materialised
    (tiny_model), on ephemeral ports; stopped with SIGTERM."""
    logs = tmp_path_factory.mktemp("engine-logs")
    events = f"tcp://127.0.0.1:{free_port()}"
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, role, extra in (
            ("prefill", "prefill", ()),
            ("decode", "decode", ()),
            ("both", "both", ("--kv-events", events)),
            ("prefill_process", "prefill", ("--kv-sender", "process")),
        ):
            procs[name] = launch(role, logs / f"{name}.log", *extra)
        started: dict[str, Any] = {r: wait_ready(p, logs / f"{r}.log") for r, p in procs.items()}
        yield {**started, "events": events}
    finally:
        stop_all(list(procs.values()))


async def run_pd(
    engines: dict[str, Any], prompt: list[int], n: int, prefill: str = "prefill"
) -> tuple[Any, Any, Any]:
    """The same body to `prefill` and decode at once (as the gateway does), and to `both`."""
    sp = {"max_new_tokens": n, **GREEDY}
    pd = {
        "input_ids": prompt,
        "sampling_params": sp,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": engines[prefill].bootstrap_port,
        "bootstrap_room": random.randrange(2**64),
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def call(role: str, body: dict[str, Any]) -> Any:
            async with s.post(f"{engines[role].url}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        both = {"input_ids": prompt, "sampling_params": sp}
        return await asyncio.gather(call(prefill, pd), call("decode", pd), call("both", both))


@pytest.mark.parametrize("length", [1, 15, 16, 50, 130])
async def test_disaggregated_equals_aggregated_and_transformers(
    engines: dict[str, Any], tiny_model: PreTrainedModel, length: int
) -> None:
    prompt = random_prompt(1000 + length, length)
    prefill, decode, both = await run_pd(engines, prompt, 8)
    expected = hf_greedy(tiny_model, prompt, 8)
    assert decode["output_ids"] == both["output_ids"] == expected
    assert prefill["output_ids"] == expected[:1]
    assert decode["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


@pytest.mark.parametrize("length", [15, 130])
async def test_a_sender_process_prefill_equals_aggregated(
    engines: dict[str, Any], tiny_model: PreTrainedModel, length: int
) -> None:
    """The prefill's KV leaves through its sender process: the decode's output is the same,
    and so is a repeated prompt's, whose cached prefix crosses too."""
    prompt = random_prompt(4000 + length, length)
    expected = hf_greedy(tiny_model, prompt, 8)
    for _ in range(2):
        prefill, decode, both = await run_pd(engines, prompt, 8, prefill="prefill_process")
        assert decode["output_ids"] == both["output_ids"] == expected
        assert prefill["output_ids"] == expected[:1]
    assert prefill["meta_info"]["cached_tokens"] == {15: 0, 130: 128}[length]  # whole pages
    url = f"{engines['prefill_process'].url}/transfer_stats"
    async with aiohttp.ClientSession() as s, asyncio.timeout(5):
        while True:  # the sender process's telemetry reaches the engine within a snapshot
            async with s.get(url) as resp:
                assert resp.status == 200
                if (await resp.json())["bytes_total"] > 0:
                    break
            await asyncio.sleep(0.1)


async def test_prefix_hits_on_both_sides_keep_the_output_exact(
    engines: dict[str, Any], tiny_model: PreTrainedModel
) -> None:
    """A repeated prompt and a multi-turn follow-up hit the prefill engine's and the both
    engine's prefix caches; the cached prefix KV crosses to the decode engine and the output
    stays token-for-token equal."""
    prompt = random_prompt(2000, 70)
    first = await run_pd(engines, prompt, 10)
    again = await run_pd(engines, prompt, 10)
    follow = prompt + first[2]["output_ids"] + random_prompt(2001, 12)
    turn2 = await run_pd(engines, follow, 6)
    assert first[0]["meta_info"]["cached_tokens"] == 0
    assert again[0]["meta_info"]["cached_tokens"] == again[2]["meta_info"]["cached_tokens"] == 64
    assert turn2[0]["meta_info"]["cached_tokens"] == 64  # the prefill engine saw no decode
    assert turn2[2]["meta_info"]["cached_tokens"] == 64  # both: 79 computed tokens -> 64
    assert again[1]["output_ids"] == first[1]["output_ids"] == hf_greedy(tiny_model, prompt, 10)
    assert turn2[1]["output_ids"] == turn2[2]["output_ids"] == hf_greedy(tiny_model, follow, 6)


async def test_kv_events_published_over_zmq(engines: dict[str, Any]) -> None:
    """The both engine publishes BlockStored (SGLang wire format) for new prefix blocks."""
    subscriber = KVEventSubscriber(engines["events"])
    try:
        await asyncio.sleep(0.5)  # ZMQ slow joiner: let the subscription reach the publisher
        prompt = random_prompt(3000, 40)
        sp = {"max_new_tokens": 1, **GREEDY}
        async with aiohttp.ClientSession() as s:
            url = f"{engines['both'].url}/generate"
            async with s.post(url, json={"input_ids": prompt, "sampling_params": sp}) as r:
                assert r.status == 200
        stored: list[BlockStored] = []
        async with asyncio.timeout(10):
            while not any(list(e.token_ids) == prompt[:32] for e in stored):
                batch = (await subscriber.recv()).batch
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
        assert all(e.block_size == 16 for e in stored)
    finally:
        subscriber.close()
