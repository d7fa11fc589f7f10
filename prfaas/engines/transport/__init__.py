"""Cross-DC KV transport: layer-wise streaming of numpy arrays over N TCP connections.

Torch-free. Prefill side: `KVSender` + `SendHandle` (thread-safe `send_layer`); decode side:
`KVReceiver` + `Transfer` (async iterator of layers, `complete()`). Frames carry an xxh3-64
checksum; wire format in PROTOCOL.md. Pacing, added delay and TCP_INFO telemetry included.
"""

from __future__ import annotations

from prfaas.engines.transport.config import ReceiverConfig, SenderConfig
from prfaas.engines.transport.errors import ProtocolError, TransferError
from prfaas.engines.transport.frames import Kind
from prfaas.engines.transport.payload import LayerArrays
from prfaas.engines.transport.receiver import KVReceiver, LayerItem, Transfer, TransferResult
from prfaas.engines.transport.sender import KVSender, SendHandle
from prfaas.engines.transport.tcp_info import TcpInfo, sample_tcp_info
from prfaas.engines.transport.telemetry import ConnectionTelemetry, TransportTelemetry

__all__ = [
    "ConnectionTelemetry",
    "KVReceiver",
    "KVSender",
    "Kind",
    "LayerArrays",
    "LayerItem",
    "ProtocolError",
    "ReceiverConfig",
    "SendHandle",
    "SenderConfig",
    "TcpInfo",
    "Transfer",
    "TransferError",
    "TransferResult",
    "TransportTelemetry",
    "sample_tcp_info",
]
