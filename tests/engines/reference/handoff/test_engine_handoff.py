"""Prefill -> decode hand-off: the layer-wise message order, in-process PD serving, and the
adapter over the real TCP transport (one process, real sockets)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from engine_harness import engine_server
from engine_helpers import hf_greedy, random_prompt
from transformers import PreTrainedModel

from prfaas.engines.kv_pages import HostCopy
from prfaas.engines.reference.handoff.base import (
    FULL_KV,
    LINEAR_STATE,
    HandoffError,
    InProcessHub,
    InProcessReceiver,
    InProcessSender,
)
from prfaas.engines.reference.handoff.transport import TransportReceiver, TransportSender
from prfaas.engines.reference.model.hybrid_cache import HybridCache, SeqState
from prfaas.engines.reference.model.presets import load_model, resolve
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.engines.transport import SenderConfig

GREEDY = {"temperature": 0, "ignore_eos": True}


async def pd_generate(
    session: aiohttp.ClientSession,
    prefill: str,
    decode: str,
    port: int,
    prompt: list[int],
    n: int,
) -> tuple[dict[str, object], dict[str, object]]:
    """Send the same body to both engines at once, as the gateway does."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, **GREEDY},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": random.randrange(2**63),
    }

    async def call(url: str) -> dict[str, object]:
        async with session.post(f"{url}/generate", json=body) as resp:
            result: dict[str, object] = await resp.json()
            return result

    p, d = await asyncio.gather(call(prefill), call(decode))
    return p, d


async def test_layers_are_shipped_in_compute_order(tiny_runner: ModelRunner) -> None:
    """A 40-token prompt (page 16) is computed as [0, 32) then [32, 40): full layers ship
    their KV after each piece (blocks 0-2 then 2-3), linear layers their state once, at the
    end; messages arrive in exactly the order the layers finished."""
    hub = InProcessHub()
    async with engine_server(tiny_runner, hub, role="prefill") as pre:
        port = pre.service.sender.bootstrap_port
        fetch = asyncio.create_task(InProcessReceiver(hub).fetch("h", port, 7, timeout_s=30))
        body = {
            "input_ids": random_prompt(3, 40),
            "bootstrap_host": "h",
            "bootstrap_port": port,
            "bootstrap_room": 7,
        }
        async with aiohttp.ClientSession() as s, s.post(f"{pre.url}/generate", json=body) as r:
            result = await r.json()
        received = await fetch
    order = [(m.layer, m.kind, m.blocks) for m in received.layers]
    lin = [(i, LINEAR_STATE, None) for i in (0, 1, 2)]
    assert order == [
        (3, FULL_KV, (0, 2)),
        (7, FULL_KV, (0, 2)),
        *lin,
        (3, FULL_KV, (2, 3)),
        *[(i, LINEAR_STATE, None) for i in (4, 5, 6)],
        (7, FULL_KV, (2, 3)),
    ]
    first = received.layers[0].arrays["k"]
    assert first.shape == (2, 32, 64) and first.dtype == np.float32  # (h_kv, T, d)
    assert result["output_ids"] and result["meta_info"]["finish_reason"]["type"] == "length"


async def test_in_process_disaggregation_equals_aggregated(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner
) -> None:
    """Prefill engine -> decode engine (in-process hand-off) produces the transformers
    output; the prefill engine's second run of a prompt ships cached blocks too."""
    hub = InProcessHub()
    async with (
        engine_server(tiny_runner, hub, role="prefill") as pre,
        engine_server(tiny_runner, hub, role="decode") as dec,
        aiohttp.ClientSession() as s,
    ):
        port = pre.service.sender.bootstrap_port
        for length in (1, 16, 50, 50):
            prompt = random_prompt(100 + length, length)
            p, d = await pd_generate(s, pre.url, dec.url, port, prompt, 7)
            assert d["output_ids"] == hf_greedy(tiny_model, prompt, 7), length
            assert p["output_ids"] == d["output_ids"][:1]  # type: ignore[index]
        assert p["meta_info"]["cached_tokens"] == 48  # type: ignore[index]
        assert dec.service.core.pool.stats().used_blocks == 0


async def test_decode_reports_a_missing_prefill_as_502(tiny_runner: ModelRunner) -> None:
    hub = InProcessHub()
    async with engine_server(tiny_runner, hub, role="decode", handoff_timeout_s=0.3) as dec:
        body = {
            "input_ids": [1, 2],
            "bootstrap_host": "h",
            "bootstrap_port": 99,
            "bootstrap_room": 1,
        }
        async with aiohttp.ClientSession() as s, s.post(f"{dec.url}/generate", json=body) as r:
            assert r.status == 502
            assert "hand-off" in (await r.json())["error"]["message"]


