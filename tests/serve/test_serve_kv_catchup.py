"""A gateway that starts beside running reference engines knows what they cache: real
engine processes outlive a first `prfaas serve`, and a second one loads their snapshots
(the KV events' replay endpoint) before it listens, so its index and its routing decisions
count the prefixes cached under the first one, before any new traffic and after it."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from prfaas.common.ports import free_port
from prfaas.serve.processes import EngineProcess, EngineSpec, start_engine

LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
PAGE = 64


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij ") for _ in range(n))


A, B, C = _text(700, 1), _text(300, 2), _text(400, 3)  # byte-level: one token a character


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[dict[str, EngineProcess]]:
    """A PD prefill and a PD decode, publishing KV events with a replay endpoint."""
    specs = [
        EngineSpec(name, role, page_size=PAGE, kv_events_port=free_port(),
                   kv_replay_port=free_port())
        for name, role in (("pd-p0", "prefill"), ("pd-d0", "decode"))
    ]  # fmt: skip
    started: dict[str, EngineProcess] = {}
    try:
        for spec in specs:
            started[spec.name] = await start_engine(spec, tmp_path)
        yield started
    finally:
        for engine in started.values():
            await engine.stop()


def _deployment(tmp: Path, engines: dict[str, EngineProcess]) -> Path:
    blocks = "".join(
        f'[[instances]]\nid = "{name}"\ncluster = "pd"\nrole = "{e.spec.role}"\n'
        f'url = "{e.url}"\nbootstrap_port = {e.bootstrap_port}\n'
        f'kv_events = "{e.kv_events}"\nkv_events_replay = "{e.kv_events_replay}"\n\n'
        for name, e in engines.items()
    )
    path = tmp / "deploy.toml"
    path.write_text(f"[gateway]\nthreshold = 100000\n\n{blocks}")
    return path


def _serve(config: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", "serve", "--port", "0", "--config",
         str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = LISTENING.search(line)
    if match is None:
        proc.kill()
        raise AssertionError(line + proc.stdout.read())
    return proc, match.group(1)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def _entries(url: str) -> int:
    with urllib.request.urlopen(f"{url}/admin/state", timeout=10) as reply:
        return int(json.load(reply)["kv_index"]["entries"])


def _settled(url: str, at_least: int) -> int:
    """The index's entries once the KV events stop moving them (at least `at_least`)."""
    deadline, last = time.monotonic() + 10, -1
    while time.monotonic() < deadline:
        now = _entries(url)
        if now == last and now >= at_least:
            return now
        last = now
        time.sleep(0.3)
    raise AssertionError(f"index at {last} entries, expected >= {at_least}")


def _complete(url: str, prompt: str) -> tuple[int, dict[str, Any]]:
    """`x-prfaas-incremental-tokens` of the routing decision, and the answer's usage."""
    body = {"model": "qwen3-next-tiny", "prompt": prompt, "max_tokens": 2}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as reply:
        return int(reply.headers["x-prfaas-incremental-tokens"]), json.load(reply)["usage"]


def _cached_blocks(prompt: str) -> int:
    return len(prompt) // PAGE


async def test_a_second_gateway_loads_what_the_engines_cache(
    tmp_path: Path, engines: dict[str, EngineProcess]
) -> None:
    """Gateway 1 routes A (700 tokens) and B (300): the prefill engine caches their full
    blocks (10 and 4) and gateway 1's index counts them. Gateway 1 stops; gateway 2 starts
    beside the same engines and, before any traffic, holds the same entries; A and B then
    route with only their tails incremental (60 and 44 tokens, what the engine reports
    cached too), and a new prompt C's blocks are added on top, nothing lost."""
    config = _deployment(tmp_path, engines)
    first, url = _serve(config)
    try:
        assert _complete(url, A)[0] == len(A)  # nothing cached yet
        assert _complete(url, B)[0] == len(B)
        before = _settled(url, _cached_blocks(A) + _cached_blocks(B))
        assert _complete(url, A)[0] == len(A) - _cached_blocks(A) * PAGE
    finally:
        _stop(first)
    second, url = _serve(config)
    try:
        assert _entries(url) == before  # loaded before listening: no traffic, no wait
        for prompt in (A, B):
            incremental, usage = _complete(url, prompt)
            assert incremental == len(prompt) - _cached_blocks(prompt) * PAGE
            assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt) - incremental
        assert _complete(url, C)[0] == len(C)
        assert _settled(url, before + _cached_blocks(C)) == before + _cached_blocks(C)
        assert _complete(url, A)[0] == len(A) - _cached_blocks(A) * PAGE
    finally:
        _stop(second)
