"""The short-term threshold trimmer: moves `t` with egress utilisation and prefill queues.

Each tick (about a second) it sees the link's measured utilisation and the predicted
backlog of both prefill pools (the gateway's predictions: PrfaaS occupancy includes the KV
over the spare egress, so a saturated link shows up as PrfaaS backlog). The rules read
them averaged over what the current `t` did (about `smoothing_s`, restarted at each move,
and no move until the averages span that long): one offload's KV runs a slow link full for
its whole transfer and one long prompt fills a pool's queue for its whole prefill, which
under a steady load is noise, not a change of load. The rules move `t` inside a band
around the long-term loop's set-point:

- **raise, multiplicatively** (`t *= raise_factor`) when the PrfaaS side is congested: its
  queue exceeds the PD-prefill queue by `queue_gap_s`, or the link is above its high-water
  mark while the PrfaaS queue is the longer one, for `confirm_ticks` ticks in a row: less
  is sent to PrfaaS, at once. A link running full while PD prefill is the busier side is
  left alone: a link-bound optimum (the planner's answer on a slow link) runs it near 100%,
  and moving work to PD would only move the queue;
- **lower** after `clear_ticks` ticks without PrfaaS congestion: down to the band's floor
  (not below one step above where the link last congested, while remembered: see below)
  while the PD-prefill queue exceeds the PrfaaS one by `queue_gap_s`, at the pace raising
  keeps (one raise's worth per `holdoff_ticks`: two compute queues are balanced, nothing
  is probed); or back to the set-point in one move once the link is below its low-water
  mark, but not while the link's last congestion is remembered (see below);
- **relax up** additively toward the set-point when `t` sits below it and neither side is
  congested;
- hold otherwise (between the marks there is a dead band).

After a multiplicative step the next waits `holdoff_ticks`, so the link's queued transfers
drain and its utilisation shows what the new `t` does before `t` moves again (a saturated
link reads 100% until then, and stepping on every tick would overshoot).

Two more rules, for overload, where both pools queue (`prfaas/sim/SCHEDULING.md` tells
what the live runs showed without them):
- **a queue still draining holds the step that answered it:** after a raise, the next raise
  waits while the PrfaaS queue is shorter than at the raise, at most as many seconds as
  that queue held (by then what was queued at the raise has drained); a lowering for the
  PD queue likewise. On a slow link a queue of KV drains for as long as it is, and
  stepping again on its length alone overshoots. Once the queue as it stood at the step
  has had its time, the averages start again: averaged over the drain, the queue reads
  long for a while after it has gone;
- **a saturated PD prefill caps raises at the set-point:** while the PD prefill pool is busy
  `SATURATED_BUSY_SHARE` of the time or more (`pd_busy_share`, the offload rule's test of
  saturation in `ttft_forecast`), the throughput-optimal set-point governs the trimmer as
  it governs each offload: raising `t` would move long prompts onto the pool that is
  already the bottleneck, and every short prompt behind them would wait their compute.

No oscillation under steady load: after a raise, the `t` at which the link was congested is
remembered until that memory expires (`link_memory_s`, half an hour, after a raise made once
the link had run full; else `memory_s`, five minutes), the link capacity grows more than
`CAPACITY_CHANGE` past what it was at the raise, or the set-point moves on a measured step
(or past `t`; a move on the estimate's noise keeps it: `set_point_moved`). Meanwhile a quiet
link lowers nothing (the raise stands), and a lowering for a congested PD prefill stops one
step above the congested `t`: where lowering for the PD queue congests the link, the two
queues otherwise take turns pulling `t` down and pushing it back up. So under a steady load
the trimmer stays where one raise put it (above the set-point, at most one raise above the
congested point) instead of cycling through it (TCP's ssthresh plays the same role).
Lowering on a quiet link down to one step above that point would gain at most one raise's
worth of `t`, one `lower_step_tokens` move at a time (`prfaas/sim/SCHEDULING.md`). Once the
memory has expired a quiet link takes `t` back to the set-point in one move, not in
`lower_step_tokens` steps: each step measured 20 s of a link that carries an offload every
few seconds (a probe that shows little), and every step was one more move of `t` under a
steady load. The memory after a link ran full is long because a short one cycled `t` under a
steady load: raise, expire, probe down, congest, raise (measured in
`prfaas/sim/SCHEDULING.md`, *Steady under a steady load*). The same holds the other way:
after a lowering for a congested PD prefill, relaxing back up stops one step below the `t`
at which PD was congested until that memory expires (`memory_s`, five minutes) or the
set-point moves as above (without it, a steady load near the PD prefill's capacity went
set-point, lower, relax, relax, lower again about a minute later in the live link-drop
phase).

Pure: state and observation in, decision out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from prfaas.common.toml_tables import check
from prfaas.policies.ttft_forecast import SATURATED_BUSY_SHARE

CAPACITY_CHANGE = 0.1  # a relative change of link capacity this large forgets the memory


@dataclass(frozen=True)
class TrimConfig:
    """Thresholds and steps of the trimmer (utilisation in [0, 1], queues in seconds)."""

    high_water: float = 0.9
    """Egress utilisation above which `t` rises."""
    low_water: float = 0.6
    """Egress utilisation below which `t` may fall."""
    queue_gap_s: float = 3.0
    """A pool is congested when its predicted queue exceeds `queue_ratio` times the
    other's plus this many seconds."""
    queue_ratio: float = 1.5
    plan_margin: float = 0.1
    """The high-water mark is at least the long-term plan's expected utilisation plus this
    (a link-bound plan runs the link near full on purpose)."""
    raise_factor: float = 1.25
    lower_step_tokens: float = 512.0
    band: tuple[float, float] = (0.5, 2.0)
    """`t` stays within [set_point * band[0], set_point * band[1]]."""
    confirm_ticks: int = 2
    """Congested ticks in a row before a raise."""
    holdoff_ticks: int = 10
    """Ticks after a raise before the next one: the transfers already queued on the link
    must drain before its utilisation shows what the new `t` does. (Lowering for a
    congested PD prefill keeps the same pace.)"""
    clear_ticks: int = 3
    """Quiet ticks in a row before each lowering step."""
    memory_s: float = 300.0
    """How long the `t` of the last raise bounds lowering, and the `t` of the last lowering
    for the PD queue bounds relaxing up; a set-point move forgets either sooner, unless it
    was on the estimate's noise alone (`set_point_moved`)."""
    link_memory_s: float = 1800.0
    """The same after a raise made once the link had run full (a tick at `high_water` or above
    since `t` last moved: KV queued on it; on a slow link one offload does that, so there
    nearly every raise is the link's); a grown link or a set-point move on a measured step
    forgets it sooner. A link's capacity changes by steps, which end the memory. Where the
    link never ran full the queue was compute and keeps `memory_s`: two compute queues that
    take turns are balanced by moving `t` both ways, which a long bound on lowering for the
    PD queue holds back (`prfaas/sim/SCHEDULING.md`)."""
    smoothing_s: float = 20.0
    """The rules read egress utilisation and each pool's backlog averaged over about this
    long (exponential moving averages; 0 reads them raw), and only over what the current `t`
    did: each move of `t` starts the averages again, and the next move waits until they span
    this long. Under a steady load one offload's KV runs the link full for its whole
    transfer, and one long prompt moves a pool's backlog by its whole prefill time: noise,
    not a change of load."""

    def __post_init__(self) -> None:
        check(0 < self.high_water <= 1.5, "high_water", self.high_water, "must be in (0, 1.5]")
        ok = 0 <= self.low_water < self.high_water
        check(ok, "low_water", self.low_water, "must be in [0, high_water)")
        check(self.queue_gap_s > 0, "queue_gap_s", self.queue_gap_s, "must be > 0")
        check(self.queue_ratio >= 1, "queue_ratio", self.queue_ratio, "must be >= 1")
        check(self.plan_margin >= 0, "plan_margin", self.plan_margin, "must be >= 0")
        check(self.raise_factor > 1, "raise_factor", self.raise_factor, "must be > 1")
        step = self.lower_step_tokens
        check(step > 0, "lower_step_tokens", step, "must be > 0")
        lo, hi = self.band if len(self.band) == 2 else (0.0, 0.0)
        check(0 < lo <= 1 <= hi, "band", self.band, "must be [low <= 1, high >= 1], low > 0")
        check(self.confirm_ticks >= 1, "confirm_ticks", self.confirm_ticks, "must be >= 1")
        check(self.holdoff_ticks >= 1, "holdoff_ticks", self.holdoff_ticks, "must be >= 1")
        check(self.clear_ticks >= 1, "clear_ticks", self.clear_ticks, "must be >= 1")
        check(self.memory_s >= 0, "memory_s", self.memory_s, "must be >= 0")
        ok = self.link_memory_s >= 0
        check(ok, "link_memory_s", self.link_memory_s, "must be >= 0")
        check(self.smoothing_s >= 0, "smoothing_s", self.smoothing_s, "must be >= 0")


