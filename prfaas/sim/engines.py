"""Simulated engine instances behind the real engine-client interface, timed by a profile.

These are the stand-ins for what cannot run here (paper-scale GPU clusters); every class is
named `Simulated*` and every number they produce is simulated, never a measurement. They
read time only through the running loop, so on `VirtualClockLoop` an hour runs in seconds.

- `SimulatedPrefillEngine`: one request computes at a time, FIFO, for `T_prefill(l)` with
  `l` the incremental (uncached) length found in its own prefix cache at start. Its KV,
  `S_kv(l)` bytes, goes over its `SimLink` to the decode instance layer-wise during the
  prefill (or all at once after it when not pipelined). The instance takes its next request
  once its KV has been delivered: that is what makes a non-pipelined instance take T + S/B
  per request (the paper's harmonic loss) and a pipelined one max(T, S/B). The computed
  blocks enter its `SimPrefixCache`, whose `BlockStored`/`BlockRemoved` events go to the
  gateway's real KV index through `publish`.
- `SimulatedDecodeEngine`: `BS_max` slots; a request takes a slot once its KV has arrived
  (through the bootstrap room), then emits one token per `T_decode`. It streams two chunks:
  the first token, then the rest at completion (per-token chunks would cost a million loop
  events per simulated hour and add nothing the timing model does not already say).
- `SimRooms`: the bootstrap rendezvous, room -> when the KV is delivered and what hit.

Both compute on `Cores` (`prfaas.sim.cores`): their own (the profile's times as they are), or
one machine's shared with the other engines, as the embedded deployment's are.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from prfaas.engine_clients.base import (
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineStats,
    QueuedCall,
)
from prfaas.policies.tables import PiecewiseLinear
from prfaas.protocol.generate import GenerateChunk, GenerateRequest
from prfaas.protocol.kv_events import KVEvent
from prfaas.sim.cache import SimPrefixCache
from prfaas.sim.cores import Cores, DedicatedCores
from prfaas.sim.link import SimLink

SIM_TOKEN = 0  # the token id every simulated output token carries
MIN_PREFILL_TOKENS = 1  # a fully cached prompt still computes its last token


class _TaskCall(QueuedCall):
    """A simulated call: its output generator runs in a task on the (virtual) loop."""

    def __init__(self, instance_id: str, chunks: AsyncGenerator[GenerateChunk, None]) -> None:
        super().__init__()
        self._instance_id = instance_id
        self._task = self._loop.create_task(self._run(chunks))

    async def _run(self, chunks: AsyncGenerator[GenerateChunk, None]) -> None:
        try:
            async for chunk in chunks:
                self.push(chunk)
        except EngineError as exc:
            self.finish(exc)
        except Exception as exc:
            self.finish(EngineError(f"{self._instance_id}: {exc!r}"))
        else:
            self.finish()

    def _stop(self) -> None:
        self._task.cancel()


@dataclass
class _Room:
    delivered: asyncio.Future[None]
    cached_tokens: int = 0


class SimRooms:
    """Bootstrap rooms: the prefill side resolves, the decode side awaits, either first."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._rooms: dict[int, _Room] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room: int) -> _Room:
        """The room's state, created by whichever side asks first."""
        if room not in self._rooms:
            self._rooms[room] = _Room(self._loop.create_future())
        return self._rooms[room]

    def discard(self, room: int) -> None:
        """Forget a room once its decode side is done with it."""
        self._rooms.pop(room, None)


@dataclass
class StageCounters:
    """What one simulated instance did (for per-stage throughput)."""

    completed: int = 0
    busy_s: float = 0.0
    tokens: int = 0
    cached_tokens: int = 0
    kv_bytes: float = 0.0
    prefix_fetches: int = 0


@dataclass(frozen=True)
class PrefillTiming:
    """What a simulated prefill instance needs from the profile."""

    prefill_s: PiecewiseLinear
    kv_bytes: PiecewiseLinear
    pipelined: bool = True


"""Where a longer cached prefix of a prompt sits in the other cluster: (tokens, the link to
fetch it over), or None."""


