"""The scheduling scenarios: the paper's case study under conditions that change over time.

A scenario is a sequence of phases, each with its true conditions (arrival rate, input
length distribution, output length, link bandwidth). The oracle re-plans with exactly these
at each phase start; the dual-timescale schedulers must find them by measurement.

Rates are set from the planner (exact costing), never hard-coded: the base rate is
`LOAD` (90%) of the oracle's Lambda_max in the scenario's hardest phase, so the oracle can
carry every phase and a configuration that cannot adapt shows where it falls short.
`burst` and `diurnal` scale that rate as the issue states; `mooncake-2x` replays the trace
at twice its timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from prfaas.loadgen.workloads.mooncake import MOONCAKE_BLOCK, load_trace
from prfaas.policies.distributions import TruncatedLogNormal, fit_truncated_lognormal
from prfaas.policies.planner import plan
from prfaas.policies.profile import DeploymentProfile, WorkloadProfile
from prfaas.policies.workload_estimate import Moments

LOAD = 0.9
SCENARIOS = (
    "bandwidth-drop",
    "burst",
    "length-shift",
    "decode-heavy",
    "diurnal",
    "mooncake-2x",
)
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3] / "shared/data/traces/mooncake_conversation.jsonl"
)


@dataclass(frozen=True)
class Conditions:
    """The true conditions of one phase."""

    rate: float
    """Mean arrivals per second over the phase."""
    mu: float
    sigma: float
    output_tokens: int
    link_gbps: float
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival gaps (1: Poisson, < 1: bursty)."""


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float
    conditions: Conditions

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    phases: tuple[Phase, ...]
    rate_at: Callable[[float], float] | None = None
    """Instantaneous arrival rate (diurnal); None: each phase's constant rate."""
    trace: Path | None = None
    """Replay this Mooncake trace instead of drawing log-normal requests."""
    speedup: float = 1.0

    @property
    def duration_s(self) -> float:
        return self.phases[-1].end_s

    def phase_at(self, t: float) -> Phase:
        for phase in self.phases:
            if t < phase.end_s:
                return phase
        return self.phases[-1]


def conditioned(profile: DeploymentProfile, c: Conditions) -> DeploymentProfile:
    """`profile` with a phase's workload and link."""
    base = profile.workload.lengths
    lengths = TruncatedLogNormal(c.mu, c.sigma, base.lo, base.hi)
    return replace(
        profile,
        workload=WorkloadProfile(lengths, c.output_tokens),
        prfaas=replace(profile.prfaas, egress_gbps=c.link_gbps),
    )


def oracle_lambda(profile: DeploymentProfile, c: Conditions) -> float:
    """The planner's Lambda_max (exact costing) for conditions `c`."""
    return plan(conditioned(profile, c), exact=True).prfaas_pd.lambda_max


def _phases(spec: Sequence[tuple[str, float, Conditions]], scale: float) -> tuple[Phase, ...]:
    out, start = [], 0.0
    for name, minutes, cond in spec:
        end = start + minutes * 60.0 * scale
        out.append(Phase(name, start, end, cond))
        start = end
    return tuple(out)


def build_scenario(
    name: str, profile: DeploymentProfile, *, time_scale: float = 1.0, trace: Path | None = None
) -> Scenario:
    """The scenario called `name` on `profile` (phases shortened by `time_scale`).

    Raises:
        ValueError: unknown name or a time scale <= 0.
    """
    if not time_scale > 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    w = profile.workload
    link = profile.prfaas.egress_gbps or 0.0
    base = Conditions(1.0, w.lengths.mu, w.lengths.sigma, w.output_tokens, link)
    builders = {
        "bandwidth-drop": _bandwidth_drop,
        "burst": _burst,
        "length-shift": _length_shift,
        "decode-heavy": _decode_heavy,
        "diurnal": _diurnal,
    }
    if name == "mooncake-2x":
        return _mooncake(base, time_scale, trace or DEFAULT_TRACE)
    if name not in builders:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return builders[name](profile, base, time_scale)


def _at_rate(profile: DeploymentProfile, conds: list[Conditions]) -> float:
    return LOAD * min(oracle_lambda(profile, c) for c in conds)


def _bandwidth_drop(p: DeploymentProfile, base: Conditions, scale: float) -> Scenario:
    low = replace(base, link_gbps=base.link_gbps / 10)
    rate = _at_rate(p, [base, low])
    b, lo = replace(base, rate=rate), replace(low, rate=rate)
    phases = _phases([("before", 10, b), ("drop", 20, lo), ("recovered", 10, b)], scale)
    return Scenario(
        "bandwidth-drop",
        f"link {base.link_gbps:g} -> {low.link_gbps:g} Gbps for 20 minutes, then back",
        phases,
    )


