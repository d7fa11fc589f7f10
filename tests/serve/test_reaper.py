"""`prfaas.serve.reaper` on real processes: a process tree like vLLM's (a server that starts
a child of its own) dies whole when its server dies, when it is told to stop, and when the
process that started it is SIGKILLed; `--exec` leaves no extra process and still dies with
its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from prfaas.serve.reaper import descendants, wrap
from prfaas.testing.processes import child_pids, engine_pid

TREE = [sys.executable, "-c", "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "time.sleep(600)"]  # fmt: skip


def _alive(pid: int) -> bool:
    """Running (a zombie counts as dead: this machine's init may not reap orphans)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _tree(root: int, size: int) -> list[int]:
    deadline = time.monotonic() + 20
    while len(found := descendants(root)) < size:
        assert time.monotonic() < deadline, found
        time.sleep(0.05)
    return found


def _all_gone(pids: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while left := [pid for pid in pids if _alive(pid)]:
        assert time.monotonic() < deadline, left
        time.sleep(0.05)


def test_the_tree_dies_with_its_server() -> None:
    proc = subprocess.Popen(wrap(TREE, exec_=False), start_new_session=True)
    server, child = _tree(proc.pid, 2)
    assert engine_pid(proc.pid) == server
    os.kill(server, signal.SIGKILL)
    assert proc.wait(10) == 128 + signal.SIGKILL
    _all_gone([server, child])


def test_sigterm_stops_the_server_then_kills_the_rest() -> None:
    proc = subprocess.Popen(wrap(TREE, exec_=False, grace_s=1), start_new_session=True)
    tree = _tree(proc.pid, 2)
    proc.terminate()
    assert proc.wait(10) == 128 + signal.SIGTERM
    _all_gone(tree)


def test_a_sigkilled_parent_takes_every_engine_along() -> None:
    starter = (
        "import subprocess, sys, time\n"
        "from prfaas.serve.reaper import wrap\n"
        f"tree = {TREE!r}\n"
        "subprocess.Popen(wrap(tree, exec_=False), start_new_session=True)\n"
        "subprocess.Popen(wrap(tree[:1] + ['-c', 'import time; time.sleep(600)'], exec_=True),\n"
        "                 start_new_session=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", starter])
    try:
        tree = _tree(parent.pid, 4)  # the reaper, the server, its child, the exec'd engine
        time.sleep(0.5)  # the exec'd one has replaced the reaper's image by now
        kept = {pid: engine_pid(pid) for pid in child_pids(parent.pid)}
        assert len(kept) == 2 and list(kept.values()).count(None) == 0
        exec_d = [pid for pid, engine in kept.items() if engine == pid]
        reaped = [engine for pid, engine in kept.items() if engine != pid]
        assert len(exec_d) == len(reaped) == 1 and reaped[0] in tree
    finally:
        parent.kill()
        parent.wait()
    _all_gone(tree)
