"""Supervision of launched reference engines, on a real `prfaas serve` process: an engine
that stops answering (SIGSTOP) is ejected, killed after `[gateway] unresponsive_restart_s`
and started again (counted in `/metrics`), and a SIGKILLed `prfaas serve` leaves no engine
process behind (each engine dies with it: its parent-death signal)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from metrics_helpers import Scrape

from prfaas.serve.reaper import descendants
from prfaas.testing.processes import alive, child_pids

LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
GRACE_S = 3.0
DEPLOYMENT = f"""
[gateway]
threshold = 100000
health_interval_s = 0.5
health_timeout_s = 1.0
unresponsive_restart_s = {GRACE_S}
[[launch]]
id = "pd-p0"
cluster = "pd"
role = "prefill"
[[launch]]
id = "pd-d0"
cluster = "pd"
role = "decode"
"""


@dataclass
class Serving:
    proc: subprocess.Popen[str]
    url: str


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    config = tmp_path_factory.mktemp("supervision") / "deploy.toml"
    config.write_text(DEPLOYMENT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", "serve", "--port", "0", "--config",
         str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if match := LISTENING.search(line):
                yield Serving(proc, match.group(1))
                return
        pytest.fail("prfaas serve did not start:\n" + "".join(seen))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/admin/state", timeout=10) as reply:
        state: dict[str, Any] = json.load(reply)
    return {i["id"]: i for i in state["clusters"]["pd"]}


def _scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return Scrape.parse(reply.read().decode())


def _engine(serving: Serving, role: str) -> int:
    return next(
        pid for pid in child_pids(serving.proc.pid)
        if role in Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    )  # fmt: skip


def _complete(url: str) -> dict[str, Any]:
    body = {"model": "qwen3-next-tiny", "prompt": "hello there", "max_tokens": 4}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer: dict[str, Any] = json.load(reply)
    return answer


def test_engines_run_in_sessions_of_their_own(serving: Serving) -> None:
    """Each engine leads its own session (one `killpg` reaches all it started)."""
    for pid in child_pids(serving.proc.pid):
        assert os.getpgid(pid) == pid == os.getsid(pid)


def test_a_stopped_engine_is_killed_and_restarted(serving: Serving) -> None:
    """SIGSTOP of the decode: ejected, then killed `unresponsive_restart_s` later and
    started again; counted; requests are served again."""
    url = serving.url
    victim = _engine(serving, "decode")
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        deadline = stopped + 60
        while _state(url)["pd-d0"]["status"] != "ejected":
            assert time.monotonic() < deadline, _state(url)
            time.sleep(0.2)
        ejected = time.monotonic()
        while alive(victim):
            assert time.monotonic() < deadline, "the stopped engine was never killed"
            time.sleep(0.1)
        assert time.monotonic() - ejected >= GRACE_S - 0.5
    finally:
        if alive(victim):
            os.kill(victim, signal.SIGKILL)
    while _state(url)["pd-d0"]["status"] != "healthy":
        assert time.monotonic() < stopped + 90, _state(url)
        time.sleep(0.25)
    scrape = _scrape(url)
    assert scrape.value("prfaas_engine_unresponsive_kills_total", instance="pd-d0") == 1
    assert scrape.value("prfaas_engine_restarts_total", instance="pd-d0") == 1
    assert _engine(serving, "decode") != victim
    assert _complete(url)["choices"][0]["text"]


def test_sigkill_of_serve_leaves_no_engine(serving: Serving) -> None:
    """SIGKILL of `prfaas serve` itself: every engine process dies with it."""
    tree = descendants(serving.proc.pid)
    assert len(tree) >= 2
    serving.proc.kill()
    serving.proc.wait()
    deadline = time.monotonic() + 10
    while [pid for pid in tree if alive(pid)]:
        assert time.monotonic() < deadline, [pid for pid in tree if alive(pid)]
        time.sleep(0.1)
