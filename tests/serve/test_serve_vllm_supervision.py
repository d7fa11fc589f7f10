"""Supervision of launched vLLM engines, on a real `prfaas serve` over real vLLM servers (a
PrfaaS prefill and a PD decode, the tiny checkpoint): a SIGKILLed vLLM API server takes its
EngineCore with it (no orphan), a stream it was serving ends at once with an OpenAI error
event and no `[DONE]`, the supervisor starts it again and the gateway serves through it; a
SIGSTOPped one is killed (its whole tree) after `unresponsive_restart_s` and started again;
a SIGKILLed `prfaas serve` leaves no vLLM process behind (standbys included); a restart
starts from the standby spawned ahead of it, and a new standby follows. Slow (vLLM starts
take about a minute each on a small machine): one module, one gateway."""

from __future__ import annotations

import contextlib
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
from urllib.parse import urlparse

import pytest
from metrics_helpers import Scrape
from vllm_helpers import MODEL, VLLM_PYTHON, require_vllm

from prfaas.serve.reaper import descendants
from prfaas.testing.launch_tables import vllm_pd_deployment
from prfaas.testing.processes import alive, child_pids, waiting_standby
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
START_TIMEOUT_S = 600
GRACE_S = 8.0


@dataclass
class Serving:
    proc: subprocess.Popen[str]
    url: str


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-supervision")
    config = root / "deploy.toml"
    config.write_text(vllm_pd_deployment(
        MODEL, VLLM_PYTHON, TINY_BLOCK_SIZE, served="qwen3-next-tiny",
        gateway=f'policy = "prfaas"\nhealth_interval_s = 0.5\nunresponsive_restart_s = {GRACE_S}\n',
    ))  # fmt: skip
    log = root / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--port", "0", "--config",
             str(config)],
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if match := LISTENING.search(log.read_text()):
                yield Serving(proc, match.group(1))
                return
            time.sleep(0.5)
        pytest.fail("prfaas serve did not start:\n" + log.read_text()[-3000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        print(log.read_text()[-4000:])


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/admin/state", timeout=10) as reply:
        state: dict[str, Any] = json.load(reply)
    return {i["id"]: i for c in state["clusters"].values() for i in c}


def _scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return Scrape.parse(reply.read().decode())


def _on_port(serving: Serving, instance: str) -> tuple[int, list[int]]:
    """`instance`'s HTTP port, and `prfaas serve`'s children given it (each a reaper: the
    engine's, and the standby's for its next start)."""
    port = int(urlparse(_state(serving.url)[instance]["url"]).port or 0)
    found = []
    for pid in child_pids(serving.proc.pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
                found.append(pid)
    return port, found


def _engine_leader(serving: Serving, instance: str) -> int:
    """The pid of `prfaas serve`'s child that runs `instance` (its vLLM server's parent)."""
    port, children = _on_port(serving, instance)
    for pid in children:
        if ("0100007F", port) in _listening(descendants(pid)):
            return pid
    raise AssertionError(f"no process serves {instance} on port {port}")


def _standby(serving: Serving, instance: str) -> int:
    """The pid of the standby for `instance`'s next start: vLLM imported, listening on
    nothing, waiting."""
    deadline = time.monotonic() + 10  # a new standby's reaper starts its server at once
    while True:
        _, children = _on_port(serving, instance)
        waiting = [pid for pid in children if waiting_standby(pid)]
        if len(waiting) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(waiting) == 1, (children, waiting)
    assert not _listening(descendants(waiting[0]))
    return waiting[0]


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> Any:
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=timeout)


def test_a_killed_vllm_decode_ends_its_stream_leaves_no_orphan_and_comes_back(
    serving: Serving,
) -> None:
    url = serving.url
    leader = _engine_leader(serving, "pd-d0")
    standby = _standby(serving, "pd-d0")
    tree = descendants(leader)
    server = child_pids(leader)[0]  # the API server; its EngineCore below it
    assert len(tree) >= 2, "expected vLLM's API server and its EngineCore"
    assert all(os.getpgid(pid) == leader for pid in tree)
    body = {"model": "qwen3-next-tiny", "prompt": "hello there", "max_tokens": 3000,
            "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
    events: list[str] = []
    with _post(url, body, timeout=60) as stream:
        for raw in stream:
            if raw.startswith(b"data: "):
                events.append(raw[6:].decode().strip())
            if len(events) >= 3:
                break
        os.kill(server, signal.SIGKILL)
        killed = time.monotonic()
        for raw in stream:
            if raw.startswith(b"data: "):
                events.append(raw[6:].decode().strip())
        ended = time.monotonic() - killed
    assert ended < 10, ended
    assert events[-1] != "[DONE]"
    assert "error" in json.loads(events[-1]), events[-3:]
    deadline = time.monotonic() + 10
    while [pid for pid in tree if alive(pid)]:
        assert time.monotonic() < deadline, f"orphans: {[p for p in tree if alive(p)]}"
        time.sleep(0.1)

    deadline = time.monotonic() + START_TIMEOUT_S
    while (
        _scrape(url).value("prfaas_engine_restarts_total", instance="pd-d0") < 1
        or _state(url)["pd-d0"]["status"] != "healthy"
    ):
        assert time.monotonic() < deadline, _state(url)
        time.sleep(1)
    assert _state(url)["pd-d0"]["ejections"] == 1
    assert _scrape(url).value("prfaas_engine_restarts_total", instance="pd-d0") == 1
    assert _engine_leader(serving, "pd-d0") == standby  # vLLM was imported ahead
    assert _standby(serving, "pd-d0") not in (leader, standby)  # and the next one is
    with _post(url, {**body, "stream": False, "max_tokens": 8}) as reply:
        answer = json.load(reply)
    assert answer["usage"]["completion_tokens"] == 8


def test_an_engine_whose_standby_died_starts_afresh(serving: Serving) -> None:
    """A standby that died while waiting (here SIGKILLed) is not told to serve: the next
    restart starts vLLM afresh, and a new standby follows it."""
    url = serving.url
    standby = _standby(serving, "pd-d0")
    os.kill(standby, signal.SIGKILL)
    leader = _engine_leader(serving, "pd-d0")
    restarts = _scrape(url).value("prfaas_engine_restarts_total", instance="pd-d0")
    os.kill(child_pids(leader)[0], signal.SIGKILL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (
        _scrape(url).value("prfaas_engine_restarts_total", instance="pd-d0") < restarts + 1
        or _state(url)["pd-d0"]["status"] != "healthy"
    ):
        assert time.monotonic() < deadline, _state(url)
        time.sleep(1)
    now = _engine_leader(serving, "pd-d0")
    assert now not in (leader, standby)
    argv = Path(f"/proc/{child_pids(now)[0]}/cmdline").read_text().split("\0")
    assert "vllm.entrypoints.openai.api_server" in argv  # a cold start
    assert _standby(serving, "pd-d0") != standby
    body = {"model": "qwen3-next-tiny", "prompt": "hello there", "max_tokens": 8,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with _post(url, body) as reply:
        assert json.load(reply)["usage"]["completion_tokens"] == 8


def test_a_stopped_vllm_prefill_is_killed_whole_and_restarted(serving: Serving) -> None:
    url = serving.url
    leader = _engine_leader(serving, "prfaas-p0")
    standby = _standby(serving, "prfaas-p0")
    tree = descendants(leader)
    server = child_pids(leader)[0]
    os.kill(server, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while [pid for pid in tree if alive(pid)]:
            assert time.monotonic() < stopped + 60, _state(url)["prfaas-p0"]
            time.sleep(0.2)
    finally:
        if alive(server):
            os.kill(server, signal.SIGKILL)
    assert time.monotonic() - stopped >= GRACE_S
    deadline = time.monotonic() + START_TIMEOUT_S
    while (
        _scrape(url).value("prfaas_engine_restarts_total", instance="prfaas-p0") < 1
        or _state(url)["prfaas-p0"]["status"] != "healthy"
    ):
        assert time.monotonic() < deadline, _state(url)
        time.sleep(1)
    scrape = _scrape(url)
    assert scrape.value("prfaas_engine_unresponsive_kills_total", instance="prfaas-p0") == 1
    assert _engine_leader(serving, "prfaas-p0") == standby
    body = {"model": "qwen3-next-tiny", "prompt": "hello there", "max_tokens": 8,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with _post(url, body) as reply:
        assert reply.headers["x-prfaas-route"] == "prfaas"
        assert json.load(reply)["usage"]["completion_tokens"] == 8
    # the restarted engines' KV events reach the index (the gateway joined them afresh)
    long = {**body, "prompt": "hello there " * 70, "max_tokens": 2}
    with _post(url, long) as reply:
        assert reply.status == 200
    deadline = time.monotonic() + 30
    while _index_entries(url) == 0:
        assert time.monotonic() < deadline, "no KV events from the restarted engines"
        time.sleep(0.5)


def _index_entries(url: str) -> int:
    with urllib.request.urlopen(f"{url}/admin/state", timeout=10) as reply:
        return int(json.load(reply)["kv_index"]["entries"])


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket listening in these processes (from /proc)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    link = os.readlink(fd)
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                addr, port = local.split(":")
                found.add((addr, int(port, 16)))
    return found


def test_every_engine_port_listens_on_loopback_and_kv_events_on_a_private_socket(
    serving: Serving,
) -> None:
    """Issue 28 finding 5: vLLM's KV-event publisher binds TCP only on every interface, where
    any subscriber read the prompts' token ids. Launched vLLM servers publish on unix
    sockets in `prfaas serve`'s private directory instead, and nothing they run listens on
    TCP beyond loopback (HTTP and the KV transport)."""
    tree = descendants(serving.proc.pid)
    listening = _listening(tree)
    assert listening, "the engines listen somewhere"
    assert {addr for addr, _ in listening} == {"0100007F"}, listening  # 127.0.0.1 only
    endpoints = set()  # each server's argv appears twice: its reaper's too
    for pid in tree:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if "--kv-events-config" in argv:
                config = json.loads(argv[argv.index("--kv-events-config") + 1])
                endpoints |= {config["endpoint"], config["replay_endpoint"]}
    assert len(endpoints) == 4, endpoints  # two servers: events and replay each
    for endpoint in endpoints:
        assert endpoint.startswith("ipc://"), endpoint
        folder = Path(endpoint.removeprefix("ipc://")).parent
        assert folder.stat().st_mode & 0o077 == 0, oct(folder.stat().st_mode)  # this user's


def test_sigkill_of_serve_leaves_no_vllm_process(serving: Serving) -> None:
    tree = descendants(serving.proc.pid)
    # two engines (each a leader, an API server, an EngineCore), two standbys (each a
    # leader and its waiting server)
    assert len(tree) >= 10
    serving.proc.kill()
    serving.proc.wait()
    deadline = time.monotonic() + 15
    while [pid for pid in tree if alive(pid)]:
        assert time.monotonic() < deadline, [pid for pid in tree if alive(pid)]
        time.sleep(0.1)
