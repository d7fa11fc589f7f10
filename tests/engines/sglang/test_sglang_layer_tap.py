"""Layer-wise sending on a tiny module stack: with the plugin's forward hooks installed,
layer k's pages of a prefilling request are handed to the transport before layer k+1 runs,
chunk after chunk, and during the last chunk Mamba layer k's final state too (never an
earlier chunk's); SGLang's own `send()` after each chunk then finds nothing left to ship,
and the decode still ends with every page and state bit-exact. With
`PRFAAS_SGLANG_LAYERWISE=0` (send-after) no hook is installed and everything leaves after
the last chunk's forward, equally bit-exact."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import sglang_helpers as sh
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from torch import nn

from prfaas.engines.sglang import layer_tap
from prfaas.engines.sglang.layer_tap import LayerTap, install_layer_hooks
from prfaas.engines.sglang.shipping import PrefillRoom
from prfaas.engines.transport import Kind, SendHandle

ROOM, TOKENS, CHUNK = 41, 15, 8
SLOT = 1  # the request's Mamba slot on the prefill


class RecordingSink:
    """A `LayerSink` that notes each message (layer, kind, blocks) and passes it on to the
    room's real `SendHandle`."""

    def __init__(self, handle: SendHandle) -> None:
        self.handle = handle
        self.sent: list[tuple[int, Kind, tuple[int, int] | None]] = []

    def send_layer(
        self,
        layer: int,
        kind: Kind,
        arrays: Mapping[str, np.ndarray],
        *,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        self.sent.append((layer % (1 << 16), kind, blocks))
        self.handle.send_layer(layer, kind, arrays, blocks=blocks)

    def send_aux(self, name: str, payload: bytes) -> None:
        self.handle.send_aux(name, payload)

    def finish(self) -> None:
        self.handle.finish()

    def abort(self, reason: str) -> None:
        self.handle.abort(reason)

    def pages(self) -> list[tuple[int, tuple[int, int] | None]]:
        return [(layer, blocks) for layer, kind, blocks in self.sent if kind is Kind.FULL_KV]

    def states(self) -> list[int]:
        return [layer for layer, kind, _ in self.sent if kind is Kind.LINEAR_STATE]


class Layer(nn.Module):
    """Decoder layer k: a full-attention layer writes its chunk's K and V into the pool."""

    def __init__(self, k: int, pool: sh.HybridPool) -> None:
        super().__init__()
        self.k, self.pool = k, pool

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.k + int(slots[0]))
        if self.k in sh.FULL_LAYERS:
            shape = (len(slots), sh.HEADS, sh.DIM)
            self.pool.k[self.k][slots] = torch.randn(shape, generator=g).to(torch.bfloat16)
            self.pool.v[self.k][slots] = torch.randn(shape, generator=g).to(torch.bfloat16)
        else:  # a linear-attention layer: the chunk moves the request's state on
            self.pool.conv[self.k][SLOT] = torch.randn(sh.CONV, generator=g).to(torch.bfloat16)
            self.pool.ssm[self.k][SLOT] = torch.randn(sh.SSM, generator=g)
        return slots


class TinyModel(nn.Module):
    def __init__(self, pool: sh.HybridPool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(k, pool) for k in range(8))

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            slots = layer(slots)
        return slots


