"""Layer-wise sending: right after decoder layer k's forward, hand layer k's new pages of
every prefilling request to the transport while layer k+1 computes, and during a request's
last chunk its Mamba state of layer k too (final once layer k ran: nothing later in the
forward writes it).

SGLang has no layer-wise transfer of its own. Two AROUND hooks add one to a prefill
scheduler using the prfaas backend in its layer-wise mode (the default):

- `init_disaggregation`: after SGLang built its KV manager, register a torch forward hook
  on each decoder layer of the model (`install_layer_hooks`), calling `LayerTap.after_layer`;
- `run_batch`: before the forward, `LayerTap.plan` works out, per request of the batch
  whose room is bootstrapped (SGLang's too: not `pending_bootstrap`, an optimistic prefill
  whose pages SGLang may still release and requeue), which logical pages this chunk
  completes (the same rule as SGLang's `send_kv_chunk`: whole pages, and the partial last
  page once the prompt ends),
  their physical ids, and for a request whose prompt this chunk ends, the Mamba slot its
  states are in (SGLang's own `send_kv_chunk` reads the same slot after the forward); one
  small device-to-host copy per batch brings these to the host, waited for by the first
  layer hook (the forward's first layer is enqueued by then). After the forward the plan is
  dropped.

Each layer hook then ships that layer's planned pages and states (`PrefillPlane.ship_pages`,
`ship_state`): the pool records an event on the forward's current stream and copies on a
side stream into pinned host memory (on CPU at once), and the worker's send queue hands the
copy to the transport once it finished, so the forward never waits for a copy. SGLang's own
`send()` after the chunk ships whatever was not shipped already. The hooks do not run on a
prefill CUDA graph's replay nor under two-batch overlap: `settings.check_prefill_args`
refuses those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from prfaas.engines.sglang.shipping import PrefillRoom

logger = logging.getLogger(__name__)

_TAP = "_prfaas_layer_tap"  # the scheduler attribute holding its LayerTap


@dataclass(frozen=True)
class PlannedRoom:
    """One request's part of the running chunk: logical pages `first..end` at physical
    `ids`, and `slot`, the Mamba slot whose states are final after each layer (the last
    chunk only; else None)."""

    state: PrefillRoom
    first: int
    end: int
    ids: np.ndarray
    slot: int | None = None


class LayerTap:
    """Ships each planned room's pages (and last-chunk states) of a layer right after that
    layer ran.

    `plane` is the `PrefillPlane` (its `rooms`, `pool`, `ship_pages`, `ship_state` and
    `on_abort`).
    """

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self._planned: list[PlannedRoom] = []
        self._pending: tuple[list[_Found], _HostRead] | None = None

    @property
    def planned(self) -> list[PlannedRoom]:
        """The batch's plan (waits for its host read the first time it is asked for)."""
        if self._pending is not None:
            found, read = self._pending
            self._pending = None
            host, at = read.numpy(), 0
            for state, first, end, ids, slot in found:
                count = 0 if ids is None else int(ids.numel())
                page_ids, at = host[at : at + count], at + count
                slot_id = None
                if slot is not None:
                    slot_id, at = int(host[at]), at + 1
                self._planned.append(
                    PlannedRoom(state, first, end if count else first, page_ids, slot_id)
                )
        return self._planned

    def plan(
        self,
        reqs: list[Any],
        req_to_token: torch.Tensor,
        to_physical: Any,
        state_slot: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
        """Work out the rooms, pages and state slots of a batch's `reqs` (SGLang's `Req`s)
        before its forward.

        `req_to_token` maps (request row, token) to a KV slot; `to_physical` is the
        allocator's `translate_kv_indices_for_transfer`; `state_slot(req)` the request's
        Mamba slot as a one-element tensor (None: the pool has no Mamba layers).
        """
        self.clear()
        pool = self.plane.pool
        page = pool.page_size
        found: list[_Found] = []
        for req in reqs:
            state = self.plane.rooms.get(getattr(req, "bootstrap_room", None))
            if state is None or req.extend_end is None or getattr(req, "pending_bootstrap", False):
                continue  # a request SGLang prefills optimistically may be released and
                # requeued before its bootstrap is final: its `send()` catches up then
            total = len(req.origin_input_ids)
            last = req.extend_end >= total
            tokens = min(req.extend_end, total) - state.base_tokens
            end = math.ceil(tokens / page) if last else tokens // page
            first = state.shipped
            ids = None
            if end > first:
                row = req_to_token[req.kv.req_pool_idx]
                base = state.base_tokens
                starts = row[base + first * page : base + end * page : page]
                ids = to_physical(starts.contiguous()) // page
            slot = None
            if last and pool.state_layers and state_slot is not None:
                slot = state_slot(req).reshape(-1)[:1]
            if ids is not None or slot is not None:
                found.append((state, first, end, ids, slot))
        if not found:
            return
        parts = [t.reshape(-1).to(torch.int64) for f in found for t in f[3:] if t is not None]
        self._pending = (found, _HostRead(torch.cat(parts)))  # the batch's one host read

    def after_layer(self, layer: int) -> None:
        """Layer `layer`'s forward has been issued: ship its planned pages and states."""
        pool = self.plane.pool
        pages, states = layer in pool.page_layers, layer in pool.state_layers
        if not (pages or states):
            return
        for p in list(self.planned):
            try:
                if pages and p.end > p.first:
                    self.plane.ship_pages(p.state, layer, p.first, p.ids, p.end)
                if states and p.slot is not None:
                    self.plane.ship_state(p.state, layer, p.slot)
            except ValueError as exc:  # never out of the forward: this room fails instead
                self._planned.remove(p)
                self.plane.on_abort(p.state.room, f"prfaas: {exc}")

    def clear(self) -> None:
        self._planned = []
        self._pending = None


_Found = tuple[PrefillRoom, int, int, torch.Tensor | None, torch.Tensor | None]
"""A room planned before the host read: (room, first, end, page ids, Mamba slot)."""


class _HostRead:
    """Device indices on their way to host memory: on a GPU copied into pinned memory
    without blocking (on the scheduler's current stream, after the batch's own writes of
    them) and waited for only when first read, by the first layer hook, when the GPU already
    has that layer's work; on the CPU read at once."""

    def __init__(self, values: torch.Tensor) -> None:
        self._event: Any = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        else:
            self._host = values

    def numpy(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.numpy()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (the longest `ModuleList` whose name ends in `layers`).

    Raises:
        ValueError: the model has no such list.
    """
    lists = [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"
    ]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no decoder layer list (`*.layers`)")
    return max(lists, key=len)


def install_layer_hooks(model: nn.Module, tap: LayerTap, start_layer: int = 0) -> None:
    """Call `tap.after_layer(k)` after decoder layer k's forward (k is the global id)."""
    for index, layer in enumerate(decoder_layers(model)):
        layer.register_forward_hook(_hook(tap, start_layer + index))


def _hook(tap: LayerTap, layer_id: int) -> Any:
    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        tap.after_layer(layer_id)

    return hook


# -- SGLang hooks (registered by plugin.register) ------------------------------------------


def init_disaggregation(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """After SGLang's own: on a prfaas prefill, hook the model's decoder layers."""
    result = original(scheduler, *args, **kwargs)
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    plane = getattr(getattr(queue, "kv_manager", None), "prefill", None)
    if plane is not None and plane.layerwise:
        tap = LayerTap(plane)
        runner = scheduler.tp_worker.model_runner
        install_layer_hooks(runner.model, tap, int(getattr(runner, "start_layer", 0) or 0))
        setattr(scheduler, _TAP, tap)
    return result


def run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Around SGLang's: plan the batch's layer-wise pages before the forward."""
    tap: LayerTap | None = getattr(scheduler, _TAP, None)
    if tap is None or not batch.forward_mode.is_extend():
        return original(scheduler, batch, *args, **kwargs)
    allocator = scheduler.token_to_kv_pool_allocator
    tap.plan(
        batch.reqs,
        scheduler.req_to_token_pool.req_to_token,
        allocator.translate_kv_indices_for_transfer,
        mamba_slot_of(scheduler.req_to_token_pool),
    )
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        tap.clear()


def mamba_slot_of(req_to_token_pool: Any) -> Callable[[Any], torch.Tensor] | None:
    """A request's Mamba slot as SGLang's `send_kv_chunk` reads it for the transfer
    (`translate_mamba_indices(req_index_to_mamba_index_mapping[req_pool_idx])`), or None
    for a pool without Mamba state."""
    mapping = getattr(req_to_token_pool, "req_index_to_mamba_index_mapping", None)
    if mapping is None:
        return None

    def slot(req: Any) -> torch.Tensor:
        index: torch.Tensor = mapping[req.kv.req_pool_idx]
        return req_to_token_pool.translate_mamba_indices(index)  # type: ignore[no-any-return]

    return slot
