"""Process-tree helpers for tests and benchmarks that watch engine processes (Linux `/proc`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the `/proc/PID/stat` fields after "pid (comm)": state, ppid, pgrp, ...) of each
    live process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        yield int(stat.parent.name), fields


def argv(pid: int) -> list[str] | None:
    """A process's command line (None once it ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return None


def child_pids(pid: int) -> list[int]:
    """The ids of `pid`'s direct children."""
    return [child for child, fields in _stats() if int(fields[1]) == pid]


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) the live processes of process group `pgid` have used."""
    ticks = sum(int(f[11]) + int(f[12]) for _, f in _stats() if int(f[2]) == pgid)
    return ticks / os.sysconf("SC_CLK_TCK")


def engine_pid(child: int) -> int | None:
    """The engine's own process behind one of `prfaas serve`'s children: the child itself,
    or, for an engine run under `prfaas.serve.reaper` (a vLLM server), the server it started
    (None while it has none). A fault meant for the engine (SIGKILL, SIGSTOP) goes there;
    `os.killpg(child, ...)` reaches its whole tree."""
    command = argv(child)
    if command is None:
        return None
    if "prfaas.serve.reaper" not in command[:3]:
        return child
    children = child_pids(child)
    return children[0] if children else None


def waiting_standby(child: int) -> bool:
    """Whether one of `prfaas serve`'s children is a vLLM engine's standby still waiting to
    be told to serve (`prfaas.engines.vllm.standby`: it has started no EngineCore yet), not
    an engine."""
    server = engine_pid(child)
    if server is None:
        return False
    command = argv(server)
    return (
        command is not None and "prfaas.engines.vllm.standby" in command and not child_pids(server)
    )


def alive(pid: int) -> bool:
    """Running (a zombie whose parent is gone counts as dead: this machine's init may not
    reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
