"""Conditional disaggregation: the two TTFT predictions, and the PrfaaS policy offloading a
request past the threshold only when PrfaaS is predicted to answer first or the PD prefill
pool is saturated; a prefix pull only when moving the prefix beats recomputing it."""

from __future__ import annotations

import math

import pytest

from prfaas.policies.routing import InstanceView, PrfaasPolicy, Regime, RoutingSnapshot
from prfaas.policies.tables import PiecewiseLinear
from prfaas.policies.ttft_forecast import (
    LinkState,
    LoadForecast,
    PrefillCosts,
    TTFTPrediction,
    least_backlog,
    predict_ttft,
)

# PrfaaS prefills 10,000 tokens/s, the PD cluster 5,000; KV is 100 kB per token.
COSTS = PrefillCosts(
    prfaas_prefill_s=PiecewiseLinear((0.0, 100_000.0), (0.0, 10.0)),
    pd_prefill_s=PiecewiseLinear((0.0, 100_000.0), (0.0, 20.0)),
    kv_bytes=PiecewiseLinear((0.0, 100_000.0), (0.0, 1e10)),
)
GBIT = 1e9 / 8  # bytes/s


def _forecast(backlog: dict[str, float], link: LinkState | None = None) -> LoadForecast:
    return LoadForecast(COSTS, backlog, link)


def test_spare_egress_is_unused_capacity_floored_at_a_fair_share() -> None:
    """10 Gbit/s with 4 used: 6 spare; saturated with 3 transfers: a new one gets 1/4."""
    assert LinkState(10 * GBIT, 4 * GBIT, 2).spare_bytes_per_s() == 6 * GBIT
    assert LinkState(10 * GBIT, 10 * GBIT, 3).spare_bytes_per_s() == 2.5 * GBIT
    assert LinkState(10 * GBIT).spare_bytes_per_s() == 10 * GBIT


def test_prediction_sums_queue_prefill_and_transfer() -> None:
    """20,000 tokens: PrfaaS 1 s queue + 2 s + 2 GB over 8 Gbit/s spare (2 s) = 5 s;
    local 0.5 s queue + 4 s = 4.5 s: local wins."""
    f = _forecast({"pf0": 1.0, "pf1": 3.0, "pd0": 0.5}, LinkState(10 * GBIT, 2 * GBIT, 1))
    p = predict_ttft(f, prfaas_tokens=20_000, local_tokens=20_000, shipped_tokens=20_000,
                     prfaas_pool=["pf0", "pf1"], local_pool=["pd0"])  # fmt: skip
    assert p == TTFTPrediction(prfaas_s=5.0, local_s=4.5, local_wait_s=0.5, local_compute_s=4.0)
    assert not p.offload
    assert p.describe() == "predicted TTFT prfaas 5.00s >= local 4.50s"


def test_no_link_telemetry_leaves_the_transfer_out() -> None:
    f = _forecast({})
    p = predict_ttft(f, prfaas_tokens=20_000, local_tokens=20_000, shipped_tokens=20_000,
                     prfaas_pool=["pf0"], local_pool=["pd0"])  # fmt: skip
    assert p == TTFTPrediction(2.0, 4.0, 0.0, 4.0) and p.offload


def test_least_backlog_of_an_empty_pool_is_infinite() -> None:
    assert least_backlog(_forecast({"a": 2.0}), []) == math.inf
    assert least_backlog(_forecast({"a": 2.0}), ["a", "b"]) == 0.0  # b is idle


def _snap(
    total: int, forecast: LoadForecast | None, *, t: float = 10_000, pd_cached: int = 0,
    pf_cached: int = 0, regime: Regime = "bandwidth_scarce",
) -> RoutingSnapshot:  # fmt: skip
    return RoutingSnapshot(
        total_tokens=total,
        threshold=t,
        regime=regime,
        forecast=forecast,
        instances=(
            InstanceView("pf0", "prfaas", "prefill", cached_tokens=pf_cached),
            InstanceView("pd-p0", "pd", "prefill", cached_tokens=pd_cached),
            InstanceView("pd-d0", "pd", "decode"),
        ),
    )


def test_policy_offloads_when_prfaas_is_predicted_faster() -> None:
    """20,000 uncached > t and PrfaaS idle: 2 s + 1.6 s transfer < 4 s local."""
    f = _forecast({}, LinkState(10 * GBIT))
    d = PrfaasPolicy().decide(_snap(20_000, f))
    assert d.route == "prfaas"
    assert d.reason == (
        "bandwidth_scarce: 20000 uncached > t=10000; predicted TTFT prfaas 3.60s < local 4.00s"
    )


