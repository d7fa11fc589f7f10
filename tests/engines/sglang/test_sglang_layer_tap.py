"""Layer-wise sending on a tiny module stack: with the plugin's forward hooks installed,
layer k's pages of a prefilling request are handed to the transport before layer k+1 runs,
chunk after chunk; SGLang's own `send()` after each chunk then finds nothing left to ship,
and the decode still ends with every page bit-exact."""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np
import sglang_helpers as sh
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from torch import nn

from prfaas.engines.sglang.layer_tap import LayerTap, install_layer_hooks
from prfaas.engines.sglang.shipping import PrefillRoom
from prfaas.engines.transport import Kind, SendHandle

ROOM, TOKENS, CHUNK = 41, 15, 8


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


class Layer(nn.Module):
    """Decoder layer k: a full-attention layer writes its chunk's K and V into the pool."""

    def __init__(self, k: int, pool: sh.HybridPool) -> None:
        super().__init__()
        self.k, self.pool = k, pool

    def forward(self, slots: torch.Tensor) -> torch.Tensor:
        if self.k in sh.FULL_LAYERS:
            g = torch.Generator().manual_seed(1000 * self.k + int(slots[0]))
            shape = (len(slots), sh.HEADS, sh.DIM)
            self.pool.k[self.k][slots] = torch.randn(shape, generator=g).to(torch.bfloat16)
            self.pool.v[self.k][slots] = torch.randn(shape, generator=g).to(torch.bfloat16)
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
