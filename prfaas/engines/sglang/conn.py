"""SGLang's KV transfer classes for the `prfaas` backend, over SGLang's Common* classes.

SGLang's `CommonKVManager` / `CommonKVSender` / `CommonKVReceiver` /
`CommonKVBootstrapServer` keep the bootstrap registry, rank mapping, status table, timeouts,
heartbeats and aborts; these subclasses add the data plane: the ZMQ control messages of
`messages.py` on the manager's socket, and the KV itself over `prfaas.engines.transport`
(`PrefillPlane`, `DecodePlane`), each manager with its own transport event-loop thread.

Supported: equal attention TP on both sides (each decode rank pairs with one prefill
rank), no pipeline or context parallelism, the `early` decode allocation policy,
full-attention KV (MHA or MLA) plus Mamba states. Anything else is refused at start-up.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device
from sglang.srt.utils.network import NetworkAddress

from prfaas.engines.sglang.buffers import AuxBuffers, SGLangPool
from prfaas.engines.sglang.decode_plane import DecodePlane, Fetch
from prfaas.engines.sglang.loop_thread import LoopThread
from prfaas.engines.sglang.messages import Endpoint, Metadata, Register, parse
from prfaas.engines.sglang.prefill_plane import PrefillPlane
from prfaas.engines.sglang.settings import BackendSettings, check_prefill_args

logger = logging.getLogger(__name__)


class PrfaasKVManager(CommonKVManager):  # type: ignore[misc]
    """One per scheduler rank: SGLang's bookkeeping plus our transport (see module doc)."""

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        settings = BackendSettings.from_env()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            check_prefill_args(server_args, layerwise=settings.layerwise)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._check_supported()
        self.pool = SGLangPool(
            args,
            _device(args),
            is_mla=bool(is_mla_backend),
            send_budget_bytes=settings.send_budget_bytes,
        )
        self.aux = AuxBuffers(args)
        self.loop = LoopThread(f"prfaas-transport-{disaggregation_mode.value}")
        self.prefill: PrefillPlane | None = None
        self.decode: DecodePlane | None = None
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.prefill = PrefillPlane(self, self.pool, self.aux, settings, self.loop)
        else:
            self.decode = DecodePlane(self, self.pool, self.aux, settings, self.loop)
            self._start_heartbeat_checker_thread()
        self._stopping = threading.Event()
        self._control = threading.Thread(
            target=self._control_loop, name="prfaas-control", daemon=True
        )
        self._control.start()

    def _check_supported(self) -> None:
        unsupported = [
            name
            for name, bad in (
                ("pipeline parallelism", self.pp_size > 1),
                ("context parallelism", self.attn_cp_size > 1 or self.dcp_size > 1),
                ("KV cache sharding", self.kv_shard_size > 1),
                ("the prefill_complete allocation policy", self.defer_decode_allocation),
            )
            if bad
        ]
        if unsupported:
            raise ValueError(
                f"the prfaas transfer backend does not support {', '.join(unsupported)}"
            )

    # -- the control socket ---------------------------------------------------------------

    def _control_loop(self) -> None:
        # Polls with a timeout so `teardown` can stop it: a ZMQ socket must not be closed
        # while another thread blocks on it.
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(100):
                continue
            frames = self.server_socket.recv_multipart()
            try:
                self._dispatch(frames)
            except (msgspec.ValidationError, msgspec.DecodeError, ValueError, KeyError):
                logger.exception("prfaas: dropping a malformed control message")

    def _dispatch(self, frames: list[bytes]) -> None:
        if frames and frames[0] == ABORT_TAG:
            notice = AbortNotification.from_zmq(frames)
            if notice is not None and self.prefill is not None:
                self.prefill.on_abort(notice.room, "Aborted by decode-side abort notification.")
            return
        msg = parse(frames)
        if isinstance(msg, Register) and self.prefill is not None:
            self.prefill.on_register(msg)
        elif isinstance(msg, Metadata) and self.prefill is not None:
            self.prefill.on_metadata(msg)
        elif isinstance(msg, Endpoint) and self.decode is not None:
            self.decode.on_endpoint(msg)
        else:
            logger.debug("prfaas: ignoring control message %r", frames[:1])

    def fail_room(self, room: int, reason: str) -> None:
        """Mark `room` Failed; the first recorded reason stays the one raised."""
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        self.update_status(room, KVPoll.Failed)

    def send_to(self, ip: str, port: int, frames: list[bytes]) -> None:
        """Push `frames` to a peer rank's control socket."""
        address = NetworkAddress(ip, port)
        self._send_multipart_locked(address.to_tcp(), frames, is_ipv6=address.is_ipv6)

    # -- SGLang's hooks into the data plane --------------------------------------------------

    def build_receiver_registration_message(self) -> list[bytes]:
        layout = self.pool.layout(self.aux.item_lens).to_json()
        return Register(self.local_ip, self.rank_port, layout).to_zmq()

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: Any,
        aux_index: int | None,
        state_indices: list[Any] | None,
        decode_prefix_len: int | None,
        is_dummy: bool,
        device_kv_indices: Any = None,
    ) -> list[bytes]:
        return Metadata(
            room=bootstrap_room,
            decode_ip=self.local_ip,
            decode_port=self.rank_port,
            required_dst_info_num=required_dst_info_num,
            decode_prefix_len=int(decode_prefix_len or 0),
            num_pages=len(kv_indices),
            is_dummy=is_dummy,
        ).to_zmq()

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        assert self.prefill is not None, "add_transfer_request on a decode-mode manager"
        self.prefill.add_transfer_request(
            bootstrap_room,
            kv_indices,
            index_slice,
            is_last_chunk,
            aux_index,
            state_indices,
            num_kv_tokens,
        )

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        with self.connection_lock:
            ranks = [
                (info["rank_ip"], int(info["rank_port"]))
                for key, infos in self.connection_pool.items()
                if key.startswith(failed_bootstrap_addr)
                for info in infos
            ]
        super()._handle_node_failure(failed_bootstrap_addr)
        if self.decode is not None:
            for rank in ranks:
                self.decode.forget_rank(rank)

    def teardown(self) -> None:
        """Stop the control thread and the transport (role switch or shutdown)."""
        self._stopping.set()
        self._control.join(timeout=5.0)
        if self.prefill is not None:
            self.prefill.close()
            self.loop.close(self.prefill.sender.close())
        elif self.decode is not None:
            self._heartbeat_shutdown.set()
            self.loop.close(self.decode.receiver.close())
        # Every socket of the manager's context (peer PUSH sockets, their monitors), or the
        # context's finaliser would wait for them forever.
        with self._socket_lock:
            self._socket_cache.clear()
            self._monitor_cache.clear()
            self._zmq_ctx.destroy(linger=0)


