"""`/metrics` through prometheus_client: exact values past 10^6, cumulative histogram
buckets, sampled gauges, label values that need escaping, one registry per gateway."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import openai
import pytest
from gateway_helpers import Engines, GatewayFactory, deployment
from metrics_helpers import Scrape
from msgspec.structs import replace as replace_struct
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY
from prometheus_client.core import GaugeMetricFamily

from prfaas.gateway.api.metrics import GatewayMetrics, labelled_gauge
from prfaas.gateway.router import RouteEvent
from prfaas.policies.routing import RouteDecision
from prfaas.policies.ttft_forecast import PullPrediction, TTFTPrediction

# What one gateway exports without link telemetry (`egress_setup` adds prfaas_egress_*).
GATEWAY_FAMILIES = {
    "prfaas_requests": "counter",
    "prfaas_kv_index_resyncs": "counter",
    "prfaas_ttft_seconds": "histogram",
    "prfaas_e2e_seconds": "histogram",
    "prfaas_tpot_seconds": "histogram",
    "prfaas_incremental_tokens": "histogram",
    "prfaas_prompt_tokens": "histogram",
    "prfaas_threshold_tokens": "gauge",
    "prfaas_queue_running": "gauge",
    "prfaas_queue_waiting": "gauge",
    "prfaas_instance_in_flight": "gauge",
    "prfaas_instance_healthy": "gauge",
    "prfaas_instances": "gauge",
    "prfaas_bandwidth_regime": "gauge",
    "prfaas_kv_index_entries": "gauge",
    "prfaas_kv_index_bytes": "gauge",
    "prfaas_kv_index_evicted_entries": "counter",
    "prfaas_kv_index_rejected_events": "counter",
    "prfaas_request_retries": "counter",
    "prfaas_request_migrations": "counter",
    "prfaas_instance_ejections": "counter",
    "prfaas_prefix_pulls": "counter",
    "prfaas_response_store_errors": "counter",
    "prfaas_queue_wait_seconds": "histogram",
    "prfaas_offload_decisions": "counter",
    "prfaas_offload_ttft_traded_seconds": "histogram",
    "prfaas_prefix_pull_decisions": "counter",
    "prfaas_prefix_pull_saved_seconds": "histogram",
}
# Escaping needed in a label value: a newline, a quote and a backslash.
ODD_ID = 'pd-d0 "rack\\7"\nrow 2'


async def _scrape(url: str) -> tuple[str, Scrape]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return resp.headers["Content-Type"], Scrape.parse(await resp.text())


async def test_counts_past_a_million_are_exact(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """A request counter and a histogram sum past 10^6 read back to the last unit (`:g`
    would print 1e+06), in `CONTENT_TYPE_LATEST`, with no `_created` series."""
    url, gateway = await gateway_factory(deployment(null_engines.urls))
    gateway.metrics.requests.labels("completions", "pd", "200").inc(1_000_000)
    gateway.metrics.prompt.observe(1_000_000)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for _ in range(3):
        await client.completions.create(model="tiny", prompt="hi", max_tokens=1)
    content_type, scrape = await _scrape(url)
    assert content_type == CONTENT_TYPE_LATEST
    pd_ok = {"api": "completions", "route": "pd", "status": "200"}
    assert scrape.value("prfaas_requests_total", **pd_ok) == 1_000_003
    assert scrape.value("prfaas_prompt_tokens_sum") == 1_000_006  # + three 2-token prompts
    assert scrape.value("prfaas_prompt_tokens_count") == 4
    assert scrape.value("prfaas_e2e_seconds_count", route="pd") == 3
    assert scrape.types == GATEWAY_FAMILIES
    assert scrape.value("prfaas_threshold_tokens") == 100


async def test_label_values_round_trip(
    null_engines: Engines, gateway_factory: GatewayFactory
) -> None:
    """An instance id with a newline, a quote and a backslash (the config allows any
    non-empty id) reads back exactly from gauges and from the resync counter."""
    config = deployment(null_engines.urls)
    instances = (*config.instances[:2], replace(config.instances[2], id=ODD_ID))
    url, gateway = await gateway_factory(replace(config, instances=instances))
    gateway.feed.resync(ODD_ID, "instance_down")
    _, scrape = await _scrape(url)
    assert scrape.value("prfaas_instance_healthy", instance=ODD_ID) == 1
    assert scrape.value("prfaas_instance_in_flight", instance=ODD_ID, cluster="pd") == 0
    labels = {"instance": ODD_ID, "reason": "instance_down"}
    assert scrape.value("prfaas_kv_index_resyncs_total", **labels) == 1


def test_histogram_buckets_are_cumulative() -> None:
    """Bucket `le` counts include every smaller bucket; sum and count cover all values."""
    m = GatewayMetrics()
    for v in (0.004, 0.005, 0.007, 200.0):
        m.ttft.labels("pd").observe(v)
    scrape = Scrape.parse(m.render().decode())
    name = "prfaas_ttft_seconds_bucket"
    buckets = {s["le"]: scrape.value(name, **s) for s in scrape.labels(name)}
    assert (buckets["0.005"], buckets["0.01"], buckets["120.0"], buckets["+Inf"]) == (2, 3, 3, 4)
    assert scrape.value("prfaas_ttft_seconds_sum", route="pd") == pytest.approx(200.016)
    assert scrape.value("prfaas_ttft_seconds_count", route="pd") == 4


def test_sampled_gauges_are_read_at_each_scrape() -> None:
    """A gauge source is called at every render; its families appear as gauges."""
    m = GatewayMetrics()
    depth = [1.0]

    def source() -> list[GaugeMetricFamily]:
        samples = [(("a",), depth[0]), (("b",), 0.5)]
        return [labelled_gauge("g", "G.", ("i",), samples)]

    m.add_gauges(source)
    assert Scrape.parse(m.render().decode()).value("g", i="a") == 1
    depth[0] = 7
    scrape = Scrape.parse(m.render().decode())
    assert (scrape.value("g", i="a"), scrape.value("g", i="b"), scrape.types["g"]) == (
        7,
        0.5,
        "gauge",
    )


def test_gauge_name_clash_is_refused() -> None:
    """A source that would export an existing name is refused when added, not shadowed."""
    m = GatewayMetrics()
    with pytest.raises(ValueError, match="prfaas_requests_total"):
        m.add_gauges(lambda: [GaugeMetricFamily("prfaas_requests_total", "Clash.", 1)])


def test_two_gateways_keep_separate_metrics() -> None:
    """Each GatewayMetrics has its own registry: counts and gauges do not leak between two
    in one process, nor into prometheus_client's process-wide default registry."""
    first, second = GatewayMetrics(), GatewayMetrics()
    first.requests.labels("chat", "pd", "200").inc(5)
    first.add_gauges(lambda: [GaugeMetricFamily("prfaas_queue_running", "Running.", 3)])
    one, two = Scrape.parse(first.render().decode()), Scrape.parse(second.render().decode())
    assert one.value("prfaas_requests_total", api="chat", route="pd", status="200") == 5
    assert two.families["prfaas_requests"] == [] and "prfaas_queue_running" not in two.families
    assert REGISTRY.get_sample_value("prfaas_requests_total", {"api": "chat"}) is None
    assert not any(f.name.startswith("prfaas_") for f in REGISTRY.collect())


