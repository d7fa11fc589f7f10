"""Summary statistics of a run: throughput, latency percentiles, goodput, routes, cache hits."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from prfaas.loadgen.records import RequestRecord

_UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0}
_SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds; None means no objective on that metric.

    `itl` bounds every inter-token gap of a request (its maximum), the others the value.
    """

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for key in _SLO_KEYS:
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {key} must be > 0 s, got {value}")

    @classmethod
    def parse(cls, text: str) -> Slo:
        """Parse `ttft=2s,tpot=50ms` (units s or ms; bare numbers are seconds).

        Raises:
            ValueError: an unknown metric or a malformed value, named in the message.
        """
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, _, raw = item.partition("=")
            match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s)?", raw.strip())
            if key.strip() not in _SLO_KEYS or match is None:
                raise ValueError(
                    f"bad SLO {item!r}: expected METRIC=VALUE[ms|s] with METRIC "
                    f"in {', '.join(_SLO_KEYS)}"
                )
            values[key.strip()] = float(match[1]) * _UNITS[match[2] or ""]
        return cls(**values)

    def met_by(self, r: RequestRecord) -> bool:
        """True if a completed request meets every objective."""
        measured = {
            "ttft": r.ttft_s,
            "tpot": r.tpot_s,
            "e2e": r.e2e_s,
            "itl": max(r.itl_s) if r.itl_s else None,
        }
        for key in _SLO_KEYS:
            limit, value = getattr(self, key), measured[key]
            if limit is not None and value is not None and value > limit:
                return False
        return r.ok

    def describe(self) -> str:
        parts = [f"{k}<={getattr(self, k) * 1e3:g}ms" for k in _SLO_KEYS if getattr(self, k)]
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class LatencyStats:
    """Seconds: mean, median, p90, p99, and how many samples."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats | None:
        if not values:
            return None
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(len(a), float(a.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class Summary:
    """The numbers of the final table and the JSON summary."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2e: LatencyStats | None
    goodput: float | None
    """Completed requests per second meeting every SLO; None without SLOs."""
    slo_attainment: float | None
    routes: dict[str, int]
    prefix_hit_rate: float | None
    """Server-reported cached prompt tokens / prompt tokens, over requests reporting both."""
    errors: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _token_rate(records: Sequence[RequestRecord], field: str, duration: float) -> float:
    total = sum(getattr(r, field) or 0 for r in records)
    return total / duration if duration > 0 else 0.0


def _hit_rate(records: Sequence[RequestRecord]) -> float | None:
    both = [r for r in records if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in both)
    return sum(r.cached_tokens or 0 for r in both) / prompt if prompt else None


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None) -> Summary:
    """Aggregate records (any order). Rates divide by `duration_s`."""
    ok = [r for r in records if r.ok]
    rate = len(ok) / duration_s if duration_s > 0 else 0.0
    met = sum(1 for r in ok if slo.met_by(r)) if slo else 0
    errors = Counter(_error_kind(r.error) for r in records if not r.ok)
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        request_throughput=rate,
        input_token_throughput=_token_rate(ok, "prompt_tokens", duration_s),
        output_token_throughput=_token_rate(ok, "completion_tokens", duration_s),
        ttft=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=LatencyStats.of([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=LatencyStats.of([x for r in ok for x in r.itl_s]),
        e2e=LatencyStats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        goodput=(met / duration_s if duration_s > 0 else 0.0) if slo else None,
        slo_attainment=(met / len(records) if records else 0.0) if slo else None,
        routes=dict(Counter(r.route or "-" for r in ok)),
        prefix_hit_rate=_hit_rate(ok),
        errors=dict(errors.most_common()),
    )


def _error_kind(error: str | None) -> str:
    """Errors grouped by their first 80 characters (status and the server's message)."""
    return (error or "unknown")[:80]