@pytest.mark.parametrize(
    ("queued", "process"),
    [(False, False), (True, False), (True, True)],
    ids=["direct", "send-queue", "send-queue-process"],
)
async def test_transport_adapter_round_trip(queued: bool, process: bool) -> None:
    """Over real TCP: repeated FULL_KV messages of one layer (several pieces) and linear
    states arrive intact and in order, with the meta; an abort surfaces as HandoffError.
    Queued (a GPU engine's sender), copies go out from the send queue's thread, each once
    its copy's fence is ready, in the order sent; and so through a sender process."""
    config = SenderConfig(host="127.0.0.1", port=0)
    sender = TransportSender(config, queued=queued, process=process)
    receiver = TransportReceiver()
    await sender.start()
    try:
        kv = [np.arange(i, i + 24, dtype=np.float32).reshape(1, 2, 3, 4) for i in range(2)]
        box = sender.open(5)
        fetch = asyncio.create_task(
            receiver.fetch("127.0.0.1", sender.bootstrap_port, 5, timeout_s=20)
        )
        box.send_layer(3, FULL_KV, {"k": kv[0], "v": kv[0]}, blocks=(0, 1))
        box.send_copy(0, LINEAR_STATE, HostCopy({"conv": kv[1], "rec": kv[1]}))
        box.send_layer(3, FULL_KV, {"k": kv[1], "v": kv[1]}, blocks=(1, 2))
        box.send_meta({})
        box.finish()
        received, _ = await asyncio.gather(fetch, box.wait())
        assert [(m.layer, m.kind, m.blocks) for m in received.layers] == [
            (3, FULL_KV, (0, 1)),
            (0, LINEAR_STATE, None),
            (3, FULL_KV, (1, 2)),
        ]
        assert np.array_equal(received.layers[2].arrays["k"], kv[1])
        assert received.aux == {"meta": b"{}"}
        doomed = sender.open(6)
        fetch = asyncio.create_task(
            receiver.fetch("127.0.0.1", sender.bootstrap_port, 6, timeout_s=20)
        )
        doomed.abort("prefill gave up")
        with pytest.raises(HandoffError, match="prefill gave up"):
            await fetch
    finally:
        await receiver.close()
        await sender.close()


async def test_in_process_sender_rejects_reuse_of_a_room() -> None:
    hub = InProcessHub()
    sender = InProcessSender(hub)
    await sender.start()
    box = sender.open(1)
    box.finish()
    with pytest.raises(ValueError, match="already"):
        sender.open(1)


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "kimi-linear-tiny"])
async def test_in_process_disaggregation_other_architectures(
    engine_model_cache: Path, preset: str
) -> None:
    """The hand-off is architecture-generic: Qwen3.5 (GQA KV) and Kimi-Linear (MLA latents
    and KDA states) decode exactly after a prefix hit on the prefill side."""
    model = load_model(resolve(preset, engine_model_cache))
    runner, hub = ModelRunner(model), InProcessHub()
    prompt = random_prompt(5, 40)
    async with (
        engine_server(runner, hub, role="prefill") as pre,
        engine_server(runner, hub, role="decode") as dec,
        aiohttp.ClientSession() as s,
    ):
        port = pre.service.sender.bootstrap_port
        await pd_generate(s, pre.url, dec.url, port, prompt, 5)
        p, d = await pd_generate(s, pre.url, dec.url, port, prompt, 5)
    assert p["meta_info"]["cached_tokens"] == 32  # type: ignore[index]
    assert d["output_ids"] == hf_greedy(model, prompt, 5)


