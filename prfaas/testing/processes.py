"""Process-tree helpers for tests and benchmarks that watch `prfaas serve`'s children."""

from __future__ import annotations

from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The ids of `pid`'s direct children (Linux `/proc`)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids
