"""The short-term threshold trimmer: multiplicative raises on PrfaaS-side congestion,
lowering for a congested PD prefill or back to the set-point on a quiet link, a band
around the set-point, and no oscillation under steady load."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace

import pytest

from prfaas.common.toml_tables import FieldError
from prfaas.policies.threshold_trim import (
    LastStep,
    TrimAverages,
    TrimConfig,
    TrimObservation,
    TrimState,
    set_point_moved,
    trim,
)

CFG = TrimConfig(smoothing_s=0.0)
"""The rules on raw observations: high 0.9, low 0.6, queues: ratio 1.5 + 3 s, x1.25 /
-512, band [0.5, 2], confirm 2, quiet 3, hold-off 10 ticks, memory 300 s (1,800 s after a
raise once the link ran full), plan margin 0.1."""
AVERAGED = TrimConfig()
"""The default: the same rules on averages over 20 s of what the current t does."""


def _obs(now: float, util: float | None, pf: float = 1.0, pd: float = 0.0,
         cap: float | None = 1e9) -> TrimObservation:  # fmt: skip
    """PrfaaS slightly busier than PD by default (so a full link may raise)."""
    return TrimObservation(now, util, pf, pd, cap)


def _run(state: TrimState, observations: list[TrimObservation],
         config: TrimConfig = CFG) -> list[tuple[float, str]]:  # fmt: skip
    out = []
    for o in observations:
        d = trim(config, state, o)
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
        (12_500, "hold: egress 0.95 > 0.90, 8 ticks after the last step"),
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
    assert d.state.threshold == 8_000  # one raise's worth: 10,000 / 1.25
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
    d = trim(CFG, replace(d.state, hot_ticks=1, since_step=50), _obs(1, 1.0))
    assert not d.changed and d.reason == "hold: egress 1.00 > 0.90, t at the band's top 20000"


def test_a_prfaas_queue_surge_raises() -> None:
    """PrfaaS 6 s queued vs PD 1 s: more than 1.5 x 1 + 3 s."""
    s = TrimState(10_000, 10_000, hot_ticks=1)
    d = trim(CFG, s, _obs(0, 0.2, pf=6.0, pd=1.0))
    assert d.state.threshold == 12_500
    assert d.reason == "raise: PrfaaS queue 6.0s > 1.5 x PD 1.0s + 3s"
    # 4.5 s is exactly 1.5 x 1 + 3: not a surge
    assert not trim(CFG, TrimState(10_000, 10_000, hot_ticks=1), _obs(0, 0.2, 4.5, 1.0)).changed


def test_a_saturated_pd_prefill_caps_raises_at_the_set_point() -> None:
    """PrfaaS queue surging, the PD prefill busy 70% of the time: the set-point governs, so
    t below it rises only to it and t at it holds; busy 40%, the band's top is the limit."""

    def surge(share: float) -> TrimObservation:
        return replace(_obs(0, 0.2, pf=20.0, pd=1.0), pd_busy_share=share)

    d = trim(CFG, TrimState(9_000, 10_000, hot_ticks=1), surge(0.7))
    assert d.state.threshold == 10_000
    d = trim(CFG, TrimState(10_000, 10_000, hot_ticks=1), surge(0.7))
    assert not d.changed
    assert d.reason == ("hold: PrfaaS queue 20.0s > 1.5 x PD 1.0s + 3s, t 10000 not below the "
                        "set-point 10000 while the PD prefill is busy 70% of the time")  # fmt: skip
    assert trim(CFG, TrimState(10_000, 10_000, hot_ticks=1), surge(0.4)).state.threshold == 12_500


def test_a_raise_holds_the_next_while_the_queue_it_answered_drains() -> None:
    """Ticks a second apart, PrfaaS congested throughout: a raise at tick 1 with 30 s queued;
    10 ticks later (the hold-off) the queue reads 20 s, still congested but draining what
    was queued at the raise, so no second raise until 30 s after it (the bound: by then
    that queue has drained); a queue that grows again past 30 s raises at once."""
    queue = [30.0, 30.0] + [20.0] * 40
    steps = _run(TrimState(10_000, 10_000), [_obs(i, 0.2, pf=q, pd=0.0) for i, q in
                                             enumerate(queue)])  # fmt: skip
    assert steps[1][0] == 12_500
    assert steps[20][1] == ("hold: PrfaaS queue 20.0s > 1.5 x PD 0.0s + 3s, draining (30.0s "
                            "at the last raise)")  # fmt: skip
    assert [t for t, _ in steps[:31]] == [10_000] + [12_500] * 30
    assert steps[32][0] == 15_625  # 31 s after the raise: two congested ticks past the bound
    regrown = [30.0, 30.0] + [20.0] * 10 + [35.0] * 2
    steps = _run(TrimState(10_000, 10_000), [_obs(i, 0.2, pf=q, pd=0.0) for i, q in
                                             enumerate(regrown)])  # fmt: skip
    assert steps[-1][0] == 15_625


