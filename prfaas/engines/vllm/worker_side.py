"""The worker half of the connector: pages and states out of the prefill's KV cache as its
layers run, into the decode's own blocks as they arrive (a thin adapter over `kv_pages`'s
device-aware `TorchPagePool`).

Prefill: a room opens with the layout signature (aux `layout`), so the decode can refuse
pages it would misread before placing any. `save_kv_layer` of a full-attention layer sends
the pages this step completed (a page the step only began waits for the next step, so no
page travels twice; the last page of the handed-over tokens goes with the last step). In
the step that reaches the handoff point (`scheduler_side.handoff`), it also sends the state
of every linear layer below it at that point (those layers have run, so their states are
final), and `wait_for_save` sends the states of the linear layers after the last
full-attention layer, the meta, and finishes. Only the last layer's pages and the states
above it wait for the end of that step's forward; the prefill's remaining token computes
while they travel. On a GPU a save only enqueues the copy (an event on the forward stream,
the copy on a side stream into bounded pinned memory) and the `SendQueue` hands each
message to the transport once its copy is done; `wait_for_save` waits for the step's
copies (`reads_done`) before vLLM may free or reuse the blocks.
Decode: each `RecvStart` becomes a transfer on the transport loop whose layers are placed as
they arrive (staged H2D copies on the pool's own stream); a request is reported finished
(or failed) only once a fence taken after its last placement is ready, polled without
blocking (`transfer_results`).
Tensor parallelism: each TP rank has its own sender at the base port + rank, and a decode's
rank r fetches from the prefill's rank r; the signature carries TP size and rank.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field

from prfaas.engines.kv_pages import Fence, PageError, PagePlacer, PageStream, SendQueue, decode_meta
from prfaas.engines.kv_pages.torch_pool import TorchPagePool
from prfaas.engines.kv_pages.wire import META, model_layer
from prfaas.engines.transport import Kind, LayerItem, Transfer, TransferError
from prfaas.engines.vllm.auth import transport_key
from prfaas.engines.vllm.config import ConnectorConfig, peer_port
from prfaas.engines.vllm.layout import KV, GroupLayout, LayoutSignature, PoolViews, check_placement
from prfaas.engines.vllm.metadata import PrfaasMetadata, RecvStart, SendStep
from prfaas.engines.vllm.trace import TransferTrace
from prfaas.engines.vllm.transport_thread import TransportThread

LAYOUT = "layout"
"""The aux message a room opens with: the prefill's `LayoutSignature` (JSON)."""
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
    """Receive outcomes, filled on the transport loop, drained by the worker thread. An
    outcome counts once its fence is ready: every write into the request's blocks it
    enqueued has landed (a failed one too, or a late copy would land in blocks vLLM has
    already given to another request)."""

    pending: list[tuple[str, bool, Fence]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)

    def add(self, req_id: str, ok: bool, fence: Fence) -> None:
        with self.lock:
            self.pending.append((req_id, ok, fence))
        self.ready.set()

    def drain(self) -> tuple[set[str], set[str]]:
        """(finished, failed) among outcomes whose fence is ready (never blocks)."""
        done: set[str] = set()
        bad: set[str] = set()
        with self.lock:
            waiting = []
            for req_id, ok, fence in self.pending:
                if not fence.ready():
                    waiting.append((req_id, ok, fence))
                    continue
                done.add(req_id)
                if not ok:
                    bad.add(req_id)
            self.pending = waiting
            self.ready.clear()  # one still waiting on its fence is polled again next step
        return done, bad


class WorkerSide:
    """Sends and receives for one worker over its `TransportThread`."""

    def __init__(self, config: ConnectorConfig, views: PoolViews, groups: GroupLayout) -> None:
        self.config, self.groups = config, groups
        self.signature = views.signature
        self.tp_rank = views.signature.tp_rank
        self.pool = TorchPagePool(
            views.pages, views.states, send_budget_bytes=config.send_budget_bytes
        )
        self.queue = SendQueue()
        key = transport_key()
        self.transport = TransportThread(
            config.sender(key, tp_rank=self.tp_rank),
            config.receiver(key),
            process=config.sender_process,
        )
        self.trace = TransferTrace(config.trace_path)
        self._layout = views.signature.to_json()
        self._page_size = views.block_size or 1
        self._state_layers = sorted(self.pool.states)
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
                stream = PageStream(handle, self.queue)
                stream.send_aux(LAYOUT, self._layout)  # first: checked before any page
                self._out[step.req_id] = _Outgoing(step.room, stream)

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
        # the copies out of this step's blocks are done before vLLM may free or reuse them
        self.pool.reads_done()

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
        self.queue.close()
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
            check_placement(self._page_size, start.skip_tokens, self._page_size)
            transfer = await self.transport.receiver.fetch(
                start.host, peer_port(start.port, self.tp_rank), start.room,
                timeout_s=self.config.pull_timeout_s if start.pull else self.config.timeout_s,
            )  # fmt: skip
            self._transfers[start.req_id] = transfer
            placer = self._placer(start)
            checked = False
            async for item in transfer:
                if not checked:  # the signature arrived before any layer (sent first)
                    self.check_signature(transfer.aux(LAYOUT))
                    checked = True
                self._check_item(item, start)
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
            self._results.add(start.req_id, ok, self.pool.fence())

    def check_signature(self, payload: bytes | None) -> None:
        """Raise PageError unless the prefill's layout signature equals this worker's."""
        if payload is None:
            raise PageError("the prefill sent no layout signature before its pages "
                            "(a PrfaaS connector of another version?)")  # fmt: skip
        why = self.signature.mismatch(LayoutSignature.from_json(payload))
        if why is not None:
            raise PageError(f"refused before placing anything: {why}")

    def _check_item(self, item: LayerItem, start: RecvStart) -> None:
        if item.kind is Kind.FULL_KV and KV in item.arrays:
            pages = item.arrays[KV]
            sender = int(pages.shape[1]) if pages.ndim == 3 else -1
            check_placement(self._page_size, start.skip_tokens, sender)

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
