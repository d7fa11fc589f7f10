"""Fixtures for the coordination tests: a real etcd per test (helpers in etcd_helpers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from etcd_helpers import EtcdServer

from prfaas.coordination.etcd import EtcdClient


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A running etcd of its own (fresh data), killed at teardown."""
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.kill()


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    """A client of the `etcd` fixture's server, closed at teardown."""
    etcd_client = EtcdClient([etcd.url], timeout_s=1.0)
    yield etcd_client
    await etcd_client.close()
