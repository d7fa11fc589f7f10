"""Helpers for the transport tests: random layers, a frame-aware TCP proxy, free ports, TLS
configurations of a throwaway CA."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prfaas.engines.transport import (
    Kind,
    KVReceiver,
    KVSender,
    ProcessSender,
    ReceiverConfig,
    SenderConfig,
    TlsConfig,
)
from prfaas.engines.transport.frames import HEADER_SIZE, Header, unpack_header
from prfaas.testing.tls_certs import CertAuthority

BIG = 1 << 30

# (dtype, shape) of the arrays each test layer carries; bf16 travels as uint16 bits.
SPECS: list[tuple[str, tuple[int, ...]]] = [
    ("float16", (4, 16, 2, 8)),
    ("uint16", (3, 7)),
    ("float32", (5, 33)),
    ("int64", (17,)),
    ("int8", (2, 3, 4)),
    ("bool", (9,)),
    ("float64", ()),
    ("int32", (0, 4)),
]


def random_arrays(rng: np.random.Generator, scale: int = 1) -> dict[str, np.ndarray]:
    """One array of each dtype/shape in SPECS (first dim scaled), with random contents."""
    arrays = {}
    for i, (dtype, shape) in enumerate(SPECS):
        shape = (shape[0] * scale, *shape[1:]) if shape else shape
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize)
        arrays[f"a{i}"] = raw.astype(np.uint8).view(dtype).reshape(shape)
    return arrays


def layer_kind(layer: int) -> Kind:
    """A hybrid pattern: every 4th layer full attention, the others linear state."""
    return Kind.FULL_KV if layer % 4 == 3 else Kind.LINEAR_STATE


def assert_same(a: dict[str, np.ndarray], b: object) -> None:
    """Bit-exact equality of two name -> array mappings (dtype, shape and bytes)."""
    assert isinstance(b, dict) or hasattr(b, "keys")
    assert list(a) == list(b)  # type: ignore[call-overload]
    for name, array in a.items():
        got = b[name]  # type: ignore[index]
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == array.tobytes(), name


def tls_configs(directory: Path) -> tuple[TlsConfig, TlsConfig]:
    """(sender, receiver) TLS of a throwaway CA in `directory`: the sender serves a
    certificate for 127.0.0.1, the receiver trusts the CA."""
    ca = CertAuthority.create(directory)
    cert = ca.issue("prefill")
    return TlsConfig(cert.cert, cert.key), TlsConfig(ca_file=ca.cert)


@dataclass
class Pair:
    """A started sender and a receiver, closed by the fixture."""

    sender: KVSender | ProcessSender
    receiver: KVReceiver

    @property
    def port(self) -> int:
        return self.sender.bootstrap_port


async def make_pair(
    sender: SenderConfig | None = None,
    receiver: ReceiverConfig | None = None,
    *,
    process: bool = False,
) -> Pair:
    """Start a sender (on an ephemeral loopback port; with `process`, a `ProcessSender`) and
    make a receiver."""
    config = sender or SenderConfig()
    kv_sender = ProcessSender(config) if process else KVSender(config)
    await kv_sender.start()
    return Pair(kv_sender, KVReceiver(receiver or ReceiverConfig()))


# A mutation sees each sender->receiver frame (header, raw bytes) and returns the bytes to
# forward and whether to close the connection afterwards.
Mutation = Callable[[Header, bytes], tuple[bytes, bool]]


@dataclass
class FrameProxy:
    """A TCP proxy between receiver and sender that can rewrite sender->receiver frames."""

    target_port: int
    mutate: Mutation
    server: asyncio.Server | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    connections: int = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [c_writer, s_writer]
        up = asyncio.create_task(_pump_raw(c_reader, s_writer))
        down = asyncio.create_task(self._pump_frames(s_reader, c_writer))
        self.tasks |= {up, down}
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for writer in (c_writer, s_writer):
            writer.close()

    async def _pump_frames(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, OSError):
            while True:
                head = await reader.readexactly(HEADER_SIZE)
                header = unpack_header(head, BIG)
                raw = head + await reader.readexactly(header.length)
                data, close = self.mutate(header, raw)
                writer.write(data)
                await writer.drain()
                if close:
                    return

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.close()
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _pump_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `predicate` on the loop until true (or fail after timeout_s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
