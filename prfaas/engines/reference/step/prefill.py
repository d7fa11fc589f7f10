"""Prefill of one request: restore the cached prefix, compute the rest in block-aligned pieces,
and (prefill role) ship every layer's KV and state the moment the layer finishes.

The prompt is computed as `[match, a)` then `[a, n)` with `a` the last block boundary before
the last token, so the linear states at `a` can be saved: the same prompt again, or a follow-up
that extends it, reuses them exactly (a match always leaves at least one token to compute).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import torch

from prfaas.engines.kv_pages import META, HostCopy
from prfaas.engines.kv_pages.device_copy import DeviceCopier, torch_dtype
from prfaas.engines.reference.cache.storage import KVStorage
from prfaas.engines.reference.handoff.base import (
    FULL_KV,
    LINEAR_STATE,
    HandoffError,
    Outbox,
    Received,
)
from prfaas.engines.reference.model.hybrid_cache import HybridCache, SeqState
from prfaas.engines.reference.model.runner import FULL, LayerListener, ModelRunner
from prfaas.engines.reference.step.sampling import Choice, TokenLogprob


class LayerShipper:
    """Turns layer-finished callbacks into `send_copy` calls: each full layer's KV in block
    ranges as pieces complete (the first range includes the cached prefix), each linear
    layer's state once, after the last piece. Copies to the host go through the engine's
    `DeviceCopier` (off the forward's stream on a GPU)."""

    def __init__(self, outbox: Outbox, block_size: int, copier: DeviceCopier) -> None:
        self.outbox, self.block_size, self.copier = outbox, block_size, copier
        self._sent: dict[int, int] = {}

    def listener(self, final: bool) -> LayerListener:
        def on_layer(idx: int, kind: str, cache: HybridCache) -> None:
            if kind == FULL:
                self._send_kv(idx, cache)
            elif final:
                copy = host_copy(
                    self.copier, {"conv": cache.conv[idx][0], "rec": cache.rec[idx][0]}
                )
                self.outbox.send_copy(idx, LINEAR_STATE, copy)

        return on_layer

    def _send_kv(self, idx: int, cache: HybridCache) -> None:
        k, v = cache.keys[idx], cache.values[idx]
        start, end = self._sent.get(idx, 0), k.shape[-2]
        copy = host_copy(self.copier, {"k": k[0, ..., start:end, :], "v": v[0, ..., start:end, :]})
        blocks = (start // self.block_size, -(-end // self.block_size))
        self.outbox.send_copy(idx, FULL_KV, copy, blocks=blocks)
        self._sent[idx] = end


def host_copy(copier: DeviceCopier, tensors: Mapping[str, torch.Tensor]) -> HostCopy:
    """Host copies of `tensors` in wire form, for an `Outbox` (complete once its fence is)."""
    arrays, fence = copier.to_host(tensors)
    return HostCopy(arrays, fence)


class PrefillRun:
    """A prompt being computed piece by piece, one piece per engine step.

    Pieces end on block boundaries (`budget` tokens at most), and the last one starts at the
    last boundary before the final token: [m, m+budget), ..., [b, n) with b = the last
    multiple of the block size below n. Every piece but the last ends block-aligned, so the
    linear states there can be saved for exact prefix reuse.
    """

    def __init__(
        self,
        storage: KVStorage,
        prompt: list[int],
        prefix: tuple[tuple[int, ...], int | None],
        outbox: Outbox | None,
        budget: int,
        copier: DeviceCopier,
    ) -> None:
        block_ids, slot = prefix
        self.prompt, self.bs = prompt, storage.block_size
        self.budget = max(self.bs, budget // self.bs * self.bs)
        self.state = storage.gather(block_ids)
        if slot is not None:
            storage.load_state(slot, self.state)
        n = len(prompt)
        self.last_boundary = max(self.state.length, (n - 1) // self.bs * self.bs)
        self.shipper = LayerShipper(outbox, self.bs, copier) if outbox is not None else None
        self.logits: torch.Tensor | None = None

    @property
    def pos(self) -> int:
        """Tokens computed (cached prefix included)."""
        return self.state.length

    @property
    def done(self) -> bool:
        return self.pos == len(self.prompt)

    def step(self, runner: ModelRunner) -> tuple[int, int]:
        """Compute the next piece; returns its [start, end)."""
        start = self.pos
        end = min(start + self.budget, self.last_boundary)
        if end <= start:
            end = len(self.prompt)
        cache = HybridCache([self.state])
        final = end == len(self.prompt)
        listener = self.shipper.listener(final=final) if self.shipper else None
        logits = runner.forward(cache, torch.tensor([self.prompt[start:end]]), listener)
        self.state = cache.row(0)
        if final:
            self.logits = logits[0]
        return start, end


def send_meta(outbox: Outbox, first: Choice, prompt_len: int, cached: int) -> None:
    """The aux message that completes a hand-off: the first output token (with its
    log-probabilities when asked for) and lengths."""
    meta: dict[str, object] = {
        "first_token": first.token, "prompt_len": prompt_len, "cached_tokens": cached
    }  # fmt: skip
    if first.logprob is not None:
        meta["first_logprob"] = [first.logprob.logprob, first.logprob.top]
    outbox.send_meta(meta)


@dataclass(frozen=True)
class HandedOff:
    """A received hand-off turned into engine state."""

    state: SeqState
    first: Choice
    cached_tokens: int


def state_from_handoff(
    received: Received, layer_types: tuple[str, ...], copier: DeviceCopier
) -> HandedOff:
    """Reassemble a `SeqState` from received layers, on the copier's device (see
    `assemble_state`); validates completeness and lengths.

    Raises:
        HandoffError: missing meta or layers, or lengths that disagree.
    """
    raw = received.aux.get(META)
    if raw is None:
        raise HandoffError("hand-off carried no meta (first token)")
    meta: Mapping[str, Any] = orjson.loads(raw)
    state = assemble_state(received, int(meta["prompt_len"]), layer_types, copier)
    token, lp = int(meta["first_token"]), meta.get("first_logprob")
    logprob = None
    if lp is not None:
        logprob = TokenLogprob(token, float(lp[0]), tuple((int(t), float(v)) for t, v in lp[1]))
    return HandedOff(state, Choice(token, logprob), int(meta.get("cached_tokens", 0)))


def assemble_state(
    received: Received, length: int, layer_types: tuple[str, ...], copier: DeviceCopier
) -> SeqState:
    """The `length`-token `SeqState` the received layers hold (KV pieces joined in order),
    placed on the copier's device on its placing stream; the caller's stream (the forward
    pass) is ordered after the placement.

    Raises:
        HandoffError: a layer missing, or KV of another length.
    """
    kv: dict[int, list[Mapping[str, np.ndarray]]] = {}
    state = SeqState(length=length)
    with copier.placing():
        for item in received.layers:
            if item.kind == FULL_KV:
                kv.setdefault(item.layer, []).append(item.arrays)
            else:
                state.conv[item.layer] = _placed(copier, np.array(item.arrays["conv"]))
                state.rec[item.layer] = _placed(copier, np.array(item.arrays["rec"]))
        for layer, parts in kv.items():
            for name, dst in (("k", state.keys), ("v", state.values)):
                dst[layer] = _placed(copier, np.concatenate([p[name] for p in parts], axis=-2))
    copier.order_after_placed()
    _check_complete(state, layer_types)
    return state


def _placed(copier: DeviceCopier, array: np.ndarray) -> torch.Tensor:
    """A fresh received wire array as a (1, ...) tensor on the copier's device (on the CPU
    sharing `array`'s memory)."""
    return copier.staged(array, torch_dtype(array.dtype))[None]


def _check_complete(state: SeqState, layer_types: tuple[str, ...]) -> None:
    for idx, kind in enumerate(layer_types):
        if kind == FULL:
            got = state.keys[idx].shape[-2] if idx in state.keys else None
            if got != state.length:
                raise HandoffError(f"layer {idx}: {got} KV tokens, expected {state.length}")
        elif idx not in state.conv or idx not in state.rec:
            raise HandoffError(f"layer {idx}: linear state missing from the hand-off")
