"""Sender telemetry: egress rate over a sliding window, and per-connection TCP samples."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectionTelemetry:
    """One data connection to a decode peer, sampled from TCP_INFO."""

    peer: str
    index: int
    bytes_sent: int
    """Payload and header bytes this process wrote on the connection."""
    rtt_s: float | None
    rttvar_s: float | None
    retransmits: int | None
    """Segments the kernel retransmitted on this connection (tcpi_total_retrans)."""
    segments_out: int | None
    delivery_rate_bytes_per_s: float | None
    """The kernel's delivery-rate estimate (tcpi_delivery_rate)."""
    cwnd: int | None
    tls: str | None = None
    """The connection's TLS version (`TLSv1.3`), None over plain TCP."""


@dataclass(frozen=True)
class TransportTelemetry:
    """A snapshot of a `KVSender`, for the gateway's schedulers."""

    at: float
    """The event loop's clock (`loop.time()`) when sampled."""
    egress_bytes_per_s: float
    """Bytes written over the last `window_s` seconds, divided by the window."""
    window_s: float
    bytes_total: int
    """Bytes written since the sender started (frames with headers, retransmits included)."""
    capacity_bytes_per_s: float | None
    """Configured capacity (explicit, else the process pacing rate), None if unset."""
    utilisation: float | None
    """egress / capacity, None without a capacity."""
    retransmission_rate: float
    """Retransmitted / sent TCP segments over all live connections (0 with none)."""
    rtt_s: float | None
    """Mean smoothed RTT of live connections, None with none."""
    resent_bytes: int
    """Payload bytes queued again because their connection died before the ACK."""
    peers: int
    active_transfers: int
    connections: tuple[ConnectionTelemetry, ...]
    handshake_failures: int = 0
    """Bootstrap connections closed before they authenticated (bad HELLO or AUTH, timeout,
    evicted by newer ones)."""
    parked_rooms: int = 0
    """REGISTERs waiting for their room to be opened."""
    parked_refused: int = 0
    """REGISTERs refused because `max_parked_rooms` were parked."""
    control_dropped: int = 0
    """Control frames dropped because a peer did not read them."""
    paced_bytes: int = 0
    """Payload bytes charged to the process token bucket (0 when unpaced): each data frame
    once, re-sends not again."""


class EgressMeter:
    """Counts bytes written and their rate over a sliding window (times from the loop clock)."""

    def __init__(self, window_s: float = 1.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self.total = 0
        self._events: deque[tuple[float, int]] = deque()
        self._in_window = 0

    def add(self, now: float, nbytes: int) -> None:
        """Record `nbytes` written at `now`."""
        self.total += nbytes
        self._events.append((now, nbytes))
        self._in_window += nbytes
        self._expire(now)

    def rate(self, now: float) -> float:
        """Bytes per second over the window ending at `now`."""
        self._expire(now)
        return self._in_window / self.window_s

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._in_window -= self._events.popleft()[1]