@dataclass(frozen=True)
class TrimObservation:
    """One tick's measurements."""

    now: float
    egress_utilisation: float | None
    """Measured egress / measured capacity; None without link telemetry."""
    prfaas_backlog_s: float
    """Predicted queue of the PrfaaS prefill pool (its least-backlogged instance)."""
    pd_backlog_s: float
    """Predicted queue of the PD prefill pool (its least-backlogged instance)."""
    capacity_bytes_per_s: float | None = None
    pd_busy_share: float = 0.0
    """The share of the recent past in which the PD prefill pool had no idle instance."""


@dataclass(frozen=True)
class TrimAverages:
    """Exponentially weighted sums of the observations since `t` last moved (`since`), each
    decaying with time constant `smoothing_s`; a mean is its sum over its weight. The
    utilisation has a weight of its own: a tick without link telemetry adds nothing to it."""

    since: float
    at: float
    """The last observation folded in."""
    weight: float = 0.0
    prfaas_backlog: float = 0.0
    pd_backlog: float = 0.0
    utilisation: float = 0.0
    utilisation_weight: float = 0.0
    peak_utilisation: float = 0.0
    """The highest utilisation a single tick measured (whether the link ran full)."""

    def queues(self) -> tuple[float, float]:
        """The mean PrfaaS and PD prefill backlogs."""
        if self.weight <= 0:
            return 0.0, 0.0
        return self.prfaas_backlog / self.weight, self.pd_backlog / self.weight

    def mean_utilisation(self) -> float | None:
        """None when no tick of this `t` had link telemetry."""
        w = self.utilisation_weight
        return self.utilisation / w if w > 0 else None


