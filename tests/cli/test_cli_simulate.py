"""`prfaas simulate`: JSON keys, the SIMULATED label, plots, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas.cli.main import main

KEYS = {
    "offered_rate",
    "served_rate",
    "ttft_mean_s",
    "ttft_p90_s",
    "tpot_mean_s",
    "egress_gbps",
    "theta_prfaas",
    "theta_pd_p",
    "theta_pd_d",
    "p_offload",
    "threshold_tokens",
}


def test_json_has_the_issue_keys_and_is_flagged_simulated(
    case_study_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json prints one document with every required key, marked simulated."""
    argv = ["simulate", "--config", str(case_study_path), "--rate", "1.5", "--duration", "120"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["simulated"] is True
    assert set(doc) >= KEYS
    assert doc["threshold_tokens"] == pytest.approx(19648.0)
    assert 0.3 < doc["p_offload"] < 0.7
    assert doc["tpot_mean_s"] == pytest.approx(0.025)


def test_table_json_file_and_plots(
    case_study_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --json the table is printed (labelled SIMULATED); --json OUT and --plot DIR
    write files."""
    out, plots = tmp_path / "run.json", tmp_path / "plots"
    argv = ["simulate", "--config", str(case_study_path), "--policy", "homogeneous"]
    argv += ["--rate", "1.0", "--duration", "60", "--json", str(out), "--plot", str(plots)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "SIMULATED" in printed and "homogeneous" in printed
    doc = json.loads(out.read_text())
    assert doc["p_offload"] == 0.0 and doc["theta_prfaas"] is None
    assert list(plots.glob("*.png"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "nope"], "unknown routing policy 'nope'"),
        (["--config", "/nonexistent.toml"], "cannot read"),
        (["--find-max", "--duration", "60"], "need --duration >= 300"),
        (["--rate", "-1"], "rate must be > 0"),
        (["--cache-blocks", "-5"], "cache_blocks must be > 0"),
    ],
)
def test_bad_input_is_a_clear_error(
    case_study_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """Exit code 2 and one line naming the bad value, no traceback."""
    argv = ["simulate", "--config", str(case_study_path), "--duration", "60", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
