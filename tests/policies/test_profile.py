"""Deployment-profile loading: the case study parses, and every malformed input is an error
naming the file, the key and the bad value."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from prfaas.common.toml_tables import ConfigError
from prfaas.policies.profile import MIB, load_profile, parse_profile


def _doc(case_study_path: Path) -> dict[str, Any]:
    return tomllib.loads(case_study_path.read_text())


def test_case_study_parses(case_study_path: Path) -> None:
    """Every section of the paper profile lands in the dataclasses with its units converted."""
    p = load_profile(case_study_path)
    assert p.workload.lengths.mu == 9.90 and p.workload.lengths.hi == 131072
    assert p.workload.output_tokens == 1024
    assert p.model.kv_bytes.ys[0] == pytest.approx(190.8 * MIB)
    assert p.prfaas.hardware.name == "h200" and p.prfaas.instances == 4
    assert p.prfaas.egress_gbps == 100
    assert p.pd.hardware.decode_batch_max == 20 and p.pd.instances == 8
    assert p.homogeneous is not None and p.homogeneous.instances == 12
    assert p.naive is not None and p.naive.decode.name == "h20"


def test_shipped_example_matches_shared_case_study(case_study_path: Path, repo_root: Path) -> None:
    """The example shipped in the package carries the same facts as the shared profile."""
    shipped = tomllib.loads((repo_root / "prfaas/examples/paper_case_study.toml").read_text())
    assert shipped == _doc(case_study_path)


def _mutated(case_study_path: Path, path: str, value: Any) -> dict[str, Any]:
    doc = _doc(case_study_path)
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return doc


_DELETE = object()

BAD_CASES = [
    ("workload", _DELETE, "deploy.toml: workload: is required"),
    ("model.kv_mib", _DELETE, "model.kv_mib: is required"),
    ("clusters.pd", _DELETE, "clusters.pd: is required"),
    ("hardware.h200.prefill_seconds", [0.44, 0.72, 1.84], "hardware.h200.prefill_seconds"),
    ("model.kv_mib", [1.0, 2.0], "model.kv_mib: must have 4 entries"),
    ("model.kv_tokens", [1024, 8192, 8192, 131072], "model.kv_tokens: must be strictly"),
    ("hardware.h20.prefill_tokens", [1024, 900, 32768, 131072], "strictly increasing"),
    ("hardware.h200.prefill_seconds", [0.44, 0.0, 1.84, 7.4], "every entry must be a number > 0"),
    ("hardware.h20.prefill_seconds", [0.88, -1.5, 5.0, 22.2], "every entry must be a number > 0"),
    ("model.kv_mib", [190.8, 308.9, "x", 2316.3], "model.kv_mib[2]: must be a number (got 'x')"),
    ("hardware.h20.decode_step_seconds", 0, "hardware.h20.decode_step_seconds: must be > 0"),
    (
        "hardware.h20.decode_step_seconds",
        _DELETE,
        "hardware.h20.decode_step_seconds: is required: decoding needs",
    ),
    ("clusters.prfaas.instances", 0, "clusters.prfaas.instances: must be a positive integer"),
    ("clusters.prfaas.instances", 2.5, "clusters.prfaas.instances: must be an integer"),
    ("clusters.prfaas.egress_gbps", -10, "clusters.prfaas.egress_gbps: must be > 0"),
    ("clusters.prfaas.egress_gbps", _DELETE, "clusters.prfaas.egress_gbps: is required"),
    ("clusters.prfaas.hardware", "b200", "clusters.prfaas.hardware: unknown hardware"),
    ("baselines.homogeneous.hardware", "h100", "baselines.homogeneous.hardware: unknown"),
    ("baselines.naive_heterogeneous.decode_hardware", "h200", "has no decode_batch_max"),
    (
        "clusters.pd.hardware",
        "h200",
        "clusters.pd.hardware: decodes here but has no decode_batch_max",
    ),
    ("workload.sigma", 0, "workload.sigma: must be > 0"),
    ("workload.max_tokens", 100, "workload.max_tokens: must exceed min_tokens"),
    (
        "workload.input_distribution",
        "zipf",
        "workload.input_distribution: must be one of 'lognormal'",
    ),
    ("workload.output_tokens", True, "workload.output_tokens: must be an integer"),
    ("workload.mu", float("nan"), "workload.mu: must be a finite number"),
    ("workload.mean", 3, "workload.mean: unknown key (known: input_distribution, mu, "),
    ("clusters.pd.egress", 3, "clusters.pd.egress: unknown key"),
    (
        "baselines.homogenous",
        {"hardware": "h20", "instances": 12},
        "baselines.homogenous: unknown key",
    ),
    ("extra", {"a": 1}, "extra: unknown key"),
    ("clusters.pd.instances", 1, "needs >= 2"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_validation_errors_name_key_and_value(
    case_study_path: Path, path: str, value: Any, message: str
) -> None:
    """Each malformed profile raises ConfigError `SOURCE: key.path: why (got VALUE)`: the value
    as the file wrote it, shown wherever one exists (not for absent or unknown keys)."""
    with pytest.raises(ConfigError) as info:
        parse_profile(_mutated(case_study_path, path, value), source="deploy.toml")
    text = str(info.value)
    assert text.startswith("deploy.toml: ")
    assert message in text
    if value is not _DELETE and "unknown key" not in message and "(got" not in message:
        assert f"(got {value!r})" in text


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    """A missing file and a syntax error are ConfigErrors naming the file."""
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read"):
        load_profile(missing)
    broken = tmp_path / "broken.toml"
    broken.write_text("[workload\nmu = 1")
    with pytest.raises(ConfigError, match=r"broken\.toml: invalid TOML"):
        load_profile(broken)