class PrfaasKVSender(CommonKVSender):  # type: ignore[misc]
    """SGLang's prefill-side sender; `send()` reaches `PrfaasKVManager.add_transfer_request`."""

    def abort(self) -> None:
        super().abort()
        self._plane().forget(self.bootstrap_room, "aborted on the prefill side")

    def clear(self) -> None:
        super().clear()
        self._plane().forget(self.bootstrap_room, "cleared on the prefill side")

    def _plane(self) -> PrefillPlane:
        plane: PrefillPlane | None = self.kv_mgr.prefill
        assert plane is not None
        return plane


class PrfaasKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """SGLang's decode-side receiver: `send_metadata` also starts the transport fetch."""

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().send_metadata(
            kv_indices, aux_index, state_indices, decode_prefix_len, *args, **kwargs
        )
        infos = [i for i in (self.bootstrap_infos or []) if not i.get("is_dummy")]
        failed = self.kv_mgr.request_status.get(self.bootstrap_room) == KVPoll.Failed
        if self.conclude_state is not None or failed or not infos:
            return
        rank = (str(infos[0]["rank_ip"]), int(infos[0]["rank_port"]))
        slot = None
        for indices in state_indices or []:
            if indices is not None and len(indices):
                slot = int(np.asarray(indices).reshape(-1)[0])
                break
        pages = np.asarray(kv_indices, dtype=np.int64).copy()
        self._plane().start(Fetch(self.bootstrap_room, rank, pages, slot, aux_index))

    def abort(self) -> None:
        super().abort()
        self._plane().cancel(self.bootstrap_room, "aborted on the decode side")

    def clear(self) -> None:
        super().clear()
        self._plane().finished(self.bootstrap_room)

    def _plane(self) -> DecodePlane:
        plane: DecodePlane | None = self.kv_mgr.decode
        assert plane is not None
        return plane


class PrfaasKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """SGLang's HTTP bootstrap registry, unchanged: ranks find each other's ZMQ address
    there, and our `Endpoint` message carries the transport address from then on."""


def _device(args: Any) -> torch.device:
    if get_device().device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", int(args.gpu_id))
    return torch.device("cpu")
