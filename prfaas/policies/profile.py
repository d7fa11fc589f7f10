"""Deployment profiles: the TOML format of the paper's case study, read into frozen dataclasses.

Every validation error is a `ProfileError` naming the file, the key and the bad value.
Unknown keys are errors, so a typo never passes silently.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas.policies.distributions import TruncatedLogNormal
from prfaas.policies.tables import PiecewiseLinear

MIB = 2**20


class ProfileError(ValueError):
    """A deployment profile is malformed; the message names file, key and value."""


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


class _Table:
    """A TOML table being read: typed getters that name `file:key`, then a check for leftovers."""

    def __init__(self, source: str, prefix: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: [{prefix}] must be a table, got {data!r}")
        self.source, self.prefix, self.data = source, prefix, data
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, name: str, message: str, value: Any) -> ProfileError:
        return ProfileError(f"{self.source}: {self.key(name)}: {message} (got {value!r})")

    def raw(self, name: str, *, required: bool = True) -> Any:
        self.seen.add(name)
        if name not in self.data:
            if required:
                raise ProfileError(f"{self.source}: missing key {self.key(name)}")
            return None
        return self.data[name]

    def table(self, name: str, *, required: bool = True) -> _Table | None:
        value = self.raw(name, required=required)
        return None if value is None else _Table(self.source, self.key(name), value)

    def string(self, name: str) -> str:
        value = self.raw(name)
        if not isinstance(value, str) or not value:
            raise self.error(name, "must be a non-empty string", value)
        return value

    def number(self, name: str, *, positive: bool = True, required: bool = True) -> float | None:
        value = self.raw(name, required=required)
        if value is None:
            return None
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value):
            raise self.error(name, "must be a finite number", value)
        if positive and value <= 0:
            raise self.error(name, "must be > 0", value)
        return float(value)

    def count(self, name: str, *, required: bool = True) -> int | None:
        value = self.raw(name, required=required)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise self.error(name, "must be a positive integer", value)
        return value

    def axis(self, name: str, *, length: int | None = None) -> tuple[float, ...]:
        value = self.raw(name)
        if not isinstance(value, list) or len(value) < 2:
            raise self.error(name, "must be a list of at least two numbers", value)
        if length is not None and len(value) != length:
            raise self.error(name, f"must have {length} entries like its token axis", value)
        for v in value:
            if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
                raise self.error(name, "every entry must be a number > 0", value)
        return tuple(float(v) for v in value)

    def increasing_axis(self, name: str) -> tuple[float, ...]:
        axis = self.axis(name)
        if any(b <= a for a, b in itertools.pairwise(axis)):
            raise self.error(name, "must be strictly increasing", self.data[name])
        return axis

    def close(self) -> None:
        extra = sorted(set(self.data) - self.seen)
        if extra:
            raise ProfileError(f"{self.source}: unknown key {self.key(extra[0])} (typo?)")


def load_profile(path: str | Path) -> DeploymentProfile:
    """Read and validate a deployment profile file.

    Raises:
        ProfileError: unreadable file, bad TOML, or any invalid/missing/unknown key.
    """
    source = str(path)
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"{source}: cannot read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{source}: invalid TOML: {exc}") from exc
    return parse_profile(data, source=source)


def parse_profile(data: Mapping[str, Any], *, source: str = "<profile>") -> DeploymentProfile:
    """Validate an already-parsed TOML document (see `load_profile`)."""
    root = _Table(source, "", dict(data))
    workload = _workload(_need(root.table("workload")))
    model = _model(_need(root.table("model")))
    hardware = _hardware(_need(root.table("hardware")))
    clusters = _need(root.table("clusters"))
    prfaas = _cluster(_need(clusters.table("prfaas")), "prfaas", hardware, link=True)
    pd = _cluster(_need(clusters.table("pd")), "pd", hardware, link=False)
    clusters.close()
    if not pd.hardware.can_decode:
        raise _no_decode(clusters, "pd", pd.hardware.name)
    if pd.instances < 2:
        raise clusters.error("pd.instances", "needs >= 2 (one prefill, one decode)", 1)
    homogeneous, naive = None, None
    baselines = root.table("baselines", required=False)
    if baselines is not None:
        homogeneous = _homogeneous(baselines.table("homogeneous", required=False), hardware)
        naive = _naive(baselines.table("naive_heterogeneous", required=False), hardware)
        baselines.close()
    root.close()
    return DeploymentProfile(source, workload, model, hardware, prfaas, pd, homogeneous, naive)


def _need(table: _Table | None) -> _Table:
    assert table is not None  # required=True raised already
    return table


def _workload(t: _Table) -> WorkloadProfile:
    kind = t.string("input_distribution")
    if kind != "lognormal":
        raise t.error("input_distribution", "only 'lognormal' is supported", kind)
    mu, sigma = t.number("mu", positive=False), t.number("sigma")
    lo, hi = t.number("min_tokens"), t.number("max_tokens")
    assert mu is not None and sigma is not None and lo is not None and hi is not None
    if hi <= lo:
        raise t.error("max_tokens", f"must exceed min_tokens={lo:g}", hi)
    output = t.count("output_tokens")
    assert output is not None
    t.close()
    return WorkloadProfile(TruncatedLogNormal(mu, sigma, lo, hi), output)


def _model(t: _Table) -> ModelProfile:
    name = t.string("name")
    tokens = t.increasing_axis("kv_tokens")
    mib = t.axis("kv_mib", length=len(tokens))
    t.close()
    return ModelProfile(name, PiecewiseLinear(tokens, tuple(m * MIB for m in mib)))


def _hardware(t: _Table) -> dict[str, HardwareProfile]:
    result = {}
    for name in list(t.data):
        h = _need(t.table(name))
        tokens = h.increasing_axis("prefill_tokens")
        seconds = h.axis("prefill_seconds", length=len(tokens))
        batch = h.count("decode_batch_max", required=False)
        step = h.number("decode_step_seconds", required=False)
        if (batch is None) != (step is None):
            missing = "decode_step_seconds" if step is None else "decode_batch_max"
            raise ProfileError(f"{t.source}: missing key {h.key(missing)} (decode needs both)")
        h.close()
        result[name] = HardwareProfile(name, PiecewiseLinear(tokens, seconds), batch, step)
    if not result:
        raise ProfileError(f"{t.source}: [hardware] defines no hardware")
    return result


def _lookup(t: _Table, key: str, hardware: Mapping[str, HardwareProfile]) -> HardwareProfile:
    name = t.string(key)
    if name not in hardware:
        known = ", ".join(sorted(hardware))
        raise t.error(key, f"unknown hardware (defined: {known})", name)
    return hardware[name]


def _cluster(
    t: _Table, name: str, hardware: Mapping[str, HardwareProfile], *, link: bool
) -> ClusterSpec:
    hw = _lookup(t, "hardware", hardware)
    instances = t.count("instances")
    assert instances is not None
    egress = t.number("egress_gbps", required=link)
    t.close()
    return ClusterSpec(name, hw, instances, egress)


def _no_decode(t: _Table, key: str, hw: str) -> ProfileError:
    return ProfileError(
        f"{t.source}: {t.key(key)}: hardware {hw!r} decodes here but has no "
        "decode_batch_max/decode_step_seconds"
    )


def _homogeneous(
    t: _Table | None, hardware: Mapping[str, HardwareProfile]
) -> HomogeneousBaseline | None:
    if t is None:
        return None
    hw = _lookup(t, "hardware", hardware)
    instances = t.count("instances")
    assert instances is not None
    if not hw.can_decode:
        raise _no_decode(t, "hardware", hw.name)
    if instances < 2:
        raise t.error("instances", "needs >= 2 (one prefill, one decode)", instances)
    t.close()
    return HomogeneousBaseline(hw, instances)


def _naive(t: _Table | None, hardware: Mapping[str, HardwareProfile]) -> NaiveBaseline | None:
    if t is None:
        return None
    prefill = _lookup(t, "prefill_hardware", hardware)
    n_prefill = t.count("prefill_instances")
    decode = _lookup(t, "decode_hardware", hardware)
    n_decode = t.count("decode_instances")
    assert n_prefill is not None and n_decode is not None
    if not decode.can_decode:
        raise _no_decode(t, "decode_hardware", decode.name)
    t.close()
    return NaiveBaseline(prefill, n_prefill, decode, n_decode)