async def test_seeded_sampling_is_the_same_disaggregated(tiny_runner: ModelRunner) -> None:
    """With a seed, sampled output does not depend on where each token was sampled: the
    prefill engine's first token plus the decode engine's rest equal the aggregated run."""
    hub = InProcessHub()
    prompt = random_prompt(9, 30)
    sp = {"max_new_tokens": 10, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": sp, "bootstrap_host": "h", "bootstrap_room": 3}
    async with (
        engine_server(tiny_runner, hub, role="prefill") as pre,
        engine_server(tiny_runner, hub, role="decode") as dec,
        engine_server(tiny_runner, hub) as both,
        aiohttp.ClientSession() as s,
    ):
        body["bootstrap_port"] = pre.service.sender.bootstrap_port

        async def call(url: str, payload: dict[str, object]) -> list[int]:
            async with s.post(f"{url}/generate", json=payload) as resp:
                ids: list[int] = (await resp.json())["output_ids"]
                return ids

        _, pd_ids = await asyncio.gather(call(pre.url, body), call(dec.url, body))
        agg = await call(both.url, {"input_ids": prompt, "sampling_params": sp})
    assert pd_ids == agg and len(agg) == 10


async def test_a_bootstrap_room_in_use_is_a_400(tiny_runner: ModelRunner) -> None:
    """A prefill request for a room whose transfer is still open is refused with 400."""
    hub = InProcessHub()
    async with engine_server(tiny_runner, hub, role="prefill") as pre, aiohttp.ClientSession() as s:
        body = {
            "input_ids": [1, 2, 3],
            "bootstrap_host": "h",
            "bootstrap_room": 42,
            "bootstrap_port": pre.service.sender.bootstrap_port,
        }
        waiting = asyncio.create_task(s.post(f"{pre.url}/generate", json=body))  # no decode
        for _ in range(1000):
            if pre.service.core.counters.snapshot().prompt_tokens:
                break
            await asyncio.sleep(0.01)
        async with s.post(f"{pre.url}/generate", json=body) as again:
            status, err = again.status, await again.json()
        waiting.cancel()
    assert status == 400 and "bootstrap_room 42" in err["error"]["message"]


async def test_bfloat16_kv_travels_as_its_bits(engine_model_cache: Path) -> None:
    """A bfloat16 engine (as on a GPU) ships KV and states as uint16 bits and the decode
    engine places them back as bfloat16: P/D greedy output equals the aggregated engine's,
    and a KV message's payload is the prefill's bfloat16 keys, bit for bit."""
    model = load_model(resolve("qwen3.5-tiny", engine_model_cache), dtype=torch.bfloat16)
    runner, hub = ModelRunner(model), InProcessHub()
    prompt = random_prompt(11, 70)
    async with (
        engine_server(runner, hub, role="prefill") as pre,
        engine_server(runner, hub, role="decode") as dec,
        engine_server(runner, hub, role="both") as agg,
        aiohttp.ClientSession() as s,
    ):
        port = pre.service.sender.bootstrap_port
        _, d = await pd_generate(s, pre.url, dec.url, port, prompt, 12)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, **GREEDY}}
        async with s.post(f"{agg.url}/generate", json=body) as r:
            aggregated = await r.json()
        fetch = asyncio.create_task(InProcessReceiver(hub).fetch("h", port, 9, timeout_s=30))
        shipped = {**body, "bootstrap_host": "h", "bootstrap_port": port, "bootstrap_room": 9}
        async with s.post(f"{pre.url}/generate", json=shipped) as r:
            assert r.status == 200
        received = await fetch
    assert d["output_ids"] == aggregated["output_ids"]
    kv = next(m for m in received.layers if m.kind == FULL_KV)  # the prefix came from the pool
    assert kv.arrays["k"].dtype == np.uint16 and kv.arrays["k"].shape[-2] == 70
    cache = HybridCache([SeqState()])
    runner.forward(cache, torch.tensor([prompt[:64]]))  # the first run's first piece
    keys = cache.keys[kv.layer][0].view(torch.uint16).numpy()  # (h, T, d)
    assert np.array_equal(kv.arrays["k"][..., :64, :], keys)


async def test_an_aborted_in_process_hand_off_drops_later_sends() -> None:
    """A request given up while its forward pass runs: the pass's later sends and its
    finish are dropped (raised into the pass they failed every request computed in it),
    and the decode side's fetch fails with the reason. Misuse after a finish still raises, and
    an open room refuses a second sender even before its first layer."""
    hub = InProcessHub()
    sender = InProcessSender(hub)
    await sender.start()
    outbox = sender.open(7)
    outbox.send_layer(0, FULL_KV, {"k": np.zeros(4, np.float32)})
    outbox.abort("request aborted")
    outbox.send_layer(1, FULL_KV, {"k": np.zeros(4, np.float32)})
    outbox.send_meta({"first_token": 1})
    outbox.finish()
    with pytest.raises(HandoffError, match="request aborted"):
        await InProcessReceiver(hub).fetch("h", sender.bootstrap_port, 7, timeout_s=5)
    finished = InProcessSender(hub)
    await finished.start()
    done = finished.open(8)
    done.finish()
    with pytest.raises(ValueError, match="already finished"):
        done.send_meta({})  # misuse is still an error
    with pytest.raises(ValueError, match="room 8 is already open"):
        finished.open(8)
