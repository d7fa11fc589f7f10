"""Routing policies: the incremental-length threshold in both bandwidth regimes, baselines,
instance choice by prefix affinity and load, and the entry-point registry."""

from __future__ import annotations

import pytest

from prfaas.policies.registry import available_policies, create_policy
from prfaas.policies.routing import (
    InstanceView,
    NoInstanceAvailable,
    PrfaasPolicy,
    Regime,
    RoutingSnapshot,
    pick_instance,
)


def _snap(
    total: int,
    *,
    pd: int = 0,
    prfaas: int = 0,
    t: float = 1000,
    regime: Regime = "bandwidth_scarce",
) -> RoutingSnapshot:
    return RoutingSnapshot(
        total_tokens=total,
        threshold=t,
        regime=regime,
        instances=(
            InstanceView("pf-0", "prfaas", "prefill", cached_tokens=prfaas),
            InstanceView("pd-p0", "pd", "prefill", cached_tokens=pd),
            InstanceView("pd-d0", "pd", "decode", cached_tokens=pd),
        ),
    )


def test_short_prompt_stays_in_pd() -> None:
    """l_total - l_pd <= t routes to PD prefill; decode always in PD."""
    d = PrfaasPolicy().decide(_snap(800))
    assert (d.route, d.prefill_instance, d.decode_instance) == ("pd", "pd-p0", "pd-d0")
    assert d.incremental_tokens == 800 and d.cached_tokens == 0


def test_long_uncached_prompt_goes_to_prfaas() -> None:
    """An uncached prompt longer than t is offloaded; incremental = total - PrfaaS cache."""
    d = PrfaasPolicy().decide(_snap(5000, prfaas=1024))
    assert (d.route, d.prefill_instance) == ("prfaas", "pf-0")
    assert d.incremental_tokens == 5000 - 1024


def test_threshold_applies_to_incremental_length() -> None:
    """A long prompt whose prefix the PD cluster caches stays in PD: 5000 - 4480 <= 1000."""
    d = PrfaasPolicy().decide(_snap(5000, pd=4480))
    assert d.route == "pd" and d.incremental_tokens == 520 and d.cached_tokens == 4480


def test_boundary_is_inclusive() -> None:
    """Exactly t uncached tokens stays in PD; one more goes to PrfaaS."""
    assert PrfaasPolicy().decide(_snap(1000)).route == "pd"
    assert PrfaasPolicy().decide(_snap(1001)).route == "prfaas"


def test_scarce_regime_ignores_prfaas_cache() -> None:
    """Bandwidth-scarce: only the PD cache counts, even if PrfaaS caches more."""
    d = PrfaasPolicy().decide(_snap(5000, prfaas=4800, pd=0))
    assert d.route == "prfaas" and d.prefix_transfer_from is None and d.prefix_source is None


def test_abundant_regime_uses_longest_prefix_anywhere() -> None:
    """Bandwidth-abundant: l_prefix = max(l_prfaas, l_pd); a prefix cached in PrfaaS makes
    the remainder short, so PD computes it after the prefix is transferred from PrfaaS."""
    d = PrfaasPolicy().decide(_snap(5000, prfaas=4800, pd=1024, regime="bandwidth_abundant"))
    assert d.route == "pd" and d.prefix_transfer_from == "prfaas"
    assert d.prefix_source == "pf-0"  # the instance the prefill pulls it from
    assert d.cached_tokens == 4800 and d.incremental_tokens == 200


def test_abundant_regime_long_remainder_pulls_pd_prefix() -> None:
    """Long remainder goes to PrfaaS; a longer PD cache is shipped over first."""
    d = PrfaasPolicy().decide(_snap(9000, prfaas=0, pd=2048, regime="bandwidth_abundant"))
    assert d.route == "prfaas" and d.prefix_transfer_from == "pd"
    assert d.prefix_source in ("pd-p0", "pd-d0")  # both hold 2048 tokens here
    assert d.incremental_tokens == 9000 - 2048


def test_falls_back_to_pd_when_prfaas_unhealthy() -> None:
    """No healthy PrfaaS prefill: long prompts still run, in PD."""
    snap = _snap(5000)
    sick = tuple(
        InstanceView(i.instance_id, i.cluster, i.role, healthy=i.cluster != "prfaas")
        for i in snap.instances
    )
    d = PrfaasPolicy().decide(RoutingSnapshot(5000, sick, threshold=1000))
    assert d.route == "pd" and "fell back" in d.reason


def test_falls_back_to_prfaas_when_no_pd_prefill() -> None:
    """No healthy PD prefill (dead, or converted to decode): short prompts run in PrfaaS."""
    snap = _snap(500)
    sick = tuple(
        InstanceView(i.instance_id, i.cluster, i.role,
                     healthy=not (i.cluster == "pd" and i.role == "prefill"))
        for i in snap.instances
    )  # fmt: skip
    d = PrfaasPolicy().decide(RoutingSnapshot(500, sick, threshold=1000))
    assert d.route == "prfaas" and "no healthy PD prefill" in d.reason


def test_no_decode_instance_is_an_error() -> None:
    """Without a healthy decode instance the policy raises, naming what is missing."""
    only_prefill = (InstanceView("pd-p0", "pd", "prefill"),)
    with pytest.raises(NoInstanceAvailable, match="decode instance in the pd cluster"):
        PrfaasPolicy().decide(RoutingSnapshot(10, only_prefill, threshold=1))


def test_baselines_and_cache_aware() -> None:
    """homogeneous always PD, naive always PrfaaS, cache-aware follows the longest prefix."""
    assert create_policy("homogeneous").decide(_snap(90_000)).route == "pd"
    assert create_policy("naive").decide(_snap(10)).route == "prfaas"
    assert create_policy("cache-aware").decide(_snap(4000, pd=3000)).route == "pd"
    assert create_policy("cache-aware").decide(_snap(4000, prfaas=3000)).route == "prfaas"


def test_pick_instance_affinity_then_load() -> None:
    """A large cached share wins over load; otherwise the least loaded instance wins."""
    a = InstanceView("a", "pd", "prefill", cached_tokens=900, load=5)
    b = InstanceView("b", "pd", "prefill", cached_tokens=0, load=0)
    d = InstanceView("d", "pd", "decode")
    for total, expected in ((1000, "a"), (4000, "b")):
        snapshot = RoutingSnapshot(total, (a, b, d), threshold=0)
        assert pick_instance(snapshot, "pd", "prefill").instance_id == expected
    with pytest.raises(NoInstanceAvailable, match="no healthy prefill instance in the prfaas"):
        pick_instance(RoutingSnapshot(10, (a, b, d), threshold=0), "prfaas", "prefill")


def test_unknown_policy_lists_known_names() -> None:
    """An unknown name is a ValueError listing every available policy."""
    with pytest.raises(ValueError, match=r"unknown routing policy 'fastest'.*homogeneous"):
        create_policy("fastest")
    assert {"prfaas", "homogeneous", "naive", "cache-aware"} <= set(available_policies())