def test_layer_k_is_handed_over_before_layer_k_plus_1_runs(pair: sh.Pair) -> None:
    src = np.array([9, 2, 30, 5], dtype=np.int32)  # the prefill's pages of the request
    dst = np.array([17, 4, 11, 26], dtype=np.int32)  # the decode's
    sender, receiver = pair.sender(ROOM), pair.receiver(ROOM)
    receiver.send_metadata(dst, 3, [np.array([2], dtype=np.int32)], decode_prefix_len=0)
    assert sh.wait_for(sender.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    plane = pair.prefill_mgr.prefill
    room: PrefillRoom = plane.rooms[ROOM]
    sink = RecordingSink(room.sink)  # type: ignore[arg-type]
    plane.rooms[ROOM] = PrefillRoom(
        ROOM, sink, base_tokens=0, num_pages=len(dst), page_layers=plane.pool.page_layers
    )
    tap = LayerTap(plane)
    model = TinyModel(pair.prefill)
    install_layer_hooks(model, tap)
    seen: dict[int, list[tuple[int, tuple[int, int] | None]]] = {}
    for k, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, k=k: seen.__setitem__(k, sink.pages()))

    slots_of = torch.as_tensor(np.repeat(src, sh.PAGE) * sh.PAGE + np.tile(np.arange(sh.PAGE), 4))
    req_to_token = slots_of[None, :].to(torch.int64)
    req = _req()
    sender.init(len(src), aux_index=1)
    for start, end in ((0, CHUNK), (CHUNK, TOKENS)):
        req.extend_end = end
        tap.plan([req], req_to_token, lambda ids: ids)
        model(slots_of[start:end])
        tap.clear()
        pages = (0, 2) if end == CHUNK else (2, 4)
        for k in sh.FULL_LAYERS:  # layer k's pages went out before layer k+1 started
            assert (k, pages) in sink.pages()
            if k + 1 < 8:
                assert (k, pages) in seen[k + 1] and (k + 1, pages) not in seen[k + 1]
        shipped = len(sink.pages())
        last = end == TOKENS
        ids = src[start // sh.PAGE : -(-end // sh.PAGE)]
        sender.send(ids, [np.array([0], dtype=np.int32)] if last else None, end - start)
        assert len(sink.pages()) == shipped  # SGLang's send() found nothing left to ship
    assert sh.wait_for(receiver.poll, KVPoll.Success) == KVPoll.Success
    assert sh.wait_for(sender.poll, KVPoll.Success) == KVPoll.Success
    for k in sh.FULL_LAYERS:
        got = pair.decode.request_tokens(k, list(dst), TOKENS)
        assert got == pair.prefill.request_tokens(k, list(src), TOKENS), k


def _req() -> Any:
    """SGLang's own `Req` for a 15-token prompt in request row 0 with our room."""
    req = Req(
        rid="tap",
        origin_input_text="",
        origin_input_ids=array("i", range(TOKENS)),
        sampling_params=SamplingParams(max_new_tokens=1),
        bootstrap_room=ROOM,
    )
    req.kv.req_pool_idx = 0
    return req


def _drive(pair: sh.Pair) -> tuple[RecordingSink, dict[int, Any]]:
    """Prefill one request in two chunks the way SGLang's scheduler does, through the
    plugin's `init_disaggregation` and `run_batch` hooks around a scheduler's attributes
    (SGLang's names: its `req_to_token_pool` with the Mamba slot mapping, the allocator's
    `translate_kv_indices_for_transfer`), with `send()` after each chunk. Returns the sink
    and, per chunk, what had reached it when each layer started (page and state messages)."""
    src = np.array([9, 2, 30, 5], dtype=np.int32)
    dst = np.array([17, 4, 11, 26], dtype=np.int32)
    sender, receiver = pair.sender(ROOM), pair.receiver(ROOM)
    receiver.send_metadata(dst, 3, [np.array([2], dtype=np.int32)], decode_prefix_len=0)
    assert sh.wait_for(sender.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    plane = pair.prefill_mgr.prefill
    sink = RecordingSink(plane.rooms[ROOM].sink)
    plane.rooms[ROOM] = PrefillRoom(
        ROOM,
        sink,
        base_tokens=0,
        num_pages=len(dst),
        page_layers=plane.pool.page_layers,
        queue=plane.queue,
    )
    model = TinyModel(pair.prefill)
    slots_of = torch.as_tensor(np.repeat(src, sh.PAGE) * sh.PAGE + np.tile(np.arange(sh.PAGE), 4))
    scheduler = SimpleNamespace(
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=pair.prefill_mgr),
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model, start_layer=0)),
        req_to_token_pool=SimpleNamespace(
            req_to_token=slots_of[None, :].to(torch.int64),
            req_index_to_mamba_index_mapping=torch.tensor([SLOT], dtype=torch.int32),
            translate_mamba_indices=lambda indices: indices,
        ),
        token_to_kv_pool_allocator=SimpleNamespace(translate_kv_indices_for_transfer=_same),
    )
    layer_tap.init_disaggregation(lambda s: None, scheduler)
    seen: dict[int, tuple[list[Any], list[int]]] = {}

    def note(k: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            plane.queue.flush()  # every send queued so far has reached the transport
            seen[k] = (sink.pages(), sink.states())

        return hook

    for k, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(note(k))
    req = _req()
    sender.init(len(src), aux_index=1)
    per_chunk: dict[int, Any] = {}
    for start, end in ((0, CHUNK), (CHUNK, TOKENS)):
        req.extend_end = end
        batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), reqs=[req])
        layer_tap.run_batch(lambda s, b, lo=start, hi=end: model(slots_of[lo:hi]), scheduler, batch)
        plane.queue.flush()
        per_chunk[end] = (sink.pages(), sink.states(), dict(seen))
        last = end == TOKENS
        ids = src[start // sh.PAGE : -(-end // sh.PAGE)]
        sender.send(ids, [np.array([SLOT], dtype=np.int32)] if last else None, end - start)
    assert sh.wait_for(receiver.poll, KVPoll.Success) == KVPoll.Success
    assert sh.wait_for(sender.poll, KVPoll.Success) == KVPoll.Success
    for k in sh.FULL_LAYERS:
        got = pair.decode.request_tokens(k, list(dst), TOKENS)
        assert got == pair.prefill.request_tokens(k, list(src), TOKENS), k
    for k in sh.MAMBA_LAYERS:  # the final state: the last chunk's
        assert pair.decode.slot_bytes(k, 2) == pair.prefill.slot_bytes(k, SLOT), k
    return sink, per_chunk


def _same(ids: torch.Tensor) -> torch.Tensor:
    return ids


def test_states_leave_layer_by_layer_during_the_last_chunk_only(pair: sh.Pair) -> None:
    sink, per_chunk = _drive(pair)
    pages, states, _ = per_chunk[CHUNK]
    assert states == []  # a state is final only once the prompt's last chunk ran
    assert sorted(pages) == [(3, (0, 2)), (7, (0, 2))]
    pages, states, seen = per_chunk[TOKENS]
    for k in range(8):  # layer k's page or state went out before layer k+1 started
        if k + 1 < 8:
            before = seen[k + 1][0] + seen[k + 1][1]
            shipped = (k, (2, 4)) if k in sh.FULL_LAYERS else k
            assert shipped in before and all(
                item not in before for item in ((k + 1, (2, 4)), k + 1)
            ), k
    assert sorted(states) == sorted(sh.MAMBA_LAYERS)
    assert sorted(sink.states()) == sorted(sh.MAMBA_LAYERS)  # send() sent none again
    timeline = pair.prefill_mgr.prefill.rooms[ROOM].timeline  # what the room's log line says
    assert "messages=10 " in timeline.summary()  # 2 x 2 page messages, 6 states
    assert "sent_before_last_send=1.000" in timeline.summary()


def test_send_after_ships_everything_after_the_last_chunk(make_pair: Any) -> None:
    pair = make_pair(LAYERWISE="0")
    assert not pair.prefill_mgr.prefill.layerwise
    sink, per_chunk = _drive(pair)
    for end in (CHUNK, TOKENS):
        pages, states, seen = per_chunk[end]
        assert all(p == ([], []) for p in seen.values())  # no hook: nothing during a forward
        assert (pages, states) == ([], []), end  # after the forward, before its send()
    assert sorted(sink.pages()) == [(3, (0, 2)), (3, (2, 4)), (7, (0, 2)), (7, (2, 4))]
    assert sorted(sink.states()) == sorted(sh.MAMBA_LAYERS)
    assert "sent_before_last_send=0.000" in pair.prefill_mgr.prefill.rooms[ROOM].timeline.summary()


def test_a_state_slot_other_than_the_hooks_fails_the_room(pair: sh.Pair) -> None:
    """The hook read the states from the slot SGLang maps the request to; a last `send()`
    naming another slot means they disagree: the room fails rather than send two states."""
    src = np.array([9, 2, 30, 5], dtype=np.int32)
    sender, receiver = pair.sender(ROOM), pair.receiver(ROOM)
    receiver.send_metadata(src, 3, [np.array([2], dtype=np.int32)], decode_prefix_len=0)
    assert sh.wait_for(sender.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    tap = LayerTap(pair.prefill_mgr.prefill)
    model = TinyModel(pair.prefill)
    install_layer_hooks(model, tap)
    slots_of = torch.as_tensor(np.repeat(src, sh.PAGE) * sh.PAGE + np.tile(np.arange(sh.PAGE), 4))
    req = _req()
    req.extend_end = TOKENS
    sender.init(len(src), aux_index=1)
    tap.plan([req], slots_of[None, :].to(torch.int64), _same, lambda r: torch.tensor([SLOT]))
    model(slots_of[:TOKENS])
    tap.clear()
    sender.send(src, [np.array([SLOT + 1], dtype=np.int32)], TOKENS)
    assert sh.wait_for(sender.poll, KVPoll.Failed) == KVPoll.Failed
    with pytest.raises(KVTransferError, match=f"states from slot {SLOT}, SGLang's send"):
        sender.failure_exception()
    assert sh.wait_for(receiver.poll, KVPoll.Failed) == KVPoll.Failed


def test_an_optimistic_prefill_still_pending_bootstrap_is_left_to_send(pair: sh.Pair) -> None:
    """SGLang may release and requeue the pages of a request it prefills before its
    bootstrap is final: the hook plans nothing for it (its `send()` catches up later)."""
    src = np.array([9, 2, 30, 5], dtype=np.int32)
    sender, receiver = pair.sender(ROOM), pair.receiver(ROOM)
    receiver.send_metadata(src, 3, [np.array([2], dtype=np.int32)], decode_prefix_len=0)
    assert sh.wait_for(sender.poll, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    tap = LayerTap(pair.prefill_mgr.prefill)
    req = _req()
    req.extend_end = CHUNK
    table = torch.arange(TOKENS, dtype=torch.int64)[None, :]
    req.pending_bootstrap = True
    tap.plan([req], table, _same, lambda r: torch.tensor([SLOT]))
    assert tap.planned == []
    req.pending_bootstrap = False
    tap.plan([req], table, _same, lambda r: torch.tensor([SLOT]))
    assert [(p.first, p.end, p.slot) for p in tap.planned] == [(0, 2, None)]
