"""The long-term rebalancer: re-solve Eq. 7/8 on the estimated workload each period, and
convert one PD-cluster instance between prefill and decode when the stages drift apart.

Each period the planner is re-run on the current estimate (incremental lengths, output
length, bandwidth) with the instances that exist now. The set-point `t` becomes the best
threshold for the *current* split once that has lain beyond a dead band, on the same side,
for `confirm_periods` periods, and moving there raises Lambda_max by `set_point_min_gain`
on the estimate and on each of its noise shifts (so sampling noise does not churn it).
"Best" is robust to the estimate's noise: the threshold whose Lambda_max is highest in the
worst of the estimate and the estimate with its mean length `noise_se` standard errors off
either way (`planner.robust_threshold`; where the link binds, Lambda_max falls steeply
below the optimum and gently above it, and a set-point planned on noise must err to the
gentle side; a period acting on a measured step takes the point optimum). A conversion
brings the robust threshold of its new split with it. The stages have drifted apart when
the prefill side's arrival-rate limit and the decode stage's (Eq. 8, which at Eq. 7's
balance is Theta_prfaas + Theta_pd_p = Theta_pd_d) differ by more than `drift_tolerance`;
the wanted move is one instance toward the starved side, and it is made only if it raises
Lambda_max by `min_gain`.

Guard rails (Kubernetes HPA stabilisation, Knative, Dynamo's planner):
- at most one conversion per period, and none while one is draining;
- a move gains at least `min_gain` of Lambda_max (`busy_min_gain` when the split runs near
  its capacity, where a little more of it cuts the queues most), and still does with the
  estimated mean length a standard error off (`noise_se`; not after a measured step);
- the same move wanted for `confirm_periods` periods in a row, unless it gains at least
  `urgent_gain` (a drift that large is not sampling noise) or a measured step of answer
  or incremental length started the period;
- a cooldown after each conversion, never shorter than that conversion's measured drain;
  a move refused only by the cooldown (or by a conversion still draining) comes back as
  `deferred`, for the loop to make when the cooldown ends rather than a period later;
- the pool losing an instance must still carry the estimated arrival rate with
  `load_margin` to spare, at its own best threshold;
- at least one prefill and one decode instance stay.

A refused move says which rail refused it; a period's `Evidence` (what woke it, see
`long_term_step.py`) says which rails it may skip. Pure: state and estimate in, decision
out, with its figures as `RebalanceFigures`; the gateway's loop drains the instance and
calls the engine's role API. Why each default is what it is: `prfaas/sim/SCHEDULING.md`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from prfaas.common.toml_tables import check
from prfaas.policies import throughput as tp
from prfaas.policies.planner import (
    PlanGrid,
    SplitOptimum,
    best_for_split,
    lambda_at,
    plan,
    robust_threshold,
)
from prfaas.policies.profile import DeploymentProfile, WorkloadProfile
from prfaas.policies.throughput import bytes_per_s_to_gbps
from prfaas.policies.workload_estimate import WorkloadEstimate

Outcome = Literal["skipped", "hold", "pending", "refused", "convert"]
Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class RebalanceConfig:
    drift_tolerance: float = 0.1
    """Relative gap between the prefill side's and decode's rate limits that counts as drift."""
    min_gain: float = 0.05
    """A conversion must raise the model's Lambda_max by at least this share: one period's
    estimate moves the gain of a move near a knife edge by a few percent, and a smaller
    share lets that noise move instances there and back ..."""
    busy_load: float = 0.9
    busy_min_gain: float = 0.01
    """... or by this share when the estimated rate is at least `busy_load` of the current
    split's Lambda_max: near its capacity a split's queues grow as 1 / (1 - load), so a few
    percent more capacity halve the wait."""
    confirm_periods: int = 2
    """Periods in a row that must want the same move."""
    urgent_gain: float = 0.15
    """A move that raises Lambda_max by at least this share needs no confirmation: noise in
    one period's estimate moves the model by a few percent, not this much (HPA likewise
    scales up without a stabilisation window). The other rails still apply."""
    cooldown_s: float = 30.0
    """Seconds after a conversion before the next (at least that conversion's drain)."""
    load_margin: float = 0.05
    """The losing pool must carry the estimated rate times (1 + margin)."""
    set_point_deadband: float = 0.15
    """The set-point moves only when the re-solved t differs by more than this share."""
    set_point_min_gain: float = 0.01
    """... and only when the move raises Lambda_max by at least this share on the estimate
    and on each noise shift of it: a move that some estimate within the noise says loses is
    noise. Not judged where the noise rail is off (`noise_se` 0, a length or answer wake),
    after a link step, or for a point optimum `urgent_set_point` times off. Where the link
    binds at a light load a period's blend of a few dozen lengths moves the robust optimum by
    15-40% back and forth while the load stays the same, each move a gain on its own
    estimate (`prfaas/sim/SCHEDULING.md`).
    Small, so that on a flat Lambda_max (a link that does not bind) the set-point still
    follows a move every estimate agrees on."""
    urgent_set_point: float = 2.0
    """A re-solved t this many times above or below the set-point applies at once, with no
    confirmation (sampling noise does not move t by a factor; a plan made for another
    workload does)."""
    noise_se: float = 1.0
    """A move must still gain `min_gain` (or `busy_min_gain`) with the estimated mean
    length this many standard errors off either way, and the set-point is the threshold
    best in the worst of the three estimates (0: neither; the point optimum is the
    set-point): near a knife edge one standard error of a period's blend moves the gain by
    more than `min_gain`, and the optimum by enough to land on the steep side of a
    link-bound Lambda_max. A period acting on a measured step of the workload is exempt
    (`Evidence.lengths_measured`)."""
    t_step: int = 64
    exact: bool = True
    """Cost each class by E[T(L)] (True) or the paper's T(E[L])."""

    def __post_init__(self) -> None:
        check(self.drift_tolerance >= 0, "drift_tolerance", self.drift_tolerance, "must be >= 0")
        check(self.min_gain >= 0, "min_gain", self.min_gain, "must be >= 0")
        check(self.busy_load > 0, "busy_load", self.busy_load, "must be > 0")
        check(self.busy_min_gain >= 0, "busy_min_gain", self.busy_min_gain, "must be >= 0")
        check(self.confirm_periods >= 1, "confirm_periods", self.confirm_periods, "must be >= 1")
        check(self.urgent_gain >= 0, "urgent_gain", self.urgent_gain, "must be >= 0")
        check(self.cooldown_s >= 0, "cooldown_s", self.cooldown_s, "must be >= 0")
        check(self.load_margin >= 0, "load_margin", self.load_margin, "must be >= 0")
        band = self.set_point_deadband
        check(0 <= band < 1, "set_point_deadband", band, "must be in [0, 1)")
        gain = self.set_point_min_gain
        check(gain >= 0, "set_point_min_gain", gain, "must be >= 0")
        urgent = self.urgent_set_point
        check(urgent > 1, "urgent_set_point", urgent, "must be > 1")
        check(self.t_step >= 1, "t_step", self.t_step, "must be >= 1")


@dataclass(frozen=True)
class Member:
    """One PD-cluster instance the rebalancer may convert."""

    instance_id: str
    load: int = 0


@dataclass(frozen=True)
class Pools:
    """The instances as they are now (healthy, not draining)."""

    n_prfaas: int
    prefill: tuple[Member, ...]
    decode: tuple[Member, ...]


@dataclass(frozen=True)
class Conversion:
    instance_id: str
    from_role: Role
    to_role: Role
    set_point: float
    """The re-solved t for the split after the conversion (applied once it is done)."""
    planned_utilisation: float | None = None
    """The link utilisation the plan expects at that set-point."""


@dataclass(frozen=True)
class RebalanceState:
    direction: int = 0
    """+1: a decode should become prefill; -1: the reverse; 0: none wanted."""
    streak: int = 0
    converting: str | None = None
    """The instance being drained and converted now."""
    cooldown_until: float = -math.inf
    set_point_side: int = 0
    """+1 / -1: the re-solved t lay above / below the dead band last period."""
    set_point_streak: int = 0

    def started(self, instance_id: str) -> RebalanceState:
        """A conversion began. The confirmed direction is kept: while the same move is still
        wanted, the next one needs no new confirmation, only the cooldown."""
        return replace(self, converting=instance_id)

    def finished(self, config: RebalanceConfig, now: float, drain_s: float) -> RebalanceState:
        """A conversion ended (well or not) at `now` after draining `drain_s` seconds."""
        return replace(self, converting=None, cooldown_until=now + max(config.cooldown_s, drain_s))


@dataclass(frozen=True)
class Evidence:
    """What a period's estimate rests on, and so which rails it may skip. The long-term
    step derives it from what woke the period (`long_term_step.Wake`) and what the period
    took unblended after a wake."""

    link_step: bool = False
    """A measured step woke the period (link, answer or incremental length): the re-solved
    set-point applies at once (a measurement is not sampling noise)."""
    workload_step: bool = False
    """The estimate took what a step test of answer or incremental length saw (or only what
    came after such a step): a wanted move needs no confirmation. After a link step alone
    moves still wait: converting at once there made the bandwidth-drop scenario's P90
    worse."""
    lengths_measured: bool = False
    """The lengths are a measurement of the workload after a step: the move and the set-point
    need not survive the length estimate's noise (`noise_se`, which guards steady
    traffic)."""
    first_look: bool = False
    """An early look on few samples before the first period ends: the set-point may move, no
    conversion is wanted or confirmed."""


@dataclass(frozen=True)
class NextSplit:
    """The split one move away, at its best threshold."""

    n_p: int
    t_best: float
    lambda_max: float


@dataclass(frozen=True)
class RebalanceFigures:
    """The re-solve's figures (for logs and `/admin/state`): the current split at its best
    threshold and the estimate it was planned on, and what the rails computed."""

    n_p: int
    t_best: float
    lambda_max: float
    prefill_bound: float
    decode_bound: float
    estimate: WorkloadEstimate
    t_best_noise: tuple[float, ...] | None = None
    """The best threshold with the mean length a standard error lower and higher (when the
    set-point's noise rail ran)."""
    t_robust: float | None = None
    """The threshold whose worst Lambda_max over the estimate and those two is highest:
    what the set-point follows when the noise rail runs (`planner.robust_threshold`)."""
    next: NextSplit | None = None
    """The split after the wanted move (when a move was wanted)."""
    robust_gain: float | None = None
    """The move's gain, whichever noise side gains less (when the move's noise rail ran)."""
    set_point_gain: float | None = None
    """A confirmed set-point move's gain in Lambda_max, the least over the estimate and its
    noise shifts (when that rail ran)."""

    @classmethod
    def of(cls, opt: SplitOptimum, estimate: WorkloadEstimate) -> RebalanceFigures:
        return cls(
            opt.n_p,
            opt.threshold_tokens,
            opt.lambda_max,
            opt.prefill_bound,
            opt.decode_bound,
            estimate,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "n_p": self.n_p,
            "t_best": self.t_best,
            "lambda_max": self.lambda_max,
            "prefill_bound": self.prefill_bound,
            "decode_bound": self.decode_bound,
            "estimate": self.estimate.to_json(),
        }
        if self.t_best_noise is not None:
            out["t_best_noise"] = list(self.t_best_noise)
        if self.t_robust is not None:
            out["t_robust"] = self.t_robust
        if self.next is not None:
            nxt = self.next
            out["next"] = {"n_p": nxt.n_p, "t_best": nxt.t_best, "lambda_max": nxt.lambda_max}
        if self.robust_gain is not None:
            out["robust_gain"] = self.robust_gain
        if self.set_point_gain is not None:
            out["set_point_gain"] = self.set_point_gain
        return out


@dataclass(frozen=True)
class RebalanceDecision:
    state: RebalanceState
    outcome: Outcome
    reason: str
    set_point: float
    conversion: Conversion | None = None
    figures: RebalanceFigures | None = None
    """The re-solve's figures (None when the period was skipped)."""
    deferred: Conversion | None = None
    """A move that every rail but time allowed (refused by the cooldown, or by a conversion
    still draining): the loop makes it once that is over, unless a later period decides
    otherwise first."""
    planned_utilisation: float | None = None
    """The link utilisation the plan expects at `set_point` for the estimated rate (the
    short-term trimmer's high-water mark rises above it: a link-bound plan runs it full)."""
    set_point_drifted: bool = False
    """The set-point moved on the blended estimate alone: no measured step behind it (a wake
    of the link, answers or lengths, or a period taking what one saw), no point optimum
    `urgent_set_point` times off, not a first look. The trimmer then keeps what it measured
    (`threshold_trim.set_point_moved`)."""


def replan_profile(
    profile: DeploymentProfile, estimate: WorkloadEstimate, n_prfaas: int, n_pd: int
) -> DeploymentProfile:
    """`profile` with the estimated workload, the measured link and the live instance counts."""
    lengths = profile.workload.lengths
    dist = estimate.distribution(lengths.lo, lengths.hi)
    out = estimate.output_tokens or profile.workload.output_tokens
    cap = estimate.capacity_bytes_per_s
    gbps = float(bytes_per_s_to_gbps(cap)) if cap else profile.prfaas.egress_gbps
    return replace(
        profile,
        workload=WorkloadProfile(dist, max(1, round(out))),
        prfaas=replace(profile.prfaas, instances=n_prfaas, egress_gbps=gbps),
        pd=replace(profile.pd, instances=n_pd),
    )


def rebalance(
    config: RebalanceConfig,
    state: RebalanceState,
    profile: DeploymentProfile,
    estimate: WorkloadEstimate | None,
    pools: Pools,
    *,
    now: float,
    set_point: float,
    min_samples: float = 1.0,
    evidence: Evidence = Evidence(),
) -> RebalanceDecision:
    """One period of the rebalancer (see the module docstring); `evidence` says which rails
    the period may skip."""
    n_p, n_d = len(pools.prefill), len(pools.decode)
    if estimate is None or estimate.samples < min_samples:
        return RebalanceDecision(state, "skipped", "too few requests observed", set_point)
    if n_p < 1 or n_d < 1:
        return RebalanceDecision(state, "skipped", f"no split to plan ({n_p}P/{n_d}D)", set_point)
    replanned = replan_profile(profile, estimate, pools.n_prfaas, n_p + n_d)
    try:
        grid = plan(replanned, t_step=config.t_step, exact=config.exact).grid
    except (ValueError, ZeroDivisionError, FloatingPointError) as exc:
        return RebalanceDecision(state, "skipped", f"the estimate cannot be planned: {exc}",
                                 set_point)  # fmt: skip
    current = best_for_split(grid, n_p)
    noise = _Noise(config, profile, estimate, pools, measured=evidence.lengths_measured)
    # the set-point follows the threshold that is best in the worst of the estimate and
    # its noise (None: a shifted estimate cannot be planned)
    solved = noise.robust(grid, n_p) if noise.on else current.threshold_tokens
    far = _far(config, set_point, current.threshold_tokens)
    new_set_point, state, set_point_gain = _set_point(
        config,
        state,
        set_point,
        solved,
        current.threshold_tokens,
        evidence.link_step,
        far,
        gain=lambda t: noise.move_gain(grid, n_p, set_point, t),
    )
    rate = min(estimate.rate, current.lambda_max)
    util = planned_utilisation(replanned, new_set_point, rate, exact=config.exact)
    period = _Period(config, state, new_set_point, RebalanceFigures.of(current, estimate), util)
    measured = evidence.link_step or evidence.workload_step or evidence.lengths_measured
    period.drifted = new_set_point != set_point and not (measured or far or evidence.first_look)
    noisy = noise.set_points() if noise.planned else None
    if noisy is not None:  # the set-point's noise rail ran: what it saw
        period.figures = replace(period.figures, t_best_noise=tuple(noisy), t_robust=solved)
    if set_point_gain is not None:
        period.figures = replace(period.figures, set_point_gain=set_point_gain)
        if new_set_point == set_point and solved is not None:
            period.held = (f"; set-point held at {set_point:.0f}: t {solved:.0f} gains "
                           f"{set_point_gain:+.1%} on the least of the estimate and its "
                           f"noise, < {config.set_point_min_gain:.0%}")  # fmt: skip
    direction, why = _drift(config, current)
    first_look = evidence.first_look
    if direction == 0 or first_look:
        return period.reset("hold", why + ("; set-point only" if first_look else ""))
    lost: Role = "decode" if direction > 0 else "prefill"
    gained: Role = "prefill" if direction > 0 else "decode"
    losing = pools.decode if direction > 0 else pools.prefill
    if len(losing) <= 1:
        return period.reset(
            "refused",
            f"{why}; refused: the PD cluster has only {len(losing)} "
            f"{lost} instance (at least one prefill and one decode must stay)",
        )
    nxt = best_for_split(grid, n_p + direction)
    next_split = NextSplit(nxt.n_p, nxt.threshold_tokens, nxt.lambda_max)
    period.figures = replace(period.figures, next=next_split)
    gain = _gain(current, nxt)
    load = estimate.rate / current.lambda_max if current.lambda_max > 0 else math.inf
    busy = load >= config.busy_load
    needed = config.busy_min_gain if busy else config.min_gain
    if gain < needed:
        at = f" (at {load:.0%} load)" if busy else ""
        return period.reset(
            "hold", f"{why}; hold: converting one {lost} gains {gain:+.1%} < {needed:.0%}{at}"
        )
    robust = noise.gain(direction)
    if robust is not None:
        period.figures = replace(period.figures, robust_gain=robust)
        if robust < needed:
            at = f" (at {load:.0%} load)" if busy else ""
            return period.reset(
                "hold",
                f"{why}; hold: converting one {lost} gains {gain:+.1%}, {robust:+.1%} with the "
                f"mean length {config.noise_se:g} standard error off, < {needed:.0%}{at}",
            )
    streak = state.streak + 1 if state.direction == direction else 1
    period.state = replace(state, direction=direction, streak=streak)
    move = f"{why}; one {lost} -> {gained} gains {gain:+.1%}"
    confirmed = streak >= config.confirm_periods or evidence.workload_step
    if not confirmed and gain < config.urgent_gain:
        return period.out("pending", f"{move}; pending ({streak}/{config.confirm_periods} periods)")
    refusal = _overload(config, nxt, direction, estimate.rate)
    if refusal is not None:
        return period.out("refused", f"{move}; refused: {refusal}")
    chosen = min(losing, key=lambda m: (m.load, m.instance_id))
    robust_next = noise.robust(grid, nxt.n_p) if noise.on else None
    nxt_set_point = nxt.threshold_tokens if robust_next is None else robust_next
    after = planned_utilisation(
        replanned, nxt_set_point, min(estimate.rate, nxt.lambda_max), exact=config.exact
    )
    conversion = Conversion(chosen.instance_id, lost, gained, nxt_set_point, after)
    wait = _wait(period.state, now)
    if wait is not None:
        return period.out("refused", f"{move}; refused: {wait}; deferred", deferred=conversion)
    return period.out("convert", f"{move}; converting {chosen.instance_id}", conversion)


def _gain(current: SplitOptimum, nxt: SplitOptimum) -> float:
    """How much more Lambda_max the split after the move has."""
    return nxt.lambda_max / current.lambda_max - 1 if current.lambda_max > 0 else math.inf


class _Noise:
    """The re-solve with the estimated mean length `noise_se` standard errors of ln E[L]
    lower and higher (mu shifted, sigma kept), planned once a rail asks for it. Off (every
    answer None) when `noise_se` is 0 or the period acts on a measured step."""

    def __init__(
        self,
        config: RebalanceConfig,
        profile: DeploymentProfile,
        estimate: WorkloadEstimate,
        pools: Pools,
        *,
        measured: bool,
    ) -> None:
        self._config, self._profile, self._estimate, self._pools = config, profile, estimate, pools
        self.on = config.noise_se > 0 and not measured
        self._grids: list[PlanGrid] | None = None

    def _planned(self) -> list[PlanGrid] | None:
        """The two shifted grids (None when one cannot be planned)."""
        if self._grids is None:
            config, estimate, pools = self._config, self._estimate, self._pools
            off = config.noise_se * estimate.log_mean_length_se
            n_pd = len(pools.prefill) + len(pools.decode)
            grids = []
            for d in (-off, off):
                shifted = replace(estimate, lengths=estimate.lengths.shifted(d))
                try:
                    replanned = replan_profile(self._profile, shifted, pools.n_prfaas, n_pd)
                    grids.append(plan(replanned, t_step=config.t_step, exact=config.exact).grid)
                except (ValueError, ZeroDivisionError, FloatingPointError):
                    return None
            self._grids = grids
        return self._grids

    @property
    def planned(self) -> bool:
        """Whether a rail has asked (and the shifted estimates were planned)."""
        return self._grids is not None

    def gain(self, direction: int) -> float | None:
        """The move's gain (each split at its best threshold), whichever side gains less
        (-inf when a shifted estimate cannot be planned)."""
        if not self.on:
            return None
        grids = self._planned()
        if grids is None:
            return -math.inf
        n_p = len(self._pools.prefill)
        return min(_gain(best_for_split(g, n_p), best_for_split(g, n_p + direction)) for g in grids)

    def robust(self, grid: PlanGrid, n_p: int) -> float | None:
        """Split `n_p`'s threshold whose Lambda_max is highest in the worst of the estimate
        (`grid`) and its two shifts (`planner.robust_threshold`); None when the rail is off
        or a shifted estimate cannot be planned."""
        if not self.on:
            return None
        grids = self._planned()
        if grids is None:
            return None
        try:
            return robust_threshold(grid, grids, n_p)
        except ValueError:
            return None

    def move_gain(self, grid: PlanGrid, n_p: int, current: float, new: float) -> float | None:
        """How much more Lambda_max split `n_p` has at threshold `new` than at `current`,
        the least over the estimate (`grid`) and its two shifts (-inf when a shift cannot be
        planned; None when the rail is off)."""
        if not self.on:
            return None
        grids = self._planned()
        if grids is None:
            return -math.inf
        gains = []
        for g in (grid, *grids):
            at = lambda_at(g, n_p, current)
            gains.append(lambda_at(g, n_p, new) / at - 1 if at > 0 else math.inf)
        return min(gains)

    def set_points(self) -> list[float] | None:
        """The best threshold of the split now on each side (an empty list when a shifted
        estimate cannot be planned)."""
        if not self.on:
            return None
        grids = self._planned()
        n_p = len(self._pools.prefill)
        return [] if grids is None else [best_for_split(g, n_p).threshold_tokens for g in grids]


@dataclass
class _Period:
    """The parts of one period's decision that every outcome shares."""

    config: RebalanceConfig
    state: RebalanceState
    set_point: float
    figures: RebalanceFigures
    utilisation: float | None
    held: str = ""
    """Why a confirmed set-point move was held (appended to every outcome's reason)."""
    drifted: bool = False
    """`RebalanceDecision.set_point_drifted`."""

    def reset(self, outcome: Outcome, reason: str) -> RebalanceDecision:
        """An outcome that wants no move: the confirmation streak starts over."""
        self.state = replace(self.state, direction=0, streak=0)
        return self.out(outcome, reason)

    def out(
        self,
        outcome: Outcome,
        reason: str,
        conversion: Conversion | None = None,
        *,
        deferred: Conversion | None = None,
    ) -> RebalanceDecision:
        return RebalanceDecision(
            self.state,
            outcome,
            reason + self.held,
            self.set_point,
            conversion,
            self.figures,
            planned_utilisation=self.utilisation,
            deferred=deferred,
            set_point_drifted=self.drifted,
        )


def _set_point(
    config: RebalanceConfig,
    state: RebalanceState,
    current: float,
    solved: float | None,
    point: float,
    stepped: bool,
    far: bool,
    gain: Callable[[float], float | None],
) -> tuple[float, RebalanceState, float | None]:
    """The re-solved t (`solved`, robust to the estimate's noise) replaces the set-point
    once it has lain beyond the dead band, on the same side, for `confirm_periods` periods
    in a row and `gain(solved)` (the move's least gain over the estimate and its noise;
    None: not judged) is at least `set_point_min_gain` (sampling noise does not churn it),
    or at once after a link step or when the point optimum `point` is `urgent_set_point`
    times off (`far`: noise does not move the optimum by a factor; a plan made for another
    workload does). `solved` None (the noise could not be planned: too few samples) counts
    as inside the band unless it applies at once; the point optimum then applies. Also
    returns the gain judged (None when none was)."""
    settled = replace(state, set_point_side=0, set_point_streak=0)
    if solved is None:
        if not (stepped or far):
            return current, settled, None
        solved = point
    band = config.set_point_deadband * current
    side = 0 if current > 0 and abs(solved - current) <= band else (1 if solved > current else -1)
    if side == 0:
        return current, settled, None
    streak = state.set_point_streak + 1 if state.set_point_side == side else 1
    waiting = replace(state, set_point_side=side, set_point_streak=streak)
    if stepped or far:
        return solved, settled, None
    if streak < config.confirm_periods:
        return current, waiting, None
    gained = gain(solved)
    if gained is not None and gained < config.set_point_min_gain:
        return current, waiting, gained  # some estimate within the noise says it loses
    return solved, settled, gained


def _far(config: RebalanceConfig, current: float, point: float) -> bool:
    """Whether the point optimum `point` is `urgent_set_point` times off the set-point (or
    there is none yet): a plan made for another workload, not the estimate's noise."""
    if current <= 0:
        return True
    return max(point / current, current / max(point, 1e-9)) >= config.urgent_set_point


def _drift(config: RebalanceConfig, opt: SplitOptimum) -> tuple[int, str]:
    """+1 when the prefill side limits Lambda_max by more than the tolerance, -1 for decode."""
    prefill, decode = opt.prefill_bound, opt.decode_bound
    text = f"prefill side {prefill:.2f} vs decode {decode:.2f} req/s"
    if prefill * (1 + config.drift_tolerance) < decode:
        return 1, f"drift: {text}"
    if decode * (1 + config.drift_tolerance) < prefill:
        return -1, f"drift: {text}"
    return 0, f"balanced: {text}"


def _wait(state: RebalanceState, now: float) -> str | None:
    """The rails of time: a conversion draining, the cooldown after one."""
    if state.converting is not None:
        return f"{state.converting} is still converting"
    if now < state.cooldown_until:
        return f"cooldown for {state.cooldown_until - now:.0f} s more"
    return None


def _overload(
    config: RebalanceConfig, nxt: SplitOptimum, direction: int, rate: float
) -> str | None:
    """Whether the pool losing an instance would no longer carry the load."""
    losing = nxt.decode_bound if direction > 0 else nxt.prefill_bound
    need = rate * (1 + config.load_margin)
    if losing < need:
        pool = "decode" if direction > 0 else "prefill"
        return f"the {pool} pool would carry {losing:.2f} req/s < {need:.2f} needed"
    return None


def planned_utilisation(
    profile: DeploymentProfile, threshold: float, rate: float, *, exact: bool
) -> float | None:
    """The link utilisation `profile`'s model expects at `threshold` when `rate` req/s
    arrive: rate * P(L > t) * E[S_kv(L) | L > t] / capacity (None without a link)."""
    link = profile.prfaas.egress_gbps
    if not link:
        return None
    dist = profile.workload.lengths
    split = tp.split_at(dist, np.array([threshold]))
    costs = tp.class_costs(
        dist,
        split,
        long_prefill=profile.prfaas.hardware.prefill_seconds,
        short_prefill=profile.pd.hardware.prefill_seconds,
        kv_bytes=profile.model.kv_bytes,
        exact=exact,
    )
    egress = rate * float(split.p[0]) * float(np.nan_to_num(costs.long_kv_bytes[0]))
    return egress / tp.gbps_to_bytes_per_s(link)
