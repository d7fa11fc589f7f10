"""Gateway metrics in the Prometheus text exposition format (no client library needed).

Counters and histograms are owned by `GatewayMetrics`; gauges (threshold, queue depths,
KV-index size, egress) are sampled when `/metrics` is scraped, so they are never stale.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def _labels(pairs: Sequence[tuple[str, str]]) -> str:
    if not pairs:
        return ""
    escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
               for k, v in pairs)  # fmt: skip
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    """A sample value without `:g`'s 6-digit rounding (byte totals need every digit)."""
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


@dataclass
class Counter:
    """A counter with labels."""

    name: str
    help: str
    label_names: tuple[str, ...] = ()
    values: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, *labels: str, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for labels, value in sorted(self.values.items()):
            pairs = list(zip(self.label_names, labels, strict=True))
            yield f"{self.name}{_labels(pairs)} {value:g}"


@dataclass
class Histogram:
    """A histogram with fixed upper bounds and optional labels."""

    name: str
    help: str
    buckets: tuple[float, ...]
    label_names: tuple[str, ...] = ()
    counts: dict[tuple[str, ...], list[int]] = field(default_factory=dict)
    sums: dict[tuple[str, ...], float] = field(default_factory=dict)

    def observe(self, value: float, *labels: str) -> None:
        counts = self.counts.setdefault(labels, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[labels] = self.sums.get(labels, 0.0) + value

    def count(self, *labels: str) -> int:
        return sum(self.counts.get(labels, ()))

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for labels, counts in sorted(self.counts.items()):
            base = list(zip(self.label_names, labels, strict=True))
            running = 0
            for bound, n in zip([*self.buckets, float("inf")], counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                yield f"{self.name}_bucket{_labels([*base, ('le', le)])} {running}"
            yield f"{self.name}_sum{_labels(base)} {self.sums[labels]:g}"
            yield f"{self.name}_count{_labels(base)} {running}"


@dataclass(frozen=True)
class Gauge:
    """A gauge sampled at scrape time: help text and (labels, value) samples."""

    help: str
    samples: tuple[tuple[tuple[tuple[str, str], ...], float], ...]

    @classmethod
    def one(cls, help_text: str, value: float) -> Gauge:
        return cls(help_text, (((), value),))


class GatewayMetrics:
    """The gateway's counters and histograms; `render` adds gauges sampled by the caller."""

    def __init__(self) -> None:
        self.requests = Counter(
            "prfaas_requests_total",
            "Finished requests by API, route and HTTP status.",
            ("api", "route", "status"),
        )
        self.ttft = Histogram(
            "prfaas_ttft_seconds", "Time to first token.", LATENCY_BUCKETS_S, ("route",)
        )
        self.e2e = Histogram(
            "prfaas_e2e_seconds", "End-to-end request latency.", LATENCY_BUCKETS_S, ("route",)
        )
        self.incremental = Histogram(
            "prfaas_incremental_tokens",
            "Uncached (incremental) prompt length at routing time.",
            TOKEN_BUCKETS,
            ("route",),
        )
        self.prompt = Histogram("prfaas_prompt_tokens", "Prompt length.", TOKEN_BUCKETS)
        self.kv_resyncs = Counter(
            "prfaas_kv_index_resyncs_total",
            "Times an instance's index entries were dropped (restart, gap, reconnect).",
            ("instance", "reason"),
        )
        self.gauge_sources: list[Callable[[], Mapping[str, Gauge]]] = []
        """More gauges sampled at scrape time (e.g. link telemetry); they win on a name clash."""

    def render(self, gauges: Mapping[str, Gauge]) -> str:
        """The exposition text: counters, histograms, then the sampled `gauges` by name."""
        lines: list[str] = []
        for metric in (self.requests, self.kv_resyncs):
            lines.extend(metric.render())
        for hist in (self.ttft, self.e2e, self.incremental, self.prompt):
            lines.extend(hist.render())
        merged = dict(gauges)
        for source in self.gauge_sources:
            merged.update(source())
        for name, gauge in merged.items():
            lines += [f"# HELP {name} {gauge.help}", f"# TYPE {name} gauge"]
            for labels, value in gauge.samples:
                lines.append(f"{name}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"