def test_offload_and_pull_decisions_are_counted_with_what_they_traded() -> None:
    """Each finished request's decision: an offload past `t` by why it went (or stayed), the
    predicted TTFT a saturated offload traded, a pull made or skipped and what it saved."""
    metrics = GatewayMetrics()
    base = RouteDecision("prfaas", "p0", "d0", 8000, 0)
    faster = TTFTPrediction(2.0, 3.0, 0.0, 3.0)
    saturated = TTFTPrediction(9.0, 6.0, 3.0, 3.0)
    made, skipped = PullPrediction(4000, 0.5, 2.0), PullPrediction(4000, 5.0, 2.0)
    for decision in (
        replace_struct(base, prediction=faster),
        replace_struct(base, prediction=saturated),
        replace_struct(base, route="pd", prediction=faster, pull=skipped),
        replace_struct(base, route="pd", pull=made),
        base,
    ):
        metrics.route_event(RouteEvent("r", decision, 8000, 4))
    text = metrics.render().decode()
    for line in (
        'prfaas_offload_decisions_total{decision="offloaded_faster"} 1.0',
        'prfaas_offload_decisions_total{decision="offloaded_saturated"} 1.0',
        'prfaas_offload_decisions_total{decision="kept_local"} 1.0',
        "prfaas_offload_ttft_traded_seconds_sum 3.0",
        "prfaas_offload_ttft_traded_seconds_count 1.0",
        'prfaas_prefix_pull_decisions_total{decision="made"} 1.0',
        'prfaas_prefix_pull_decisions_total{decision="skipped"} 1.0',
        "prfaas_prefix_pull_saved_seconds_sum 1.5",
    ):
        assert line in text.splitlines(), line
