"""The Envoy front door (deploy/envoy/) over three real gateway replicas, which are
`prfaas serve --config F --port P` processes over one real reference engine.

- Requests through Envoy spread over the replicas (each replica's own `/metrics` counts
  what Envoy's per-host counters say it sent there), and SSE events pass as they come.
- SIGKILL of one replica under load: Envoy ejects it at its first failure and sends it no
  new request after that; requests on the other replicas all succeed; requests that were
  in flight on the dead replica are retried elsewhere when no byte of their answer had
  left (no response headers yet), and lost when their stream had begun (never retried:
  output cannot be sent twice).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from envoy_helpers import EnvoyFront
from metrics_helpers import Scrape
from replica_helpers import (
    MODEL,
    Engine,
    Outcome,
    Replica,
    completion,
    gateway_replicas,
    reference_engine,
)

pytestmark = pytest.mark.timeout(120)


@dataclass
class Front:
    """Gateway replicas over the shared engine, and Envoy in front of them."""

    replicas: list[Replica]
    envoy: EnvoyFront


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Started once for the module: replicas of one deployment share its engines."""
    with reference_engine(tmp_path_factory.mktemp("engine")) as running:
        yield running


@pytest.fixture
def front(engine: Engine, tmp_path: Path) -> Iterator[Front]:
    """Three gateway replicas (one deployment file, a port each) behind Envoy."""
    with gateway_replicas(engine, tmp_path, 3) as replicas:
        envoy = EnvoyFront(tmp_path, [r.address for r in replicas])
        envoy.start()
        try:
            yield Front(replicas, envoy)
        finally:
            envoy.stop()


async def _served(s: aiohttp.ClientSession, url: str) -> float:
    """Completions a gateway says it finished (its `prfaas_requests_total`, all labels)."""
    async with s.get(f"{url}/metrics") as r:
        scrape = Scrape.parse(await r.text())
    return sum(x.value for x in scrape.families["prfaas_requests"] if x.name.endswith("_total"))


async def test_requests_spread_over_the_replicas_and_streams_pass_unbuffered(
    front: Front,
) -> None:
    """24 requests, 6 at a time, all answered; every replica served some, and each one's
    own count equals what Envoy says it sent it. A streamed answer's events arrive over
    its duration, not all at its end."""
    envoy = front.envoy
    async with aiohttp.ClientSession() as s:
        await envoy.wait_routable(s, [r.address for r in front.replicas])
        slots = asyncio.Semaphore(6)

        async def one(n: int) -> Outcome:
            async with slots:
                return await completion(s, envoy.url, n, stream=False)

        outcomes = await asyncio.gather(*(one(n) for n in range(24)))
        assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
        served = {r.address: await _served(s, r.url) for r in front.replicas}
        assert sum(served.values()) == 24
        assert min(served.values()) >= 3, served
        hosts = await envoy.hosts(s)
        assert {a: h.stats["rq_success"] for a, h in hosts.items()} == served

        body = {"model": MODEL, "prompt": "stream", "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        start, arrivals, events = time.monotonic(), [], []
        async with s.post(f"{envoy.url}/v1/completions", json=body) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-prfaas-route"] == "pd"  # the gateway's own headers pass
            async for line in r.content:
                if line.startswith(b"data: "):
                    arrivals.append(time.monotonic())
                    events.append(line)
    assert events[-1].strip() == b"data: [DONE]" and len(events) >= 49
    duration = arrivals[-1] - start
    assert arrivals[-1] - arrivals[0] > 0.5 * duration, (arrivals[0] - start, duration)


async def test_sigkill_of_one_replica_under_load(front: Front) -> None:
    """8 clients send requests (half streamed) back to back; one replica is SIGKILLed
    while it holds requests. Every failed request is a stream that replica had begun
    answering; requests on the other replicas, and every request started after the kill,
    succeed; Envoy ejected the dead replica and made at most one attempt on it after it
    died (the failed one that ejects it when nothing was in flight there)."""
    envoy, victim = front.envoy, front.replicas[0]
    others = [r.address for r in front.replicas[1:]]
    outcomes: list[Outcome] = []
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + 60.0

    async def client(c: int, s: aiohttp.ClientSession) -> None:
        n = c
        while loop.time() < stop_at:
            outcomes.append(await completion(s, envoy.url, n, stream=n % 2 == 0))
            n += 8

    async with aiohttp.ClientSession() as s:
        await envoy.wait_routable(s, [r.address for r in front.replicas])
        clients = [asyncio.create_task(client(c, s)) for c in range(8)]
        await asyncio.sleep(1.5)
        await envoy.wait_host(s, victim.address, lambda h: h.stats["rq_active"] > 0)
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        at_kill = (await envoy.hosts(s))[victim.address]
        await asyncio.sleep(3.0)
        stop_at = loop.time()
        await asyncio.gather(*clients)
        end = await envoy.hosts(s)
        counters = await envoy.counters(s)
    await asyncio.sleep(0.3)  # the access log is flushed every 50 ms
    log = {line["request_id"]: line for line in envoy.access_log()}

    dead = end[victim.address]
    after_death = dead.stats["rq_total"] - at_kill.stats["rq_total"] + dead.stats["cx_connect_fail"]
    assert after_death <= 1, dead.stats
    assert not dead.routable
    assert counters["outlier_detection.ejections_enforced_consecutive_local_origin_failure"] >= 1
    assert all(end[a].routable for a in others)

    failed = [o for o in outcomes if not o.ok]
    for o in failed:  # a stream the dead replica had begun: headers came, then the cut
        assert o.stream and o.status == 200 and o.start < killed_at, o
        assert o.request_id is not None
        line = log[o.request_id]
        assert line["upstream_host"] == victim.address, line
        assert line["details"].startswith("upstream_reset_after_response_started"), line
    assert all(o.ok for o in outcomes if o.start > killed_at)
    on_others = [o for o in outcomes if log[o.request_id or ""]["upstream_host"] in others]
    assert on_others and all(o.ok for o in on_others)

    retried = [line for line in log.values() if line["attempts"] > 1]
    assert counters["upstream_rq_retry"] == len(retried) == counters["upstream_rq_retry_success"]
    assert all(line["upstream_host"] in others and line["status"] == 200 for line in retried)
    assert counters.get("upstream_rq_retry_overflow", 0) == 0
    after = [o for o in outcomes if o.start > killed_at]
    assert len(after) >= 8
    print(
        f"\n{len(outcomes)} requests; the killed replica held {at_kill.stats['rq_active']} "
        f"at the kill: {len(failed)} streams it had begun were lost, {len(retried)} requests "
        f"retried elsewhere before any byte of their answer; {len(after)} requests after the "
        f"kill, all answered; attempts on it after its death: {after_death}"
    )
