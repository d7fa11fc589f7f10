"""`prfaas serve` stops gracefully, as a real process over real reference engines it
launched (`[[launch]]`): on SIGTERM it refuses new connections, answers a new request on an
open connection (and `/health`) with 503, lets requests in flight finish within the drain
deadline while its engines keep serving them, ends the ones still running at the deadline
with an OpenAI error (an error event on a stream, 503 on a whole answer), never cutting one
without it, then stops its engines and exits."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from http_server_helpers import read_response, request

from prfaas.testing.processes import child_pids

LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
DRAIN_S = 8.0
SLACK_S = 10.0
"""Beyond the deadline: the engines' stop (SIGTERM, up to 5 s each, concurrently)."""
SHORT, LONG = 40, 4000  # output tokens: ~1-2 s, and minutes, on the tiny model on CPU

DEPLOYMENT = """
[gateway]
threshold = 100000
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
class Answer:
    """What a client got: the status and the `data:` payloads (a whole answer's body as its
    one payload), read to the end of a complete HTTP body (a cut one raises)."""

    status: int
    events: list[str]
    at: float
    """When the answer ended (loop time)."""

    @property
    def done(self) -> bool:
        return self.events[-1:] == ["[DONE]"]

    def error_code(self) -> str | None:
        last = json.loads(self.events[-1]) if self.events and not self.done else {}
        error = last.get("error")
        return None if error is None else str(error["code"])


async def _ask(
    session: aiohttp.ClientSession, url: str, tokens: int, stream: bool, started: asyncio.Event
) -> Answer:
    body = {"model": "qwen3-next-tiny", "prompt": "hello there", "max_tokens": tokens,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    loop = asyncio.get_running_loop()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if not stream:
            return Answer(resp.status, [(await resp.read()).decode()], loop.time())
        events = []
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.set()
        return Answer(resp.status, events, loop.time())


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def _start(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    config = tmp / "deploy.toml"
    config.write_text(DEPLOYMENT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", "serve", "--port", "0", "--config",
         str(config), "--drain-timeout", str(DRAIN_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if not line:
            break
        if match := LISTENING.search(line):
            return proc, match.group(1)
    proc.kill()
    raise AssertionError("".join(seen))


async def test_sigterm_drains_then_stops_the_engines(tmp_path: Path) -> None:
    """Short and long requests in flight (a stream and a whole one of each), SIGTERM:
    new connections are refused at once; `/health` on an open connection gets 503
    `shutting_down`; the engines stay up and the short requests complete normally
    (`[DONE]`, 200); at the deadline the long stream ends with a `shutting_down` error
    event (a complete body, no `[DONE]`) and the long whole request gets 503; the process
    exits 0 within the deadline plus the engines' stop, and its engines are gone."""
    proc, url = _start(tmp_path)
    port = int(url.rsplit(":", 1)[1])
    try:
        engines = child_pids(proc.pid)
        assert len(engines) == 2
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request("GET", "/health"))
        assert (await read_response(reader)).status == 200  # kept alive
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            flags = [asyncio.Event() for _ in range(4)]
            kinds = [(SHORT, True), (SHORT, False), (LONG, True), (LONG, False)]
            tasks = [
                asyncio.create_task(_ask(session, url, n, stream, flag))
                for (n, stream), flag in zip(kinds, flags, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(flags[0].wait(), flags[2].wait()), 60)
            await asyncio.sleep(0.3)  # the whole requests are on the engines too
            loop = asyncio.get_running_loop()
            proc.send_signal(signal.SIGTERM)
            signalled = loop.time()
            await asyncio.sleep(0.5)
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)
            writer.write(request("GET", "/health"))
            refused = await read_response(reader)
            assert refused.status == 503 and refused.headers["connection"] == "close"
            assert refused.json()["error"]["code"] == "shutting_down"
            assert _alive(engines) == engines  # still serving
            answers = await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_S + 30)
        short_stream, short_whole, long_stream, long_whole = answers
        assert short_stream.status == 200 and short_stream.done
        assert len(short_stream.events) == SHORT + 1
        assert short_whole.status == 200
        assert json.loads(short_whole.events[0])["usage"]["completion_tokens"] == SHORT
        assert long_stream.status == 200 and not long_stream.done
        assert long_stream.error_code() == "shutting_down"
        assert 1 < len(long_stream.events) < LONG
        assert long_whole.status == 503
        assert json.loads(long_whole.events[0])["error"]["code"] == "shutting_down"
        for cut in (long_stream, long_whole):
            assert DRAIN_S - 0.5 <= cut.at - signalled <= DRAIN_S + 2
        assert proc.wait(DRAIN_S + SLACK_S) == 0
        assert loop.time() - signalled <= DRAIN_S + SLACK_S
        assert "draining (up to 8 s" in (proc.stdout.read() if proc.stdout else "")
        assert _alive(engines) == []
        writer.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_second_signal_ends_the_drain_at_once(tmp_path: Path) -> None:
    """A long stream in flight, a 8 s drain: a second SIGTERM a second into the drain ends
    it then (the stream gets its `shutting_down` event), and the process exits long before
    the deadline would have passed."""
    proc, url = _start(tmp_path)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            started = asyncio.Event()
            task = asyncio.create_task(_ask(session, url, LONG, True, started))
            await asyncio.wait_for(started.wait(), 60)
            loop = asyncio.get_running_loop()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            second = loop.time()
            answer = await asyncio.wait_for(task, 30)
        assert answer.error_code() == "shutting_down"
        assert answer.at - second < 2.0
        assert proc.wait(SLACK_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
