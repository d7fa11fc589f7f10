"""Gateway metrics, exposed with prometheus_client in the Prometheus text format.

`GatewayMetrics` owns one `CollectorRegistry` (never the process-wide default, so two
gateways in one process count apart): counters and histograms booked per request, and
gauges sampled when `/metrics` is scraped (threshold, queue depths, KV-index size, egress),
so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from prfaas.gateway.link import EgressMonitor
from prfaas.gateway.router import RouteEvent

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TOKEN_BUCKETS = (0, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

GaugeSource = Callable[[], Iterable[Metric]]
"""Gauges (or counters kept elsewhere) read at scrape time: a fresh family per metric name
on every call."""


def labelled_gauge(
    name: str,
    help_text: str,
    label_names: Iterable[str],
    samples: Iterable[tuple[Iterable[str], float]],
) -> GaugeMetricFamily:
    """A sampled gauge with one value per label-value tuple (in `label_names` order)."""
    family = GaugeMetricFamily(name, help_text, labels=list(label_names))
    for labels, value in samples:
        family.add_metric(list(labels), value)
    return family


class _SampledGauges:
    """A collector that reads its gauges from a `GaugeSource` at every scrape."""

    def __init__(self, source: GaugeSource) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        return self._source()

    def describe(self) -> Iterable[Metric]:
        """The metric names, so the registry rejects a clash when the source is added."""
        return self._source()


class _WithoutCreated:
    """A registry's metrics without their `_created` samples.

    prometheus_client turns those off only process-wide (`disable_created_metrics()`, a
    module global that would change every other registry in the process); this drops them
    for one registry. Each `collect()` builds fresh `Metric`s, so filtering them in place
    touches nothing that outlives the scrape.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            created = metric.name + "_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric


