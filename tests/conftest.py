"""Project-wide fixtures: where the repo and the read-only shared data live."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
CASE_STUDY = SHARED_DATA / "paper" / "case_study.toml"
PAPER_RESULTS = SHARED_DATA / "paper" / "results.toml"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository checkout."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def paper_results_path() -> Path:
    """The paper's published results, read from the shared folder beside the repo."""
    assert PAPER_RESULTS.is_file(), f"shared data missing: {PAPER_RESULTS}"
    return PAPER_RESULTS


@pytest.fixture(scope="session")
def case_study_path() -> Path:
    """The paper's case-study profile, read from the shared folder beside the repo."""
    assert CASE_STUDY.is_file(), f"shared data missing: {CASE_STUDY}"
    return CASE_STUDY
