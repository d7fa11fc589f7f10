"""`prfaas serve` as a real process for live tests: spawned holding a known deployment
secret (so a test may call the engines' control routes with its token, as an operator would),
awaited until its start-up summary, loaded with fresh prompts, stopped."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import aiohttp

from prfaas.common.secret import ENV_SECRET, DeploymentSecret

START_TIMEOUT_S = 300
READY = re.compile(r"\(Ctrl-C\) stops|Ctrl-C stops")
LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
MODEL = "qwen3-next-tiny"

# The deployment secret `prfaas serve` hands its engines: known here, so the test may call
# an engine's control routes (`/admin/egress`) with its token, as an operator would.
SECRET = DeploymentSecret.generate()
ENGINE_AUTH = {"Authorization": f"Bearer {SECRET.control_token()}"}


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, ENV_SECRET: SECRET.hex()},
    )


def started(proc: subprocess.Popen[str]) -> str:
    """Wait for the start-up summary; returns the gateway URL."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited before ready:\n{''.join(seen)}")
        seen.append(line)
        if READY.search(line):
            match = LISTENING.search("".join(seen))
            assert match is not None, seen
            return match.group(1)
    raise AssertionError(f"not ready in {START_TIMEOUT_S}s:\n{''.join(seen)}")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def words(n_tokens: int, seed: int) -> str:
    """`n_tokens` byte-level tokens of fresh text (no prefix shared with other seeds)."""
    rng = random.Random(seed)
    text = f"{seed} "
    while len(text) < n_tokens:
        text += "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) + " "
    return text[:n_tokens]


async def complete(s: aiohttp.ClientSession, url: str, tokens: int, seed: int) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": words(tokens, seed), "max_tokens": 2}
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-prfaas-route", "")


async def admin_state(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/admin/state") as resp:
        body: dict[str, Any] = await resp.json()
        return body


async def load(url: str, seconds: float, tokens: int, workers: int, seed: int) -> list[int]:
    """`workers` clients sending fresh prompts back to back; returns every status."""
    statuses: list[int] = []
    end = time.monotonic() + seconds

    async def worker(w: int) -> None:
        async with aiohttp.ClientSession() as s:
            n = 0
            while time.monotonic() < end:
                status, _ = await complete(s, url, tokens, seed + 1000 * w + n)
                statuses.append(status)
                n += 1

    await asyncio.gather(*(worker(w) for w in range(workers)))
    return statuses


def get(url: str, headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)


async def load_until_a_decode_converts(
    url: str, timeout_s: float, statuses: list[int]
) -> tuple[dict[str, Any], int]:
    """A prefill-heavy load (3 clients, 900-token prompts, 2 output tokens) until one of the
    PD decodes `pd-d0`, `pd-d1` reports role prefill; every status goes to `statuses`.
    Returns that instance's `/admin/state` entry and the next unused prompt seed."""
    deadline = time.monotonic() + timeout_s
    seed = 10
    while True:
        assert time.monotonic() < deadline, get(f"{url}/admin/state")["scheduler"]
        statuses += await load(url, 3.0, 900, 3, seed)
        seed += 10_000
        pd = {i["id"]: i for i in get(f"{url}/admin/state")["clusters"]["pd"]}
        roles = {i: v["role"] for i, v in pd.items()}
        if list(roles.values()).count("prefill") == 2:
            converted = next(pd[i] for i in ("pd-d0", "pd-d1") if roles[i] == "prefill")
            return converted, seed
