"""The engine side of the prefill -> decode KV hand-off, and an in-process implementation.

A prefill engine opens an `Outbox` per request (keyed by SGLang's `bootstrap_room`) and pushes
each layer's arrays the moment the layer finishes (`send_copy` is thread-safe and does not wait
for a device copy: it is called from inside the forward pass), then the meta (the first
token), then `finish()`. A decode engine `fetch`es the room from the prefill engine's
bootstrap address and gets every layer in the order sent. `transport.py` adapts the cross-DC
TCP transport to this interface; `InProcessHub` connects engines living in one process
(tests).

Layer kinds: `FULL_KV` carries `{"k", "v"}` for the block range `blocks` of a full-attention
layer (MLA: the compressed latents); `LINEAR_STATE` carries `{"conv", "rec"}` of a linear layer.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import orjson

from prfaas.engines.kv_pages import META, HostCopy

_T = TypeVar("_T")

FULL_KV = "full_kv"
LINEAR_STATE = "linear_state"


class HandoffError(Exception):
    """A hand-off failed: aborted, timed out, or the peer was lost."""


@dataclass(frozen=True)
class ReceivedLayer:
    """One layer's arrays as sent; `blocks` is the [start, end) block range of a FULL_KV."""

    layer: int
    kind: str
    arrays: Mapping[str, np.ndarray]
    blocks: tuple[int, int] | None = None


@dataclass(frozen=True)
class Received:
    """A complete hand-off: layers in the order sent and aux payloads by name."""

    layers: tuple[ReceivedLayer, ...]
    aux: Mapping[str, bytes]


class Outbox(Protocol):
    """Prefill side of one room. All methods but `wait` are thread-safe and return at once."""

    def send_layer(
        self,
        layer: int,
        kind: str,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        """Queue one layer's arrays; do not modify them until `wait()` returns."""

    def send_copy(
        self, layer: int, kind: str, copy: HostCopy, *, blocks: tuple[int, int] | None = None
    ) -> None:
        """Queue one layer's arrays being copied to the host; they go once the copy is done."""

    def send_meta(self, meta: Mapping[str, Any]) -> None:
        """Queue the JSON meta (aux `meta`), ordered with the layers."""

    def finish(self) -> None:
        """No more messages."""

    def abort(self, reason: str) -> None:
        """Give up; the decode side's fetch raises `HandoffError(reason)`."""

    async def wait(self) -> None:
        """Return once the decode side has everything. Raises `HandoffError`."""


class HandoffSender(Protocol):
    """One per prefill engine: the bootstrap endpoint decode engines fetch from."""

    async def start(self) -> None: ...

    @property
    def bootstrap_port(self) -> int: ...

    def open(self, room: int) -> Outbox:
        """Start the transfer of `room`. Raises ValueError if the room is already open."""

    async def close(self) -> None: ...


class HandoffReceiver(Protocol):
    """One per decode engine."""

    async def fetch(self, host: str, port: int, room: int, *, timeout_s: float) -> Received:
        """Everything the prefill side sent for `room`. Raises `HandoffError`."""

    async def close(self) -> None: ...


@dataclass
class _Room:
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Future[Received]
    delivered: asyncio.Future[None]
    layers: list[ReceivedLayer] = field(default_factory=list)
    aux: dict[str, bytes] = field(default_factory=dict)
    opened: bool = False
    closed: bool = False
    aborted: bool = False


class InProcessHub:
    """Connects in-process senders and receivers by (port, room); one event loop."""

    def __init__(self) -> None:
        self._ports = itertools.count(1)
        self._rooms: dict[tuple[int, int], _Room] = {}
        self._lock = threading.Lock()

    def room(self, port: int, room: int) -> _Room:
        """The shared record of a room, created on first use by either side."""
        with self._lock:
            key = (port, room)
            if key not in self._rooms:
                loop = asyncio.get_running_loop()
                self._rooms[key] = _Room(loop, loop.create_future(), loop.create_future())
            return self._rooms[key]

    def next_port(self) -> int:
        return next(self._ports)

    def forget(self, port: int, room: int) -> None:
        with self._lock:
            self._rooms.pop((port, room), None)


class InProcessOutbox:
    """`Outbox` over an `InProcessHub` room; arrays are copied when sent. Once aborted,
    sends are dropped (a request given up while its forward pass runs), as over the
    transport."""

    def __init__(self, room: _Room) -> None:
        self._room = room
        self._lock = threading.Lock()

    def send_layer(
        self,
        layer: int,
        kind: str,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        copied = {name: np.array(a, copy=True) for name, a in arrays.items()}
        with self._lock:
            if self._check_open():
                self._room.layers.append(ReceivedLayer(layer, kind, copied, blocks))

    def send_copy(
        self, layer: int, kind: str, copy: HostCopy, *, blocks: tuple[int, int] | None = None
    ) -> None:
        self.send_layer(layer, kind, copy.arrays(), blocks=blocks)

    def send_meta(self, meta: Mapping[str, Any]) -> None:
        with self._lock:
            if self._check_open():
                self._room.aux[META] = orjson.dumps(dict(meta))

    def finish(self) -> None:
        with self._lock:
            if not self._check_open():
                return
            self._room.closed = True
            result = Received(tuple(self._room.layers), dict(self._room.aux))
        self._room.loop.call_soon_threadsafe(_settle, self._room.ready, result, None)

    def abort(self, reason: str) -> None:
        with self._lock:
            self._room.closed = self._room.aborted = True
        self._room.loop.call_soon_threadsafe(_fail, self._room, HandoffError(reason))

    async def wait(self) -> None:
        await self._room.delivered

    def _check_open(self) -> bool:
        """Whether to send: False once aborted.

        Raises:
            ValueError: after `finish`.
        """
        if self._room.aborted:
            return False
        if self._room.closed:
            raise ValueError("hand-off already finished")
        return True


def _settle(fut: asyncio.Future[_T], result: _T, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _fail(room: _Room, error: HandoffError) -> None:
    for fut in (room.ready, room.delivered):
        if not fut.done():
            fut.set_exception(error)
            fut.exception()  # retrieved: either side may be gone (a crash), never awaiting it


class InProcessSender:
    """`HandoffSender` over an `InProcessHub`; its port is a hub-local number."""

    def __init__(self, hub: InProcessHub) -> None:
        self._hub = hub
        self._port = 0

    async def start(self) -> None:
        self._port = self._hub.next_port()

    @property
    def bootstrap_port(self) -> int:
        return self._port

    def open(self, room: int) -> InProcessOutbox:
        shared = self._hub.room(self._port, room)
        if shared.opened:
            raise ValueError(f"room {room} is already open")
        shared.opened = True
        return InProcessOutbox(shared)

    async def close(self) -> None:
        return None


class InProcessReceiver:
    """`HandoffReceiver` over an `InProcessHub` (the host is ignored)."""

    def __init__(self, hub: InProcessHub) -> None:
        self._hub = hub

    async def fetch(self, host: str, port: int, room: int, *, timeout_s: float) -> Received:
        shared = self._hub.room(port, room)
        try:
            result = await asyncio.wait_for(asyncio.shield(shared.ready), timeout_s)
        except TimeoutError as exc:
            raise HandoffError(f"room {room}: no hand-off within {timeout_s} s") from exc
        finally:
            self._hub.forget(port, room)
        _settle(shared.delivered, None, None)
        return result

    async def close(self) -> None:
        return None
