"""Frozen, validated configuration of the KV sender and receiver."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prfaas.engines.transport.tls import TlsConfig

MIB = 2**20


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _optional_rate(name: str, value: float | None) -> None:
    if value is not None:
        _positive(name, value)


@dataclass(frozen=True)
class SenderConfig:
    """Prefill side: bootstrap listener, connections, window, pacing and timeouts."""

    host: str = "127.0.0.1"
    """Address the bootstrap listener binds (decode peers connect here)."""
    port: int = 0
    """Bootstrap port; 0 picks a free one (read it back from `KVSender.bootstrap_port`)."""
    connections: int = 4
    """TCP connections each decode peer opens; frames are striped across them."""
    window_bytes: int = 32 * MIB
    """Per-peer in-flight window: payload bytes sent but not yet acknowledged."""
    chunk_bytes: int = 1 * MIB
    """Largest frame payload; a layer larger than this is split into parts."""
    rate_bytes_per_s: float | None = None
    """Token-bucket pacing per peer (None: unpaced)."""
    process_rate_bytes_per_s: float | None = None
    """Token-bucket pacing of the whole process's egress (None: unpaced)."""
    capacity_bytes_per_s: float | None = None
    """Link capacity for telemetry utilisation; defaults to the process rate if set."""
    delay_s: float = 0.0
    """Added one-way delay of every frame (link emulation); does not reduce throughput."""
    pipelined: bool = True
    """False holds every layer until `finish()` (the comparison mode)."""
    register_timeout_s: float = 30.0
    """A room that no decode peer registers within this fails with TransferError."""
    transfer_timeout_s: float = 300.0
    """A room not delivered within this (from `open`) fails with TransferError."""
    peer_timeout_s: float = 10.0
    """A peer with no live connection for this long fails all its transfers."""
    tcp_user_timeout_s: float | None = 20.0
    """Linux TCP_USER_TIMEOUT of data connections: a connection whose sent data stays
    unacknowledged this long is reset (a silent partition), so its frames are re-sent on
    the others instead of stalling the window. None leaves the kernel default."""
    auth_key: bytes = field(default=b"", repr=False)
    """Key of the handshake's HMAC challenge-response (the deployment secret's transport
    key); empty authenticates nothing (any client that speaks the protocol is accepted)."""
    handshake_timeout_s: float = 3.0
    """A new connection must finish HELLO and AUTH within this, else it is closed."""
    max_handshakes: int = 256
    """Connections still in their handshake; a new one beyond this evicts the oldest."""
    max_peers: int = 64
    """Authenticated decode peers at once; a connection from one more is closed."""
    max_parked_rooms: int = 4096
    """REGISTERs for rooms not opened yet (all peers); one more is refused with ABORT."""
    max_control_frames: int = 1024
    """Control frames queued for one peer; past this (a peer that does not read) new ones
    are dropped and counted."""
    idle_timeout_s: float = 60.0
    """An authenticated connection that sent nothing for this long while its peer has no
    room (open or parked) is closed; the receiver reconnects when it needs to."""
    tls: TlsConfig | None = None
    """Serve TLS on the bootstrap port (needs `cert_file` and `key_file`); None: plain TCP.
    The TLS handshake must finish within `handshake_timeout_s` too."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not 1 <= self.connections <= 64:
            raise ValueError(f"connections must be in 1..64, got {self.connections}")
        if not 4096 <= self.chunk_bytes <= 64 * MIB:
            raise ValueError(f"chunk_bytes must be in 4096..{64 * MIB}, got {self.chunk_bytes}")
        if self.window_bytes < self.chunk_bytes:
            raise ValueError(
                f"window_bytes ({self.window_bytes}) must be >= chunk_bytes ({self.chunk_bytes})"
            )
        _optional_rate("rate_bytes_per_s", self.rate_bytes_per_s)
        _optional_rate("process_rate_bytes_per_s", self.process_rate_bytes_per_s)
        _optional_rate("capacity_bytes_per_s", self.capacity_bytes_per_s)
        if not (math.isfinite(self.delay_s) and 0 <= self.delay_s <= 10):
            raise ValueError(f"delay_s must be in [0, 10], got {self.delay_s!r}")
        for name in ("register_timeout_s", "transfer_timeout_s", "peer_timeout_s",
                     "handshake_timeout_s", "idle_timeout_s"):  # fmt: skip
            _positive(name, getattr(self, name))
        _optional_rate("tcp_user_timeout_s", self.tcp_user_timeout_s)
        for name in ("max_handshakes", "max_peers", "max_parked_rooms", "max_control_frames"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.auth_key, bytes):
            raise ValueError("auth_key must be bytes")
        if self.tls is not None and self.tls.cert_file is None:
            raise ValueError("a TLS sender needs tls.cert_file and tls.key_file")

    @property
    def capacity(self) -> float | None:
        """Capacity used for utilisation: explicit, else the process pacing rate."""
        return self.capacity_bytes_per_s or self.process_rate_bytes_per_s


@dataclass(frozen=True)
class ReceiverConfig:
    """Decode side: reconnection, buffering and frame limits."""

    connect_timeout_s: float = 5.0
    """Give up re-establishing a lost connection to a sender after this long."""
    max_buffered_bytes: int = 256 * MIB
    """Reading pauses while delivered-but-unconsumed layer bytes exceed this."""
    max_frame_bytes: int = 64 * MIB
    """Frames announcing a larger payload are a protocol error (garbage protection)."""
    max_message_bytes: int = 8 * 1024 * MIB
    """A message (one layer) announcing more bytes fails its transfer."""
    auth_key: bytes = field(default=b"", repr=False)
    """Key of the handshake (the senders' `auth_key`); a sender whose WELCOME proof does
    not match is never talked to."""
    tls: TlsConfig | None = None
    """Connect to every sender over TLS, verifying its certificate; None: plain TCP."""

    def __post_init__(self) -> None:
        _positive("connect_timeout_s", self.connect_timeout_s)
        if not isinstance(self.auth_key, bytes):
            raise ValueError("auth_key must be bytes")
        if self.max_buffered_bytes < MIB:
            raise ValueError(f"max_buffered_bytes must be >= {MIB}, got {self.max_buffered_bytes}")
        if self.max_message_bytes < self.max_frame_bytes:
            raise ValueError(
                f"max_message_bytes ({self.max_message_bytes}) must be >= max_frame_bytes "
                f"({self.max_frame_bytes})"
            )
        if not 4096 <= self.max_frame_bytes <= 1024 * MIB:
            raise ValueError(
                f"max_frame_bytes must be in 4096..{1024 * MIB}, got {self.max_frame_bytes}"
            )
