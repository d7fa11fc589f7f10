"""Engine process trees that die with their engine and with `prfaas serve` (Linux).

`python -m prfaas.serve.reaper --parent PID [--exec] -- CMD...`, which `prfaas serve` starts
in a session of its own (one `killpg` then reaches every process of that engine):

- `--exec`, for an engine that starts no processes of its own (the reference engine): set
  the parent-death signal (SIGKILL when `PID` dies) and become CMD (`exec` keeps both the
  pid and that signal): no extra process.
- otherwise (vLLM: its API server starts an EngineCore process that nothing stops when the
  server is killed, so it lived on, holding its memory and ports): stay CMD's parent, as a
  child subreaper (every orphaned descendant becomes this process's child). CMD gets the
  parent-death signal SIGTERM (this process killed alone: vLLM shuts down its own children).
  When CMD exits, however it died, every descendant left is killed and reaped, then this
  process exits with CMD's status (128 + signal for a signal). SIGTERM or SIGINT is passed
  on to CMD, and everything left after `--grace` seconds is killed; the death of `PID`
  (SIGHUP, the parent-death signal here) kills everything at once.

Nothing but the standard library: it starts before any engine code is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def prctl(option: int, value: int) -> None:
    """`prctl(option, value)`.

    Raises:
        OSError: the kernel refused it.
    """
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from `/proc`), parents before their children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # it ended while we looked
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


_reaped: dict[int, int] = {}
"""Wait statuses of the children reaped so far, by pid."""


def _reap_any(flags: int = os.WNOHANG) -> int | None:
    """Reap one exited child (without blocking, by default) and note its status: its pid,
    or None (none exited, or no children left)."""
    try:
        pid, status = os.waitpid(-1, flags)
    except ChildProcessError:
        return None
    if pid:
        _reaped[pid] = status
    return pid or None


def kill_tree(rounds: int = 50) -> None:
    """SIGKILL every descendant and reap them (orphans come to this subreaper), until none
    is left or `rounds` tries (a process forking while killed needs another round)."""
    me = os.getpid()
    for _ in range(rounds):
        left = descendants(me)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
        while _reap_any() is not None:
            pass
    while _reap_any() is not None:
        pass


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def supervise(cmd: Sequence[str], parent: int, grace_s: float) -> int:
    """Run `cmd` as a child subreaper; its exit status once its whole tree is gone."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != parent:  # it died before the signal was armed
        return 128 + signal.SIGHUP
    child: subprocess.Popen[bytes] | None = None

    def parent_died(_sig: int, _frame: FrameType | None) -> None:
        kill_tree()
        os._exit(128 + signal.SIGHUP)

    def terminate(_sig: int, _frame: FrameType | None) -> None:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        signal.setitimer(signal.ITIMER_REAL, grace_s)

    def overdue(_sig: int, _frame: FrameType | None) -> None:
        kill_tree()

    signal.signal(signal.SIGHUP, parent_died)
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    signal.signal(signal.SIGALRM, overdue)
    child = subprocess.Popen(cmd, preexec_fn=_pdeathsig(signal.SIGTERM))
    while child.pid not in _reaped and _reap_any(0) is not None:
        pass
    kill_tree()
    status = _reaped.get(child.pid)
    code = 128 + signal.SIGKILL if status is None else _exit_code(status)
    child.returncode = code  # reaped here, not by Popen
    return code


def _pdeathsig(sig: int) -> Callable[[], None]:
    """A `preexec_fn` (this process is single-threaded): the child gets `sig` when we die."""
    return lambda: prctl(PR_SET_PDEATHSIG, sig)


def become(cmd: Sequence[str], parent: int) -> None:
    """Arm SIGKILL for the death of `parent`, then exec `cmd` (never returns)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)
    os.execvp(cmd[0], list(cmd))


def wrap(cmd: Sequence[str], *, exec_: bool, grace_s: float = 10.0) -> list[str]:
    """The command line that runs `cmd` under this module, for a child of this process."""
    head = [sys.executable, "-m", "prfaas.serve.reaper", "--parent", str(os.getpid())]
    head += ["--exec"] if exec_ else ["--grace", str(grace_s)]
    return [*head, "--", *cmd]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prfaas.serve.reaper")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--exec", action="store_true", dest="exec_")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command")
    if args.exec_:
        become(cmd, args.parent)
    return supervise(cmd, args.parent, args.grace)


if __name__ == "__main__":
    sys.exit(main())
