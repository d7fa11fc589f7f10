"""The schedulers' shared decision value: versions, publishing as JSON and back."""

from __future__ import annotations

import msgspec
import pytest

from prfaas.policies.schedule_state import ScheduleState


def _state() -> ScheduleState:
    return ScheduleState(threshold=19456.0, set_point=19456.0, roles=(("pd-d0", "decode"),))


def test_changed_bumps_epoch_and_replaces_only_given_fields() -> None:
    """Each change is a new version (epoch + 1) carrying its cause; the rest is kept."""
    s = _state().changed("short-term: raise", threshold=24320)
    assert (s.epoch, s.threshold, s.set_point, s.regime) == (
        1,
        24320.0,
        19456.0,
        "bandwidth_scarce",
    )
    assert s.roles == (("pd-d0", "decode"),) and s.cause == "short-term: raise"
    s2 = s.changed("long-term: convert", roles={"pd-p1": "prefill", "pd-d0": "prefill"})
    assert s2.epoch == 2 and s2.roles == (("pd-d0", "prefill"), ("pd-p1", "prefill"))
    assert s2.threshold == 24320.0 and s2.role_map() == {"pd-d0": "prefill", "pd-p1": "prefill"}


def test_round_trip_through_json() -> None:
    """What a leader publishes, a follower decodes to an equal value."""
    s = _state().changed("x", regime="bandwidth_abundant")
    assert ScheduleState.decode(s.encode()) == s
    assert ScheduleState.decode(s.encode().decode()) == s


def test_decode_rejects_a_bad_document() -> None:
    """A missing threshold or a wrong regime is refused, never applied half-read."""
    with pytest.raises(msgspec.ValidationError):
        ScheduleState.decode(b'{"epoch": 1, "set_point": 5.0}')
    with pytest.raises(msgspec.ValidationError):
        ScheduleState.decode(b'{"threshold": 1, "set_point": 1, "regime": "plenty"}')


def test_newer_than_orders_by_epoch() -> None:
    """A follower applies only strictly newer versions."""
    a = _state()
    b = a.changed("x", threshold=1)
    assert b.newer_than(a) and b.newer_than(None)
    assert not a.newer_than(b) and not a.newer_than(a)


def test_a_newer_leaders_versions_win_whatever_their_epoch() -> None:
    """After a failover the new leader's first version beats the old leader's later ones: a
    paused old leader's states are never applied over the new leader's."""
    a = _state()
    old = a.changed("old leader", threshold=1, leader_epoch=10)
    old_later = old.changed("old leader, later", threshold=2).changed("again", threshold=3)
    new = old.changed("new leader", threshold=4, leader_epoch=42)
    assert old_later.leader_epoch == 10 and old_later.epoch > new.epoch
    assert new.newer_than(old_later) and not old_later.newer_than(new)
    assert ScheduleState.decode(new.encode()) == new