def test_once_the_queue_at_a_raise_has_drained_its_average_does_not_raise_again() -> None:
    """On averages (the default): a link full and 40 s of KV queued for 22 s raise t once;
    the queue then drains a second a second. Averaged over the drain, the link still read
    94% a second after the queue had gone, and raised t again; once the 40 s queued at the
    raise are up the averages start again, and they read a quiet link."""
    state, moves = TrimState(10_000, 10_000), []
    for i in range(120):
        queue = 40.0 if i < 22 else max(0.0, 40.0 - (i - 22))
        d = trim(AVERAGED, state, _obs(float(i), 1.0 if queue > 0 else 0.0, pf=queue))
        state = d.state
        moves += [(i, state.threshold)] if d.changed else []
    assert moves == [(21, 12_500)]
    assert state.last_step == LastStep(True, 21.0, pytest.approx(40.0), 40.0)


def test_the_draining_hold_lasts_as_long_as_the_queue_held_at_the_raise() -> None:
    """On averages: 19 s with 2 s queued, then 60 s of KV queued for three ticks: the raise
    reads the averaged queue (14 s) but the queue held 60 s. It then reads 8 s, still
    congested and shorter than at the raise: held for the 60 s queued at the raise (the
    averaged queue's length alone ended the hold after 14 s and raised again 21 s after the
    first, then every 21 s), then measured afresh for 20 s, then raised again."""
    state, moves = TrimState(10_000, 10_000), []
    for i in range(120):
        queue = 2.0 if i < 19 else 60.0 if i < 22 else 8.0
        d = trim(AVERAGED, state, _obs(float(i), 0.3, pf=queue))
        state = d.state
        moves += [i] if d.changed else []
    assert moves[0] == 21 and moves[1] >= 21 + 60 + 20
    assert state.last_step is not None and state.last_step.at == moves[1]


def test_a_lowering_holds_the_next_while_the_pd_queue_drains_but_not_a_raise() -> None:
    """The PD side alike; and the hold is for the step in the same direction only: after a
    lowering, a congested PrfaaS side raises at once."""
    lowered = TrimState(8_000, 10_000, quiet_ticks=2, since_step=50,
                        last_step=LastStep(False, 0.0, 30.0))  # fmt: skip
    d = trim(CFG, lowered, _obs(5, 0.1, pf=0.0, pd=20.0))
    assert not d.changed and d.reason.endswith("draining (30.0s at the last lowering)")
    assert trim(CFG, lowered, _obs(31, 0.1, pf=0.0, pd=20.0)).state.threshold == 6_400
    d = trim(CFG, replace(lowered, hot_ticks=1), _obs(5, 0.2, pf=20.0, pd=1.0))
    assert d.state.threshold == 10_000 and d.state.last_step == LastStep(True, 5, 20.0, 20.0)


def test_quiet_link_returns_to_the_set_point_in_one_move() -> None:
    """Three quiet ticks, then t goes back to the set-point at once (not 512 tokens a step:
    each step would be one more move of t), and holds there."""
    steps = _run(TrimState(11_200, 10_000), [_obs(i, 0.3) for i in range(12)])
    assert [t for t, _ in steps] == [11_200] * 2 + [10_000] * 10
    assert steps[2][1] == "lower: egress 0.30 < 0.6"
    assert steps[-1][1] == "hold: within the dead band"


def test_dead_band_holds() -> None:
    """Between the marks, above the set-point, queues balanced: nothing moves."""
    d = trim(CFG, TrimState(12_000, 10_000, quiet_ticks=5), _obs(0, 0.75))
    assert not d.changed and d.reason == "hold: within the dead band"


