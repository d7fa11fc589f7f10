"""Prometheus text exposition: exact lines for counters, cumulative histogram buckets,
sampled gauges, escaped label values."""

from __future__ import annotations

from prfaas.gateway.api.metrics import Counter, GatewayMetrics, Gauge, Histogram


def test_counter_and_escaping() -> None:
    c = Counter("x_total", "Help.", ("a",))
    c.inc('q"uo\\te')
    c.inc('q"uo\\te', by=2)
    assert list(c.render()) == [
        "# HELP x_total Help.",
        "# TYPE x_total counter",
        'x_total{a="q\\"uo\\\\te"} 3',
    ]


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram("lat", "Latency.", (1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 9.0):
        h.observe(v)
    assert list(h.render())[2:] == [
        'lat_bucket{le="1"} 2',
        'lat_bucket{le="2"} 3',
        'lat_bucket{le="+Inf"} 4',
        "lat_sum 12",
        "lat_count 4",
    ]
    assert h.count() == 4


def test_render_includes_gauges() -> None:
    m = GatewayMetrics()
    m.requests.inc("chat", "pd", "200")
    text = m.render({"g": Gauge("G.", (((("i", "a"),), 1.0), ((("i", "b"),), 0.5)))})
    assert 'prfaas_requests_total{api="chat",route="pd",status="200"} 1\n' in text
    assert text.endswith('# HELP g G.\n# TYPE g gauge\ng{i="a"} 1\ng{i="b"} 0.5\n')
