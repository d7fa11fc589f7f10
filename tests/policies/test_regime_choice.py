"""The bandwidth regime from measured utilisation and whether pulls pay (spare bandwidth
against the KV production rate), with hysteresis and confirmation."""

from __future__ import annotations

import pytest

from prfaas.common.toml_tables import FieldError
from prfaas.policies.regime_choice import LinkReading, RegimeConfig, RegimeState, choose_regime

CFG = RegimeConfig(abundant_below=0.4, scarce_above=0.7, confirm_ticks=3, scarce_ticks=2)


def _walk(regime: str, utils: list[float | None]) -> list[tuple[str, bool]]:
    state = RegimeState(regime)  # type: ignore[arg-type]
    out: list[tuple[str, bool]] = []
    for u in utils:
        d = choose_regime(CFG, state, LinkReading(u))
        state = d.state
        out.append((state.regime, d.changed))
    return out


def test_abundant_after_confirmed_quiet_ticks() -> None:
    assert _walk("bandwidth_scarce", [0.1, 0.1, 0.1, 0.1]) == [
        ("bandwidth_scarce", False),
        ("bandwidth_scarce", False),
        ("bandwidth_abundant", True),
        ("bandwidth_abundant", False),
    ]


def test_a_busy_tick_restarts_the_count() -> None:
    walk = _walk("bandwidth_scarce", [0.1, 0.1, 0.5, 0.1, 0.1, 0.1])
    assert [r for r, _ in walk] == ["bandwidth_scarce"] * 5 + ["bandwidth_abundant"]


def test_scarce_after_two_busy_ticks() -> None:
    assert _walk("bandwidth_abundant", [0.8, 0.8]) == [
        ("bandwidth_abundant", False),
        ("bandwidth_scarce", True),
    ]


def test_between_the_marks_nothing_changes() -> None:
    """0.4 <= u <= 0.7 is the hysteresis band: each regime stays."""
    assert _walk("bandwidth_abundant", [0.55] * 5)[-1] == ("bandwidth_abundant", False)
    assert _walk("bandwidth_scarce", [0.55] * 5)[-1] == ("bandwidth_scarce", False)


def test_unknown_capacity_holds_and_says_so() -> None:
    d = choose_regime(CFG, RegimeState("bandwidth_scarce", 2), LinkReading(None))
    assert d.state == RegimeState("bandwidth_scarce") and d.reason == "hold: no measured capacity"


def test_reason_names_the_measurement() -> None:
    d = choose_regime(CFG, RegimeState("bandwidth_abundant", 1), LinkReading(0.93))
    assert d.changed and d.reason == "bandwidth_scarce: egress utilisation 0.93 > 0.7 for 2 ticks"


def test_marks_must_be_ordered() -> None:
    with pytest.raises(FieldError, match=r"abundant_below: must be in \[0, scarce_above\)"):
        RegimeConfig(abundant_below=0.8, scarce_above=0.7)


MBIT = 1e6 / 8  # bytes/s


def test_an_idle_link_slower_than_kv_production_is_not_abundant() -> None:
    """The embedded default's case: 10 Mbit/s idle against 40 Mbit/s of KV production; a
    pull there always costs more than the recompute it saves, so the regime stays scarce."""
    state = RegimeState("bandwidth_scarce")
    slow = LinkReading(0.0, 10 * MBIT, 40 * MBIT)
    for _ in range(10):
        d = choose_regime(CFG, state, slow)
        state = d.state
        assert (state.regime, d.changed, d.reason) == ("bandwidth_scarce", False, "hold")
    fast = LinkReading(0.0, 100 * MBIT, 40 * MBIT)
    for _ in range(3):
        d = choose_regime(CFG, state, fast)
        state = d.state
    assert d.changed and d.reason == (
        "bandwidth_abundant: egress utilisation 0.00 < 0.4, spare "
        "100.0 Mbit/s > KV production 40.0 Mbit/s for 3 ticks"
    )


def test_abundant_turns_scarce_once_the_spare_falls_below_kv_production() -> None:
    """Utilisation 0.5 (inside the band) but only 20 Mbit/s spare against 40 of KV
    production: pulls no longer pay."""
    d = choose_regime(
        CFG, RegimeState("bandwidth_abundant", 1), LinkReading(0.5, 20 * MBIT, 40 * MBIT)
    )
    assert d.changed and d.reason == (
        "bandwidth_scarce: spare 20.0 Mbit/s <= KV production 40.0 Mbit/s for 2 ticks"
    )
