"""Cross-DC KV transport: layer-wise streaming of numpy arrays over N TCP connections.

Torch-free. Prefill side: `KVSender` + `SendHandle` (thread-safe `send_layer`); decode side:
`KVReceiver` + `Transfer` (async iterator of layers, `complete()`). Frames carry an xxh3-64
checksum; wire format in PROTOCOL.md. Pacing, added delay, TCP_INFO telemetry and optional
TLS (`TlsConfig`) included.

Prefill (one `KVSender` per process, started on the event loop)::

    sender = KVSender(SenderConfig(connections=4))
    await sender.start()                       # bootstrap_port goes into the request
    handle = sender.open(room)                 # before or after the decode side fetches
    # inside the forward pass, on a worker thread, right after layer i:
    handle.send_layer(i, Kind.FULL_KV, {"k": k.numpy(), "v": v.numpy()}, blocks=(0, 8))
    handle.send_aux("meta", orjson.dumps({"first_token": tok}))
    handle.finish()
    await handle.wait()                        # delivered, or TransferError

`ProcessSender` has `KVSender`'s API and runs it in a child process fed through a shared
ring, so that an engine's forward pass never shares the GIL with the sockets.

Decode (one `KVReceiver` per process)::

    transfer = await receiver.fetch(host, bootstrap_port, room, timeout_s=60)
    async for layer, kind, arrays in transfer:  # in send order, each verified
        ...
    result = await transfer.complete()         # remaining layers + every aux payload
"""

from __future__ import annotations

from prfaas.engines.transport.config import ReceiverConfig, SenderConfig
from prfaas.engines.transport.errors import ProtocolError, TransferError
from prfaas.engines.transport.frames import Kind
from prfaas.engines.transport.payload import LayerArrays
from prfaas.engines.transport.process_sender import ProcessSender
from prfaas.engines.transport.receiver import KVReceiver, LayerItem, Transfer, TransferResult
from prfaas.engines.transport.sender import KVSender, SendHandle
from prfaas.engines.transport.tcp_info import TcpInfo, sample_tcp_info
from prfaas.engines.transport.telemetry import ConnectionTelemetry, TransportTelemetry
from prfaas.engines.transport.tls import TlsConfig

__all__ = [
    "ConnectionTelemetry",
    "KVReceiver",
    "KVSender",
    "Kind",
    "LayerArrays",
    "LayerItem",
    "ProcessSender",
    "ProtocolError",
    "ReceiverConfig",
    "SendHandle",
    "SenderConfig",
    "TcpInfo",
    "TlsConfig",
    "Transfer",
    "TransferError",
    "TransferResult",
    "TransportTelemetry",
    "sample_tcp_info",
]
