"""Role conversion through the engines' role API, and the long-term loop's guard rails and
early wakes, on the virtual clock with the real Router, registry and schedulers over
simulated engines (the simulated PD instances implement the role API: drain, then switch;
the case study's decode step is 25 ms)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from prfaas.engine_clients.base import EngineError, Role
from prfaas.gateway.router import Router
from prfaas.gateway.scheduling.config import SchedulerConfig
from prfaas.gateway.scheduling.decisions import Decision
from prfaas.gateway.scheduling.roles import RoleConverter, asked_conversions
from prfaas.gateway.scheduling.scheduler import Scheduler
from prfaas.policies.profile import DeploymentProfile, load_profile
from prfaas.policies.rebalance import RebalanceConfig
from prfaas.policies.workload_estimate import WorkloadEstimate
from prfaas.protocol.generate import SamplingParams
from prfaas.sim.cluster import SimCluster
from prfaas.sim.deployments import Deployment, SimOptions
from prfaas.sim.virtual_loop import run_virtual

_rid = itertools.count()


@pytest.fixture(scope="module")
def profile(case_study_path: Path) -> DeploymentProfile:
    return load_profile(case_study_path)


def _deployment(profile: DeploymentProfile, n_p: int, n_d: int) -> Deployment:
    pd = profile.pd.hardware
    return Deployment("test", "prfaas", 1, profile.prfaas.hardware, n_p, n_d, pd, pd, 8000.0, 100.0)


async def _request(router: Router, tokens: int, out: int, errors: list[str]) -> None:
    ids = tuple(np.random.default_rng(next(_rid)).integers(1, 50_000, tokens).tolist())
    try:
        routed = await router.dispatch(f"r{next(_rid)}", ids, SamplingParams(max_new_tokens=out),
                                       stream=True)  # fmt: skip
        try:
            while await routed.next() is not None:
                pass
        finally:
            routed.close()
    except (EngineError, RuntimeError) as exc:
        errors.append(repr(exc))


async def _load(router: Router, seconds: float, gap: float, tokens: int, out: int) -> list[str]:
    """One request every `gap` seconds for `seconds`; returns the errors."""
    errors: list[str] = []
    tasks = []
    for _ in range(int(seconds / gap)):
        tasks.append(asyncio.create_task(_request(router, tokens, out, errors)))
        await asyncio.sleep(gap)
    await asyncio.gather(*tasks)
    return errors


def test_converter_drains_then_switches_and_loses_nothing(profile: DeploymentProfile) -> None:
    """A decode instance with requests in flight: while it drains the policies cannot pick
    it; then the engine switches, the registry takes its role and bootstrap address, and
    every request it held finished well."""

    async def main() -> None:
        cluster = SimCluster(profile, _deployment(profile, 1, 2), SimOptions())
        errors: list[str] = []
        load = [asyncio.create_task(_request(cluster.router, 2_000, 400, errors))
                for _ in range(6)]  # fmt: skip
        await asyncio.sleep(3.0)  # decoding now (400 tokens at 25 ms: 10 s)
        target = next(s for s in cluster.instances if s.role == "decode" and s.in_flight)
        converter = RoleConverter(cluster.instances, drain_timeout_s=60)
        task = asyncio.create_task(converter.convert(target.instance_id, "prefill"))
        await asyncio.sleep(0.5)
        assert target.draining
        view = next(v for v in cluster.instances.views({}) if v.instance_id == target.instance_id)
        assert not view.healthy  # nothing new is routed to it
        result = await task
        await asyncio.gather(*load)
        assert result.ok and result.drain_s > 5.0 and errors == []
        assert (target.role, target.draining) == ("prefill", False)
        assert (target.bootstrap_host, target.bootstrap_port) == (target.instance_id, 0)
        assert cluster.pd[target.instance_id].role == "prefill"

    run_virtual(main())


def test_converter_reports_an_engine_without_a_role_api(profile: DeploymentProfile) -> None:
    async def main() -> None:
        cluster = SimCluster(profile, _deployment(profile, 1, 1), SimOptions())
        result = await RoleConverter(cluster.instances, drain_timeout_s=5).convert(
            "prfaas-p0", "decode"
        )
        state = cluster.instances["prfaas-p0"]
        assert not result.ok and result.error is not None and "no role API" in result.error
        assert (state.role, state.draining) == ("prefill", False)

    run_virtual(main())


def _scheduled(
    profile: DeploymentProfile, n_d: int, urgent_gain: float = 0.15, cooldown_s: float = 5.0
) -> tuple[Scheduler, list[str]]:
    """A prefill-heavy load (30K-token prompts, 16 output tokens) on 1 prefill + `n_d`
    decode instances for 100 s, the schedulers on 10-second periods."""
    rebalance = RebalanceConfig(cooldown_s=cooldown_s, urgent_gain=urgent_gain)
    config = SchedulerConfig(period_s=10.0, rebalance=rebalance)

    async def main() -> tuple[Scheduler, list[str]]:
        cluster = SimCluster(profile, _deployment(profile, 1, n_d), SimOptions())
        scheduler = Scheduler(config, profile, cluster.router, cluster.instances)
        scheduler.start()
        try:
            errors = await _load(cluster.router, 100.0, 0.5, 30_000, 16)
        finally:
            await scheduler.stop()
        return scheduler, errors

    return run_virtual(main())


def test_prefill_heavy_load_converts_a_decode(
    profile: DeploymentProfile, caplog: pytest.LogCaptureFixture
) -> None:
    """Two decodes, one prefill, a prefill-bound load: after the confirmation periods one
    decode becomes a prefill (drained first); no request fails; the schedule's roles, the
    log and the set-point follow. (No urgent path here: every move is confirmed.)"""
    caplog.set_level(logging.INFO, logger="prfaas.scheduler")
    scheduler, errors = _scheduled(profile, 2, urgent_gain=math.inf)
    assert errors == []
    done = [c for c in scheduler.long.conversions if c.ok]
    assert len(done) >= 1 and done[0].to_role == "prefill"
    roles = scheduler.board.state.role_map()
    assert sum(r == "prefill" for r in roles.values()) >= 2 and "decode" in roles.values()
    kinds = [(d.loop, d.kind) for d in scheduler.board.recent]
    assert ("long-term", "role") in kinds
    logged = [json.loads(r.message) for r in caplog.records if r.name == "prfaas.scheduler"]
    pending = [d for d in logged if d["inputs"].get("outcome") == "pending"]
    assert pending and pending[0]["at"] < done[0].started_at  # confirmed before converting


def test_a_large_drift_converts_at_the_first_period_that_sees_it(
    profile: DeploymentProfile, caplog: pytest.LogCaptureFixture
) -> None:
    """The same load with the default urgent gain: the move gains far more than noise
    could, so the first period that wants it converts, with no pending period before."""
    caplog.set_level(logging.INFO, logger="prfaas.scheduler")
    scheduler, errors = _scheduled(profile, 2)
    assert errors == []
    done = [c for c in scheduler.long.conversions if c.ok]
    assert done and done[0].to_role == "prefill"
    logged = [json.loads(r.message) for r in caplog.records if r.name == "prfaas.scheduler"]
    wanted = [d for d in logged if d["inputs"].get("outcome") in ("pending", "convert")]
    assert wanted[0]["inputs"]["outcome"] == "convert"


def test_a_first_look_moves_a_far_off_set_point_before_the_first_period(
    profile: DeploymentProfile,
) -> None:
    """2,000-token prompts where the profile's prior expects a median of 20K: as soon as
    `min_samples` requests were routed, a first look re-solves `t` and, being more than 2x
    off, applies it; the first period still ends at 60 s (the look keeps its samples)."""
    config = SchedulerConfig(period_s=60.0)  # min_samples 20 by default

    async def main() -> tuple[float | None, float | None, float]:
        cluster = SimCluster(profile, _deployment(profile, 1, 2), SimOptions())
        scheduler = Scheduler(config, profile, cluster.router, cluster.instances)
        prior = scheduler.board.state.set_point
        scheduler.start()
        loop = asyncio.get_running_loop()
        start, moved, period = loop.time(), None, None
        try:
            load = asyncio.create_task(_load(cluster.router, 70.0, 1.0, 2_000, 16))
            while loop.time() - start < 70:
                await asyncio.sleep(1.0)
                if moved is None and scheduler.board.state.set_point != prior:
                    moved = loop.time() - start
                if period is None and scheduler.long.estimate is not None:
                    period = loop.time() - start
            assert await load == []
        finally:
            await scheduler.stop()
        return moved, period, scheduler.board.state.set_point / prior

    moved, period, ratio = run_virtual(main())
    assert moved is not None and 20 <= moved < 25  # the 20th request arrives at 19 s
    assert period is not None and 60 <= period < 62
    assert ratio <= 0.5


def test_a_move_the_cooldown_refused_is_made_when_the_cooldown_ends(
    profile: DeploymentProfile, caplog: pytest.LogCaptureFixture
) -> None:
    """Three decodes and a 12-second cooldown on 10-second periods: the period after the
    first conversion wants the next one too, and the cooldown refuses it. The move is made
    on the tick the cooldown ends, not at the next period (a period's clock would put it
    within a second of a multiple of 10 s after the first period). The cooldown lasts at
    least the drain it follows (about 14.5 s here, after the conversion that began at the
    10 s period), so it ends between two periods."""
    caplog.set_level(logging.INFO, logger="prfaas.scheduler")
    scheduler, errors = _scheduled(profile, 3, cooldown_s=12.0)
    assert errors == []
    first, second = [c for c in scheduler.long.conversions if c.ok][:2]
    assert first.to_role == second.to_role == "prefill"
    cooled = first.started_at + first.drain_s + max(12.0, first.drain_s)
    assert cooled <= second.started_at <= cooled + 1.0  # the next tick
    logged = [json.loads(r.message) for r in caplog.records if r.name == "prfaas.scheduler"]
    refused = [d for d in logged if first.started_at < d["at"] < second.started_at
               and d["reason"].endswith("; deferred")]  # fmt: skip
    assert refused and "refused: cooldown for" in refused[-1]["reason"]
    during = [d for d in logged if "is still converting" in d["reason"]]
    assert during and during[0]["inputs"]["n_p"] == 2  # planned with the split it makes
    made = [d for d in logged if d["inputs"].get("deferred")]
    assert made and made[0]["at"] == pytest.approx(second.started_at, abs=0.01)
    assert made[0]["reason"] == f"deferred decode -> prefill: converting {second.instance_id}"


def test_a_deferred_move_is_dropped_when_the_split_changed(
    profile: DeploymentProfile, caplog: pytest.LogCaptureFixture
) -> None:
    """Three decodes and a 12-second cooldown, as above: while a move waits for the
    cooldown (the period at 30 s deferred it), a decode is ejected. When the cooldown ends
    the move is not made on a split it was not decided for; the log says why."""
    caplog.set_level(logging.INFO, logger="prfaas.scheduler")
    config = SchedulerConfig(period_s=10.0, rebalance=RebalanceConfig(cooldown_s=12.0))

    async def main() -> tuple[Scheduler, float]:
        cluster = SimCluster(profile, _deployment(profile, 1, 3), SimOptions())
        scheduler = Scheduler(config, profile, cluster.router, cluster.instances)
        scheduler.start()
        loop = asyncio.get_running_loop()
        load = asyncio.create_task(_load(cluster.router, 60.0, 0.5, 30_000, 16))
        ejected_at = math.nan
        try:
            while not load.done():
                await asyncio.sleep(0.5)
                long, last = scheduler.long, scheduler.long.last
                waiting = last is not None and "refused: cooldown" in last.reason
                if math.isnan(ejected_at) and long.deferred is not None and waiting:
                    decode = next(s for s in cluster.instances
                                  if s.cluster == "pd" and s.role == "decode")  # fmt: skip
                    decode.eject("test: the instance died")
                    ejected_at = loop.time()
            await load
        finally:
            await scheduler.stop()
        return scheduler, ejected_at

    scheduler, ejected_at = run_virtual(main())
    assert not math.isnan(ejected_at)  # a move was deferred
    logged = [json.loads(r.message) for r in caplog.records if r.name == "prfaas.scheduler"]
    dropped = [d for d in logged if "dropped:" in d["reason"]]
    assert dropped and dropped[0]["reason"] == (
        "deferred decode -> prefill dropped: 2P/2D is now 2P/1D"
    )
    assert not [c for c in scheduler.long.conversions if c.started_at >= ejected_at]


def test_a_request_closed_before_its_end_leaves_the_schedulers_books(
    profile: DeploymentProfile,
) -> None:
    """A client reads the first token of a long answer and goes away: the Router reports
    the request as aborted, so the observer no longer counts it as decoding (the decode
    occupancy it estimates answers from) nor keeps its start time."""

    async def main() -> tuple[int, int, int]:
        cluster = SimCluster(profile, _deployment(profile, 1, 1), SimOptions())
        scheduler = Scheduler(SchedulerConfig(), profile, cluster.router, cluster.instances)
        ids = tuple(range(1, 2_001))
        routed = await cluster.router.dispatch("gone", ids, SamplingParams(max_new_tokens=400),
                                               stream=True)  # fmt: skip
        observer = scheduler.observer
        decoding = observer.decoding_now
        routed.close()
        return decoding, observer.decoding_now, len(observer._arrived)

    before, after, kept = run_virtual(main())
    assert (before, after, kept) == (1, 0, 0)


def test_a_period_during_a_conversion_plans_with_the_split_it_makes(
    profile: DeploymentProfile,
) -> None:
    """While a decode drains on its way to prefill, the live pools leave it out (nothing
    is routed to it) and the rebalancer's pools count it as a prefill already: a period in
    the drain decides on the split the conversion makes, not on one instance short."""
    rebalance = RebalanceConfig(cooldown_s=5.0)

    async def main() -> list[tuple[int, int, int, int]]:
        cluster = SimCluster(profile, _deployment(profile, 1, 3), SimOptions())
        scheduler = Scheduler(SchedulerConfig(period_s=10.0, rebalance=rebalance), profile,
                              cluster.router, cluster.instances)  # fmt: skip
        scheduler.start()
        seen = []
        load = asyncio.create_task(_load(cluster.router, 60.0, 0.5, 30_000, 16))
        try:
            while not load.done():
                await asyncio.sleep(0.5)
                if scheduler.long.converting:
                    live, planned = scheduler.long.pools(), scheduler.long.pools(planned=True)
                    seen.append((len(live.prefill), len(live.decode),
                                 len(planned.prefill), len(planned.decode)))  # fmt: skip
            assert await load == []
        finally:
            await scheduler.stop()
        return seen

    seen = run_virtual(main())
    assert seen  # a conversion drained while we looked
    assert seen[0][2:] == (2, 2)  # the first conversion makes 2P/2D of 1P/3D
    assert all(p + d == 4 and p == lp + 1 for lp, _, p, d in seen), seen  # decode -> prefill
    assert (1, 2) in {(lp, ld) for lp, ld, _, _ in seen}  # draining: in neither live pool


def test_the_last_decode_is_never_converted(profile: DeploymentProfile) -> None:
    """The same load with one decode: the rebalancer wants more prefill but the guard rail
    refuses, every period, and says why."""
    scheduler, errors = _scheduled(profile, 1)
    assert errors == [] and scheduler.long.conversions == []
    refused = [d for d in scheduler.board.recent if d.inputs.get("outcome") == "refused"]
    assert refused
    assert refused[-1].reason.endswith(
        "refused: the PD cluster has only 1 decode instance "
        "(at least one prefill and one decode must stay)"
    )
    shown = scheduler.to_json()["recent"]
    assert any(d["inputs"].get("outcome") == "refused" for d in shown)


def _estimates(
    profile: DeploymentProfile,
    request: Callable[[float], tuple[int, int]],
    seconds: float,
    period_s: float,
    decisions: list[Decision] | None = None,
) -> dict[float, WorkloadEstimate | None]:
    """Two requests a second, `request(now)` giving each its prompt and answer tokens, on
    2P/2D for `seconds`; the long-term estimate every half second (and the schedulers'
    recent decisions appended to `decisions`)."""

    async def main() -> dict[float, WorkloadEstimate | None]:
        cluster = SimCluster(profile, _deployment(profile, 2, 2), SimOptions())
        scheduler = Scheduler(SchedulerConfig(period_s=period_s), profile, cluster.router,
                              cluster.instances)  # fmt: skip
        scheduler.start()
        loop = asyncio.get_running_loop()
        start, errors, tasks = loop.time(), [], []
        seen: dict[float, WorkloadEstimate | None] = {}
        try:
            while (now := loop.time() - start) < seconds:
                tokens, out = request(now)
                tasks.append(asyncio.create_task(_request(cluster.router, tokens, out, errors)))
                await asyncio.sleep(0.5)
                seen[round(now + 0.5, 1)] = scheduler.long.estimate
            await asyncio.gather(*tasks)
        finally:
            await scheduler.stop()
        assert errors == []
        if decisions is not None:
            decisions.extend(scheduler.board.recent)
        return seen

    return run_virtual(main())


def _periods_at(seen: dict[float, WorkloadEstimate | None]) -> list[float]:
    """When a period ran (a new estimate appeared), to the half second."""
    times, before = [], None
    for at, estimate in seen.items():
        if estimate is not None and estimate is not before:
            times.append(at)
        before = estimate
    return times


def test_longer_answers_wake_the_long_term_loop_before_its_period_ends(
    profile: DeploymentProfile,
) -> None:
    """Answers step from 100 to 600 tokens (2.5 to 15 s) at 45 s: within 13 s (the requests
    decoding now outlive the old answers; 5 ticks confirm), before the period due at 60 s,
    a period runs and takes the longer answers (unblended); without the wake the estimate
    would still be the 100 tokens that the periods at 20 and 40 s saw."""
    seen = _estimates(profile, lambda now: (2_000, 100 if now < 45 else 600), 65.0, 20.0)
    before, after = seen[44.0], seen[58.0]
    assert before is not None and after is not None
    assert before.output_tokens is not None and 80 <= before.output_tokens <= 130
    assert after.output_tokens is not None and after.output_tokens >= 1.5 * before.output_tokens


def test_longer_prompts_wake_the_long_term_loop_before_its_period_ends(
    profile: DeploymentProfile,
) -> None:
    """Prompts step from 2,000 to 8,000 tokens at 65 s (30-second periods): once about 30
    of the last 100 are long, their mean ln L lies 0.4 above the estimate's, and 5 ticks
    later, before the period due at 90 s, a period runs and takes those 100 lengths
    (unblended); without the wake the estimate would still be the 2,000 tokens of the
    period at 60 s. The set-point it re-solves is logged with what woke it."""
    decisions: list[Decision] = []
    seen = _estimates(profile, lambda now: (2_000 if now < 65 else 8_000, 16), 95.0, 30.0,
                      decisions)  # fmt: skip
    before, after = seen[64.0], seen[89.0]
    assert before is not None and after is not None
    assert before.lengths.mu == pytest.approx(math.log(2_000), abs=0.01)
    assert after.lengths.mu >= math.log(2_000) + 0.4, after.lengths.mu
    assert any(65 < at < 90 for at in _periods_at(seen))
    woken = [d.kind for d in decisions if d.inputs.get("woken_by") == ["lengths"]]
    assert "set_point" in woken  # the log says what woke the period that moved t


def test_a_length_wake_takes_the_lengths_since_the_step(profile: DeploymentProfile) -> None:
    """The same step: the CUSUM sounds after about 18 long prompts (each adds ln 4 - 0.25)
    and the woken period takes the lengths since it last stood at zero (at least 20: at
    most a couple of them from before the step), not the last 100 (70 of them short); the
    next regular period takes only its own lengths, all after the step."""
    decisions: list[Decision] = []
    seen = _estimates(profile, lambda now: (2_000 if now < 65 else 8_000, 16), 135.0, 30.0,
                      decisions)  # fmt: skip
    logged = [d for d in decisions if d.kind == "rebalance" and "woken_by" in d.inputs]
    woken = next(d.at for d in logged if d.inputs["woken_by"] == ["lengths"])
    after = next(d.at for d in logged if d.at > woken and "lengths" in d.inputs["after_wake"])
    assert 65 < woken < 80, woken
    at_wake, restarted = seen[woken + 0.5], seen[after + 0.5]
    assert at_wake is not None and restarted is not None
    assert at_wake.lengths.n == 20 and at_wake.lengths.mu > math.log(8_000) - 0.15
    assert restarted.lengths.mu == pytest.approx(math.log(8_000), abs=1e-6)


def test_a_step_the_periods_half_blended_still_wakes_the_loop(
    profile: DeploymentProfile,
) -> None:
    """A step of ln 1.7 (2,000 to 3,400 tokens) at 50 s with 30-second periods: the period
    at 60 s blends a third of a period of it in, and the one at 90 s the rest of its share,
    so the last 100 lengths never lie 0.4 from the estimate for long. The CUSUM keeps its
    evidence across those periods (about 0.28 per long prompt) and wakes the loop before
    the period due at 120 s; the estimate after it is the new length."""
    decisions: list[Decision] = []
    seen = _estimates(profile, lambda now: (2_000 if now < 50 else 3_400, 16), 125.0, 30.0,
                      decisions)  # fmt: skip
    woken = [d.at for d in decisions if d.inputs.get("woken_by") == ["lengths"]]
    assert woken and 50 < woken[0] < 119, woken
    at_wake = seen[woken[0] + 0.5]
    assert at_wake is not None
    assert at_wake.lengths.mu > math.log(3_400) - 0.1, at_wake.lengths.mu


def test_the_period_after_an_answer_wake_counts_only_answers_begun_after_it(
    profile: DeploymentProfile,
) -> None:
    """Answers step down from 600 to 100 tokens at 45 s (20-second periods): the wakes
    read the answers from the requests decoding then (80-240 tokens, Little's law while the
    long ones drain); the next regular period takes the answers of the requests that came
    after the last wake, exactly 100 tokens each, unblended: neither the wakes' readings nor
    a long answer that began before the step stays in the estimate."""
    seen = _estimates(profile, lambda now: (2_000, 600 if now < 45 else 100), 95.0, 20.0)
    *_, woken, regular = _periods_at(seen)
    at_wake, restarted = seen[woken], seen[regular]
    assert at_wake is not None and restarted is not None
    assert at_wake.output_n == 1 and at_wake.output_tokens != 100  # Little's law's reading
    assert regular == pytest.approx(woken + 20, abs=1.0)
    assert restarted.output_tokens == 100 and restarted.output_n >= 20


def test_the_decision_after_a_wake_names_what_it_took_unblended(
    profile: DeploymentProfile,
) -> None:
    """Answers step up from 100 to 1,500 tokens at 45 s on 2P/2D: the wakes move decodes
    in, and the next regular period, which reads the new answers from the requests that came
    after the last wake (the occupancy's, none has finished yet), logs `after_wake` (its
    move, like the wake's, needs no confirmation)."""
    decisions: list[Decision] = []
    seen = _estimates(profile, lambda now: (2_000, 100 if now < 45 else 1_500), 95.0, 20.0,
                      decisions)  # fmt: skip
    *_, woken, regular = _periods_at(seen)
    logged = {d.at: d.inputs for d in decisions if d.kind == "rebalance" and "woken_by" in d.inputs}
    assert logged[woken - 0.5]["woken_by"] == ["answers"]
    assert logged[regular - 0.5]["after_wake"] == ["answers"]
    assert logged[regular - 0.5]["woken_by"] == []
    restarted = seen[regular]
    assert restarted is not None and restarted.output_tokens is not None
    assert restarted.output_tokens >= 1_300


def test_steady_log_normal_lengths_do_not_wake_the_long_term_loop(
    profile: DeploymentProfile,
) -> None:
    """Ten minutes of log-normal prompts (sigma 1, the case study's spread) at a steady
    rate: the recent lengths' mean wanders with the sample, never as far as a step, so
    every period runs on its 60-second clock."""
    rng = np.random.default_rng(7)

    def request(now: float) -> tuple[int, int]:
        return int(np.clip(rng.lognormal(7.6, 1.0), 128, 131_072)), 16

    seen = _estimates(profile, request, 600.0, 60.0)
    periods = _periods_at(seen)
    assert [round(at / 60.0) for at in periods] == list(range(1, 11)), periods
    assert all(abs(at - 60.0 * round(at / 60.0)) <= 1.0 for at in periods), periods


def test_a_follower_measures_the_pd_pool_busy_share_its_requests_are_routed_on(
    profile: DeploymentProfile,
) -> None:
    """Only the leader trims, but every replica routes: a follower's ticks fold the PD
    prefill pool's busy time into the share its forecasts carry (40 s of a pool with work
    booked, time constant 20 s: 1 - e^-2 = 0.86)."""

    async def main() -> float:
        cluster = SimCluster(profile, _deployment(profile, 1, 1), SimOptions())
        scheduler = Scheduler(SchedulerConfig(period_s=20.0), profile, cluster.router,
                              cluster.instances)  # fmt: skip
        scheduler.follow("another-gateway")
        prefill = next(s for s in cluster.instances if s.cluster == "pd" and s.role == "prefill")
        loop = asyncio.get_running_loop()
        scheduler.observer.ledger.admit(prefill.instance_id, "booked", 1000.0, loop.time())
        scheduler.start()
        try:
            await asyncio.sleep(40.0)
        finally:
            await scheduler.stop()
        forecast = scheduler.observer.forecast()
        assert forecast is not None
        return forecast.local_busy_share

    assert run_virtual(main()) == pytest.approx(1 - math.exp(-2), abs=0.05)


def test_conversions_asked_by_hand_are_checked() -> None:
    """An operator's `roles`: what changes, in PD instances only, keeping one healthy
    instance of each role; anything else is refused naming what is wrong."""
    pd: dict[str, Role] = {"pd-p0": "prefill", "pd-d0": "decode", "pd-d1": "decode"}
    healthy = set(pd)
    assert asked_conversions(pd, {"pd-d1": "prefill", "pd-p0": "prefill"}, healthy) == [
        ("pd-d1", "prefill")
    ]
    assert asked_conversions(pd, {"pd-p0": "decode", "pd-d0": "prefill"}, healthy) == [
        ("pd-p0", "decode"),
        ("pd-d0", "prefill"),
    ]
    for asked, words in (
        ({"pd-d0": "prefill", "pd-d1": "prefill"}, "no healthy decode"),
        ({"pd-p0": "decode"}, "no healthy prefill"),
        ({"prfaas-p0": "decode"}, "not a PD-cluster instance"),
        ({"pd-d0": "both"}, "must be prefill|decode"),
        ({}, "must be an object"),
        (["pd-d0"], "must be an object"),
    ):
        with pytest.raises(ValueError, match=words):
            asked_conversions(pd, asked, healthy)
    # the only healthy decode may not go, even with another (ejected) decode listed
    with pytest.raises(ValueError, match="no healthy decode"):
        asked_conversions(pd, {"pd-d0": "prefill"}, {"pd-p0", "pd-d0"})