@dataclass(frozen=True)
class LastStep:
    """A multiplicative step: a raise for a congested PrfaaS side, or a lowering for a
    congested PD prefill; when, and the queue of the side it answered: averaged (what the
    rules compare) and as it stood at the step (how long what was queued takes to drain)."""

    raised: bool
    at: float
    queue_s: float
    held_s: float = 0.0

    def draining(self, now: float, queue_s: float) -> bool:
        """Whether that side's queue, `queue_s` now (averaged), is still draining what it
        held at the step: shorter than then, and not yet as many seconds later as it held
        (the longer of the average and the queue at the step: a 30-second queue of KV that
        built up just before the step averages a third of that over the 20 s before it,
        and drains for 30 s)."""
        return queue_s < self.queue_s and now - self.at < max(self.queue_s, self.held_s)


@dataclass(frozen=True)
class TrimState:
    """The trimmer's memory between ticks."""

    threshold: float
    set_point: float
    hot_ticks: int = 0
    quiet_ticks: int = 0
    since_step: int = 1_000_000
    """Ticks since the last multiplicative step (a raise, or a lowering for the PD queue)."""
    congested_at: float | None = None
    """`t` at the last raise; while remembered, a lowering for the PD queue stops one step
    above it and a quiet link lowers nothing."""
    remember_until: float = -math.inf
    pd_congested_at: float | None = None
    """`t` at the last lowering for a congested PD prefill (relaxing up stops one step
    below it while remembered)."""
    pd_remember_until: float = -math.inf
    capacity: float | None = None
    """Link capacity when the link's congestion memory was taken (while none is held, the
    latest measured), so that a link that grows by steps still forgets it."""
    planned_utilisation: float | None = None
    """What the long-term plan expects the link to run at (None: unknown)."""
    averages: TrimAverages | None = None
    """What the current `t` did so far (None: no tick seen since it was set)."""
    last_step: LastStep | None = None
    """The last multiplicative step since the set-point was set (None: none)."""

    def with_set_point(self, set_point: float, planned: float | None = None) -> TrimState:
        """The long-term loop re-solved `t`: jump to it, forget the congestion memory, and
        measure afresh what the new `t` does."""
        return TrimState(
            threshold=set_point,
            set_point=set_point,
            capacity=self.capacity,
            since_step=self.since_step,
            planned_utilisation=planned,
        )

    def high_water(self, config: TrimConfig) -> float:
        """The utilisation above which the link counts as congested."""
        planned = self.planned_utilisation
        return (
            config.high_water
            if planned is None
            else max(config.high_water, planned + config.plan_margin)
        )


