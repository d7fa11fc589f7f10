"""`prfaas plan` end to end: the console script's table, JSON, plots and error exits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prfaas.cli.main import main


def test_json_output(case_study_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one object with the three deployments and the ratios."""
    assert main(["plan", "--config", str(case_study_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"prfaas_pd", "homogeneous", "naive_heterogeneous"}
    assert (doc["prfaas_pd"]["n_p"], doc["prfaas_pd"]["n_d"]) == (3, 5)
    assert doc["prfaas_pd"]["ratio_vs_homogeneous"] > 1.4
    assert doc["evaluation"] == "representative"


def test_table_and_exact_mode(case_study_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The table names every row the issue lists and says which evaluation mode it used."""
    assert main(["plan", "--config", str(case_study_path)]) == 0
    out = capsys.readouterr().out
    for label in (
        "threshold t",
        "Lambda_max",
        "bottleneck",
        "egress",
        "link utilisation",
        "homogeneous PD",
        "naive heterogeneous",
        "PrfaaS-PD vs homogeneous",
    ):
        assert label in out
    assert "representative lengths" in out
    assert main(["plan", "--config", str(case_study_path), "--exact-expectation"]) == 0
    assert "exact expectation" in capsys.readouterr().out


def test_plot_writes_figure5(case_study_path: Path, tmp_path: Path) -> None:
    """--plot DIR writes both panels of Figure 5 as real PNG files."""
    assert main(["plan", "--config", str(case_study_path), "--plot", str(tmp_path)]) == 0
    for name in ("fig5a_lambda_vs_np.png", "fig5b_bounds_vs_threshold.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_bad_config_exits_2_with_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken profile is a one-line error on stderr and exit code 2, not a traceback."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[workload]\nmu = 'x'\n")
    assert main(["plan", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prfaas plan: error: ") and "Traceback" not in err


def test_console_script_runs(case_study_path: Path) -> None:
    """The installed `prfaas` entry point works as a separate process."""
    exe = shutil.which("prfaas", path=str(Path(sys.executable).parent))
    assert exe is not None, "console script not installed in this environment"
    done = subprocess.run(
        [exe, "plan", "--config", str(case_study_path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout)["prfaas_pd"]["n_prfaas"] == 4
