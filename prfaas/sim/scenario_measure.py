"""Per-phase numbers of a scenario's runs, the share of the static-to-oracle gap the
dual-timescale schedulers close, and the issue's goal check. All SIMULATED.

Per phase [start, end) and variant:
- served rate: requests completed in the phase / its length;
- SLO goodput: requests that arrived in the phase and met both SLOs (TTFT, TPOT) / length;
- TTFT mean and P90 over the requests that arrived in the phase;
- rejected (no instance could take it) and failed (an engine error) among those arrivals;
- `t` changes and conversions (completed) in the phase; settling time: from the phase start
  to the last set-point change or conversion in it (0: none); seconds with egress above 90%
  of the link (from the 5-second timeline).

A phase starts with a step when its conditions differ from the previous phase's; settling
is checked only there (a diurnal swing has no step to settle after).

Goals (dual-timescale vs the oracle, per phase): served >= 90% of the oracle's, P90 TTFT <=
1.5x the oracle's, >= 70% of the gap closed wherever static serves < 90% of the oracle, no
lost request, settled within three long-term periods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from prfaas.loadgen.records import RequestRecord
from prfaas.sim.scenario_run import VariantRun
from prfaas.sim.scenarios import Phase

EGRESS_HOT = 0.9
SERVED_GOAL, TTFT_GOAL, GAP_GOAL = 0.9, 1.5, 0.7
STATIC_LOSS = 0.1  # the gap goal applies where static serves < 90% of the oracle
SETTLE_PERIODS = 3


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 10.0
    tpot_s: float = 0.05


@dataclass(frozen=True)
class PhaseMetrics:
    phase: str
    offered_rate: float
    served_rate: float
    goodput_rate: float
    ttft_mean_s: float | None
    ttft_p90_s: float | None
    rejected: int
    failed: int
    t_changes: int
    conversions: int
    settle_s: float
    egress_hot_s: float
    threshold_end: float
    split_end: str
    """PD prefill/decode instances at the phase end, e.g. "3P/5D"."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def phase_metrics(run: VariantRun, phase: Phase, slo: SLO) -> PhaseMetrics:
    a, b = phase.start_s, phase.end_s
    span = b - a
    arrived = [r for r in run.records if a <= r.scheduled_s < b]
    ok = [r for r in arrived if r.ok]
    served = sum(1 for r in run.records if r.ok and r.end_s is not None and a <= r.end_s < b)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    good = sum(1 for r in ok if _meets(r, slo))
    rejected = sum(1 for r in arrived if not r.ok and "NoInstanceAvailable" in (r.error or ""))
    in_phase = [e for e in run.events if a <= e.at < b]
    slow = [e.at for e in in_phase if e.kind in ("set_point", "role")]
    ends = [c.started_at + c.drain_s for c in run.conversions if c.ok]
    done = [t for t in ends if a <= t < b]
    samples = [s for s in run.timeline if a <= s.at < b]
    hot = sum(1 for s in samples if s.link_gbps and s.egress_gbps > EGRESS_HOT * s.link_gbps)
    last = samples[-1] if samples else None
    return PhaseMetrics(
        phase=phase.name,
        offered_rate=len(arrived) / span,
        served_rate=served / span,
        goodput_rate=good / span,
        ttft_mean_s=float(np.mean(ttft)) if ttft else None,
        ttft_p90_s=float(np.percentile(ttft, 90)) if ttft else None,
        rejected=rejected,
        failed=len(arrived) - len(ok) - rejected,
        t_changes=sum(1 for e in in_phase if e.kind == "threshold"),
        conversions=len(done),
        settle_s=max([*slow, *done], default=a) - a,
        egress_hot_s=hot * _sample_s(run),
        threshold_end=last.threshold if last else float("nan"),
        split_end=f"{last.n_prefill}P/{last.n_decode}D" if last else "-",
    )


def _meets(r: RequestRecord, slo: SLO) -> bool:
    ttft_ok = r.ttft_s is not None and r.ttft_s <= slo.ttft_s
    return ttft_ok and (r.tpot_s is None or r.tpot_s <= slo.tpot_s)


def _sample_s(run: VariantRun) -> float:
    t = run.timeline
    return t[1].at - t[0].at if len(t) > 1 else 0.0


@dataclass(frozen=True)
class PhaseVerdict:
    """The goal check of one phase (dual-timescale against the oracle)."""

    phase: str
    served_vs_oracle: float | None
    p90_vs_oracle: float | None
    static_vs_oracle: float | None
    gap_closed: float | None
    """(dual - static) / (oracle - static) of served rate; None where static loses < 10%."""
    lost: int
    settle_s: float
    checks: dict[str, bool]
    """goal -> met (only the goals that apply)."""

    @property
    def met(self) -> bool:
        return all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def verdict(
    static: PhaseMetrics,
    dual: PhaseMetrics,
    oracle: PhaseMetrics,
    period_s: float,
    *,
    step: bool = True,
) -> PhaseVerdict:
    """The goal check of one phase; `step`: the phase starts with a change of conditions
    (only then does settling apply)."""
    served = _ratio(dual.served_rate, oracle.served_rate)
    p90 = _ratio(dual.ttft_p90_s, oracle.ttft_p90_s)
    static_share = _ratio(static.served_rate, oracle.served_rate)
    checks = {
        "served >= 90% of oracle": served is not None and served >= SERVED_GOAL,
        "P90 TTFT <= 1.5x oracle": p90 is not None and p90 <= TTFT_GOAL,
        "no lost request": dual.rejected + dual.failed == 0,
    }
    if step:
        checks["settled within 3 periods"] = dual.settle_s <= SETTLE_PERIODS * period_s
    gap = None
    if static_share is not None and static_share < 1 - STATIC_LOSS:
        gap = (dual.served_rate - static.served_rate) / (oracle.served_rate - static.served_rate)
        checks["gap closed >= 70%"] = gap >= GAP_GOAL
    return PhaseVerdict(
        dual.phase,
        served,
        p90,
        static_share,
        gap,
        dual.rejected + dual.failed,
        dual.settle_s,
        checks,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def metrics_by_phase(
    runs: Sequence[VariantRun], phases: Sequence[Phase], slo: SLO
) -> dict[str, list[PhaseMetrics]]:
    return {run.variant: [phase_metrics(run, p, slo) for p in phases] for run in runs}
