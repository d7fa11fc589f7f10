"""The `[scheduler]` table of a deployment file: which loops run, how often, and the tuning
of their pure cores (each a frozen dataclass of `prfaas.policies`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prfaas.common.toml_tables import check
from prfaas.policies.long_term_step import LongTermConfig, StepConfig
from prfaas.policies.rebalance import RebalanceConfig
from prfaas.policies.regime_choice import RegimeConfig
from prfaas.policies.threshold_trim import TrimConfig
from prfaas.policies.workload_estimate import EstimateConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """Dual-timescale scheduling (see `prfaas/sim/SCHEDULING.md` for the tuning)."""

    profile: str | None = None
    """Planner profile TOML (hardware tables, KV bytes, cluster sizes) the predictions and
    re-solves use; `prfaas serve`'s embedded deployment supplies its measured one."""
    short_term: bool = True
    """Trim `t` and choose the regime every tick."""
    long_term: bool = True
    """Re-solve the set-point and convert roles every period."""
    conditional: bool = True
    """Offload past `t` only when PrfaaS is predicted to answer first or the PD prefill is
    saturated (prefix pulls are checked against the predictions either way)."""
    tick_s: float = 1.0
    period_s: float = 60.0
    drain_timeout_s: float = 600.0
    """Longest wait for an instance to drain before its conversion is abandoned."""
    min_threshold: float = 0.0
    """Floor of every set-point the long-term loop chooses."""
    max_threshold: float | None = None
    """Ceiling of every set-point (None: none)."""
    trim: TrimConfig = field(default_factory=TrimConfig)
    regime: RegimeConfig = field(default_factory=RegimeConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    steps: StepConfig = field(default_factory=StepConfig)
    """The step tests that wake a long-term period early."""

    def __post_init__(self) -> None:
        check(self.tick_s > 0, "tick_s", self.tick_s, "must be > 0")
        check(self.period_s >= self.tick_s, "period_s", self.period_s, "must be >= tick_s")
        check(self.drain_timeout_s > 0, "drain_timeout_s", self.drain_timeout_s, "must be > 0")
        check(self.min_threshold >= 0, "min_threshold", self.min_threshold, "must be >= 0")
        top = self.max_threshold
        ok = top is None or top >= self.min_threshold
        check(ok, "max_threshold", top, "must be >= min_threshold")

    def long_term_config(self) -> LongTermConfig:
        """What the long-term loop's pure steps read of this table."""
        return LongTermConfig(self.period_s, self.rebalance, self.estimate, self.steps)

    def clamp(self, threshold: float) -> float:
        """`threshold` within [min_threshold, max_threshold]."""
        top = self.max_threshold if self.max_threshold is not None else threshold
        return min(max(threshold, self.min_threshold), top)
