"""The worker half of the connector: pages and states out of the prefill's KV cache as its
layers run, into the decode's own blocks as they arrive (a thin adapter over `kv_pages`).

Prefill: `save_kv_layer` of a full-attention layer sends the pages this step completed (a
page the step only began waits for the next step, so no page travels twice; the last page
of the handed-over tokens goes with the last step). In the step that reaches the handoff
point (`scheduler_side.handoff`), it also sends the state of every linear layer below
it at that point (those layers have run, so their states are final), and `wait_for_save`
sends the states of the linear layers after the last full-attention layer, the meta, and
finishes. Only the last layer's pages and the states above it wait for the end of that
step's forward; the prefill's remaining token computes while they travel.
Decode: each `RecvStart` becomes a transfer on the transport loop whose layers are placed as
they arrive; completion (or failure) is reported through `transfer_results`.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field

from prfaas.engines.kv_pages import PagedPool, PageError, PagePlacer, PageStream, decode_meta
from prfaas.engines.kv_pages.wire import META, model_layer
from prfaas.engines.transport import Transfer, TransferError
from prfaas.engines.vllm.auth import transport_key
from prfaas.engines.vllm.config import ConnectorConfig
from prfaas.engines.vllm.layout import GroupLayout
from prfaas.engines.vllm.metadata import PrfaasMetadata, RecvStart, SendStep
from prfaas.engines.vllm.trace import TransferTrace
from prfaas.engines.vllm.transport_thread import TransportThread

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.01


@dataclass
class _Outgoing:
    room: int
    stream: PageStream
    sent_pages: int = 0
    sent_states: int = 0  # how many of the pool's state layers (in model order) went out


@dataclass
class _Results:
    """Receive outcomes, filled on the transport loop, drained by the worker thread."""

    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)

    def add(self, req_id: str, ok: bool) -> None:
        with self.lock:
            self.finished.add(req_id)
            if not ok:
                self.failed.add(req_id)
        self.ready.set()

    def drain(self) -> tuple[set[str], set[str]]:
        with self.lock:
            done, bad = self.finished, self.failed
            self.finished, self.failed = set(), set()
            self.ready.clear()
        return done, bad


class WorkerSide:
    """Sends and receives for one worker over its `TransportThread`."""

    def __init__(self, config: ConnectorConfig, pool: PagedPool, groups: GroupLayout) -> None:
        self.config, self.pool, self.groups = config, pool, groups
        key = transport_key()
        self.transport = TransportThread(config.sender(key), config.receiver(key))
        self.trace = TransferTrace(config.trace_path)
        paged = [groups.block_size[groups.group_of[layer]] for layer in pool.pages]
        self._page_size = paged[0] if paged else 1
        self._state_layers = sorted(pool.states)
        self._out: dict[str, _Outgoing] = {}
        self._meta: PrfaasMetadata | None = None
        self._steps: list[SendStep] = []
        self._receiving: set[str] = set()  # worker thread: receives not yet reported
        self._transfers: dict[str, Transfer] = {}  # transport loop only
        self._ended: set[str] = set()  # transport loop only: ended before their fetch began
        self._results = _Results()

    @property
    def bootstrap_port(self) -> int:
        return self.transport.sender.bootstrap_port

    # -- every step ------------------------------------------------------------------------

    def start_sends(self, meta: PrfaasMetadata) -> None:
        """This step's sends (idempotent per step): open the rooms of requests starting to
        send. Called at the step's first saved layer: vLLM starts loads after the forward."""
        if self._meta is meta:
            return
        self._meta, self._steps = meta, meta.sends
        for step in meta.sends:
            if step.req_id not in self._out:
                handle = self.transport.call(
                    functools.partial(self.transport.sender.open, step.room)
                )
                self._out[step.req_id] = _Outgoing(step.room, PageStream(handle))

    def start_recvs(self, meta: PrfaasMetadata) -> None:
        """Start fetching the KV of requests this step allocated blocks for."""
        for start in meta.recvs:
            self._receiving.add(start.req_id)
            self.transport.submit(self._receive(start))

    def save_layer(self, meta: PrfaasMetadata, layer: int) -> None:
        """After a full-attention layer ran: send the pages this step wrote."""
        self.start_sends(meta)
        if layer not in self.pool.pages:
            return
        gid = self.groups.group_of[layer]
        size = self.groups.block_size[gid]
        for step in self._steps:
            if step.error is not None:
                continue
            out = self._out[step.req_id]
            first = out.sent_pages
            ids = step.block_ids[gid][first : _pages_done(step, size)]
            out.stream.send_pages(self.pool, layer, ids, first)
            self.trace("sent", out.room, layer=layer, tokens=step.end)
            if step.last:
                self._send_states(step, out, below=layer)

    def end_step(self, meta: PrfaasMetadata) -> None:
        """After the forward: states, meta and finish for requests now at their handoff."""
        self.start_sends(meta)
        for step in self._steps:
            out = self._out[step.req_id]
            out.sent_pages = _pages_done(step, self._page_size)
            if step.error is not None:
                out.stream.abort(step.error)
                del self._out[step.req_id]
                continue
            if not step.last:
                continue
            self.trace("forward_done", out.room, tokens=step.end, blocks=step.block_ids)
            self._send_states(step, out)
            out.stream.send_meta({"num_tokens": step.end})
            out.stream.finish()
            del self._out[step.req_id]
        self._steps = []

    def _send_states(self, step: SendStep, out: _Outgoing, below: int | None = None) -> None:
        """Send the final states of the linear layers not sent yet (those below model layer
        `below` only, when given: the layers this step has already run)."""
        pending = self._state_layers[out.sent_states :]
        for layer in pending if below is None else [x for x in pending if x < below]:
            slot = self.groups.state_slot(layer, step.block_ids, step.end)
            out.stream.send_state(self.pool, layer, slot)
            out.sent_states += 1

    def transfer_results(
        self, finished_req_ids: set[str], meta: PrfaasMetadata | None
    ) -> tuple[set[str], set[str]]:
        """(finished receives, failed receives); ends the transfers of finished requests.

        On a step that computed nothing while receives are pending (vLLM polls for them in a
        loop), waits up to IDLE_WAIT_S for one to end: the poll would otherwise spin a core
        that the prefill on the same machine, or the receive itself, needs."""
        for req_id in finished_req_ids:
            out = self._out.pop(req_id, None)
            if out is not None:  # ended (aborted) before its handoff point
                out.stream.abort("the prefill request ended before its KV was complete")
            if req_id in self._receiving:
                self.transport.soon(functools.partial(self._cancel, req_id))
        if meta is not None and meta.idle and self._receiving:
            self._results.ready.wait(IDLE_WAIT_S)
        done, failed = self._results.drain()
        self._receiving -= done
        return done, failed

    def close(self) -> None:
        self.transport.close()

    # -- the transport loop ------------------------------------------------------------------

    def _cancel(self, req_id: str) -> None:
        transfer = self._transfers.get(req_id)
        if transfer is not None:
            transfer.cancel("the decode request ended (aborted) before its KV arrived")
        else:
            self._ended.add(req_id)

    async def _receive(self, start: RecvStart) -> None:
        ok = False
        try:
            if start.req_id in self._ended:
                raise ValueError("the decode request ended before its KV transfer began")
            transfer = await self.transport.receiver.fetch(
                start.host, start.port, start.room, timeout_s=self.config.timeout_s
            )
            self._transfers[start.req_id] = transfer
            placer = self._placer(start)
            async for item in transfer:
                placer.place(item)
                self.trace("placed", start.room, layer=model_layer(item.layer),
                           kind=item.kind.name)  # fmt: skip
            meta = decode_meta(transfer.aux(META))
            if meta.get("num_tokens") != start.num_tokens:
                raise PageError(f"prefill sent {meta.get('num_tokens')} tokens, "
                                f"decode expects {start.num_tokens}")  # fmt: skip
            placer.check_complete(start.num_tokens)
            ok = True
            self.trace("received", start.room, tokens=start.num_tokens, bytes=transfer.nbytes,
                       blocks=start.block_ids, skip=start.skip_tokens)  # fmt: skip
        except (TransferError, PageError, ValueError) as exc:
            logger.error("request %s: KV transfer failed: %s", start.req_id, exc)
            failed = self._transfers.get(start.req_id)
            if failed is not None:
                failed.cancel(str(exc))
        finally:
            self._transfers.pop(start.req_id, None)
            self._ended.discard(start.req_id)
            self._results.add(start.req_id, ok)

    def _placer(self, start: RecvStart) -> PagePlacer:
        tables = {layer: start.block_ids[self.groups.group_of[layer]] for layer in self.pool.pages}
        slots = {
            layer: self.groups.state_slot(layer, start.block_ids, start.num_tokens)
            for layer in self.pool.states
        }
        return PagePlacer(self.pool, tables, slots, skip_tokens=start.skip_tokens)


def _pages_done(step: SendStep, size: int) -> int:
    """Pages of the request complete after `step` (the last, partial page at its end)."""
    return -(-step.end // size) if step.last else step.end // size