@dataclass(frozen=True)
class TrimDecision:
    state: TrimState
    changed: bool
    reason: str


def band(config: TrimConfig, set_point: float) -> tuple[float, float]:
    return set_point * config.band[0], set_point * config.band[1]


def set_point_moved(
    config: TrimConfig,
    state: TrimState,
    set_point: float,
    planned: float | None,
    *,
    drifted: bool,
    now: float,
) -> TrimState:
    """`state` around the long-term loop's new set-point at `now`. After a move on the
    blended estimate alone (`drifted`: no step was measured), `t` and the memory that holds
    it stay while that memory is held and `t` lies on its side of the new set-point (or on
    it), within the new band: above after a raise for the link or the PrfaaS queue, below
    after a lowering for the PD queue. The raise answered a queue the trimmer measured,
    which the estimate's noise does not undo; jumping to the new set-point and forgetting
    brought the same queue and the same raise back (`prfaas/sim/SCHEDULING.md`, *Steady
    under a steady load*). Otherwise `t` jumps to the set-point and is measured afresh
    (`TrimState.with_set_point`)."""
    lo, hi = band(config, set_point)
    t = state.threshold
    raise_held = state.congested_at is not None and now < state.remember_until
    lowering_held = state.pd_congested_at is not None and now < state.pd_remember_until
    above = raise_held and set_point <= t <= hi
    below = lowering_held and lo <= t <= set_point
    if drifted and (above or below):
        return replace(state, set_point=set_point, planned_utilisation=planned)
    return state.with_set_point(set_point, planned)


