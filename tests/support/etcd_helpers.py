"""A real single-member etcd for the coordination tests: `prfaas.testing.etcd_server`'s
server, whose failures to start fail the test (never skip it)."""

from __future__ import annotations

import pytest

from prfaas.testing import etcd_server
from prfaas.testing.etcd_server import EtcdStartError


def etcd_binary() -> str:
    """The etcd server binary; fails the test when there is none."""
    try:
        return etcd_server.etcd_binary()
    except EtcdStartError as exc:
        pytest.fail(str(exc))


class EtcdServer(etcd_server.EtcdServer):
    """One etcd member in `data_dir`, killable and restartable on the same ports and data
    (see `prfaas.testing.etcd_server`); a start that fails fails the test."""

    def start(self, wait_s: float = 15.0) -> None:
        try:
            super().start(wait_s)
        except EtcdStartError as exc:
            pytest.fail(str(exc))
