"""Supervision of launched reference engines, on a real `prfaas serve` process: an engine
that stops answering (SIGSTOP) is ejected, killed after `[gateway] unresponsive_restart_s`
and started again (counted in `/metrics`), one converted by hand restarts in its new role,
and a SIGKILLed `prfaas serve` leaves no engine process behind (each engine dies with it:
its parent-death signal)."""

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
admin_keys = ["op"]
[[launch]]
id = "pd-p0"
cluster = "pd"
role = "prefill"
[[launch]]
id = "pd-d0"
cluster = "pd"
role = "decode"
[[launch]]
id = "pd-d1"
cluster = "pd"
role = "decode"
"""
ADMIN = {"Authorization": "Bearer op", "Content-Type": "application/json"}


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
         str(config), "--no-scheduler"],
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


def _state(url: str, roles: dict[str, str] | None = None) -> dict[str, Any]:
    """The PD cluster's instances by id; `roles`: converted by hand first (`POST`)."""
    data = None if roles is None else json.dumps({"roles": roles}).encode()
    request = urllib.request.Request(f"{url}/admin/state", data, ADMIN)
    with urllib.request.urlopen(request, timeout=120) as reply:
        state: dict[str, Any] = json.load(reply)
    return {i["id"]: i for i in state["clusters"]["pd"]}


def _scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return Scrape.parse(reply.read().decode())


def _engine(serving: Serving, instance: str) -> int:
    """The pid of the instance's engine: the child whose stderr goes to the instance's log
    (`<id>.log`, `<id>.<restart>.log` after a restart)."""
    logs = {pid: Path(os.readlink(f"/proc/{pid}/fd/2")) for pid in child_pids(serving.proc.pid)}
    return next(pid for pid, log in logs.items() if log.name.startswith(f"{instance}."))


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


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
    victim = _engine(serving, "pd-d0")
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
    assert _engine(serving, "pd-d0") != victim
    assert _complete(url)["choices"][0]["text"]


def test_a_converted_engine_restarts_in_its_new_role(serving: Serving) -> None:
    """A decode converted to prefill by hand, then killed, is started again as a prefill
    (a restart in its launch role would have the gateway send prefills to a decode)."""
    url = serving.url
    assert _state(url, {"pd-d1": "prefill"})["pd-d1"]["role"] == "prefill"
    victim = _engine(serving, "pd-d1")
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while _scrape(url).value("prfaas_engine_restarts_total", instance="pd-d1") != 1 or (
        _state(url)["pd-d1"]["status"] != "healthy"
    ):
        assert time.monotonic() < deadline, _state(url)
        time.sleep(0.25)
    restarted = _engine(serving, "pd-d1")
    assert restarted != victim and _flag(_argv(restarted), "--role") == "prefill"
    assert _state(url)["pd-d1"]["role"] == "prefill"
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