class GatewayMetrics:
    """The gateway's counters, histograms and sampled gauges, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "prfaas_requests",  # exported as prfaas_requests_total
            "Finished requests by API, route and HTTP status.",
            ("api", "route", "status"),
            registry=reg,
        )
        self.kv_resyncs = Counter(
            "prfaas_kv_index_resyncs",  # exported as prfaas_kv_index_resyncs_total
            "Times an instance's index entries were dropped (restart, gap, reconnect).",
            ("instance", "reason"),
            registry=reg,
        )
        self.ttft = Histogram(
            "prfaas_ttft_seconds",
            "Time to first token.",
            ("route",),
            registry=reg,
            buckets=LATENCY_BUCKETS_S,
        )
        self.queue_wait = Histogram(
            "prfaas_queue_wait_seconds",
            "Time a request waited for an admission slot (those that got one, and those that"
            " gave up at queue_timeout_s).",
            registry=reg,
            buckets=LATENCY_BUCKETS_S,
        )
        self.e2e = Histogram(
            "prfaas_e2e_seconds",
            "End-to-end request latency.",
            ("route",),
            registry=reg,
            buckets=LATENCY_BUCKETS_S,
        )
        self.tpot = Histogram(
            "prfaas_tpot_seconds",
            "Time per output token after the first (streamed answers of 2+ tokens).",
            ("route",),
            registry=reg,
            buckets=TPOT_BUCKETS_S,
        )
        self.incremental = Histogram(
            "prfaas_incremental_tokens",
            "Uncached (incremental) prompt length at routing time.",
            ("route",),
            registry=reg,
            buckets=TOKEN_BUCKETS,
        )
        self.prompt = Histogram(
            "prfaas_prompt_tokens",
            "Prompt length of admitted requests.",
            registry=reg,
            buckets=TOKEN_BUCKETS,
        )
        self.retries = Counter(
            "prfaas_request_retries",  # exported as prfaas_request_retries_total
            "Re-dispatches of requests that failed on an engine before their first token.",
            registry=reg,
        )
        self.migrations = Counter(
            "prfaas_request_migrations",  # exported as prfaas_request_migrations_total
            "Re-dispatches of requests whose decode engine failed mid-stream.",
            registry=reg,
        )
        self.response_store_errors = Counter(
            "prfaas_response_store_errors",  # exported as prfaas_response_store_errors_total
            "Responses API answers the response store could not keep (follow-ups get 404).",
            registry=reg,
        )
        self.offloads = Counter(
            "prfaas_offload_decisions",  # exported as prfaas_offload_decisions_total
            "Requests past t whose offload was decided on predicted TTFT: offloaded as faster,"
            " offloaded as the PD prefill was saturated (the threshold governs), or kept local.",
            ("decision",),
            registry=reg,
        )
        self.ttft_traded = Histogram(
            "prfaas_offload_ttft_traded_seconds",
            "Predicted TTFT an offload under saturation cost its request against computing it"
            " locally (PrfaaS minus local, predicted): what was traded for throughput.",
            registry=reg,
            buckets=LATENCY_BUCKETS_S,
        )
        self.pulls = Counter(
            "prfaas_prefix_pull_decisions",  # exported as prfaas_prefix_pull_decisions_total
            "Prefix pulls the bandwidth-abundant regime checked: made (the transfer predicted"
            " faster than the recompute) or skipped (recomputed instead).",
            ("decision",),
            registry=reg,
        )
        self.pull_saved = Histogram(
            "prfaas_prefix_pull_saved_seconds",
            "Predicted seconds a pull saved against recomputing its prefix (recompute minus"
            " transfer, predicted), for the pulls made.",
            registry=reg,
            buckets=LATENCY_BUCKETS_S,
        )
        self._exported = _WithoutCreated(reg)

    def route_event(self, event: RouteEvent) -> None:
        """Book what the Router reports about a finished request (`Router.on_event`): its
        retries and migrations, and the predictions its offload and pull were decided on."""
        if event.retries:
            self.retries.inc(event.retries)
        if event.migrations:
            self.migrations.inc(event.migrations)
        decision = event.decision
        prediction, pull = decision.prediction, decision.pull
        if prediction is not None:
            if decision.route == "pd":
                self.offloads.labels("kept_local").inc()
            elif prediction.faster:
                self.offloads.labels("offloaded_faster").inc()
            else:
                self.offloads.labels("offloaded_saturated").inc()
                self.ttft_traded.observe(prediction.prfaas_s - prediction.local_s)
        if pull is not None:
            self.pulls.labels("made" if pull.pays else "skipped").inc()
            if pull.pays:
                self.pull_saved.observe(pull.recompute_s - pull.transfer_s)

    def add_gauges(self, source: GaugeSource) -> None:
        """Sample `source` at every scrape from now on.

        Raises:
            ValueError: one of its metric names is already exported.
        """
        self.registry.register(_SampledGauges(source))

    def render(self) -> bytes:
        """The exposition text (`prometheus_client.CONTENT_TYPE_LATEST`)."""
        return generate_latest(self._exported)


def egress_gauges(monitor: EgressMonitor) -> list[GaugeMetricFamily]:
    """`prfaas_egress_*` and `prfaas_link_*` gauges from the latest samples."""

    def per(name: str, help_text: str, field: str) -> GaugeMetricFamily:
        samples = sorted(monitor.samples.items())
        values = (((i,), float(getattr(x, field) or 0.0)) for i, x in samples)
        return labelled_gauge(name, help_text, ("instance",), values)

    return [
        per(
            "prfaas_egress_bytes_per_second",
            "PrfaaS prefill KV egress per instance (transport telemetry).",
            "egress_bytes_per_s",
        ),
        per(
            "prfaas_egress_capacity_bytes_per_second",
            "Link capacity each instance's egress is measured against (0: unknown).",
            "capacity_bytes_per_s",
        ),
        per(
            "prfaas_egress_bytes_sent",
            "KV bytes sent per instance since it started.",
            "bytes_total",
        ),
        GaugeMetricFamily(
            "prfaas_egress_utilisation",
            "PrfaaS egress / configured link capacity.",
            float(monitor.state.get("egress_utilisation") or 0.0),
        ),
        per("prfaas_link_rtt_seconds", "Mean smoothed TCP RTT of KV connections.", "rtt_s"),
        per(
            "prfaas_link_retransmission_rate",
            "Retransmitted / sent TCP segments of KV connections.",
            "retransmission_rate",
        ),
    ]