def test_policy_keeps_a_long_request_local_when_prfaas_is_backed_up() -> None:
    """The same request with 3 s queued on PrfaaS: 6.6 s >= 4 s, so PD computes it."""
    f = _forecast({"pf0": 3.0}, LinkState(10 * GBIT))
    d = PrfaasPolicy().decide(_snap(20_000, f))
    assert (d.route, d.prefill_instance) == ("pd", "pd-p0")
    assert d.reason.endswith("predicted TTFT prfaas 6.60s >= local 4.00s")


def test_a_saturated_link_keeps_long_requests_local() -> None:
    """Link full with 4 transfers: 2 GB at a fifth of 1 Gbit/s takes 80 s."""
    f = _forecast({}, LinkState(1 * GBIT, 1 * GBIT, 4))
    assert PrfaasPolicy().decide(_snap(20_000, f)).route == "pd"


def test_short_requests_never_consult_the_forecast() -> None:
    """At or below t the request stays local whatever PrfaaS's prediction."""
    d = PrfaasPolicy().decide(_snap(10_000, _forecast({"pd-p0": 100.0})))
    assert d.route == "pd" and "predicted" not in d.reason


def test_prediction_uses_what_each_cluster_would_compute() -> None:
    """PD caches 8,000 of 30,000: local computes 22,000 (4.4 s); PrfaaS caches nothing and
    computes 30,000 (3 s, no link term): PrfaaS wins. In the abundant regime PrfaaS would
    pull the PD prefix and compute 22,000 (2.2 s)."""
    f = _forecast({})
    d = PrfaasPolicy().decide(_snap(30_000, f, pd_cached=8_000))
    assert d.route == "prfaas" and d.reason.endswith("prfaas 3.00s < local 4.40s")
    d = PrfaasPolicy().decide(_snap(30_000, f, pd_cached=8_000, regime="bandwidth_abundant"))
    assert d.route == "prfaas" and d.reason.endswith(
        "prfaas 2.20s < local 4.40s; pull of 8000 tokens 0.00s < recompute 0.80s"
    )  # no link telemetry: the pull's transfer is left out, as the offload's
    assert d.prefix_transfer_from == "pd"


@pytest.mark.parametrize("backlog", [0.0, 2.0, 2.4, 2.5])
def test_break_even_is_strict(backlog: float) -> None:
    """PrfaaS 20,000 tokens = 2 s + queue vs local 4.5 s (0.5 s queue): offload only while
    strictly faster (2.5 s of PrfaaS queue ties and stays local)."""
    f = _forecast({"pf0": backlog, "pd-p0": 0.5})
    route = PrfaasPolicy().decide(_snap(20_000, f)).route
    assert route == ("prfaas" if 2.0 + backlog < 4.5 else "pd")


def test_the_decode_gets_the_whole_prompts_kv_cached_prefix_included() -> None:
    """PrfaaS caches 18,000 of 20,000 tokens: it computes 2,000 (0.2 s) but ships the KV of
    all 20,000 (2 GB over 1 Gbit/s: 16 s); local computes 20,000 (4 s) and wins."""
    f = _forecast({}, LinkState(1 * GBIT))
    d = PrfaasPolicy().decide(_snap(20_000, f, pf_cached=18_000, t=1_000))
    assert d.route == "pd"
    assert d.reason.endswith("predicted TTFT prfaas 16.20s >= local 4.00s")


def test_a_saturated_local_pool_lets_the_threshold_govern() -> None:
    """Over a slow link PrfaaS is predicted slower (2 s + 16 s) than local (4 s of compute),
    but once the local queue is at least that compute (4 s), throughput decides: offload,
    and the reason says what TTFT it trades."""
    slow = LinkState(1 * GBIT)
    assert PrfaasPolicy().decide(_snap(20_000, _forecast({"pd-p0": 3.9}, slow))).route == "pd"
    d = PrfaasPolicy().decide(_snap(20_000, _forecast({"pd-p0": 4.0}, slow)))
    assert d.route == "prfaas"
    assert d.reason.endswith("predicted TTFT prfaas 18.00s >= local 8.00s; local queue 4.00s "
                             ">= its compute 4.00s: the threshold governs")  # fmt: skip


def test_a_pool_busy_most_of_the_time_lets_the_threshold_govern_on_a_short_wait() -> None:
    """A 1 s local queue is shorter than the 4 s compute, so the TTFT rule alone would keep
    the prompt local; with the pool busy 60% of the recent past it is saturated and the
    prompt goes over the link. Busy 40%, or no queue at all (idle now, however busy
    lately), and TTFT decides again."""
    slow = LinkState(1 * GBIT)

    def busy(share: float, backlog: float) -> LoadForecast:
        return LoadForecast(COSTS, {"pd-p0": backlog}, slow, local_busy_share=share)

    d = PrfaasPolicy().decide(_snap(20_000, busy(0.6, 1.0)))
    assert d.route == "prfaas"
    assert d.reason.endswith("predicted TTFT prfaas 18.00s >= local 5.00s; local queue 1.00s, "
                             "pool busy 60% of the time: the threshold governs")  # fmt: skip
    assert PrfaasPolicy().decide(_snap(20_000, busy(0.4, 1.0))).route == "pd"
    assert PrfaasPolicy().decide(_snap(20_000, busy(0.9, 0.0))).route == "pd"


