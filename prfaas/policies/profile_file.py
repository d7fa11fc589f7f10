"""The deployment-profile file, table by table, as `prfaas.common.toml_tables` reads it.

These dataclasses mirror the TOML (`prfaas/examples/paper_case_study.toml` is an example)
and validate each table and the references between tables; `profile.py` turns a valid file
into the `DeploymentProfile` the throughput model uses (tables, distribution, hardware).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prfaas.common.toml_tables import FieldError, check


@dataclass(frozen=True)
class WorkloadTable:
    """`[workload]`: truncated log-normal input lengths and a fixed output length."""

    input_distribution: Literal["lognormal"]
    mu: float
    """Mean of ln(input tokens)."""
    sigma: float
    min_tokens: float
    max_tokens: float
    output_tokens: int

    def __post_init__(self) -> None:
        check(math.isfinite(self.mu), "mu", self.mu, "must be a finite number")
        for key in ("sigma", "min_tokens", "max_tokens"):
            _positive(key, getattr(self, key))
        lo, hi = self.min_tokens, self.max_tokens
        check(hi > lo, "max_tokens", hi, f"must exceed min_tokens={lo:g}")
        _count("output_tokens", self.output_tokens)


@dataclass(frozen=True)
class ModelTable:
    """`[model]`: KV bytes (MiB, states included) a prefill of `kv_tokens` tokens produces."""

    name: str
    kv_tokens: tuple[float, ...]
    kv_mib: tuple[float, ...]

    def __post_init__(self) -> None:
        check(bool(self.name), "name", self.name, "must not be empty")
        _table("kv_tokens", self.kv_tokens, "kv_mib", self.kv_mib)


@dataclass(frozen=True)
class HardwareTable:
    """`[hardware.NAME]`: prefill latency against tokens; decode constants if it decodes."""

    prefill_tokens: tuple[float, ...]
    prefill_seconds: tuple[float, ...]
    decode_batch_max: int | None = None
    decode_step_seconds: float | None = None

    def __post_init__(self) -> None:
        _table("prefill_tokens", self.prefill_tokens, "prefill_seconds", self.prefill_seconds)
        if self.decode_batch_max is not None:
            _count("decode_batch_max", self.decode_batch_max)
        if self.decode_step_seconds is not None:
            _positive("decode_step_seconds", self.decode_step_seconds)
        if (self.decode_batch_max is None) != (self.decode_step_seconds is None):
            absent = "decode_batch_max" if self.decode_batch_max is None else "decode_step_seconds"
            raise FieldError(absent, None, "is required: decoding needs both decode constants")

    @property
    def can_decode(self) -> bool:
        return self.decode_batch_max is not None


@dataclass(frozen=True)
class ClusterTable:
    """`[clusters.prfaas]` / `[clusters.pd]`: identical instances of one hardware."""

    hardware: str
    instances: int
    egress_gbps: float | None = None
    """The cluster's cross-cluster link (required for the PrfaaS cluster)."""

    def __post_init__(self) -> None:
        _count("instances", self.instances)
        if self.egress_gbps is not None:
            _positive("egress_gbps", self.egress_gbps)


@dataclass(frozen=True)
class ClustersTable:
    """`[clusters]`: the PrfaaS cluster and the local PD cluster."""

    prfaas: ClusterTable
    pd: ClusterTable

    def __post_init__(self) -> None:
        egress = self.prfaas.egress_gbps
        check(egress is not None, "prfaas.egress_gbps", egress, "is required: its link to PD")
        n = self.pd.instances
        check(n >= 2, "pd.instances", n, "needs >= 2 (one prefill, one decode)")


@dataclass(frozen=True)
class HomogeneousTable:
    """`[baselines.homogeneous]`: one PD cluster does everything (the split is optimised)."""

    hardware: str
    instances: int

    def __post_init__(self) -> None:
        n = self.instances
        check(n >= 2, "instances", n, "needs >= 2 (one prefill, one decode)")


@dataclass(frozen=True)
class NaiveTable:
    """`[baselines.naive_heterogeneous]`: every prefill on one hardware, decode on another."""

    prefill_hardware: str
    prefill_instances: int
    decode_hardware: str
    decode_instances: int

    def __post_init__(self) -> None:
        _count("prefill_instances", self.prefill_instances)
        _count("decode_instances", self.decode_instances)


@dataclass(frozen=True)
class BaselinesTable:
    """`[baselines]`: the deployments the paper compares against (each optional)."""

    homogeneous: HomogeneousTable | None = None
    naive_heterogeneous: NaiveTable | None = None


@dataclass(frozen=True)
class MachineTable:
    """`[machine]` (optional): the deployment's engines share one machine's cores, and the
    hardware tables' times were measured with `busy_engines` engines working at once,
    `shared_slowdown` times their alone times (what start-up profiling measures)."""

    shared_slowdown: float
    busy_engines: int

    def __post_init__(self) -> None:
        ok = math.isfinite(self.shared_slowdown) and self.shared_slowdown >= 1
        check(ok, "shared_slowdown", self.shared_slowdown, "must be a number >= 1")
        _count("busy_engines", self.busy_engines)


@dataclass(frozen=True)
class ProfileFile:
    """A whole profile file; every hardware name it uses must be defined under `[hardware]`."""

    workload: WorkloadTable
    model: ModelTable
    hardware: Mapping[str, HardwareTable]
    clusters: ClustersTable
    baselines: BaselinesTable = field(default_factory=BaselinesTable)
    machine: MachineTable | None = None

    def __post_init__(self) -> None:
        check(bool(self.hardware), "hardware", self.hardware, "defines no hardware")
        defined = ", ".join(sorted(self.hardware))
        for key, name, decodes in self._references():
            check(name in self.hardware, key, name, f"unknown hardware (defined: {defined})")
            ok = not decodes or self.hardware[name].can_decode
            why = "decodes here but has no decode_batch_max/decode_step_seconds"
            check(ok, key, name, why)

    def _references(self) -> Iterator[tuple[str, str, bool]]:
        """(key, hardware name, decodes there) for every hardware reference."""
        yield "clusters.prfaas.hardware", self.clusters.prfaas.hardware, False
        yield "clusters.pd.hardware", self.clusters.pd.hardware, True
        if (homogeneous := self.baselines.homogeneous) is not None:
            yield "baselines.homogeneous.hardware", homogeneous.hardware, True
        if (naive := self.baselines.naive_heterogeneous) is not None:
            yield "baselines.naive_heterogeneous.prefill_hardware", naive.prefill_hardware, False
            yield "baselines.naive_heterogeneous.decode_hardware", naive.decode_hardware, True


def _positive(key: str, value: float) -> None:
    check(math.isfinite(value), key, value, "must be a finite number")
    check(value > 0, key, value, "must be > 0")


def _count(key: str, value: int) -> None:
    check(value >= 1, key, value, "must be a positive integer")


def _table(x_key: str, xs: tuple[float, ...], y_key: str, ys: tuple[float, ...]) -> None:
    """A piecewise-linear table: >= 2 strictly increasing token knots, one value > 0 each."""
    for key, axis in ((x_key, xs), (y_key, ys)):
        check(len(axis) >= 2, key, axis, "must list at least two numbers")
        ok = all(math.isfinite(v) and v > 0 for v in axis)
        check(ok, key, axis, "every entry must be a number > 0")
    increasing = all(b > a for a, b in itertools.pairwise(xs))
    check(increasing, x_key, xs, "must be strictly increasing")
    check(len(ys) == len(xs), y_key, ys, f"must have {len(xs)} entries like its token axis")
