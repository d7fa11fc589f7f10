"""The bandwidth regime, chosen from the measured link rather than from configuration.

The abundant regime (paper 3.4.3) pulls cached prefixes across the link instead of
recomputing them. A pull pays only when moving KV is faster than producing it: when the
link's spare bandwidth exceeds the KV production rate of a prefill (Eq. 1's `Phi_kv`; the
lowest over the profiled lengths, where pulls pay first). An idle link that is slower than
that is not abundant: every pull over it would cost more than the recompute it saves. So the
chooser leans to `bandwidth_abundant` while the utilisation is below `abundant_below` *and*
the spare bandwidth beats `Phi_kv` (when the profile gives one), switching after
`confirm_ticks` ticks in a row; and back to `bandwidth_scarce` after `scarce_ticks` ticks
above `scarce_above` utilisation or with less spare than `Phi_kv`. The gap between the two
marks and the confirmation keep it from flapping when the pulls themselves raise the
utilisation. Without a measured capacity it holds. Each pull is still checked on its own
(`ttft_forecast.predict_pull`).

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
class LinkReading:
    """One tick's measurement of the link, as the chooser reads it."""

    utilisation: float | None
    """Egress over capacity (None: no measured capacity)."""
    spare_bytes_per_s: float | None = None
    kv_rate_bytes_per_s: float | None = None
    """The lowest KV production rate of a prefill (`Phi_kv`; None: no profile)."""

    @property
    def pulls_pay(self) -> bool | None:
        """Whether the spare bandwidth beats the KV production rate (None: unknown)."""
        if self.spare_bytes_per_s is None or self.kv_rate_bytes_per_s is None:
            return None
        return self.spare_bytes_per_s > self.kv_rate_bytes_per_s

    def describe_rates(self) -> str:
        assert self.spare_bytes_per_s is not None and self.kv_rate_bytes_per_s is not None
        sign = ">" if self.pulls_pay else "<="
        return (f"spare {self.spare_bytes_per_s * 8e-6:.1f} Mbit/s {sign} KV production "
                f"{self.kv_rate_bytes_per_s * 8e-6:.1f} Mbit/s")  # fmt: skip


@dataclass(frozen=True)
class RegimeDecision:
    state: RegimeState
    changed: bool
    reason: str


def choose_regime(config: RegimeConfig, state: RegimeState, link: LinkReading) -> RegimeDecision:
    """One tick: keep or switch the regime given the link's measurement."""
    util, pays = link.utilisation, link.pulls_pay
    if util is None:
        return RegimeDecision(RegimeState(state.regime), False, "hold: no measured capacity")
    if state.regime == "bandwidth_scarce":
        other: Regime = "bandwidth_abundant"
        leaning = util < config.abundant_below and pays is not False
        needed = config.confirm_ticks
        why = f"egress utilisation {util:.2f} < {config.abundant_below:g}"
        if pays is not None:
            why += f", {link.describe_rates()}"
    else:
        other = "bandwidth_scarce"
        busy = util > config.scarce_above
        leaning = busy or pays is False
        needed = config.scarce_ticks
        why = f"egress utilisation {util:.2f} > {config.scarce_above:g}"
        if not busy and leaning:
            why = link.describe_rates()  # pulls no longer pay
    if not leaning:
        return RegimeDecision(RegimeState(state.regime), False, "hold")
    streak = state.streak + 1
    why += f" for {streak} ticks"
    if streak < needed:
        return RegimeDecision(RegimeState(state.regime, streak), False, f"hold: {why}")
    return RegimeDecision(RegimeState(other), True, f"{other}: {why}")
