"""The link as the gateway sees it: egress telemetry of a real, paced KV transport (a
`KVSender` streaming to a `KVReceiver` over loopback TCP), served at `/transfer_stats` the
way the reference engine serves it, polled by `EgressMonitor` on the health cadence, and
measured by the start-up link probe's `busy_rate`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp_helpers import start_app
from gateway_helpers import deployment
from metrics_helpers import Scrape

from prfaas.engines.transport import Kind, KVReceiver, KVSender, SenderConfig
from prfaas.gateway.api.app import GatewayApp
from prfaas.gateway.api.assembly import egress_setup
from prfaas.gateway.api.metrics import GatewayMetrics, egress_gauges
from prfaas.gateway.health import HealthMonitor, HealthPolicy
from prfaas.gateway.instances import InstanceManager
from prfaas.gateway.link import EgressMonitor, EgressSample
from prfaas.serve.profiling import busy_rate

RATE = 2e6  # bytes/s
CHUNK = 64 * 1024
LAYER_BYTES = 256 * 1024


@dataclass
class Paced:
    sender: KVSender
    receiver: KVReceiver
    url: str


def _transfer_stats_app(sender: KVSender) -> web.Application:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(asdict(sender.telemetry()))

    app = web.Application()
    app.router.add_get("/transfer_stats", handler)
    return app


@pytest.fixture
async def paced() -> AsyncIterator[Paced]:
    """A sender paced at 2 MB/s per process (64 KiB burst) with its `/transfer_stats`."""
    config = SenderConfig(process_rate_bytes_per_s=RATE, chunk_bytes=CHUNK, connections=2)
    sender, receiver = KVSender(config), KVReceiver()
    await sender.start()
    runner, url = await start_app(_transfer_stats_app(sender))
    yield Paced(sender, receiver, url)
    await runner.cleanup()
    await receiver.close()
    await sender.close()


async def _transfer(p: Paced, room: int, layers: int) -> None:
    handle = p.sender.open(room)
    arrays = {"k": np.ones(LAYER_BYTES // 4, dtype=np.float32)}
    for layer in range(layers):
        handle.send_layer(layer, Kind.FULL_KV, arrays, blocks=(0, 1))
    handle.finish()
    port = p.sender.bootstrap_port
    transfer = await p.receiver.fetch("127.0.0.1", port, room, timeout_s=30)
    await transfer.complete()
    await handle.wait()


async def test_busy_rate_measures_the_paced_rate(paced: Paced) -> None:
    """Samples every 10 ms during a 1 MiB transfer: the busy-span rate is the pacing rate
    (never above it beyond the one-chunk burst; a busy machine can only make it lower)."""
    samples = [EgressSample.from_json(asdict(paced.sender.telemetry()))]
    run = asyncio.ensure_future(_transfer(paced, 1, layers=4))
    while not run.done():
        await asyncio.sleep(0.01)
        samples.append(EgressSample.from_json(asdict(paced.sender.telemetry())))
    await run
    rate, busy = busy_rate(samples)
    sent = samples[-1].bytes_total - samples[0].bytes_total
    assert sent > 4 * LAYER_BYTES
    assert busy >= (sent - CHUNK) / RATE * 0.97
    assert 0.6 * RATE <= rate <= RATE * sent / (sent - CHUNK) * 1.03


def test_busy_rate_spans_from_last_idle_to_first_final_sample() -> None:
    """Exact arithmetic: bytes moved 100 -> 400 between t=1.0 (last at 100) and t=3.0."""

    def s(at: float, total: int) -> EgressSample:
        return EgressSample(at, 0.0, total, None, None, 0.0, None, 0)

    samples = [s(0.0, 100), s(1.0, 100), s(2.0, 250), s(3.0, 400), s(4.0, 400)]
    assert busy_rate(samples) == (150.0, 2.0)
    assert busy_rate([s(0.0, 5), s(1.0, 5)]) == (0.0, 0.0)


async def test_monitor_publishes_state_and_gauges(paced: Paced) -> None:
    """After a transfer, the monitor's state and `/metrics` gauges carry the sender's byte
    count, capacity and utilisation; an instance answering 404 is dropped, not retried."""
    calls = 0

    async def not_found(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.json_response({"error": {"message": "no transport"}}, status=404)

    app = web.Application()
    app.router.add_get("/transfer_stats", not_found)
    missing, missing_url = await start_app(app)
    try:
        monitor = EgressMonitor({"p0": paced.url, "sglang": missing_url}, {"delay_s": 0.005})
        await _transfer(paced, 2, layers=2)
        await monitor.poll()
        await monitor.poll()
        total = paced.sender.telemetry().bytes_total
        assert set(monitor.samples) == {"p0"} and calls == 1
        st = monitor.state
        assert st["egress_bytes_total"] == total > 2 * LAYER_BYTES
        assert st["capacity_bytes_per_s"] == RATE and st["delay_s"] == 0.005
        assert 0 < st["egress_utilisation"] <= 1.5 and st["egress_bytes_per_s"] > 0
        assert st["rtt_s"] is not None and st["instances"]["p0"]["bytes_total"] == total
        metrics = GatewayMetrics()
        metrics.add_gauges(lambda: egress_gauges(monitor))
        scrape = Scrape.parse(metrics.render().decode())
        assert scrape.value("prfaas_egress_bytes_sent", instance="p0") == total
        assert scrape.value("prfaas_egress_utilisation") == st["egress_utilisation"]
        assert scrape.value("prfaas_link_rtt_seconds", instance="p0") == st["rtt_s"]
        assert scrape.labels("prfaas_egress_bytes_per_second") == [{"instance": "p0"}]
    finally:
        await monitor.close()
        await missing.cleanup()


class _CountingPoller:
    def __init__(self, fail: bool = False) -> None:
        self.polls, self.closed, self.fail = 0, False, fail

    async def poll(self) -> None:
        self.polls += 1
        if self.fail:
            raise RuntimeError("telemetry broke")

    async def close(self) -> None:
        self.closed = True


async def test_health_monitor_runs_and_closes_pollers() -> None:
    """Pollers run after each health round; one that raises does not stop the others or the
    health checks; `stop()` closes them all."""
    monitor = HealthMonitor(InstanceManager(), HealthPolicy(interval_s=0.01))
    broken, good = _CountingPoller(fail=True), _CountingPoller()
    monitor.add_poller(broken)
    monitor.add_poller(good)
    await monitor.poll_once()
    monitor.start()
    await asyncio.sleep(0.05)
    await monitor.stop()
    assert good.polls >= 2 and broken.polls == good.polls and monitor.polls == good.polls
    assert good.closed and broken.closed


async def test_egress_setup_polls_prfaas_prefill_instances(paced: Paced) -> None:
    """`egress_setup()` on a gateway: only the PrfaaS-cluster prefill instance is polled
    (here a real paced sender behind `/transfer_stats`), `/admin/state` shows its link
    telemetry, and `/metrics` its egress gauges, refreshed on the health cadence."""
    urls = {"prfaas-p0": paced.url, "pd-p0": paced.url, "pd-d0": paced.url}
    app = GatewayApp(deployment(urls), setup=egress_setup({"note": "test"}))
    url = f"http://127.0.0.1:{await app.start('127.0.0.1', 0)}"
    try:
        await _transfer(paced, 3, layers=2)
        total = paced.sender.telemetry().bytes_total
        async with aiohttp.ClientSession() as s:
            for _ in range(50):  # health interval 0.2 s
                async with s.get(f"{url}/admin/state") as resp:
                    link = (await resp.json())["link"]
                if link["egress_bytes_total"] == total:
                    break
                await asyncio.sleep(0.1)
            async with s.get(f"{url}/metrics") as resp:
                scrape = Scrape.parse(await resp.text())
    finally:
        await app.stop()
    assert link["egress_bytes_total"] == total and link["note"] == "test"
    assert set(link["instances"]) == {"prfaas-p0"}
    assert scrape.value("prfaas_egress_bytes_sent", instance="prfaas-p0") == total
    assert scrape.labels("prfaas_egress_bytes_sent") == [{"instance": "prfaas-p0"}]
