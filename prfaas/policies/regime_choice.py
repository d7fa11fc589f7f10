"""The bandwidth regime, chosen from the measured link rather than from configuration.

The abundant regime (paper 3.4.3) pulls cached prefixes across the link, which costs
egress; it pays only while the link has room to spare. So the chooser switches to
`bandwidth_abundant` after `confirm_ticks` ticks in a row below `abundant_below` measured
utilisation, and back to `bandwidth_scarce` after `scarce_ticks` ticks above
`scarce_above`. The gap between the two marks and the confirmation keep it from flapping
when the pulls themselves raise the utilisation. Without a measured capacity it holds.

Pure: state and observation in, decision out.
"""

from __future__ import annotations

from dataclasses import dataclass

from prfaas.common.toml_tables import check
from prfaas.policies.routing import Regime


@dataclass(frozen=True)
class RegimeConfig:
    abundant_below: float = 0.4
    """Measured utilisation under which the link counts as abundant."""
    scarce_above: float = 0.7
    """Measured utilisation over which the link counts as scarce."""
    confirm_ticks: int = 10
    """Ticks in a row below `abundant_below` before switching to abundant."""
    scarce_ticks: int = 2
    """Ticks in a row above `scarce_above` before switching to scarce."""

    def __post_init__(self) -> None:
        ok = 0 <= self.abundant_below < self.scarce_above
        check(ok, "abundant_below", self.abundant_below, "must be in [0, scarce_above)")
        check(self.scarce_above <= 1.5, "scarce_above", self.scarce_above, "must be <= 1.5")
        check(self.confirm_ticks >= 1, "confirm_ticks", self.confirm_ticks, "must be >= 1")
        check(self.scarce_ticks >= 1, "scarce_ticks", self.scarce_ticks, "must be >= 1")


@dataclass(frozen=True)
class RegimeState:
    regime: Regime
    streak: int = 0
    """Ticks in a row pointing to the other regime."""


@dataclass(frozen=True)
class RegimeDecision:
    state: RegimeState
    changed: bool
    reason: str


def choose_regime(
    config: RegimeConfig, state: RegimeState, utilisation: float | None
) -> RegimeDecision:
    """One tick: keep or switch the regime given the measured utilisation."""
    if utilisation is None:
        return RegimeDecision(RegimeState(state.regime), False, "hold: no measured capacity")
    if state.regime == "bandwidth_scarce":
        other: Regime = "bandwidth_abundant"
        leaning = utilisation < config.abundant_below
        needed, mark = config.confirm_ticks, f"< {config.abundant_below:g}"
    else:
        other = "bandwidth_scarce"
        leaning = utilisation > config.scarce_above
        needed, mark = config.scarce_ticks, f"> {config.scarce_above:g}"
    if not leaning:
        return RegimeDecision(RegimeState(state.regime), False, "hold")
    streak = state.streak + 1
    why = f"egress utilisation {utilisation:.2f} {mark} for {streak} ticks"
    if streak < needed:
        return RegimeDecision(RegimeState(state.regime, streak), False, f"hold: {why}")
    return RegimeDecision(RegimeState(other), True, f"{other}: {why}")