def test_busy_pd_prefill_lowers_below_the_set_point_to_the_band_floor() -> None:
    """PD queue 10 s vs PrfaaS 1 s: t falls by a raise's worth (/1.25), the next step 10
    ticks later, down to the band's floor 5,000."""
    s = TrimState(7_000, 10_000, quiet_ticks=2)
    d = trim(CFG, s, _obs(0, 0.1, pf=1.0, pd=10.0))
    assert d.state.threshold == 5_600
    assert d.reason == "lower: PD queue 10.0s > 1.5 x PrfaaS 1.0s + 3s"
    d = trim(CFG, replace(d.state, quiet_ticks=2), _obs(1, 0.1, pf=1.0, pd=10.0))
    assert not d.changed and d.reason.endswith("9 ticks after the last step")
    d = trim(CFG, replace(d.state, quiet_ticks=2, since_step=10), _obs(2, 0.1, pf=1.0, pd=10.0))
    assert d.state.threshold == 5_000
    d = trim(CFG, replace(d.state, quiet_ticks=2, since_step=10), _obs(3, 0.1, pf=1.0, pd=10.0))
    assert not d.changed and "t at its floor 5000" in d.reason


def test_lowering_for_pd_stops_one_step_above_where_the_link_was_congested() -> None:
    """The link congested at 8,000 (t raised to 10,000); then the PD queue congests: t falls
    only to 8,512, not by a raise's worth to 8,000 (which would congest the link again and
    cycle), and holds there until the memory expires (the link ran full: 1,800 s)."""
    state = TrimState(8_000, 10_000, hot_ticks=1)
    state = trim(CFG, state, _obs(0, 0.95)).state
    assert state.threshold == 10_000 and state.congested_at == 8_000
    pd_hot = replace(state, quiet_ticks=2, since_step=10)
    d = trim(CFG, pd_hot, _obs(1, 0.1, pf=1.0, pd=10.0))
    assert d.state.threshold == 8_512
    assert d.reason == "lower: PD queue 10.0s > 1.5 x PrfaaS 1.0s + 3s"
    # (no draining hold: the queue of that lowering counts as drained)
    again = replace(d.state, quiet_ticks=2, since_step=10, last_step=None)
    d = trim(CFG, again, _obs(2, 0.1, pf=1.0, pd=10.0))
    assert not d.changed and d.reason.endswith(
        "t at its floor 8512, one step above 8000, where the link congested"
    )
    assert not trim(CFG, again, _obs(1_799, 0.1, pf=1.0, pd=10.0)).changed
    d = trim(CFG, again, _obs(1_801, 0.1, pf=1.0, pd=10.0))
    assert d.state.threshold == 6_810  # the memory expired: /1.25, in whole tokens


def test_a_compute_queue_is_remembered_five_minutes_a_full_link_half_an_hour() -> None:
    """A raise for the PrfaaS queue while the link never ran full (a compute queue): a quiet
    link lowers nothing and a lowering for the PD queue stops one step above for 300 s; the
    same raise after one tick of a full link is remembered for 1,800 s (KV queued on the
    link, whose capacity changes only by steps)."""
    for peak, until in ((0.5, 300.0), (0.95, 1_800.0)):
        state = TrimState(10_000, 10_000, hot_ticks=1)
        state = trim(CFG, state, _obs(-1, peak, pf=1.0, pd=1.0)).state  # not congested
        state = replace(state, hot_ticks=1)
        d = trim(CFG, state, _obs(0, 0.1, pf=20.0, pd=1.0))
        assert d.reason == "raise: PrfaaS queue 20.0s > 1.5 x PD 1.0s + 3s"
        assert (d.state.congested_at, d.state.remember_until) == (10_000, until)
        assert d.state.averages is not None and d.state.averages.peak_utilisation == 0.0


def test_a_congested_pd_pulls_t_down_at_the_pace_a_congested_prfaas_pushes_it_up() -> None:
    """30 ticks of one pool's queue far ahead: PrfaaS congested raises t x1.25 three times
    (ticks 1, 11, 21); PD congested lowers it /1.25 three times (ticks 2, 12, 22). Additive
    512-token steps would have taken it only from 40,000 to 34,880."""
    up = _run(TrimState(20_000, 20_000), [_obs(i, 0.1, pf=20.0, pd=0.0) for i in range(30)])
    assert up[-1][0] == 39_062  # 20,000 x 1.25^3 = 39,062.5, rounded half to even
    down = _run(TrimState(40_000, 40_000), [_obs(i, 0.1, pf=0.0, pd=20.0) for i in range(30)])
    assert down[-1][0] == pytest.approx(40_000 / 1.25**3)


