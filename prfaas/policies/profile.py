"""Deployment profiles: what the throughput model knows about one deployment and its baselines.

The file (the TOML format of the paper's case study) is read and validated table by table in
`profile_file.py`; here its numbers become the model's objects (piecewise-linear tables, the
truncated log-normal, hardware resolved by name). Every error is a `ConfigError` naming the
file, the key path and the bad value; unknown keys are errors, so a typo never passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas.common.toml_tables import build, load_toml
from prfaas.policies.distributions import TruncatedLogNormal
from prfaas.policies.profile_file import (
    ClusterTable,
    HardwareTable,
    HomogeneousTable,
    MachineTable,
    NaiveTable,
    ProfileFile,
)
from prfaas.policies.tables import PiecewiseLinear

MIB = 2**20


@dataclass(frozen=True)
class WorkloadProfile:
    """The input-length distribution and output length of the served traffic."""

    lengths: TruncatedLogNormal
    output_tokens: int


@dataclass(frozen=True)
class ModelProfile:
    """The served model: KV bytes a prefill of N tokens produces (states included)."""

    name: str
    kv_bytes: PiecewiseLinear


@dataclass(frozen=True)
class HardwareProfile:
    """One instance type: prefill latency against tokens, and decode constants if it decodes."""

    name: str
    prefill_seconds: PiecewiseLinear
    decode_batch_max: int | None = None
    decode_step_seconds: float | None = None

    @property
    def can_decode(self) -> bool:
        return self.decode_batch_max is not None and self.decode_step_seconds is not None


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster of identical instances; `egress_gbps` is its cross-cluster link, if any."""

    name: str
    hardware: HardwareProfile
    instances: int
    egress_gbps: float | None = None


@dataclass(frozen=True)
class HomogeneousBaseline:
    """All prefill and decode in one PD cluster of `instances` (the split is optimised)."""

    hardware: HardwareProfile
    instances: int


@dataclass(frozen=True)
class NaiveBaseline:
    """Every prefill on one hardware, every decode on another; no threshold."""

    prefill: HardwareProfile
    prefill_instances: int
    decode: HardwareProfile
    decode_instances: int


@dataclass(frozen=True)
class SharedMachine:
    """Engines sharing one machine's cores (`[machine]`): the profile's times are those
    with `busy_engines` working at once, `shared_slowdown` times each one's alone time. The
    throughput model plans with the profile's times as they are (right at capacity); the
    simulator runs each engine at its alone speed while at most `cores` work."""

    shared_slowdown: float
    busy_engines: int

    @property
    def cores(self) -> float:
        """The cores the engines effectively share: `busy_engines` at once each ran
        `shared_slowdown` times slower. Under 1 when the machine had less than a core to
        spare for them (other load): then even an engine alone runs slower than alone."""
        return self.busy_engines / self.shared_slowdown


@dataclass(frozen=True)
class DeploymentProfile:
    """Everything the throughput model needs about one deployment and its baselines."""

    source: str
    workload: WorkloadProfile
    model: ModelProfile
    hardware: Mapping[str, HardwareProfile]
    prfaas: ClusterSpec
    pd: ClusterSpec
    homogeneous: HomogeneousBaseline | None
    naive: NaiveBaseline | None
    machine: SharedMachine | None = None


def load_profile(path: str | Path) -> DeploymentProfile:
    """Read and validate a deployment profile file.

    Raises:
        ConfigError: unreadable file, bad TOML, or any invalid/missing/unknown key.
    """
    return parse_profile(load_toml(path), source=str(path))


def parse_profile(data: Mapping[str, Any], *, source: str = "<profile>") -> DeploymentProfile:
    """Validate an already-parsed TOML document (see `load_profile`)."""
    file = build(ProfileFile, dict(data), source=source)
    hardware = {name: _hardware(name, h) for name, h in file.hardware.items()}
    w, m = file.workload, file.model
    lengths = TruncatedLogNormal(w.mu, w.sigma, w.min_tokens, w.max_tokens)
    kv_bytes = PiecewiseLinear(m.kv_tokens, tuple(mib * MIB for mib in m.kv_mib))
    return DeploymentProfile(
        source=source,
        workload=WorkloadProfile(lengths, w.output_tokens),
        model=ModelProfile(m.name, kv_bytes),
        hardware=hardware,
        prfaas=_cluster("prfaas", file.clusters.prfaas, hardware),
        pd=_cluster("pd", file.clusters.pd, hardware),
        homogeneous=_homogeneous(file.baselines.homogeneous, hardware),
        naive=_naive(file.baselines.naive_heterogeneous, hardware),
        machine=_machine(file.machine),
    )


def _hardware(name: str, h: HardwareTable) -> HardwareProfile:
    seconds = PiecewiseLinear(h.prefill_tokens, h.prefill_seconds)
    return HardwareProfile(name, seconds, h.decode_batch_max, h.decode_step_seconds)


def _cluster(name: str, c: ClusterTable, hardware: Mapping[str, HardwareProfile]) -> ClusterSpec:
    return ClusterSpec(name, hardware[c.hardware], c.instances, c.egress_gbps)


def _homogeneous(
    h: HomogeneousTable | None, hardware: Mapping[str, HardwareProfile]
) -> HomogeneousBaseline | None:
    return None if h is None else HomogeneousBaseline(hardware[h.hardware], h.instances)


def _machine(m: MachineTable | None) -> SharedMachine | None:
    return None if m is None else SharedMachine(m.shared_slowdown, m.busy_engines)


def _naive(n: NaiveTable | None, hardware: Mapping[str, HardwareProfile]) -> NaiveBaseline | None:
    if n is None:
        return None
    prefill, decode = hardware[n.prefill_hardware], hardware[n.decode_hardware]
    return NaiveBaseline(prefill, n.prefill_instances, decode, n.decode_instances)
