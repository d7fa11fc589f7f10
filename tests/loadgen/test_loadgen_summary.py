"""Summary math on hand-built records: percentiles, goodput under SLOs, routes, hit rate."""

from __future__ import annotations

import pytest

from prfaas.loadgen.records import RequestRecord
from prfaas.loadgen.stats import Slo, summarize


def _rec(
    i: int,
    ttft: float,
    e2e: float,
    *,
    n_out: int = 11,
    ok: bool = True,
    route: str | None = None,
    cached: int | None = None,
    error: str | None = None,
) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        session_id=i,
        turn=0,
        scheduled_s=float(i),
        start_s=float(i),
        ok=ok,
        error=error,
        status=200 if ok else 500,
        ttft_s=ttft if ok else None,
        e2e_s=e2e if ok else None,
        itl_s=(0.01,) * (n_out - 1) if ok else (),
        sent_tokens=100,
        prompt_tokens=100 if ok else None,
        completion_tokens=n_out if ok else None,
        cached_tokens=cached,
        route=route,
        incremental_tokens=None,
    )


def test_slo_parse_units_and_errors() -> None:
    slo = Slo.parse("ttft=2s, tpot=50ms,e2e=1.5")
    assert (slo.ttft, slo.tpot, slo.e2e, slo.itl) == (2.0, 0.05, 1.5, None)
    with pytest.raises(ValueError, match="bad SLO 'latency=2s'"):
        Slo.parse("latency=2s")
    with pytest.raises(ValueError, match="bad SLO 'ttft=fast'"):
        Slo.parse("ttft=fast")
    with pytest.raises(ValueError, match=r"SLO ttft must be > 0 s, got 0\.0"):
        Slo.parse("ttft=0")


def test_summary_counts_rates_and_percentiles() -> None:
    records = [_rec(i, ttft=0.1 * (i + 1), e2e=1.0 + 0.1 * (i + 1)) for i in range(10)]
    records.append(_rec(10, 0, 0, ok=False, error="HTTP 500: engine exploded"))
    s = summarize(records, duration_s=5.0, slo=None)
    assert (s.completed, s.failed) == (10, 1)
    assert s.request_throughput == pytest.approx(2.0)
    assert s.output_token_throughput == pytest.approx(110 / 5)
    assert s.input_token_throughput == pytest.approx(1000 / 5)
    assert s.ttft is not None and s.ttft.median == pytest.approx(0.55)
    assert s.ttft.p90 == pytest.approx(0.91)
    assert s.tpot is not None and s.tpot.mean == pytest.approx(0.1)  # (e2e - ttft) / 10
    assert s.errors == {"HTTP 500: engine exploded": 1}
    assert s.goodput is None and s.prefix_hit_rate is None


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [_rec(i, ttft=0.1 * (i + 1), e2e=2.0) for i in range(10)]  # ttft 0.1 .. 1.0
    s = summarize(records, duration_s=2.0, slo=Slo(ttft=0.45))
    assert s.goodput == pytest.approx(4 / 2.0)
    assert s.slo_attainment == pytest.approx(0.4)
    strict = summarize(records, duration_s=2.0, slo=Slo(ttft=0.45, itl=0.005))
    assert strict.goodput == 0.0


def test_route_split_and_prefix_hit_rate() -> None:
    records = [
        _rec(0, 0.1, 1, route="prfaas", cached=50),
        _rec(1, 0.1, 1, route="pd", cached=0),
        _rec(2, 0.1, 1, route="pd", cached=None),
    ]
    s = summarize(records, duration_s=1.0, slo=None)
    assert s.routes == {"prfaas": 1, "pd": 2}
    assert s.prefix_hit_rate == pytest.approx(50 / 200)  # over requests that report it


def test_record_json_round_trip() -> None:
    rec = _rec(3, 0.2, 1.2, route="pd")
    data = rec.to_json()
    assert data["tpot_s"] == pytest.approx(0.1)
    assert RequestRecord.from_json(data) == rec