def trim(config: TrimConfig, state: TrimState, obs: TrimObservation) -> TrimDecision:
    """One tick of the trimmer (see the module docstring)."""
    state = replace(_forget_if_stale(state, obs), since_step=state.since_step + 1)
    state = _drained(state, obs.now)
    seen = _averaged(config, state.averages, obs)
    state = replace(state, averages=seen)
    if obs.now - seen.since < config.smoothing_s:
        return TrimDecision(state, False, f"hold: measuring what t {state.threshold:.0f} does")
    (pf, pd), util = seen.queues(), seen.mean_utilisation()
    queue_hot = pf > config.queue_ratio * pd + config.queue_gap_s
    pd_hot = pd > config.queue_ratio * pf + config.queue_gap_s
    high = state.high_water(config)
    link_hot = util is not None and util > high and pf > pd
    step = state.last_step
    if link_hot or queue_hot:
        why = (
            f"egress {util:.2f} > {high:.2f}"
            if link_hot and util is not None
            else f"PrfaaS queue {pf:.1f}s > {config.queue_ratio:g} x PD {pd:.1f}s"
            f" + {config.queue_gap_s:g}s"
        )
        if step is not None and step.raised and step.draining(obs.now, pf):
            return TrimDecision(replace(state, quiet_ticks=0), False,
                                f"hold: {why}, draining ({step.queue_s:.1f}s at the last "
                                "raise)")  # fmt: skip
        return _raise(config, replace(state, quiet_ticks=0), obs, why, pf)
    state = replace(state, hot_ticks=0, quiet_ticks=state.quiet_ticks + 1)
    if state.quiet_ticks < config.clear_ticks:
        return TrimDecision(state, False, "hold: waiting for quiet ticks")
    lo, _ = band(config, state.set_point)
    t, sp = state.threshold, state.set_point
    if pd_hot:
        why = (
            f"PD queue {pd:.1f}s > {config.queue_ratio:g} x PrfaaS {pf:.1f}s"
            f" + {config.queue_gap_s:g}s"
        )
        if state.since_step < config.holdoff_ticks:
            left = config.holdoff_ticks - state.since_step
            return TrimDecision(state, False, f"hold: {why}, {left} ticks after the last step")
        if step is not None and not step.raised and step.draining(obs.now, pd):
            return TrimDecision(state, False, f"hold: {why}, draining ({step.queue_s:.1f}s at "
                                "the last lowering)")  # fmt: skip
        lowered = _lower(config, state, lo, why, step=t * (1 - 1 / config.raise_factor))
        if not lowered.changed:
            return lowered
        stepped = replace(
            lowered.state,
            since_step=0,
            last_step=LastStep(False, obs.now, pd, obs.pd_backlog_s),
            pd_congested_at=t,
            pd_remember_until=obs.now + config.memory_s,
        )
        return replace(lowered, state=stepped)
    if t > sp and (util is None or util < config.low_water):
        util_text = "unknown" if util is None else f"{util:.2f}"
        why = f"egress {util_text} < {config.low_water:g}"
        if state.congested_at is not None:
            return TrimDecision(state, False, f"hold: {why}, t {t:.0f} raised from "
                                f"{state.congested_at:.0f}, where the link congested "
                                "(remembered)")  # fmt: skip
        return _lower(config, state, sp, why, step=t - sp)
    if t < sp:
        ceiling = sp
        if state.pd_congested_at is not None:
            ceiling = min(sp, state.pd_congested_at - config.lower_step_tokens)
        if t >= ceiling:  # only with a memory: else the ceiling is the set-point, above t
            return TrimDecision(state, False, f"hold: t {t:.0f} not below {ceiling:.0f}, one "
                                f"step below {state.pd_congested_at:.0f}, where the PD queue "
                                "was congested")  # fmt: skip
        new = min(t + config.lower_step_tokens, ceiling)
        return _moved(state, new, f"relax up toward set-point {sp:.0f}")
    return TrimDecision(state, False, "hold: within the dead band")


def _averaged(config: TrimConfig, seen: TrimAverages | None, obs: TrimObservation) -> TrimAverages:
    """Fold this tick's observations into the averages of the current `t` (every tick
    weighs the same when fresh; older ones decay with `smoothing_s`)."""
    if seen is None:
        seen = TrimAverages(since=obs.now, at=obs.now)
    dt = max(obs.now - seen.at, 0.0)
    decay = math.exp(-dt / config.smoothing_s) if config.smoothing_s > 0 else 0.0
    util = obs.egress_utilisation
    return TrimAverages(
        since=seen.since,
        at=obs.now,
        weight=seen.weight * decay + 1.0,
        prfaas_backlog=seen.prfaas_backlog * decay + obs.prfaas_backlog_s,
        pd_backlog=seen.pd_backlog * decay + obs.pd_backlog_s,
        utilisation=seen.utilisation * decay + (0.0 if util is None else util),
        utilisation_weight=seen.utilisation_weight * decay + (0.0 if util is None else 1.0),
        peak_utilisation=max(seen.peak_utilisation, 0.0 if util is None else util),
    )


def _drained(state: TrimState, now: float) -> TrimState:
    """`state` measuring afresh once what was queued at the last step has drained (as many
    seconds after it as the queue held then; the draining hold may last longer, to the
    averaged queue's length): the averages of the drain itself would still read the queue
    it answered after it is gone, and raise `t` a second time for it. Only the averages the
    step started: those of a later move of `t` measure that move."""
    step, seen = state.last_step, state.averages
    if step is None or seen is None or not seen.since <= step.at < step.at + step.held_s <= now:
        return state
    return replace(state, averages=None)


