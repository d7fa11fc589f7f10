"""TCP_INFO parsing, checked against a real loopback connection and a synthetic buffer."""

from __future__ import annotations

import socket
import struct
import sys

import pytest
from transport_helpers import eventually, make_pair

from prfaas.engines.transport import SenderConfig
from prfaas.engines.transport.tcp_info import (
    TCP_ESTABLISHED,
    parse_tcp_info,
    sample_tcp_info,
    set_user_timeout,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO is Linux-only")


def _connected_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


def test_real_socket_counters_match_the_bytes_we_moved() -> None:
    """bytes_acked/bytes_sent (u64 at offsets 120/200) equal what we sent, bytes_received
    (128) what the peer got; the state is ESTABLISHED and RTT/MSS are sane."""
    server, client, accepted = _connected_pair()
    try:
        payload = b"x" * 300_000
        client.sendall(payload)
        got = 0
        while got < len(payload):
            got += len(accepted.recv(1 << 20))
        accepted.sendall(b"y" * 1000)  # makes the client's bytes surely acked
        assert client.recv(1000)
        info = sample_tcp_info(client)
        peer = sample_tcp_info(accepted)
        assert info is not None and peer is not None
        assert info.state == TCP_ESTABLISHED
        # Linux counts the acknowledged SYN in bytes_acked (RFC 4898 semantics).
        assert info.bytes_acked == len(payload) + 1 and info.bytes_sent == len(payload)
        assert info.bytes_received is not None and 1 <= info.bytes_received <= 1000
        assert peer.bytes_received == len(payload)
        assert info.total_retrans == 0 and info.bytes_retrans == 0
        assert 0 < info.rtt_s < 1.0 and info.snd_mss > 0 and info.snd_cwnd > 0
        assert info.segs_out >= len(payload) // 65536
        assert info.delivery_rate is not None and info.delivery_rate > 0
    finally:
        for sock in (client, accepted, server):
            sock.close()


def test_closed_socket_samples_none() -> None:
    sock = socket.socket()
    sock.close()
    assert sample_tcp_info(sock) is None


def test_synthetic_buffer_fields_at_documented_offsets() -> None:
    """Every field reads from its offset in struct tcp_info; short buffers give None."""
    raw = bytearray(232)
    raw[0], raw[2] = 1, 3
    struct.pack_into("<I", raw, 68, 1500)  # rtt us
    struct.pack_into("<I", raw, 72, 250)  # rttvar
    struct.pack_into("<I", raw, 100, 42)  # total_retrans
    struct.pack_into("<Q", raw, 120, 2**40 + 5)  # bytes_acked
    struct.pack_into("<I", raw, 136, 999)  # segs_out
    struct.pack_into("<Q", raw, 160, 123456789)  # delivery_rate
    struct.pack_into("<Q", raw, 208, 77)  # bytes_retrans
    info = parse_tcp_info(bytes(raw))
    assert (info.state, info.retransmits_now, info.total_retrans) == (1, 3, 42)
    assert (info.rtt_s, info.rttvar_s) == (0.0015, 0.00025)
    assert (info.bytes_acked, info.segs_out, info.delivery_rate, info.bytes_retrans) == (
        2**40 + 5,
        999,
        123456789,
        77,
    )
    old_kernel = parse_tcp_info(bytes(raw[:104]))
    assert old_kernel.total_retrans == 42 and old_kernel.bytes_acked is None
    assert old_kernel.delivery_rate is None
    with pytest.raises(ValueError, match="shorter than 104"):
        parse_tcp_info(bytes(50))


def test_user_timeout_is_applied() -> None:
    server, client, accepted = _connected_pair()
    try:
        assert set_user_timeout(client, 2.5)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500
        assert not set_user_timeout(client, None)
    finally:
        for sock in (client, accepted, server):
            sock.close()


async def test_sender_connections_carry_the_user_timeout() -> None:
    pair = await make_pair(SenderConfig(tcp_user_timeout_s=7.0))
    try:
        await pair.receiver.fetch("127.0.0.1", pair.port, 1, timeout_s=5)
        await eventually(lambda: bool(pair.sender._peers))
        peer = next(iter(pair.sender._peers.values()))
        await eventually(lambda: len(peer.connections) == 4)
        for conn in peer.connections.values():
            sock = conn.writer.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 7000
    finally:
        await pair.receiver.close()
        await pair.sender.close()