class _SimulatedInstance(BaseEngineClient):
    """What both simulated instances share: each call runs as a task on the loop, a PD
    request needs a bootstrap room, load is what waits and what runs."""

    role: ClassVar[str]
    _waiting: int
    _running: int

    def generate(self, request: GenerateRequest) -> EngineCall:
        return _TaskCall(self.instance_id, self._call(request))

    async def _call(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        if request.bootstrap is None:
            raise EngineError(
                f"{self.instance_id}: a {self.role} request needs a bootstrap room", status=400
            )
        async for chunk in self._generate(request, request.bootstrap.room):
            yield chunk

    @abstractmethod
    def _generate(self, request: GenerateRequest, room: int) -> AsyncGenerator[GenerateChunk, None]:
        """The call's output for a request in bootstrap room `room`."""

    async def stats(self) -> EngineStats:
        return EngineStats(waiting=self._waiting, running=self._running)


class SimulatedPrefillEngine(_SimulatedInstance):
    """A simulated prefill instance (see the module docstring).

    A request the Router gave a prefix pull (`GenerateRequest.prefix_pull`: the
    bandwidth-abundant regime, where the pull was predicted to beat the recompute) first
    pulls that prefix's KV, `S_kv(prefix_tokens)` bytes, over `pull_link` (from the other
    cluster), then computes only the rest. The whole prefix: a real export sends every
    block from the first and the linear states at its end, whatever the puller caches
    (`benchmarks/prefix_pull.py` measured the pull at S_kv(n) within 0.2%, and its time at
    1.02-1.04x bytes / rate from 2K tokens). As a pull's source it exports at once (the
    puller's transfer is the pull's time).
    """

    role = "prefill"
    prefix_pull = True

    def __init__(
        self,
        instance_id: str,
        *,
        timing: PrefillTiming,
        link: SimLink,
        cache: SimPrefixCache,
        rooms: SimRooms,
        publish: Callable[[str, Sequence[KVEvent]], None],
        pull_link: SimLink | None = None,
        cores: Cores | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.timing, self.link, self.cache, self.rooms = timing, link, cache, rooms
        self.cores = DedicatedCores() if cores is None else cores
        self._publish = publish
        self._pull_link = pull_link
        self._slot = asyncio.Semaphore(1)
        self._waiting = 0
        self._running = 0
        self.counters = StageCounters()

    async def _generate(
        self, request: GenerateRequest, room_id: int
    ) -> AsyncGenerator[GenerateChunk, None]:
        room = self.rooms.get(room_id)
        try:
            cached = await self._run(request, room)
        except (Exception, asyncio.CancelledError) as exc:
            _fail_room(room, self.instance_id, exc)
            raise
        yield GenerateChunk((SIM_TOKEN,), "", len(request.input_ids), 1, cached)

    async def _run(self, request: GenerateRequest, room: _Room) -> int:
        self._waiting += 1
        try:
            await self._slot.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            return await self._compute_and_send(request, room)
        finally:
            self._running -= 1
            self._slot.release()

    async def _compute_and_send(self, request: GenerateRequest, room: _Room) -> int:
        loop = asyncio.get_running_loop()
        start = loop.time()
        ids = request.input_ids
        keys = self.cache.keys(ids)
        cached = await self._fetch_prefix(request, self.cache.match(keys) * self.cache.block_size)
        tokens = max(len(ids) - cached, MIN_PREFILL_TOKENS)
        compute_s = float(self.timing.prefill_s(tokens))
        nbytes = float(self.timing.kv_bytes(len(ids)))  # the decode gets the whole prompt's KV
        sent: asyncio.Future[None] | None = None
        if self.timing.pipelined:  # produced at the speed the cores give it now
            produce_s = self.cores.expected_s(self.instance_id, compute_s)
            sent = self.link.transfer(nbytes, produce_s=produce_s)
        await self.cores.compute(self.instance_id, compute_s)
        self._publish(self.instance_id, self.cache.store(ids, keys))
        if sent is None:
            sent = self.link.transfer(nbytes)
        room.cached_tokens = cached
        await asyncio.shield(sent)
        if not room.delivered.done():
            room.delivered.set_result(None)
        self._count(loop.time() - start, len(ids), cached, nbytes)
        return cached

    async def _fetch_prefix(self, request: GenerateRequest, cached: int) -> int:
        """Pull the prefix the Router asked for, if longer than what is cached here; the
        tokens now cached."""
        wanted = request.prefix_tokens
        if request.prefix_pull is None or self._pull_link is None or wanted <= cached:
            return cached
        await asyncio.shield(self._pull_link.transfer(float(self.timing.kv_bytes(wanted))))
        self.counters.prefix_fetches += 1
        return wanted

    async def export_prefix(
        self, input_ids: Sequence[int], room: int, tokens: int | None = None
    ) -> int:
        """The longest prefix of `input_ids` cached here (the puller charges the transfer)."""
        return self.cache.match(self.cache.keys(input_ids)) * self.cache.block_size

    def _count(self, busy_s: float, tokens: int, cached: int, nbytes: float) -> None:
        c = self.counters
        c.completed += 1
        c.busy_s += busy_s
        c.tokens += tokens
        c.cached_tokens += cached
        c.kv_bytes += nbytes

    async def info(self) -> EngineInfo:
        page = self.cache.block_size
        return EngineInfo("prefill", page, self.instance_id, 0, "simulated")


def _fail_room(room: _Room, instance_id: str, exc: BaseException) -> None:
    """Tell a waiting decode side that its KV will never come."""
    if room.delivered.done():
        return
    error = (
        exc
        if isinstance(exc, EngineError)
        else EngineError(f"{instance_id}: prefill aborted: {exc!r}")
    )
    room.delivered.set_exception(error)
    room.delivered.exception()  # the decode side may be gone already: mark it retrieved


class SimulatedDecodeEngine(_SimulatedInstance):
    """A simulated decode instance: `batch_max` slots, `step_s` per token per slot (at the
    speed its `cores` give it)."""

    role = "decode"

    def __init__(
        self,
        instance_id: str,
        *,
        batch_max: int,
        step_s: float,
        rooms: SimRooms,
        page_size: int,
        cores: Cores | None = None,
    ) -> None:
        if batch_max < 1 or not step_s > 0:
            raise ValueError(
                f"{instance_id}: need batch_max >= 1 and step_s > 0, got {batch_max}, {step_s}"
            )
        self.instance_id = instance_id
        self.step_s, self.rooms, self.page_size = step_s, rooms, page_size
        self.batch_max = batch_max
        self.cores = DedicatedCores() if cores is None else cores
        self._slots = asyncio.Semaphore(batch_max)
        self._waiting = 0
        self._running = 0
        self.counters = StageCounters()

    async def _generate(
        self, request: GenerateRequest, room_id: int
    ) -> AsyncGenerator[GenerateChunk, None]:
        room = self.rooms.get(room_id)
        try:
            await room.delivered
        finally:
            self.rooms.discard(room_id)
        async with self._slot():
            async for chunk in self._decode(request, room.cached_tokens):
                yield chunk

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncGenerator[None, None]:
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._slots.release()

    async def _decode(
        self, request: GenerateRequest, cached: int
    ) -> AsyncGenerator[GenerateChunk, None]:
        n, prompt = request.sampling.max_new_tokens, len(request.input_ids)
        start = asyncio.get_running_loop().time()
        await self.cores.compute(self.instance_id, self.step_s)
        yield GenerateChunk((SIM_TOKEN,), "", prompt, 1, cached, "length" if n == 1 else None)
        if n > 1:
            await self.cores.compute(self.instance_id, self.step_s * (n - 1))
            yield GenerateChunk((SIM_TOKEN,) * (n - 1), "", prompt, n, cached, "length")
        c = self.counters
        c.completed += 1
        c.tokens += n
        c.busy_s += asyncio.get_running_loop().time() - start

    async def info(self) -> EngineInfo:
        return EngineInfo("decode", self.page_size, model="simulated")