def test_relaxes_up_to_the_set_point_once_pd_is_no_longer_congested() -> None:
    s = TrimState(9_000, 10_000, quiet_ticks=2)
    d = trim(CFG, s, _obs(0, 0.7))
    assert d.state.threshold == 9_512 and d.reason == "relax up toward set-point 10000"
    d = trim(CFG, replace(d.state, quiet_ticks=2), _obs(1, 0.7))
    assert d.state.threshold == 10_000


def test_after_lowering_for_pd_relaxing_up_stops_one_step_below_where_pd_congested() -> None:
    """Set-point 10,000, PD congested there: t falls to 8,000; once PD is quiet it relaxes
    up 512 tokens a step only to 9,488 (one step below 10,000) and holds there, instead of
    climbing back to the set-point and cycling; after `memory_s` it climbs the rest, and a
    new set-point forgets the memory at once."""
    state = TrimState(10_000, 10_000, quiet_ticks=2)
    state = trim(CFG, state, _obs(0, 0.1, pf=1.0, pd=10.0)).state
    assert state.threshold == 8_000
    quiet = _run(state, [_obs(i, 0.1, pf=1.0, pd=1.0) for i in range(1, 40)])
    assert [t for t, _ in quiet][-1] == 9_488
    assert sorted({t for t, _ in quiet}) == [8_000, 8_512, 9_024, 9_488]  # then it holds
    assert quiet[-1][1] == (
        "hold: t 9488 not below 9488, one step below 10000, where the PD queue was congested"
    )
    held = replace(state, threshold=9_488, quiet_ticks=2)
    assert not trim(CFG, held, _obs(299, 0.1)).changed
    assert trim(CFG, held, _obs(301, 0.1)).state.threshold == 10_000
    assert held.with_set_point(12_000).pd_congested_at is None


def test_steps_land_on_whole_tokens_and_stop_at_a_fractional_set_point() -> None:
    """A quiet link lowers 4,000 to the set-point 3,000.5 and stops there (a step rounded
    after the clamp would land on 3,000, below it, and relax up to 3,000.5 and round down
    again every tick); raises from 3,001 land on 3,751 (x1.25 = 3,751.25)."""
    steps = _run(TrimState(4_000, 3_000.5, quiet_ticks=2), [_obs(i, 0.1) for i in range(12)])
    assert {t for t, _ in steps} == {3_000.5}
    assert steps[-1] == (3_000.5, "hold: within the dead band")
    up = trim(CFG, TrimState(3_001, 3_000.5, hot_ticks=1), _obs(0, 0.95))
    assert up.state.threshold == 3_751


def test_no_link_telemetry_counts_as_a_quiet_link() -> None:
    d = trim(CFG, TrimState(11_000, 10_000, quiet_ticks=2), _obs(0, None))
    assert d.state.threshold == 10_000 and d.reason == "lower: egress unknown < 0.6"


def _steady(plant: Callable[[float], float], ticks: int, config: TrimConfig) -> list[float]:
    """Run the trimmer against a link whose utilisation depends only on t."""
    state, ts = TrimState(10_000, 10_000), []
    for i in range(ticks):
        state = trim(config, state, _obs(float(i), plant(state.threshold))).state
        ts.append(state.threshold)
    return ts


@pytest.mark.parametrize(("config", "settled"), [(CFG, 60), (AVERAGED, 180)])
def test_no_oscillation_when_congestion_has_a_sharp_edge(config: TrimConfig, settled: int) -> None:
    """Congested below 12,000 tokens, idle above: one raise past the edge, and the quiet
    link then lowers nothing for the rest of the memory (it would go back to the set-point
    and congest again). (On averages, the raise waits for a measuring span of 20 s.)"""
    ts = _steady(lambda t: 0.95 if t < 12_000 else 0.3, 300, config)
    tail = ts[settled:]
    assert len(set(tail)) == 1
    assert 12_000 <= tail[0] <= 12_000 * CFG.raise_factor
    assert sum(a != b for a, b in itertools.pairwise(ts)) <= 2


