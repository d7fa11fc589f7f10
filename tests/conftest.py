"""Project-wide fixtures: where the repo and the read-only shared data live, and the null
server (in process and as its own process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp_helpers import start_app
from etcd_helpers import EtcdServer
from redis_helpers import RedisServer

from prfaas.common.ports import ENV_RANGE, slice_of
from prfaas.testing.null_server import NullConfig, NullServer

# The SGLang plugin's tests need the real `sglang` package, which lives in its own
# environment (.venv-sglang): `make test` prepares it and runs tests/engines/sglang there,
# failing loudly if it cannot. Other environments leave that folder out.
if importlib.util.find_spec("sglang") is None:
    collect_ignore = ["engines/sglang"]

# Under pytest-xdist (`make test`) each worker, with every process it starts, picks ports
# from a slice of its own: a port one worker picked for a server still starting is free
# to the other's bind check, and vLLM takes tens of seconds to bind. (A worker started in
# place of a crashed one, gw2 on, gets none: it picks from the whole room.)
if "PYTEST_XDIST_WORKER" in os.environ:
    _slice = slice_of(
        int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")),
        int(os.environ["PYTEST_XDIST_WORKER_COUNT"]),
    )
    if _slice is not None:
        os.environ[ENV_RANGE] = _slice

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


@pytest.fixture
async def null_url() -> AsyncIterator[str]:
    """Base URL of an in-process null server on loopback (block size 4 for cache checks)."""
    runner, url = await start_app(NullServer(NullConfig(block_size=4)).app())
    yield url
    await runner.cleanup()


@pytest.fixture
def null_process() -> Iterator[str]:
    """Base URL of `python -m prfaas.testing.null_server` in its own process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prfaas.testing.null_server", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A running etcd of its own (fresh data), killed at teardown."""
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A running Redis of its own (empty), killed at teardown."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()