def _forget_if_stale(state: TrimState, obs: TrimObservation) -> TrimState:
    """Forget the link's congestion memory once it expires or the link grows (a link that
    shrank makes the remembered congestion only more true), the PD prefill's once it
    expires."""
    cap, old = obs.capacity_bytes_per_s, state.capacity
    moved = cap is not None and old is not None and cap > (1 + CAPACITY_CHANGE) * old
    if moved or obs.now >= state.remember_until:
        state = replace(state, congested_at=None, remember_until=-math.inf)
    if obs.now >= state.pd_remember_until:
        state = replace(state, pd_congested_at=None, pd_remember_until=-math.inf)
    if cap is None or (state.congested_at is not None and state.capacity is not None):
        return state  # a memory is measured against the capacity it was taken at
    return replace(state, capacity=cap)


def _raise(
    config: TrimConfig, state: TrimState, obs: TrimObservation, why: str, queue_s: float
) -> TrimDecision:
    """A raise for a congested PrfaaS side, whose (averaged) queue is `queue_s`; remembered
    for `link_memory_s` if the link ran full at some tick of what the current `t` did, else
    for `memory_s`."""
    state = replace(state, hot_ticks=state.hot_ticks + 1)
    _, hi = band(config, state.set_point)
    top = f"t at the band's top {hi:.0f}"
    if obs.pd_busy_share >= SATURATED_BUSY_SHARE and state.set_point < hi:
        hi = state.set_point
        top = (f"t {state.threshold:.0f} not below the set-point {hi:.0f} while the PD "
               f"prefill is busy {obs.pd_busy_share:.0%} of the time")  # fmt: skip
    t = state.threshold
    if state.hot_ticks < config.confirm_ticks:
        return TrimDecision(state, False, f"hold: {why} (tick {state.hot_ticks})")
    if state.since_step < config.holdoff_ticks:
        left = config.holdoff_ticks - state.since_step
        return TrimDecision(state, False, f"hold: {why}, {left} ticks after the last step")
    if t >= hi:
        return TrimDecision(state, False, f"hold: {why}, {top}")
    seen = state.averages
    # the plain mark, not the plan's: a link planned to run full still queues KV when it does
    link_full = seen is not None and seen.peak_utilisation >= config.high_water
    memory = config.link_memory_s if link_full else config.memory_s
    remembered = replace(
        state,
        hot_ticks=0,
        since_step=0,
        congested_at=t,
        remember_until=obs.now + memory,
        capacity=state.capacity if obs.capacity_bytes_per_s is None else obs.capacity_bytes_per_s,
        last_step=LastStep(True, obs.now, queue_s, obs.prfaas_backlog_s),
    )
    return _moved(remembered, min(round(t * config.raise_factor), hi), f"raise: {why}")


def _lower(
    config: TrimConfig,
    state: TrimState,
    target: float,
    why: str,
    *,
    step: float = 0.0,
) -> TrimDecision:
    """Lower toward `target` by `step` (at least `lower_step_tokens`), not below one step
    above the `t` at which the link was last congested (while remembered)."""
    t = state.threshold
    floor = target
    if state.congested_at is not None:
        floor = max(floor, state.congested_at + config.lower_step_tokens)
    if t <= floor:
        where = ""
        if floor != target:
            where = f", one step above {state.congested_at:.0f}, where the link congested"
        return TrimDecision(state, False, f"hold: {why}, t at its floor {floor:.0f}{where}")
    step = max(step, config.lower_step_tokens)
    return _moved(state, max(round(t - step), floor), f"lower: {why}")


def _moved(state: TrimState, threshold: float, why: str) -> TrimDecision:
    """Move `t` and start measuring what the new one does. Steps land on whole tokens before
    they are clamped to their bound (a raise by 1.25 left 4,608.000000000001, and a later
    step down to the set-point 4,608 was a move of 1e-12)."""
    now = state.averages.at if state.averages is not None else 0.0
    fresh = TrimAverages(since=now, at=now)
    return TrimDecision(
        replace(state, threshold=float(threshold), quiet_ticks=0, averages=fresh), True, why
    )
