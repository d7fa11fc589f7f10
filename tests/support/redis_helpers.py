"""A real Redis server for the tests of the shared Responses store: Debian's `redis-server`
(the Makefile's test target installs it), on a free loopback port, without persistence,
killable and restartable on the same port. A server that cannot start fails the test."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from prfaas.common.ports import free_port

REDIS_SERVER = os.environ.get("PRFAAS_REDIS_SERVER", "/usr/bin/redis-server")


class RedisServer:
    """One `redis-server` on 127.0.0.1; `url` is its `redis://` address."""

    def __init__(self) -> None:
        binary = shutil.which(REDIS_SERVER) or shutil.which("redis-server")
        if binary is None:
            pytest.fail(f"no redis-server at {REDIS_SERVER} or on PATH: run `make test`, "
                        "which installs Debian's redis-server")  # fmt: skip
        self._binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_s: float = 10.0) -> None:
        argv = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "no"]  # fmt: skip
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        pytest.fail(f"redis-server did not answer on port {self.port} within {wait_s} s")

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None
