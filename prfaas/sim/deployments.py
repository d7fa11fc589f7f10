"""What a simulation runs: the deployment (instances, hardware, policy, threshold) and the
simulator's own knobs, as frozen validated dataclasses, plus the three Table 6 deployments
derived from a profile and the planner's answer."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from prfaas.policies.planner import PlanReport
from prfaas.policies.profile import DeploymentProfile, HardwareProfile
from prfaas.policies.routing import Regime

DeploymentName = Literal["prfaas_pd", "homogeneous", "naive_heterogeneous"]
PAPER_BLOCK_SIZE = 512  # Mooncake traces hash 512-token blocks: one hash id = one KV block
REGIMES: tuple[Regime, ...] = ("bandwidth_scarce", "bandwidth_abundant")
DEFAULT_CACHE_BLOCKS = 32768  # ~280 GB of this model's KV per 8-GPU instance (8.5 MB/block)


@dataclass(frozen=True)
class SimOptions:
    """The simulator's own knobs (not part of the deployment profile)."""

    block_size: int = PAPER_BLOCK_SIZE
    """KV page size in tokens, for the prefix caches and the gateway's index."""
    cache_blocks: int | None = DEFAULT_CACHE_BLOCKS
    """Prefix-cache capacity per prefill instance in blocks; None: unbounded."""
    pipelined: bool = True
    """Layer-wise KV streaming during prefill; False ships the KV after the prefill."""
    link_delay_s: float = 0.005
    """One-way delay of the cross-cluster link."""
    intra_gbps: float = 800.0
    """PD-cluster RDMA bandwidth (PD-P -> PD-D transfers)."""
    egress_gbps: float | None = None
    """Override the profile's cross-cluster link capacity."""
    partition_egress: bool = False
    """Give each PrfaaS instance a fixed 1/N slice of the link (static per-instance pacing)
    instead of fair sharing; the paper's non-pipelined model (T + S*N/B) assumes this."""
    threshold: float | None = None
    """Override the planner's threshold t (tokens of incremental length)."""
    regime: Regime = "bandwidth_scarce"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.cache_blocks is not None and self.cache_blocks <= 0:
            raise ValueError(
                f"cache_blocks must be > 0 (or None: unbounded), got {self.cache_blocks}"
            )
        _positive("intra_gbps", self.intra_gbps)
        if self.egress_gbps is not None:
            _positive("egress_gbps", self.egress_gbps)
        if not (math.isfinite(self.link_delay_s) and self.link_delay_s >= 0):
            raise ValueError(f"link_delay_s must be >= 0, got {self.link_delay_s}")
        if self.regime not in REGIMES:
            raise ValueError(f"regime must be one of {REGIMES}, got {self.regime!r}")
        if self.threshold is not None and not self.threshold >= 0:
            raise ValueError(f"threshold must be >= 0 tokens, got {self.threshold}")


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class Deployment:
    """One simulated deployment: who prefills where, who decodes, and how requests route."""

    name: str
    policy: str
    n_prfaas: int
    prfaas_hw: HardwareProfile | None
    n_p: int
    n_d: int
    pd_hw: HardwareProfile
    decode_hw: HardwareProfile
    threshold: float
    egress_gbps: float

    def __post_init__(self) -> None:
        if self.n_d < 1:
            raise ValueError(f"deployment {self.name}: needs >= 1 decode instance, got {self.n_d}")
        if self.n_prfaas + self.n_p < 1:
            raise ValueError(f"deployment {self.name}: needs >= 1 prefill instance")
        if self.n_prfaas and self.prfaas_hw is None:
            raise ValueError(f"deployment {self.name}: PrfaaS instances need a hardware profile")
        if not self.decode_hw.can_decode:
            raise ValueError(f"deployment {self.name}: {self.decode_hw.name} cannot decode")
        _positive("egress_gbps", self.egress_gbps)


def deployments(
    profile: DeploymentProfile, report: PlanReport, options: SimOptions
) -> dict[DeploymentName, Deployment]:
    """The profile's deployments at the planner's configurations (baselines if present)."""
    link = options.egress_gbps or profile.prfaas.egress_gbps or 0.0
    main = report.prfaas_pd
    t = options.threshold if options.threshold is not None else main.threshold_tokens or 0.0
    pd_hw = profile.pd.hardware
    out: dict[DeploymentName, Deployment] = {
        "prfaas_pd": Deployment(
            "prfaas_pd", "prfaas", main.n_prfaas, profile.prfaas.hardware,
            main.n_p, main.n_d, pd_hw, pd_hw, t, link,
        )
    }  # fmt: skip
    if profile.homogeneous is not None and report.homogeneous is not None:
        hw, h = profile.homogeneous.hardware, report.homogeneous
        out["homogeneous"] = Deployment(
            "homogeneous", "homogeneous", 0, None, h.n_p, h.n_d, hw, hw, 0.0, link
        )
    if profile.naive is not None:
        nv = profile.naive
        out["naive_heterogeneous"] = Deployment(
            "naive_heterogeneous", "naive", nv.prefill_instances, nv.prefill,
            0, nv.decode_instances, nv.decode, nv.decode, 0.0, link,
        )  # fmt: skip
    return out


def with_policy(deployment: Deployment, policy: str) -> Deployment:
    """The same instances routed by another policy."""
    return replace(deployment, policy=policy)
