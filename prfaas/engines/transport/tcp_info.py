"""Linux TCP socket introspection and tuning: TCP_INFO sampling (RTT, retransmits, delivery
rate of a connected socket) and TCP_USER_TIMEOUT.

Offsets follow `struct tcp_info` in include/uapi/linux/tcp.h. The kernel fills at most the
buffer it is given and at most its own struct size, so fields past the returned length
(older kernels) read as None.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

TCP_INFO_BUFFER = 256
# name -> (offset, struct format); all little-endian on the platforms we run on.
_FIELDS: dict[str, tuple[int, str]] = {
    "state": (0, "B"),
    "ca_state": (1, "B"),
    "retransmits": (2, "B"),
    "rto_us": (8, "I"),
    "snd_mss": (16, "I"),
    "unacked": (24, "I"),
    "lost": (32, "I"),
    "retrans": (36, "I"),
    "rtt_us": (68, "I"),
    "rttvar_us": (72, "I"),
    "snd_cwnd": (80, "I"),
    "total_retrans": (100, "I"),
    "pacing_rate": (104, "Q"),
    "bytes_acked": (120, "Q"),
    "bytes_received": (128, "Q"),
    "segs_out": (136, "I"),
    "segs_in": (140, "I"),
    "notsent_bytes": (144, "I"),
    "min_rtt_us": (148, "I"),
    "delivery_rate": (160, "Q"),
    "bytes_sent": (200, "Q"),
    "bytes_retrans": (208, "Q"),
}
TCP_ESTABLISHED = 1


@dataclass(frozen=True)
class TcpInfo:
    """A TCP_INFO sample. Rates in bytes/s, times in seconds; None where the kernel lacks it.

    `bytes_acked` counts the acknowledged SYN too (RFC 4898), so it is one more than the
    payload bytes acknowledged.
    """

    state: int
    rtt_s: float
    rttvar_s: float
    min_rtt_s: float | None
    rto_s: float
    snd_mss: int
    snd_cwnd: int
    unacked: int
    lost: int
    retransmits_now: int
    total_retrans: int
    segs_out: int
    segs_in: int
    bytes_acked: int | None
    bytes_received: int | None
    bytes_sent: int | None
    bytes_retrans: int | None
    delivery_rate: int | None
    pacing_rate: int | None
    notsent_bytes: int | None


def parse_tcp_info(raw: bytes) -> TcpInfo:
    """Decode a TCP_INFO buffer as returned by getsockopt.

    Raises:
        ValueError: if `raw` is too short to hold the mandatory fields (104 bytes).
    """
    if len(raw) < 104:
        raise ValueError(f"TCP_INFO buffer of {len(raw)} bytes is shorter than 104")
    values: dict[str, int | None] = {}
    for name, (offset, fmt) in _FIELDS.items():
        size = struct.calcsize(fmt)
        values[name] = (
            struct.unpack_from("<" + fmt, raw, offset)[0] if offset + size <= len(raw) else None
        )

    def req(name: str) -> int:
        value = values[name]
        assert value is not None  # the first 104 bytes are always present
        return value

    min_rtt = values["min_rtt_us"]
    return TcpInfo(
        state=req("state"),
        rtt_s=req("rtt_us") / 1e6,
        rttvar_s=req("rttvar_us") / 1e6,
        min_rtt_s=min_rtt / 1e6 if min_rtt is not None else None,
        rto_s=req("rto_us") / 1e6,
        snd_mss=req("snd_mss"),
        snd_cwnd=req("snd_cwnd"),
        unacked=req("unacked"),
        lost=req("lost"),
        retransmits_now=req("retransmits"),
        total_retrans=req("total_retrans"),
        segs_out=values["segs_out"] or 0,
        segs_in=values["segs_in"] or 0,
        bytes_acked=values["bytes_acked"],
        bytes_received=values["bytes_received"],
        bytes_sent=values["bytes_sent"],
        bytes_retrans=values["bytes_retrans"],
        delivery_rate=values["delivery_rate"],
        pacing_rate=values["pacing_rate"],
        notsent_bytes=values["notsent_bytes"],
    )


def sample_tcp_info(sock: socket.socket) -> TcpInfo | None:
    """TCP_INFO of `sock`, or None where unsupported (non-Linux) or the socket is closed."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or sock.fileno() < 0:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, TCP_INFO_BUFFER)
    except OSError:
        return None
    return parse_tcp_info(raw)


def set_user_timeout(sock: socket.socket, timeout_s: float | None) -> bool:
    """Set TCP_USER_TIMEOUT (Linux); returns whether it was applied."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if timeout_s is None or option is None or sock.fileno() < 0:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, int(timeout_s * 1000))
    except OSError:
        return False
    return True
