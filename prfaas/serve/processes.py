"""Reference engines as child processes: start, wait for readiness, stop (children included).

Each child runs `python -m prfaas.cli.main engine ...` and prints one line once it listens:
`prfaas engine ready: http://HOST:PORT role=ROLE bootstrap_port=B`. Its stderr goes to a log
file so a failed start can be diagnosed. The deployment secret reaches it through its
environment (`PRFAAS_SECRET`), never its command line, which `ps` shows to every user.

Every engine runs in a session (and process group) of its own, under `reaper.py`: its whole
tree dies with it (`kill_group` after its leader exits, whatever ended it) and with this
process (a parent-death signal, so even a SIGKILLed `prfaas serve` leaves nothing behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prfaas.serve import reaper

READY = re.compile(rb"prfaas engine ready: (http://\S+) role=(\w+) bootstrap_port=(\d+)")
STOP_GRACE_S = 5.0


def ipc_events(directory: str, name: str) -> tuple[str, str]:
    """Engine `name`'s KV-event and replay endpoints as unix sockets in `directory` (the
    same across its restarts)."""
    return f"ipc://{directory}/{name}.events", f"ipc://{directory}/{name}.replay"


@dataclass(frozen=True)
class EngineSpec:
    """One engine to start."""

    name: str
    role: str
    model: str = "qwen3-next-tiny"
    page_size: int = 64
    threads: int = 1
    kv_events_port: int | None = None
    extra_args: tuple[str, ...] = ()
    kv_replay_port: int | None = None
    """Replay endpoint of its KV events (recent batches and snapshots), with
    `kv_events_port`."""
    port: int = 0
    """HTTP port (0: any free one); a restart asks for the port it had."""
    bootstrap_port: int = 0
    """KV bootstrap port (0: any free one)."""
    kv_events_ipc: str | None = None
    """Publish KV events on unix sockets in this directory (private to this user:
    `ipc_events`) instead of `kv_events_port`: vLLM's publisher binds TCP only on every
    interface, where anyone who reaches the host could read the prompts' token ids."""

    def argv(self, host: str) -> list[str]:
        args = [sys.executable, "-m", "prfaas.cli.main", "engine", "--role", self.role]
        args += ["--model", self.model, "--host", host, "--port", str(self.port),
                 "--bootstrap-port", str(self.bootstrap_port)]  # fmt: skip
        args += ["--page-size", str(self.page_size), "--threads", str(self.threads)]
        if self.kv_events_port is not None:
            args += ["--kv-events", f"tcp://{host}:{self.kv_events_port}"]
            if self.kv_replay_port is not None:
                args += ["--kv-events-replay", f"tcp://{host}:{self.kv_replay_port}"]
        return [*args, *self.extra_args]


@dataclass
class EngineProcess:
    """A started engine child."""

    spec: EngineSpec
    process: asyncio.subprocess.Process
    url: str
    bootstrap_port: int
    log: Path
    drain: asyncio.Task[None]

    @property
    def kv_events(self) -> str | None:
        if self.spec.kv_events_ipc is not None:
            return ipc_events(self.spec.kv_events_ipc, self.spec.name)[0]
        port = self.spec.kv_events_port
        return None if port is None else f"tcp://127.0.0.1:{port}"

    @property
    def kv_events_replay(self) -> str | None:
        if self.spec.kv_events_ipc is not None:
            return ipc_events(self.spec.kv_events_ipc, self.spec.name)[1]
        port = self.spec.kv_replay_port
        return None if port is None or self.kv_events is None else f"tcp://127.0.0.1:{port}"

    @property
    def port(self) -> int:
        return int(urlparse(self.url).port or 0)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; always reaps the child."""
        await stop_process(self.process)
        self.drain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.drain


async def stop_process(process: asyncio.subprocess.Process, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the engine's leader process, SIGKILL its whole group after `grace_s`, and
    SIGKILL whatever is left of the group once the leader is gone (a child it left)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            kill_group(process)
            await process.wait()
    kill_group(process)


def kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL every process of the engine's process group (a stopped one too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def spawn(
    argv: list[str],
    *,
    exec_: bool,
    env: Mapping[str, str],
    stdout: Any,
    stderr: Any,
    stdin: Any = asyncio.subprocess.DEVNULL,
) -> asyncio.subprocess.Process:
    """Start `argv` as an engine: in a new session, under `reaper` (`exec_`: `argv` starts
    no processes of its own, so it only gets the parent-death signal)."""
    return await asyncio.create_subprocess_exec(
        *reaper.wrap(argv, exec_=exec_),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        env=dict(env),
        start_new_session=True,
    )


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def start_engine(
    spec: EngineSpec,
    log_dir: Path,
    host: str = "127.0.0.1",
    timeout_s: float = 180.0,
    env: Mapping[str, str] | None = None,
    log_name: str | None = None,
) -> EngineProcess:
    """Start one engine and wait for its ready line. `env` is added to this process's
    environment for the child (the deployment secret goes there); its stderr goes to
    `log_dir/<log_name or name>.log`.

    Raises:
        RuntimeError: it exited or did not become ready in time (names its log file).
    """
    log = log_dir / f"{log_name or spec.name}.log"
    with log.open("wb") as err:
        process = await spawn(
            spec.argv(host),
            exec_=True,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            env={**os.environ, **(env or {})},
        )
    assert process.stdout is not None
    try:
        match = await asyncio.wait_for(_ready_line(process.stdout), timeout_s)
    except (TimeoutError, EOFError):
        await stop_process(process)
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"engine {spec.name} did not start (log {log}):\n{tail}") from None
    except BaseException:  # cancelled while starting: never leave the child behind
        await asyncio.shield(stop_process(process))
        raise
    drain = asyncio.get_running_loop().create_task(_drain(process.stdout))
    url, port = match.group(1).decode(), int(match.group(3))
    return EngineProcess(spec, process, url, port, log, drain)


async def _ready_line(stdout: asyncio.StreamReader) -> re.Match[bytes]:
    while line := await stdout.readline():
        if match := READY.search(line):
            return match
    raise EOFError("engine exited before it was ready")
