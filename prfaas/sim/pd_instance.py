"""A simulated PD-cluster instance that can switch between prefill and decode.

The PD cluster is homogeneous, so any of its instances can prefill or decode; the role is a
setting. `SimulatedPDInstance` holds one simulated engine of each kind for its hardware and
hands each new call to the one of its current role. `set_role` is the simulated role API:
with `drain` (like the reference engine's `POST /admin/role`) it waits until every call it
holds has ended, then switches; without, it switches at once and the old role's calls
finish beside the new role's (the free conversion of an idealised oracle). Switching away
from prefill drops the prefix cache (the index is told), so routing never counts blocks an
instance cannot prefill from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from prfaas.engine_clients.base import (
    BaseEngineClient,
    EngineCall,
    EngineError,
    EngineInfo,
    EngineStats,
    Role,
)
from prfaas.protocol.generate import GenerateRequest
from prfaas.protocol.kv_events import KVEvent
from prfaas.sim.engines import SimulatedDecodeEngine, SimulatedPrefillEngine


class SimulatedPDInstance(BaseEngineClient):
    """A switchable PD instance (see the module docstring). Mutated by `set_role`."""

    def __init__(
        self,
        instance_id: str,
        role: Role,
        *,
        prefill: SimulatedPrefillEngine,
        decode: SimulatedDecodeEngine,
        publish: Callable[[str, Sequence[KVEvent]], None],
        drain: bool = True,
    ) -> None:
        if role == "both":
            raise ValueError(f"{instance_id}: a simulated PD instance is prefill or decode")
        self.instance_id = instance_id
        self.role: Role = role
        self.prefill, self.decode = prefill, decode
        self.drain = drain
        self.switches = 0
        self._publish = publish
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    prefix_pull = True

    async def export_prefix(
        self, input_ids: Sequence[int], room: int, tokens: int | None = None
    ) -> int:
        """What its prefill engine caches (dropped when it stopped prefilling)."""
        return await self.prefill.export_prefix(input_ids, room, tokens)

    def generate(self, request: GenerateRequest) -> EngineCall:
        engine = self.prefill if self.role == "prefill" else self.decode
        call = engine.generate(request)
        self._active += 1
        self._idle.clear()
        call.ended.add_done_callback(self._ended)
        return call

    def _ended(self, _: asyncio.Future[None]) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    @property
    def active(self) -> int:
        """Calls started and not yet ended."""
        return self._active

    async def set_role(self, role: Role, *, timeout_s: float = 300.0, epoch: int = 0) -> float:
        """The simulated role API (one simulated gateway: `epoch` is not fenced)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        if role == "both":
            raise ValueError(f"{self.instance_id}: a simulated PD instance is prefill or decode")
        if self.drain:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
            except TimeoutError:
                raise EngineError(f"{self.instance_id}: did not drain in {timeout_s:g} s") from None
        if role != self.role:
            if self.role == "prefill":
                self._publish(self.instance_id, self.prefill.cache.clear())
            self.role = role
            self.switches += 1
        return loop.time() - start

    async def stats(self) -> EngineStats:
        engine = self.prefill if self.role == "prefill" else self.decode
        return await engine.stats()

    async def info(self) -> EngineInfo:
        if self.role == "prefill":
            return await self.prefill.info()
        return await self.decode.info()
