"""Ports picked now for a process to bind later (an engine's HTTP and bootstrap ports, an
etcd's, a test server's).

A port is picked below the kernel's ephemeral range (`ip_local_port_range`) when there is room
there: the kernel never hands such a port to an outgoing connection or to a `bind(("", 0))`,
so nothing else on the machine takes it between the pick and the bind, nor between an
engine's death and its restart on the same ports. One process never hands out a port twice
(a process and its children may, as before); side by side, each test worker, with its
children, picks from a slice of its own (`PRFAAS_PORT_RANGE`), so that two workers never
do. Where the range cannot be read (not Linux) or leaves no room, the kernel picks (`bind`
to 0).
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000
"""The lowest port picked: well-known and registered services mostly sit below it."""
MIN_ROOM = 1000
"""Fewer free-to-pick ports than this below the ephemeral range: let the kernel pick."""
ATTEMPTS = 200
ENV_RANGE = "PRFAAS_PORT_RANGE"
"""`LOW-HIGH` (HIGH excluded): pick only among these ports (those below the ephemeral range),
so that processes picking at once never pick the same port: each takes its own slice."""

_given: set[int] = set()
_lock = threading.Lock()


def pickable(ephemeral_low: int, allowed: range | None = None) -> range:
    """The ports picked from, given the ephemeral range's lowest port and the slice
    `allowed` (None: all): empty when there is too little room."""
    room = range(LOWEST, ephemeral_low)
    if allowed is not None:
        room = range(max(room.start, allowed.start), min(room.stop, allowed.stop))
    return room if len(room) >= MIN_ROOM else range(0)


def slice_of(index: int, count: int) -> str | None:
    """The `PRFAAS_PORT_RANGE` value of process `index` (0 to `count` - 1) of `count`
    picking side by side: the `count`th part of this machine's room; None where that part
    would be too small to pick from (the process then picks from the whole room)."""
    room = pickable(ephemeral_low())
    size = len(room) // count
    if not 0 <= index < count or size < MIN_ROOM:
        return None
    low = room.start + index * size
    return f"{low}-{low + size}"


def _allowed() -> range | None:
    """The slice `PRFAAS_PORT_RANGE` sets, if any.

    Raises:
        ValueError: it is not `LOW-HIGH`.
    """
    value = os.environ.get(ENV_RANGE)
    if not value:
        return None
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        raise ValueError(f"{ENV_RANGE} must be LOW-HIGH, got {value!r}") from None
    return range(low, high)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, which no connection or kernel-picked bind will take."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct such ports."""
    room = pickable(ephemeral_low(), _allowed())
    with _lock:
        return [_pick(room, host) for _ in range(n)]


def _pick(room: range, host: str) -> int:
    for _ in range(ATTEMPTS if room else 0):
        port = random.choice(room)
        if port not in _given and _bindable(host, port):
            _given.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_low() -> int:
    """The kernel's lowest ephemeral port (0 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