@pytest.mark.parametrize(("config", "first"), [(CFG, 1), (AVERAGED, 21)])
def test_no_oscillation_under_a_smooth_load(config: TrimConfig, first: int) -> None:
    """util = 1.2 - t / 40,000: one raise (on averages, once they span 20 s) lands in the
    dead band and t never moves again."""
    ts = _steady(lambda t: 1.2 - t / 40_000, 200, config)
    assert ts == [10_000.0] * first + [12_500.0] * (200 - first)


def test_one_transfer_at_a_time_is_not_congestion() -> None:
    """Each offload's KV runs the link full for 10 s, then it idles 5 s (two thirds busy on
    on average): on averages nothing moves; read raw, the first transfer raises t."""
    util = [1.0 if i % 15 < 10 else 0.0 for i in range(300)]
    obs = [_obs(float(i), u) for i, u in enumerate(util)]
    assert {t for t, _ in _run(TrimState(10_000, 10_000), obs, AVERAGED)} == {10_000}
    assert _run(TrimState(10_000, 10_000), obs[:2])[-1][0] == 12_500


def test_ticks_without_link_telemetry_leave_the_averaged_utilisation_alone() -> None:
    """Every other tick has no link telemetry: the link's average is over the ticks that
    had some (95%, congested), so t rises once the averages span 20 s; with no telemetry
    at all the link is unknown, and t falls toward the set-point as on a quiet link."""
    obs = [_obs(float(i), 0.95 if i % 2 else None) for i in range(25)]
    steps = _run(TrimState(10_000, 10_000), obs, AVERAGED)
    assert steps[19][0] == 10_000 and steps[19][1] == "hold: measuring what t 10000 does"
    assert steps[21] == (12_500, "raise: egress 0.95 > 0.90")
    blind = _run(TrimState(11_000, 10_000), [_obs(float(i), None) for i in range(25)], AVERAGED)
    assert blind[22] == (10_000, "lower: egress unknown < 0.6")


def test_one_long_prompt_at_a_time_is_not_a_congested_pd_prefill() -> None:
    """The PD prefill's queue jumps to 6 s with each long prompt and drains (one in three
    ticks busy): on averages (about 2 s) t holds; read raw, the first jump lowers it."""
    obs = [_obs(float(i), 0.3, pf=0.0, pd=6.0 if i % 3 == 0 else 0.0) for i in range(300)]
    assert {t for t, _ in _run(TrimState(10_000, 10_000), obs, AVERAGED)} == {10_000}
    lowered = trim(CFG, TrimState(10_000, 10_000, quiet_ticks=5), obs[0])
    assert lowered.state.threshold < 10_000


def test_a_quiet_link_keeps_a_remembered_raise_until_the_memory_goes() -> None:
    """The link congested at 10,000 and t was raised to 12,500: a quiet link lowers nothing
    while that is remembered; after the memory, or at once when the link grows 20%, t falls
    toward the set-point again; a smaller link keeps the memory (the congestion is only more
    likely)."""
    s = TrimState(12_500, 10_000, congested_at=10_000, remember_until=300.0, quiet_ticks=2,
                  capacity=1e9)  # fmt: skip
    held = trim(CFG, s, _obs(100, 0.3))
    assert not held.changed and held.reason == (
        "hold: egress 0.30 < 0.6, t 12500 raised from 10000, where the link congested (remembered)"
    )
    s2 = replace(held.state, quiet_ticks=2)
    assert trim(CFG, s2, _obs(300, 0.3)).state.threshold == 10_000  # expired
    assert trim(CFG, s2, _obs(102, 0.3, cap=1.2e9)).state.threshold == 10_000  # link grew
    assert not trim(CFG, s2, _obs(102, 0.3, cap=0.5e9)).changed  # link shrank: remembered


def test_a_link_that_grows_by_small_steps_forgets_the_raise_once_grown_past_the_change() -> None:
    """Growth is measured against the capacity the memory was taken at, not tick to tick:
    +4% a tick forgets the congestion at the third tick (+12.5%)."""
    s = TrimState(12_500, 10_000, congested_at=10_000, remember_until=300.0, capacity=1e9)
    held = []
    for i, cap in enumerate((1.04e9, 1.0816e9, 1.124864e9)):
        s = trim(CFG, s, _obs(100 + i, 0.3, cap=cap)).state
        held.append(s.congested_at)
    assert held == [10_000, 10_000, None]
    assert s.capacity == 1.124864e9  # no memory held: the latest


