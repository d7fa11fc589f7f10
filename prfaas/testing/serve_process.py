"""`prfaas serve` as a child process for benchmarks: start it with its output in a log file,
wait until it listens, stop it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
READY = re.compile(r"Ctrl-C\) stops|Ctrl-C stops")


def start_serve(
    args: list[str], log: Path, env: Mapping[str, str] | None = None, timeout_s: float = 300.0
) -> tuple[subprocess.Popen[bytes], str]:
    """`prfaas serve ARGS` writing to `log`; the process and its URL once it is ready.

    Raises:
        RuntimeError: it exited first (the log's tail attached) or was not ready in time.
    """
    with log.open("wb") as out:
        cmd = [sys.executable, "-m", "prfaas.cli.main", "serve", *args]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if READY.search(text) and (found := LISTENING.search(text)):
            return proc, found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"prfaas serve exited:\n{text[-3000:]}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"prfaas serve was not ready within {timeout_s:g} s")


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the gateway drains and stops its engines), SIGKILL after a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
