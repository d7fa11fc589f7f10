"""The short-term threshold trimmer: multiplicative raises on PrfaaS-side congestion,
additive lowering, a band around the set-point, and no oscillation under steady load."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

import pytest

from prfaas.common.toml_tables import FieldError
from prfaas.policies.threshold_trim import TrimConfig, TrimObservation, TrimState, trim

CFG = TrimConfig()
"""high 0.9, low 0.6, queues: ratio 1.5 + 3 s, x1.25 / -512, band [0.5, 2], confirm 2,
quiet 3, hold-off 10 ticks, memory 300 s, plan margin 0.1."""


def _obs(now: float, util: float | None, pf: float = 1.0, pd: float = 0.0,
         cap: float | None = 1e9) -> TrimObservation:  # fmt: skip
    """PrfaaS slightly busier than PD by default (so a full link may raise)."""
    return TrimObservation(now, util, pf, pd, cap)


def _run(state: TrimState, observations: list[TrimObservation]) -> list[tuple[float, str]]:
    out = []
    for o in observations:
        d = trim(CFG, state, o)
        state = d.state
        out.append((state.threshold, d.reason))
    return out


def test_raise_needs_two_congested_ticks_then_multiplies_then_holds_off() -> None:
    """Two hot ticks raise by x1.25; the next raise waits 10 ticks for the link to drain."""
    steps = _run(TrimState(10_000, 10_000), [_obs(i, 0.95) for i in range(13)])
    assert steps[:4] == [
        (10_000, "hold: egress 0.95 > 0.90 (tick 1)"),
        (12_500, "raise: egress 0.95 > 0.90"),
        (12_500, "hold: egress 0.95 > 0.90 (tick 1)"),
        (12_500, "hold: egress 0.95 > 0.90, 8 ticks after the last raise"),
    ]
    assert [t for t, _ in steps[4:]] == [12_500] * 7 + [15_625, 15_625]
    assert steps[11][1] == "raise: egress 0.95 > 0.90"


def test_a_full_link_raises_only_while_prfaas_is_the_busier_side() -> None:
    """Link at 100% but PD prefill as busy or busier: moving work to PD would only move the
    queue, so t holds; with PD far behind, t even falls."""
    s = TrimState(10_000, 10_000, hot_ticks=1, quiet_ticks=5)
    d = trim(CFG, s, _obs(0, 1.0, pf=2.0, pd=2.0))
    assert not d.changed and d.reason == "hold: within the dead band"
    d = trim(CFG, s, _obs(0, 1.0, pf=0.0, pd=10.0))
    assert d.state.threshold == 9_400  # 10,000 x (1 - 1/1.25) x 3/10: the raising pace
    assert d.reason == "lower: PD queue 10.0s > 1.5 x PrfaaS 0.0s + 3s"


def test_the_plan_lifts_the_high_water_mark() -> None:
    """A link-bound plan expects 95% utilisation: the link counts as congested only above
    1.05, so running it full is not a reason to raise."""
    s = TrimState(10_000, 10_000, hot_ticks=1, planned_utilisation=0.95)
    assert s.high_water(CFG) == pytest.approx(1.05)
    assert not trim(CFG, s, _obs(0, 1.0)).changed
    assert trim(CFG, replace(s, planned_utilisation=0.5), _obs(0, 1.0)).state.threshold == 12_500


def test_raise_is_clamped_to_the_band() -> None:
    s = TrimState(18_000, 10_000, hot_ticks=1)
    d = trim(CFG, s, _obs(0, 1.0))
    assert d.changed and d.state.threshold == 20_000
    d = trim(CFG, replace(d.state, hot_ticks=1, since_raise=50), _obs(1, 1.0))
    assert not d.changed and d.reason == "hold: egress 1.00 > 0.90, t at the band's top 20000"


def test_a_prfaas_queue_surge_raises() -> None:
    """PrfaaS 6 s queued vs PD 1 s: more than 1.5 x 1 + 3 s."""
    s = TrimState(10_000, 10_000, hot_ticks=1)
    d = trim(CFG, s, _obs(0, 0.2, pf=6.0, pd=1.0))
    assert d.state.threshold == 12_500
    assert d.reason == "raise: PrfaaS queue 6.0s > 1.5 x PD 1.0s + 3s"
    # 4.5 s is exactly 1.5 x 1 + 3: not a surge
    assert not trim(CFG, TrimState(10_000, 10_000, hot_ticks=1), _obs(0, 0.2, 4.5, 1.0)).changed


def test_quiet_link_lowers_additively_back_to_the_set_point() -> None:
    """Every third quiet tick takes 512 tokens off, down to the set-point, never below."""
    ts = [t for t, _ in _run(TrimState(11_200, 10_000), [_obs(i, 0.3) for i in range(12)])]
    assert ts == [11_200, 11_200, 10_688, 10_688, 10_688, 10_176, 10_176, 10_176, 10_000,
                  10_000, 10_000, 10_000]  # fmt: skip


def test_dead_band_holds() -> None:
    """Between the marks, above the set-point, queues balanced: nothing moves."""
    d = trim(CFG, TrimState(12_000, 10_000, quiet_ticks=5), _obs(0, 0.75))
    assert not d.changed and d.reason == "hold: within the dead band"


def test_busy_pd_prefill_lowers_below_the_set_point_to_the_band_floor() -> None:
    """PD queue 10 s vs PrfaaS 1 s: t falls by 512 per 3 quiet ticks (the minimum step:
    the raising pace would be 6% of 5,600) down to 5,000."""
    s = TrimState(5_600, 10_000, quiet_ticks=2)
    d = trim(CFG, s, _obs(0, 0.1, pf=1.0, pd=10.0))
    assert d.state.threshold == 5_088
    assert d.reason == "lower: PD queue 10.0s > 1.5 x PrfaaS 1.0s + 3s"
    d = trim(CFG, replace(d.state, quiet_ticks=2), _obs(1, 0.1, pf=1.0, pd=10.0))
    assert d.state.threshold == 5_000
    d = trim(CFG, replace(d.state, quiet_ticks=2), _obs(2, 0.1, pf=1.0, pd=10.0))
    assert not d.changed and "t at its floor 5000" in d.reason


def test_a_congested_pd_pulls_t_down_at_the_pace_a_congested_prfaas_pushes_it_up() -> None:
    """30 ticks of one pool's queue far ahead: PrfaaS congested raises t x1.25 three times
    (ticks 2, 12, 22); PD congested lowers it by 6% every 3 ticks, ten times. Additive
    512-token steps would have taken it only from 40,000 to 34,880."""
    up = _run(TrimState(20_000, 20_000), [_obs(i, 0.1, pf=20.0, pd=0.0) for i in range(30)])
    assert up[-1][0] == 20_000 * 1.25**3
    down = _run(TrimState(40_000, 40_000), [_obs(i, 0.1, pf=0.0, pd=20.0) for i in range(30)])
    assert down[-1][0] == pytest.approx(40_000 * 0.94**10)
    assert down[-1][0] < 40_000 / 1.25**2


def test_relaxes_up_to_the_set_point_once_pd_is_no_longer_congested() -> None:
    s = TrimState(9_000, 10_000, quiet_ticks=2)
    d = trim(CFG, s, _obs(0, 0.7))
    assert d.state.threshold == 9_512 and d.reason == "relax up toward set-point 10000"
    d = trim(CFG, replace(d.state, quiet_ticks=2), _obs(1, 0.7))
    assert d.state.threshold == 10_000


def test_no_link_telemetry_counts_as_a_quiet_link() -> None:
    d = trim(CFG, TrimState(11_000, 10_000, quiet_ticks=2), _obs(0, None))
    assert d.state.threshold == 10_488 and d.reason == "lower: egress unknown < 0.6"


def _steady(plant: Callable[[float], float], ticks: int) -> list[float]:
    """Run the trimmer against a link whose utilisation depends only on t."""
    state, ts = TrimState(10_000, 10_000), []
    for i in range(ticks):
        state = trim(CFG, state, _obs(float(i), plant(state.threshold))).state
        ts.append(state.threshold)
    return ts


def test_no_oscillation_when_congestion_has_a_sharp_edge() -> None:
    """Congested below 12,000 tokens, idle above: after at most two probes the trimmer sits
    one step above the last congested t and stays there for the rest of the memory."""
    ts = _steady(lambda t: 0.95 if t < 12_000 else 0.3, 250)
    tail = ts[60:]
    assert len(set(tail)) == 1
    assert 12_000 <= tail[0] <= 12_000 * CFG.raise_factor
    assert sum(a != b for a, b in itertools.pairwise(ts)) <= 12


def test_no_oscillation_under_a_smooth_load() -> None:
    """util = 1.2 - t / 40,000: one raise lands in the dead band and t never moves again."""
    ts = _steady(lambda t: 1.2 - t / 40_000, 200)
    assert ts[1:] == [12_500.0] * 199


def test_memory_expires_and_a_growing_link_forgets_it() -> None:
    """After the memory the trimmer may lower to the set-point again; a link 20% larger
    forgets it at once; a smaller one keeps it (the congestion is only more likely)."""
    s = TrimState(12_500, 10_000, congested_at=10_000, remember_until=300.0, quiet_ticks=2,
                  capacity=1e9)  # fmt: skip
    d = trim(CFG, s, _obs(100, 0.3))
    assert d.state.threshold == 11_988  # floor 10,512 still far
    s2 = replace(d.state, threshold=10_600, quiet_ticks=2)
    assert trim(CFG, s2, _obs(101, 0.3)).state.threshold == 10_512
    s3 = replace(s2, threshold=10_512, quiet_ticks=2)
    assert not trim(CFG, s3, _obs(102, 0.3)).changed
    assert trim(CFG, s3, _obs(300, 0.3)).state.threshold == 10_000  # expired
    assert trim(CFG, s3, _obs(102, 0.3, cap=1.2e9)).state.threshold == 10_000  # link grew
    assert not trim(CFG, s3, _obs(102, 0.3, cap=0.5e9)).changed  # link shrank: remembered


def test_a_new_set_point_resets_t_and_the_memory() -> None:
    s = TrimState(12_500, 10_000, hot_ticks=1, congested_at=10_000, remember_until=99.0,
                  capacity=5.0, since_raise=7)  # fmt: skip
    new = s.with_set_point(25_000, 0.4)
    assert new == TrimState(25_000, 25_000, capacity=5.0, since_raise=7, planned_utilisation=0.4)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("high_water", 0.0, "high_water: must be in (0, 1.5] (got 0.0)"),
        ("low_water", 0.95, "low_water: must be in [0, high_water) (got 0.95)"),
        ("raise_factor", 1.0, "raise_factor: must be > 1 (got 1.0)"),
        ("queue_ratio", 0.5, "queue_ratio: must be >= 1 (got 0.5)"),
        ("band", (1.2, 2.0), "band: must be [low <= 1, high >= 1], low > 0 (got (1.2, 2.0))"),
        ("confirm_ticks", 0, "confirm_ticks: must be >= 1 (got 0)"),
    ],
)
def test_config_errors_name_the_bad_value(field: str, value: object, message: str) -> None:
    with pytest.raises(FieldError) as err:
        TrimConfig(**{field: value})  # type: ignore[arg-type]
    assert str(err.value) == message