def test_a_pool_offered_more_than_it_can_do_lets_the_threshold_govern_with_no_queue() -> None:
    """The PD prefill idle this instant (no queue, busy share 0) and the slow link making
    PrfaaS 14 s slower: TTFT alone keeps the prompt local. Offered 120% of what it can do
    over the recent past (a burst), its queue only grows: saturated, offloaded; offered
    exactly what it can do, too. At 90% TTFT decides again."""
    slow = LinkState(1 * GBIT)

    def offered(work: float) -> LoadForecast:
        return LoadForecast(COSTS, {}, slow, local_work_per_s=work)

    d = PrfaasPolicy().decide(_snap(20_000, offered(1.2)))
    assert d.route == "prfaas"
    assert d.reason.endswith("predicted TTFT prfaas 18.00s >= local 4.00s; PD prefill offered "
                             "120% of what it can do: the threshold governs")  # fmt: skip
    assert PrfaasPolicy().decide(_snap(20_000, offered(1.0))).route == "prfaas"
    d = PrfaasPolicy().decide(_snap(20_000, offered(0.9)))
    assert d.route == "pd" and d.reason.endswith("predicted TTFT prfaas 18.00s >= local 4.00s")


def test_the_pools_offered_work_spreads_over_its_instances() -> None:
    """Two PD prefills offered 1.6 s of work per second: each 80% of what it can do."""
    f = LoadForecast(COSTS, {}, local_work_per_s=1.6)
    p = predict_ttft(f, prfaas_tokens=20_000, local_tokens=20_000, shipped_tokens=20_000,
                     prfaas_pool=["pf0"], local_pool=["pd0", "pd1"])  # fmt: skip
    assert p.local_load == pytest.approx(0.8) and not p.local_saturated


def test_a_pull_that_costs_more_than_recomputing_is_not_made() -> None:
    """The issue's case: PrfaaS caches 6,000 tokens of a 6,100-token prompt, PD nothing, t =
    4,000. Abundant: 100 uncached <= t, so PD computes it, pulling the 6,000-token prefix:
    600 MB over 1 Gbit/s (4.8 s) against recomputing 6,000 tokens in PD (1.2 s). Not worth
    it: routed as in the scarce regime (6,100 uncached > t), where the TTFT check keeps it
    local (PrfaaS ships 610 MB: 4.9 s + 0.01 s >= 1.22 s)."""
    f = _forecast({}, LinkState(1 * GBIT))
    d = PrfaasPolicy().decide(
        _snap(6_100, f, pf_cached=6_000, t=4_000, regime="bandwidth_abundant")
    )
    assert (d.route, d.prefix_transfer_from, d.cached_tokens) == ("pd", None, 0)
    assert d.reason.endswith("; no pull of 6000 tokens 4.80s >= recompute 1.20s")


def test_a_pull_that_beats_recomputing_is_made() -> None:
    """The same over 100 Gbit/s: the pull takes 0.048 s against 1.2 s of recompute."""
    f = _forecast({}, LinkState(100 * GBIT))
    d = PrfaasPolicy().decide(
        _snap(6_100, f, pf_cached=6_000, t=4_000, regime="bandwidth_abundant")
    )
    assert (d.route, d.prefix_transfer_from, d.cached_tokens) == ("pd", "prfaas", 6_000)
    assert d.reason.endswith("; pull of 6000 tokens 0.05s < recompute 1.20s")


def test_min_kv_rate_is_the_lowest_phi_kv_of_either_cluster() -> None:
    """KV 100 kB/token; PrfaaS 10,000 tokens/s (1 GB/s), PD 5,000 (0.5 GB/s)."""
    assert COSTS.min_kv_rate() == pytest.approx(0.5e9)


def test_pulls_are_checked_when_offloads_are_not_conditional() -> None:
    """`conditional = false` turns off the TTFT condition on offloads, not the pull check:
    the long request goes to PrfaaS on the threshold alone, and the slow pull is not made."""
    f = LoadForecast(COSTS, {}, LinkState(1 * GBIT), conditional=False)
    d = PrfaasPolicy().decide(_snap(20_000, f, pf_cached=0, pd_cached=6_000, t=1_000,
                                    regime="bandwidth_abundant"))  # fmt: skip
    assert (d.route, d.prefix_transfer_from) == ("prfaas", None)
    assert "predicted TTFT" not in d.reason and "; no pull of 6000 tokens" in d.reason
