"""Gateway replicas as a deployment runs them: one reference engine started once, and
several `prfaas serve --config F --port P` processes over it (the same deployment file,
a port each), each a real process a test can SIGKILL."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from prfaas.common.ports import free_port

MODEL = "qwen3-next-tiny"
START_TIMEOUT_S = 120.0
ENGINE_READY = re.compile(r"prfaas engine ready: (http://\S+) role=both bootstrap_port=(\d+)")
LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")


@dataclass
class Engine:
    url: str
    bootstrap_port: int


@dataclass
class Replica:
    """One gateway process."""

    port: int
    proc: subprocess.Popen[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def _wait_line(proc: subprocess.Popen[str], pattern: re.Pattern[str], log: Path) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if match := pattern.search(line):
            return match
    proc.kill()
    raise AssertionError(f"not ready:\n{''.join(seen)}\n{log.read_text(errors='replace')[-2000:]}")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def reference_engine(workdir: Path) -> Iterator[Engine]:
    """One reference engine doing prefill and decode (`--role both`): the cheapest
    deployment the replicas can share."""
    log = workdir / "engine.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "engine", "--role", "both",
             "--model", MODEL, "--port", "0", "--bootstrap-port", "0", "--threads", "1"],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    try:
        match = _wait_line(proc, ENGINE_READY, log)
        yield Engine(match.group(1), int(match.group(2)))
    finally:
        _stop(proc)


def deployment_file(path: Path, engine: Engine, extra: str = "") -> Path:
    """The one deployment file every replica reads; `extra` is appended (tables such as
    `[scheduler]` and `[coordination]`; without the latter each replica runs alone)."""
    path.write_text(
        f"""
[model]
name = "{MODEL}"
block_size = 64
[gateway]
threshold = 100000
[[instances]]
id = "pd-0"
cluster = "pd"
role = "both"
url = "{engine.url}"
bootstrap_port = {engine.bootstrap_port}
"""
        + extra
    )
    return path


@contextmanager
def gateway_replicas(engine: Engine, workdir: Path, count: int) -> Iterator[list[Replica]]:
    """`count` gateway processes over `engine`, started at once, each listening when this
    yields; stopped (or reaped, if a test killed one) on exit."""
    config = deployment_file(workdir / "deployment.toml", engine)
    replicas: list[Replica] = []
    try:
        for n in range(count):
            port = free_port()
            with (workdir / f"gateway-{n}.log").open("w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(config),
                     "--port", str(port), "--replica-id", f"gateway-{n}"],
                    stdout=subprocess.PIPE, stderr=err, text=True,
                )  # fmt: skip
            replicas.append(Replica(port, proc))
        for n, replica in enumerate(replicas):
            _wait_line(replica.proc, LISTENING, workdir / f"gateway-{n}.log")
        yield replicas
    finally:
        for replica in replicas:
            _stop(replica.proc)


@dataclass
class Outcome:
    """One client request through Envoy: its `data:` payloads (a whole answer's body as its
    one payload), or the client's exception when the body was cut."""

    n: int
    stream: bool
    start: float
    end: float
    status: int | None
    request_id: str | None
    events: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whole: 200 and, streamed, ended by `[DONE]`."""
        if self.error is not None or self.status != 200 or not self.events:
            return False
        return self.events[-1] == "[DONE]" if self.stream else '"choices"' in self.events[0]

    def error_code(self) -> str | None:
        """The code of the OpenAI error the answer ended with (a stream's last event, a
        whole answer's body), if it ended with one."""
        if self.error is not None or not self.events or self.events[-1] == "[DONE]":
            return None
        try:
            body = json.loads(self.events[-1])
        except ValueError:
            return None
        error = body.get("error") if isinstance(body, dict) else None
        return None if not isinstance(error, dict) else str(error.get("code"))


async def completion(
    s: aiohttp.ClientSession, url: str, n: int, stream: bool, tokens: int = 24
) -> Outcome:
    """Completion `n` (`tokens` tokens, greedy) through `url`: its outcome, never raising."""
    body = {"model": MODEL, "prompt": f"request {n}", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    out = Outcome(n, stream, time.monotonic(), 0.0, None, None)
    try:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            out.status, out.request_id = r.status, r.headers.get("x-request-id")
            if stream and r.status == 200:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        out.events.append(line[6:].decode().strip())
            else:
                out.events.append(await r.text())
    except aiohttp.ClientError as exc:
        out.error = repr(exc)
    out.end = time.monotonic()
    return out
