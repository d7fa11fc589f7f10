"""Prefill side of the prfaas backend: the transport sender, the rooms, and what SGLang's
control messages and `send()` calls do to them.

`PrefillPlane` belongs to one prefill-mode `PrfaasKVManager` (one per scheduler rank). It
runs a `KVSender` on the manager's `LoopThread`; answers a decode's `Register` with that
sender's endpoint; opens a room's `SendHandle` once the decode's `Metadata` arrived (the
room is then `WaitingForInput`); ships pages per layer (`ship_pages`, from the forward
hook and from `send()`), and with the last chunk the Mamba states, SGLang's metadata
buffers and our meta; and turns the handle's outcome into the room's `KVPoll` state.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll

from prfaas.engines.kv_pages import LayerSink
from prfaas.engines.sglang.buffers import AuxBuffers, KVLayout, SGLangPool
from prfaas.engines.sglang.loop_thread import LoopThread
from prfaas.engines.sglang.messages import Endpoint, Metadata, Register
from prfaas.engines.sglang.settings import BackendSettings
from prfaas.engines.sglang.shipping import PrefillRoom, Shipper
from prfaas.engines.transport import Kind, KVSender, SenderConfig

logger = logging.getLogger(__name__)

AUX = "sglang_aux"  # the aux message carrying SGLang's metadata buffers


class PrefillPlane:
    """The prefill rank's transport and rooms (see the module docstring).

    `mgr` is the owning `PrfaasKVManager` (a `CommonKVManager`): its `update_status`,
    `record_failure`, `transfer_infos` and ZMQ sending are SGLang's own.
    """

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
        self.loop = loop
        host = settings.bind_host or mgr.local_ip
        self.sender = KVSender(
            SenderConfig(
                host=host,
                connections=settings.connections,
                transfer_timeout_s=settings.transfer_timeout_s,
                register_timeout_s=settings.transfer_timeout_s,
                rate_bytes_per_s=settings.rate_bytes_per_s or None,
            )
        )
        loop.run(self.sender.start())
        self.endpoint = (host, self.sender.bootstrap_port)
        self.layout = pool.layout(aux.item_lens)
        self.rooms: dict[int, PrefillRoom] = {}
        self._lock = threading.Lock()
        self.shipper = Shipper(pool.device)

    # -- control messages (the manager's ZMQ thread) --------------------------------------

    def on_register(self, msg: Register) -> None:
        """Answer a decode rank with our transport endpoint, or why we cannot serve it."""
        error = KVLayout.from_json(msg.layout).mismatch(self.layout) or ""
        if error:
            logger.error(
                "prfaas: decode %s:%s cannot pair: %s", msg.decode_ip, msg.decode_port, error
            )
        reply = Endpoint(self.mgr.local_ip, self.mgr.rank_port, *self.endpoint, error=error)
        self.mgr.send_to(msg.decode_ip, msg.decode_port, reply.to_zmq())

    def on_metadata(self, msg: Metadata) -> None:
        """A decode rank allocated the room: once all expected ranks did, it is bootstrapped."""
        infos = self.mgr.transfer_infos.setdefault(msg.room, {})
        infos[(msg.decode_ip, msg.decode_port)] = msg
        if len(infos) < msg.required_dst_info_num:
            return
        self.mgr.req_to_decode_prefix_len[msg.room] = msg.decode_prefix_len
        self.mgr.resolve_kv_replica_factor(infos)  # MLA: SGLang's transfer metrics need it
        real = [m for m in infos.values() if not m.is_dummy]
        if len(real) > 1:
            self.mgr.fail_room(msg.room, "prfaas: one decode rank per prefill rank only")
            return
        if real:
            self._open(real[0])
        self.mgr.update_status(msg.room, KVPoll.WaitingForInput)

    def on_abort(self, room: int, reason: str) -> None:
        """The decode side gave up the room (or the prefill did): fail it on both sides."""
        self.mgr.fail_room(room, reason)
        self.forget(room, reason)

    def _open(self, msg: Metadata) -> None:
        with self._lock:
            if msg.room in self.rooms:
                return
            handle = self.sender.open(msg.room)
            self.rooms[msg.room] = self.new_room(msg, handle)
        future = self.loop.submit(handle.wait())
        future.add_done_callback(lambda done: self._concluded(msg.room, done))

    def new_room(self, msg: Metadata, sink: LayerSink) -> PrefillRoom:
        return PrefillRoom(
            msg.room,
            sink,
            base_tokens=msg.decode_prefix_len,
            num_pages=msg.num_pages,
            page_layers=self.pool.page_layers,
        )

    def _concluded(self, room: int, done: concurrent.futures.Future[None]) -> None:
        error = done.exception()
        if error is None:
            self.mgr.update_status(room, KVPoll.Success)
        else:
            self.mgr.fail_room(room, f"prfaas transfer failed: {error}")

    def forget(self, room: int, reason: str) -> None:
        """Drop the room; a transfer still running is aborted (the decode fails with `reason`)."""
        with self._lock:
            state = self.rooms.pop(room, None)
        if state is not None:
            state.stream.abort(reason)

    # -- shipping (the scheduler thread) ---------------------------------------------------

    def ship_pages(
        self, state: PrefillRoom, layer: int, first: int, ids: np.ndarray | torch.Tensor, end: int
    ) -> None:
        """Hand `layer`'s logical pages `first..end` (physical `ids`) to the transport,
        skipping those already handed over."""
        start = state.take(layer, first, end)
        if start is None:
            return
        chosen = ids[start - first : end - first]

        def work() -> None:
            arrays = self.pool.gather(layer, chosen).arrays()
            state.stream.send_arrays(layer, Kind.FULL_KV, arrays, blocks=(start, end))

        self.shipper.submit(work)

    def add_transfer_request(
        self,
        room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None,
        state_indices: list[Any] | None,
        num_kv_tokens: int | None,
    ) -> None:
        """SGLang's `send()` for one chunk: the pages of `index_slice` (logical, physical
        `kv_indices`), and with the last chunk the states, metadata buffers and meta."""
        state = self.rooms.get(room)
        if state is None:  # a dummy rank, or the room was cleared
            return
        self.mgr.update_status(room, KVPoll.Transferring)
        ids = np.asarray(kv_indices, dtype=np.int64)
        state.tokens += int(num_kv_tokens or 0)
        try:
            for layer in self.pool.page_layers:
                self.ship_pages(state, layer, index_slice.start, ids, index_slice.stop)
        except ValueError as exc:
            self.on_abort(room, f"prfaas: {exc}")
            return
        if is_last_chunk:
            self._finish(state, aux_index, _mamba_slot(state_indices))

    def _finish(self, state: PrefillRoom, aux_index: int | None, slot: int | None) -> None:
        pool, stream = self.pool, state.stream
        if pool.state_layers and slot is None:
            self.on_abort(state.room, "prfaas: the last chunk carried no Mamba state slot")
            return
        meta = {"num_tokens": state.tokens, "base_tokens": state.base_tokens}

        def work() -> None:
            for layer in pool.state_layers:
                stream.send_state(pool, layer, slot)  # type: ignore[arg-type]
            if aux_index is not None:
                stream.send_aux(AUX, self.aux.read(aux_index))
            stream.send_meta(meta)
            stream.finish()

        self.shipper.submit(work)

    def close(self) -> None:
        self.shipper.close()


def _mamba_slot(state_indices: list[Any] | None) -> int | None:
    """The request's Mamba slot from SGLang's per-component state indices."""
    for indices in state_indices or []:
        if indices is not None and len(indices):
            return int(np.asarray(indices).reshape(-1)[0])
    return None
