"""Prefill side of the prfaas backend: the transport sender, the rooms, and what SGLang's
control messages and `send()` calls do to them.

`PrefillPlane` belongs to one prefill-mode `PrfaasKVManager` (one per scheduler rank). It
runs a `KVSender` on the manager's `LoopThread`; answers a decode's `Register` with that
sender's endpoint; opens a room's `SendHandle` once the decode's `Metadata` arrived (the
room is then `WaitingForInput`); and turns the handle's outcome into the room's `KVPoll`
state.

Layer-wise (the default): the forward hook ships each layer's new pages (`ship_pages`) and,
during the last chunk, each Mamba layer's final state (`ship_state`) right after that layer
ran; SGLang's `send()` after a chunk ships what the hook did not (a cached prefix, a state
of a request the hook did not plan), and with the last chunk SGLang's metadata buffers and
our meta. Send-after (`PRFAAS_SGLANG_LAYERWISE=0`): no hook; `send()` only notes each
chunk's pages, and the last one ships every page, state and metadata after the last chunk's
forward. Either way the pool copies on the forward thread's stream order (a side stream
after an event, into the pinned budget) and one `SendQueue` per worker hands the copies to
the transport once they finished.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll

from prfaas.engines.kv_pages import LayerSink, SendQueue
from prfaas.engines.sglang.buffers import AuxBuffers, KVLayout, SGLangPool
from prfaas.engines.sglang.loop_thread import LoopThread
from prfaas.engines.sglang.messages import Endpoint, Metadata, Register
from prfaas.engines.sglang.settings import BackendSettings
from prfaas.engines.sglang.shipping import PrefillRoom
from prfaas.engines.transport import KVSender, ProcessSender, SenderConfig

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
        self.layerwise = settings.layerwise
        host = settings.bind_host or mgr.local_ip
        config = SenderConfig(
            host=host,
            connections=settings.connections,
            transfer_timeout_s=settings.transfer_timeout_s,
            register_timeout_s=settings.transfer_timeout_s,
            rate_bytes_per_s=settings.rate_bytes_per_s or None,
        )
        self.sender = ProcessSender(config) if settings.sender_process else KVSender(config)
        loop.run(self.sender.start())
        self.endpoint = (host, self.sender.bootstrap_port)
        self.layout = pool.layout(aux.item_lens)
        self.rooms: dict[int, PrefillRoom] = {}
        self._lock = threading.Lock()
        self.queue = SendQueue("prfaas-kv-send")
        logger.info(
            "prfaas prefill: %s, transport %s:%d, %d connections, pacing %s, send budget %d bytes",
            "layer-wise" if self.layerwise else "send-after",
            *self.endpoint,
            settings.connections,
            f"{settings.rate_bytes_per_s:.0f} B/s" if settings.rate_bytes_per_s else "off",
            settings.send_budget_bytes,
        )

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
            queue=self.queue,
        )

    def _concluded(self, room: int, done: concurrent.futures.Future[None]) -> None:
        error = done.exception()
        state = self.rooms.get(room)
        if state is not None:
            logger.info(
                "prfaas prefill room=%d mode=%s ok=%d %s",
                room,
                "layerwise" if self.layerwise else "send_after",
                error is None,
                state.timeline.summary(),
            )
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
        self, state: PrefillRoom, layer: int, first: int, ids: np.ndarray, end: int
    ) -> None:
        """Hand `layer`'s logical pages `first..end` (physical `ids`) to the transport,
        skipping those already handed over (the copy is enqueued; see the module doc)."""
        start = state.take(layer, first, end)
        if start is None:
            return
        state.timeline.note_queued(layer)
        chosen = [int(i) for i in ids[start - first : end - first]]
        state.stream.send_pages(self.pool, layer, chosen, first_page=start)

    def ship_state(self, state: PrefillRoom, layer: int, slot: int) -> None:
        """Hand `layer`'s final Mamba state in `slot` to the transport, once per room."""
        if state.take_state(layer):
            state.state_slot = slot
            state.timeline.note_queued(layer)
            state.stream.send_state(self.pool, layer, slot)

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
        ids = np.array(kv_indices, dtype=np.int64)  # a copy: send-after keeps it
        state.tokens += int(num_kv_tokens or 0)
        if is_last_chunk:
            state.timeline.last_send = time.perf_counter()
        pieces = [(int(index_slice.start), int(index_slice.stop), ids)]
        if not self.layerwise:
            state.deferred += pieces
            if not is_last_chunk:
                return
            pieces, state.deferred = state.deferred, []
        try:
            for layer in self.pool.page_layers:
                for first, end, chosen in pieces:
                    self.ship_pages(state, layer, first, chosen, end)
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
        if state.states_shipped() and state.state_slot != slot:
            self.on_abort(
                state.room,
                f"prfaas: the forward hook sent Mamba states from slot {state.state_slot}, "
                f"SGLang's send() names slot {slot}",
            )
            return
        for layer in pool.state_layers:  # those the hook did not send
            self.ship_state(state, layer, slot)  # type: ignore[arg-type]
        if aux_index is not None:
            stream.send_aux(AUX, self.aux.read(aux_index))
        stream.send_meta({"num_tokens": state.tokens, "base_tokens": state.base_tokens})
        stream.finish()

    def close(self) -> None:
        self.queue.close()


def _mamba_slot(state_indices: list[Any] | None) -> int | None:
    """The request's Mamba slot from SGLang's per-component state indices."""
    for indices in state_indices or []:
        if indices is not None and len(indices):
            return int(np.asarray(indices).reshape(-1)[0])
    return None