def test_a_raise_on_a_shrunken_link_takes_its_capacity() -> None:
    """A memory taken at 1e9, then the link halves and the trimmer raises again: growth is
    then measured from 0.5e9, so the link coming back to 0.6e9 forgets the congestion."""
    s = TrimState(12_500, 10_000, congested_at=10_000, remember_until=300.0, capacity=1e9,
                  hot_ticks=1)  # fmt: skip
    raised = trim(CFG, s, _obs(100, 0.95, cap=0.5e9))
    assert raised.reason == "raise: egress 0.95 > 0.90" and raised.state.capacity == 0.5e9
    assert trim(CFG, raised.state, _obs(101, 0.3, cap=0.6e9)).state.congested_at is None


def test_no_link_telemetry_keeps_a_remembered_raise_too() -> None:
    """An unknown link counts as a quiet one (above), so a remembered raise stands there too."""
    s = TrimState(12_500, 10_000, congested_at=10_000, remember_until=300.0, quiet_ticks=2)
    held = trim(CFG, s, _obs(100, None))
    assert not held.changed and held.reason.startswith("hold: egress unknown < 0.6, t 12500")
    assert trim(CFG, replace(held.state, quiet_ticks=2), _obs(300, None)).state.threshold == 10_000


def test_a_new_set_point_resets_t_and_the_memory() -> None:
    s = TrimState(12_500, 10_000, hot_ticks=1, congested_at=10_000, remember_until=99.0,
                  capacity=5.0, since_step=7)  # fmt: skip
    s = replace(s, averages=TrimAverages(since=1.0, at=3.0, weight=2.0))
    new = s.with_set_point(25_000, 0.4)
    assert new == TrimState(25_000, 25_000, capacity=5.0, since_step=7, planned_utilisation=0.4)


def test_a_set_point_drifting_on_the_estimate_keeps_a_remembered_raise() -> None:
    """t raised to 12,500 for the link congested at 10,000 (remembered until 1,800 s). A
    set-point move on the estimate alone to 9,000, 11,000 or 12,500 keeps t and the memory,
    and a quiet link then lowers nothing; one to 13,000 (above t) or 6,000 (t beyond its
    band, 12,000) moves t there and forgets; so does a move on a measured step, one once the
    memory has expired, or one with no memory held."""
    s = TrimState(12_500, 10_000, congested_at=10_000, remember_until=1_800.0, capacity=1e9,
                  since_step=30, quiet_ticks=2)  # fmt: skip
    for sp in (9_000, 11_000, 12_500):
        kept = set_point_moved(CFG, s, sp, 0.5, drifted=True, now=100)
        assert kept == replace(s, set_point=sp, planned_utilisation=0.5)
        held = trim(CFG, kept, _obs(100, 0.1))
        assert not held.changed
        assert held.reason.endswith("where the link congested (remembered)") or sp == 12_500
    for sp, drifted, now, state in (
        (13_000, True, 100, s),
        (6_000, True, 100, s),
        (11_000, False, 100, s),
        (11_000, True, 1_800, s),
        (11_000, True, 100, replace(s, congested_at=None, remember_until=-math.inf)),
    ):
        moved = set_point_moved(CFG, state, sp, 0.5, drifted=drifted, now=now)
        assert moved == state.with_set_point(sp, 0.5)


def test_a_set_point_drifting_on_the_estimate_keeps_a_remembered_lowering() -> None:
    """The same below the set-point: t lowered to 8,000 for the PD queue congested at 10,000
    stays through a drift of the set-point to 9,000 or 12,000 (and relaxes up to the lower
    of the set-point and one step below 10,000), not through one to 7,500 (below t) or to
    17,000 (t below its band), nor once that memory has expired (300 s)."""
    s = TrimState(8_000, 10_000, pd_congested_at=10_000, pd_remember_until=300.0,
                  quiet_ticks=2)  # fmt: skip
    for sp in (9_000, 12_000):
        kept = set_point_moved(CFG, s, sp, None, drifted=True, now=0)
        assert kept.threshold == 8_000 and kept.pd_congested_at == 10_000
        relaxed = _run(kept, [_obs(i, 0.1, pf=1.0, pd=1.0) for i in range(1, 12)])
        assert max(t for t, _ in relaxed) == min(sp, 9_488)
    for sp, now in ((7_500, 0), (17_000, 0), (9_000, 300)):
        moved = set_point_moved(CFG, s, sp, None, drifted=True, now=now)
        assert (moved.threshold, moved.pd_congested_at) == (sp, None)


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
