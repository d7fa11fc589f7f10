"""Decode side of the prfaas backend: learn each prefill rank's transport endpoint, fetch
each room over the transport, and place what arrives in this engine's own pools.

`DecodePlane` belongs to one decode-mode `PrfaasKVManager`. It runs a `KVReceiver` on the
manager's `LoopThread`. A receiver's `send_metadata` calls `start(...)`: once the prefill
rank's `Endpoint` is known (it answers our `Register`), a task fetches the room, places
every layer's pages at this request's page ids and its Mamba state in its slot
(`PagePlacer`, off the loop on a worker thread; on a GPU the pool stages them in pinned
memory and copies them in on its own placing stream), writes SGLang's metadata buffers at
its aux index, checks nothing is missing, waits for the pool's fence taken after the last
placement (every copy into this engine's memory done), and only then marks the room
`Success`. Any failure (the prefill's abort, a timeout, a lost prefill, a bad layout)
marks it `Failed` with the reason, which `failure_exception()` raises.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from prfaas.engines.kv_pages import PageError, PagePlacer, decode_meta, model_layer
from prfaas.engines.sglang.buffers import AuxBuffers, SGLangPool
from prfaas.engines.sglang.loop_thread import LoopThread
from prfaas.engines.sglang.messages import Endpoint
from prfaas.engines.sglang.prefill_plane import AUX
from prfaas.engines.sglang.settings import BackendSettings
from prfaas.engines.transport import KVReceiver, Transfer, TransferError

logger = logging.getLogger(__name__)

RankAddress = tuple[str, int]  # a prefill rank's ZMQ address, as /route gives it


@dataclass
class Fetch:
    """One room to fetch: where its pages, state and metadata go in this engine."""

    room: int
    rank: RankAddress
    page_ids: np.ndarray
    slot: int | None
    aux_index: int | None
    transfer: Transfer | None = None
    arrivals: list[tuple[int, float]] = field(default_factory=list)
    """(model layer, seconds since the fetch started) per received message."""


class DecodePlane:
    """The decode rank's transport and fetches (see the module docstring)."""

    def __init__(
        self,
        mgr: Any,
        pool: SGLangPool,
        aux: AuxBuffers,
        settings: BackendSettings,
        loop: LoopThread,
    ) -> None:
        self.mgr = mgr
        self.pool = pool
        self.aux = aux
        self.settings = settings
        self.loop = loop
        self.receiver = KVReceiver()
        self.endpoints: dict[RankAddress, tuple[str, int] | str] = {}
        self._waiting: dict[RankAddress, list[Fetch]] = {}
        self._fetches: dict[int, Fetch] = {}
        self._lock = threading.Lock()

    def on_endpoint(self, msg: Endpoint) -> None:
        """A prefill rank told us its transport endpoint (or why we cannot pair)."""
        rank = (msg.rank_ip, msg.rank_port)
        with self._lock:
            self.endpoints[rank] = msg.error or (msg.host, msg.port)
            waiting = self._waiting.pop(rank, [])
        for fetch in waiting:
            self._launch(fetch)

    def forget_rank(self, rank: RankAddress) -> None:
        """The prefill rank is gone: its next registration brings a new endpoint."""
        with self._lock:
            self.endpoints.pop(rank, None)

    def start(self, fetch: Fetch) -> None:
        """Fetch `fetch.room` once its prefill rank's endpoint is known."""
        with self._lock:
            self._fetches[fetch.room] = fetch
            if fetch.rank not in self.endpoints:
                self._waiting.setdefault(fetch.rank, []).append(fetch)
                return
        self._launch(fetch)

    def cancel(self, room: int, reason: str) -> None:
        """Stop fetching `room` (the prefill side's transfer fails with `reason`)."""
        with self._lock:
            fetch = self._fetches.pop(room, None)
        if fetch is not None and fetch.transfer is not None:
            self.loop.loop.call_soon_threadsafe(fetch.transfer.cancel, reason)

    def _launch(self, fetch: Fetch) -> None:
        if fetch.room not in self._fetches:  # cleared while waiting for the endpoint
            return
        endpoint = self.endpoints[fetch.rank]
        if isinstance(endpoint, str):
            self._fail(fetch.room, f"prfaas: the prefill rank refused this decode: {endpoint}")
            return
        self.loop.submit(self._fetch(fetch, endpoint))

    async def _fetch(self, fetch: Fetch, endpoint: tuple[str, int]) -> None:
        started = time.perf_counter()
        try:
            transfer = await self.receiver.fetch(
                *endpoint, fetch.room, timeout_s=self.settings.transfer_timeout_s
            )
            fetch.transfer = transfer
            if fetch.room not in self._fetches:  # cancelled while connecting
                transfer.cancel("cancelled by decode")
            table = [int(i) for i in fetch.page_ids]
            slots = {} if fetch.slot is None else dict.fromkeys(self.pool.state_layers, fetch.slot)
            placer = PagePlacer(self.pool, dict.fromkeys(self.pool.page_layers, table), slots)
            async for item in transfer:
                await asyncio.to_thread(placer.place, item)
                fetch.arrivals.append((model_layer(item.layer), time.perf_counter() - started))
            result = await transfer.complete()
            meta = decode_meta(result.aux.get("meta"))
            placer.check_complete(int(meta["num_tokens"]))
            if fetch.aux_index is not None:
                self.aux.write(fetch.aux_index, result.aux[AUX])
            fence = self.pool.fence()  # after the last placement: covers all of this room's
            if not fence.ready():
                await asyncio.to_thread(fence.wait)
        except (TransferError, PageError, ValueError, KeyError) as exc:
            self._fail(fetch.room, f"prfaas transfer failed: {exc}")
            return
        self._log(fetch, result.nbytes, time.perf_counter() - started)
        self.mgr.update_status(fetch.room, KVPoll.Success)

    def _fail(self, room: int, reason: str) -> None:
        self.mgr.fail_room(room, reason)

    @staticmethod
    def _log(fetch: Fetch, nbytes: int, seconds: float) -> None:
        layers = " ".join(f"{layer}:{t * 1e3:.2f}" for layer, t in fetch.arrivals)
        logger.info(
            "prfaas transfer room=%d bytes=%d ms=%.2f layer_ms=[%s]",
            fetch.room,
            nbytes,
            seconds * 1e3,
            layers,
        )

    def finished(self, room: int) -> None:
        """SGLang cleared the room: forget it (a fetch still running is cancelled)."""
        self.cancel(room, "cleared by decode")
