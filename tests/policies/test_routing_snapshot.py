"""The per-request routing values: frozen msgspec Structs (typed fields, immutable, value
equality), a snapshot's remembered answers equal fresh ones, and the PrfaaS reason text."""

from __future__ import annotations

import msgspec
import pytest

from prfaas.policies.routing import (
    InstanceView,
    PrfaasPolicy,
    RouteDecision,
    RoutingSnapshot,
)


@pytest.mark.parametrize("cls", [InstanceView, RoutingSnapshot, RouteDecision])
def test_values_are_frozen_structs_with_their_declared_fields(cls: type) -> None:
    fields = msgspec.structs.fields(cls)
    assert fields and cls.__struct_config__.frozen  # type: ignore[attr-defined]
    assert [f.name for f in fields] == list(cls.__annotations__)


def test_views_are_frozen_values() -> None:
    """Keyword and positional construction agree; replace, equality and hash work."""
    a = InstanceView(instance_id="a", cluster="pd", role="prefill", cached_tokens=3)
    assert a == InstanceView("a", "pd", "prefill", 3, 0, True)
    assert hash(a) == hash(InstanceView("a", "pd", "prefill", 3))
    assert msgspec.structs.replace(a, load=2).load == 2 and a.load == 0
    with pytest.raises(AttributeError):
        a.load = 1  # type: ignore[misc]


def test_snapshot_answers_are_remembered_and_public() -> None:
    """Repeated questions give the same answers as a fresh snapshot (the pools policies
    and plugins use are public); equality and repr ignore what was remembered."""
    views = (
        InstanceView("pf-0", "prfaas", "prefill", cached_tokens=900, healthy=False),
        InstanceView("pf-1", "prfaas", "both", cached_tokens=100),
        InstanceView("pd-p0", "pd", "prefill", cached_tokens=300),
        InstanceView("pd-d0", "pd", "decode", cached_tokens=700),
    )
    snap = RoutingSnapshot(1000, views, threshold=10.0)
    fresh = RoutingSnapshot(1000, views, threshold=10.0)
    assert [i.instance_id for i in snap.pool(None, "prefill")] == ["pf-1", "pd-p0"]
    assert snap.pool(None, "prefill") is snap.pool(None, "prefill")  # computed once
    assert [i.instance_id for i in snap.pool("prfaas", "decode")] == ["pf-1"]
    assert (snap.cached_in("prfaas"), snap.cached_in("pd")) == (100, 700)
    assert snap.cached_in("prfaas") == 100  # the unhealthy pf-0's 900 never counts
    assert snap == fresh and repr(snap) == repr(fresh) and hash(snap) == hash(fresh)


@pytest.mark.parametrize("thresholds", [[256.0, 0.0, -0.0, 1e20, 256.0, 2.5], [7, 7.0, 1e-05]])
def test_reason_text_equals_the_plain_format(thresholds: list[float]) -> None:
    views = (InstanceView("pf", "prfaas", "prefill"), InstanceView("pd", "pd", "both"))
    for t in thresholds:
        d = PrfaasPolicy().decide(RoutingSnapshot(540, views, threshold=t))
        sign = "<=" if t >= 540 else ">"
        assert d.reason == f"bandwidth_scarce: 540 uncached {sign} t={t:g}"
