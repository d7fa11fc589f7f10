"""Layer-wise sending: right after decoder layer k's forward, hand layer k's new pages of
every prefilling request to the transport, while layer k+1 computes.

SGLang has no layer-wise transfer of its own. Two AROUND hooks add one to a prefill
scheduler using the prfaas backend:

- `init_disaggregation`: after SGLang built its KV manager, register a torch forward hook
  on each decoder layer of the model (`install_layer_hooks`), calling `LayerTap.after_layer`;
- `run_batch`: before the forward, `LayerTap.plan` works out, per request of the batch
  whose room is bootstrapped, which logical pages this chunk completes (the same rule as
  SGLang's `send_kv_chunk`: whole pages, and the partial last page once the prompt ends)
  and their physical ids; after the forward the plan is dropped.

Each layer hook then ships that layer's planned pages (`PrefillPlane.ship_pages`): on CUDA
by recording an event on the forward stream and letting the shipper thread copy once it
fires, on CPU at once. SGLang's own `send()` after the chunk ships whatever was not shipped
already. Forward hooks do not run on CUDA graph replay, hence `--disable-prefill-cuda-graph`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from prfaas.engines.sglang.shipping import PrefillRoom

_TAP = "_prfaas_layer_tap"  # the scheduler attribute holding its LayerTap


@dataclass(frozen=True)
class PlannedRoom:
    """One request's pages the running chunk completes: logical `first..end`, physical
    `ids` (on the pool's device)."""

    state: PrefillRoom
    first: int
    end: int
    ids: torch.Tensor


class LayerTap:
    """Ships each planned room's pages of a layer right after that layer ran.

    `plane` is the `PrefillPlane` (its `rooms`, `pool` and `ship_pages`).
    """

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        self.planned: list[PlannedRoom] = []

    def plan(self, reqs: list[Any], req_to_token: torch.Tensor, to_physical: Any) -> None:
        """Work out the rooms and pages of a batch's `reqs` (SGLang's `Req`s) before its
        forward.

        `req_to_token` maps (request row, token) to a KV slot; `to_physical` is the
        allocator's `translate_kv_indices_for_transfer`.
        """
        self.planned = []
        page = self.plane.pool.page_size
        for req in reqs:
            state = self.plane.rooms.get(getattr(req, "bootstrap_room", None))
            if state is None or req.extend_end is None:
                continue
            total = len(req.origin_input_ids)
            tokens = min(req.extend_end, total) - state.base_tokens
            end = math.ceil(tokens / page) if req.extend_end >= total else tokens // page
            first = state.shipped
            if end <= first:
                continue
            row = req_to_token[req.kv.req_pool_idx]
            starts = row[state.base_tokens + first * page : state.base_tokens + end * page : page]
            ids = to_physical(starts.contiguous()) // page
            self.planned.append(PlannedRoom(state, first, end, ids))

    def after_layer(self, layer: int) -> None:
        """Layer `layer`'s forward has been issued: ship its planned pages."""
        if layer not in self.plane.pool.page_layers:
            return
        for p in self.planned:
            self.plane.ship_pages(p.state, layer, p.first, p.ids, p.end)

    def clear(self) -> None:
        self.planned = []


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
    if plane is not None:
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
    )
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        tap.clear()