def _burst(p: DeploymentProfile, base: Conditions, scale: float) -> Scenario:
    rate = 0.55 * oracle_lambda(p, base)
    calm = replace(base, rate=rate)
    burst = replace(base, rate=2 * rate, burstiness=0.25)
    spec = [("before", 5, calm), ("burst", 1, burst), ("after", 5, calm)]
    return Scenario("burst", "arrivals at 2x for 60 s, gamma-bursty (CV 2)", _phases(spec, scale))


def _length_shift(p: DeploymentProfile, base: Conditions, scale: float) -> Scenario:
    longer = replace(base, mu=10.6)
    rate = _at_rate(p, [base, longer])
    b, lg = replace(base, rate=rate), replace(longer, rate=rate)
    phases = _phases([("before", 10, b), ("longer", 30, lg), ("after", 10, b)], scale)
    return Scenario("length-shift", f"log-normal mu {base.mu:g} -> 10.6 for 30 minutes", phases)


def _decode_heavy(p: DeploymentProfile, base: Conditions, scale: float) -> Scenario:
    heavy = replace(base, output_tokens=3 * base.output_tokens)
    rate = _at_rate(p, [base, heavy])
    b, h = replace(base, rate=rate), replace(heavy, rate=rate)
    phases = _phases([("before", 10, b), ("decode-heavy", 30, h), ("after", 10, b)], scale)
    return Scenario("decode-heavy", "output length x3 for 30 minutes", phases)


def _diurnal(p: DeploymentProfile, base: Conditions, scale: float) -> Scenario:
    """Rate between 0.5x and 1.1x of Lambda_max, sinusoidal, 20-minute period, two periods
    (each half a phase: rising from the trough, falling from the peak)."""
    top = oracle_lambda(p, base)
    period = 20 * 60.0 * scale
    lo, hi = 0.5 * top, 1.1 * top

    def rate_at(t: float) -> float:
        return lo + (hi - lo) * (1 - math.cos(2 * math.pi * t / period)) / 2

    mean = (lo + hi) / 2
    spec = [(n, 10, replace(base, rate=mean)) for n in ("rise-1", "fall-1", "rise-2", "fall-2")]
    return Scenario(
        "diurnal",
        "rate 0.5x..1.1x Lambda_max, sinusoidal, 20-minute period",
        _phases(spec, scale),
        rate_at=rate_at,
    )


def _mooncake(base: Conditions, scale: float, trace: Path) -> Scenario:
    """The trace at 2x its speed, cut into three phases of ten minutes. Its true conditions
    (what the oracle plans with) come from the trace itself (`trace_conditions`)."""
    speedup = 2.0
    true = replace(trace_conditions(trace, speedup), link_gbps=base.link_gbps)
    spec = [(n, 10, true) for n in ("first-10min", "second-10min", "third-10min")]
    return Scenario(
        "mooncake-2x",
        f"{trace.name} replayed at twice its timestamps",
        _phases(spec, scale),
        trace=trace,
        speedup=speedup,
    )


def trace_conditions(trace: Path, speedup: float, lo: int = 128, hi: int = 131_072) -> Conditions:
    """A Mooncake trace's workload as the planner sees it: the log-normal fit of its
    incremental lengths (each prompt minus the longest prefix of whole blocks an earlier
    request sent, i.e. one unbounded cache, clamped into [lo, hi]), its mean output length
    and its mean rate.

    Raises:
        TraceError: the trace cannot be read.
    """
    entries = load_trace(trace, MOONCAKE_BLOCK)
    seen: set[int] = set()
    incremental: list[int] = []
    for e in entries:
        hit = 0
        while hit < len(e.hash_ids) and e.hash_ids[hit] in seen:
            hit += 1
        cached = min(hit * MOONCAKE_BLOCK, e.input_length - 1)
        incremental.append(min(max(e.input_length - cached, lo), hi))
        seen.update(e.hash_ids[: e.input_length // MOONCAKE_BLOCK])
    m = Moments.of(incremental)
    fit = fit_truncated_lognormal(m.mu, m.sigma, lo, hi)
    n = len(entries)
    span = (entries[-1].timestamp_s - entries[0].timestamp_s) / speedup
    output = round(sum(e.output_length for e in entries) / n)
    return Conditions(n / span if span > 0 else math.inf, fit.mu, fit.sigma, output, 0.0)
