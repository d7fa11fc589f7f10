"""Fixtures for the coordination tests: a client of the project-wide `etcd` fixture's
server (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from etcd_helpers import EtcdServer

from prfaas.coordination.etcd import EtcdClient


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    """A client of the `etcd` fixture's server, closed at teardown."""
    etcd_client = EtcdClient([etcd.url], timeout_s=1.0)
    yield etcd_client
    await etcd_client.close()
