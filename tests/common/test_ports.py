"""Ports picked for a later bind: below the kernel's ephemeral range, free, never handed out
twice by one process; the kernel's pick where there is no room."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from prfaas.common import ports


def _ephemeral_low() -> int:
    return int(ports.EPHEMERAL_RANGE.read_text().split()[0])


def test_the_room_is_below_the_ephemeral_range_or_none() -> None:
    assert ports.pickable(32768) == range(ports.LOWEST, 32768)
    assert ports.pickable(ports.LOWEST + ports.MIN_ROOM - 1) == range(0)
    assert ports.pickable(0) == range(0)


def test_a_slice_keeps_the_picks_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes picking side by side, each in its own slice, never pick the same port."""
    assert ports.pickable(32768, range(20000, 25000)) == range(20000, 25000)
    assert ports.pickable(32768, range(30000, 40000)) == range(30000, 32768)
    assert ports.pickable(32768, range(32000, 40000)) == range(0)  # too little room
    low = _ephemeral_low()
    assert ports.slice_of(2, 2) is None  # a worker started in place of a crashed one
    assert ports.slice_of(0, (low - ports.LOWEST) // ports.MIN_ROOM + 1) is None  # too small
    halves = [ports.slice_of(i, 2) for i in range(2)]
    assert halves[1] is not None
    assert halves == [f"{ports.LOWEST}-{ports.LOWEST + (low - ports.LOWEST) // 2}",
                      f"{ports.LOWEST + (low - ports.LOWEST) // 2}-"
                      f"{ports.LOWEST + 2 * ((low - ports.LOWEST) // 2)}"]  # fmt: skip
    monkeypatch.setenv(ports.ENV_RANGE, halves[1])
    start, stop = (int(p) for p in halves[1].split("-"))
    assert all(start <= ports.free_port() < stop for _ in range(64))
    monkeypatch.setenv(ports.ENV_RANGE, "10000:20000")
    with pytest.raises(ValueError, match="PRFAAS_PORT_RANGE must be LOW-HIGH"):
        ports.free_port()


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    picked = ports.free_ports(64) + [ports.free_port() for _ in range(64)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST <= p < _ephemeral_low() for p in picked), picked
    for port in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.free_port()))
        busy.listen()
        taken = busy.getsockname()[1]
        ports._given.discard(taken)  # only the listener stands in the way now
        choices = iter([taken, taken])
        real_choice = ports.random.choice
        monkeypatch.setattr(
            ports.random, "choice", lambda room: next(choices, None) or real_choice(room)
        )
        port = ports.free_port()
    assert port != taken and ports.LOWEST <= port < _ephemeral_low()


def test_no_room_lets_the_kernel_pick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    whole = tmp_path / "ip_local_port_range"
    whole.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", whole)
    port = ports.free_port()
    assert port >= 1024
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
