"""`TorchPagePool`: the device-aware page mover. A `PagePool` over torch views of an engine's
KV memory, on a GPU or on the CPU, shared by the vLLM connector and the SGLang plugin.

The views follow `PagedPool`'s convention: for every full-attention layer, each component
as `(num_pages, page_size, *token_shape)` (a strided view of the engine's memory, no copy;
an engine whose pages are opaque bytes, e.g. vLLM's, gives `(num_pages, page_size,
page_bytes // page_size)` uint8 rows); for every linear-attention (Mamba) layer, each state
component as `(num_slots, *state_shape)`. bfloat16 travels as uint16 and fp8 as uint8
(their bits unchanged).

On a GPU (prefill): `gather` and `read_state` record an event on the caller's current
stream (the forward pass, which has only enqueued the layer's KV write when its hook runs)
and copy on a low-priority side stream into pinned host memory from a `HostBudget`, so the
forward never waits for a copy unless the budget is spent (a link slower than the prefill
holds back the forward instead of growing host memory without bound). The returned
`HostCopy` is ready once the copy finished; `reads_done()` waits for every copy enqueued
so far (before the engine may free or reuse the blocks).
On a GPU (decode): `scatter` and `write_state` stage received host arrays in pinned memory
and copy them in on the pool's own placing stream; `fence()` marks everything enqueued so
far, so a request is reported complete only once its pages are in place.
On the CPU the same code runs without streams: every copy is complete when it returns.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from prfaas.engines.kv_pages.device_copy import WIRE, DeviceCopier, movable, numpy_dtype
from prfaas.engines.kv_pages.errors import PageError
from prfaas.engines.kv_pages.host_copy import Fence, HostCopy
from prfaas.engines.kv_pages.pool import Placement, check_pages
from prfaas.engines.kv_pages.staging import DEFAULT_BUDGET_BYTES

Tensors = Mapping[str, torch.Tensor]


class TorchPagePool:
    """Page and state-slot views of one engine's KV memory (see the module docstring)."""

    def __init__(
        self,
        pages: Mapping[int, Tensors],
        states: Mapping[int, Tensors] | None = None,
        *,
        send_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        states = states or {}
        every = (*pages.values(), *states.values())
        devices = {t.device for comps in every for t in comps.values()}
        if len(devices) > 1:
            raise ValueError(f"every view must live on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._wire = {
            (layer, name): WIRE.get(t.dtype)
            for comps in (pages, states)
            for layer, tensors in comps.items()
            for name, t in tensors.items()
        }
        self.pages = {layer: _movable(f"pages[{layer}]", c, 2) for layer, c in pages.items()}
        self.states = {layer: _movable(f"states[{layer}]", c, 1) for layer, c in states.items()}
        sizes = {t.shape[1] for comps in self.pages.values() for t in comps.values()}
        if len(sizes) > 1:
            raise ValueError(f"every page component must share one page size, got {sorted(sizes)}")
        self.copier = DeviceCopier(self.device, send_budget_bytes=send_budget_bytes)
        self.budget = self.copier.budget

    # -- PagePool --------------------------------------------------------------------------

    @property
    def page_layers(self) -> Collection[int]:
        return self.pages.keys()

    @property
    def state_layers(self) -> Collection[int]:
        return self.states.keys()

    @property
    def page_size(self) -> int:
        for comps in self.pages.values():
            for tensor in comps.values():
                return int(tensor.shape[1])
        return 0

    def gather(self, layer: int, block_ids: Sequence[int]) -> HostCopy:
        """A host copy of `layer`'s pages `block_ids`, each component `(n, page_size, *token)`."""
        comps = self._layer(self.pages, "paged (full-attention)", layer)
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        return self._read(layer, comps, ids, one=False)

    def read_state(self, layer: int, slot: int) -> HostCopy:
        """A host copy of `layer`'s state components in `slot`."""
        comps = self._layer(self.states, "state (linear-attention)", layer)
        return self._read(layer, comps, torch.tensor([slot], dtype=torch.long), one=True)

    def scatter(
        self,
        layer: int,
        arrays: Mapping[str, np.ndarray],
        first_token: int,
        block_ids: Sequence[int],
        *,
        skip: int = 0,
    ) -> int:
        """Write token-ordered pages into this pool (as `PagedPool.scatter`); returns the
        end of the tokens covered. The write is enqueued: see `fence()`."""
        dest = self._layer(self.pages, "paged (full-attention)", layer)
        shapes = {n: (tuple(t.shape), self._wire_dtype(layer, n)) for n, t in dest.items()}
        check_pages(layer, arrays, shapes)
        where = Placement.of(arrays, first_token, block_ids, self.page_size, skip)
        if not len(where.rows):
            return where.end
        with self.copier.placing():
            index = (self.copier.index(where.pages), self.copier.index(where.offsets))
            for name, src in arrays.items():
                rows = self.copier.staged(where.rows_of(src), dest[name].dtype)
                dest[name].index_put_(index, rows)
        return where.end

    def write_state(self, layer: int, slot: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Write a state received for `layer` into `slot` (enqueued: see `fence()`)."""
        dest = self._layer(self.states, "state (linear-attention)", layer)
        if set(arrays) != set(dest):
            raise PageError(f"layer {layer}: got states {sorted(arrays)}, pool has {sorted(dest)}")
        for name, src in arrays.items():
            target = dest[name]
            wire = self._wire_dtype(layer, name)
            if src.shape != tuple(target.shape[1:]) or src.dtype != wire:
                raise PageError(
                    f"layer {layer} state {name!r}: {src.dtype}{list(src.shape)} does not match "
                    f"the pool's {wire}{list(target.shape[1:])}"
                )
        with self.copier.placing():
            for name, src in arrays.items():
                dest[name][slot].copy_(self.copier.staged(src, dest[name].dtype), non_blocking=True)

    # -- completion --------------------------------------------------------------------------

    def fence(self) -> Fence:
        """Marks every write enqueued so far: ready once they are all in the engine's memory."""
        return self.copier.placed()

    def reads_done(self) -> None:
        """Wait until every copy out of the engine's memory enqueued so far has finished."""
        self.copier.reads_done()

    # -- internals ---------------------------------------------------------------------------

    def _read(self, layer: int, comps: Tensors, ids: torch.Tensor, *, one: bool) -> HostCopy:
        """Rows `ids` of every component into host buffers from the budget (`one`: a single
        row, handed out without its leading axis)."""
        roots, fence = self.copier.to_host(comps, ids)
        return HostCopy({n: self._to_wire(layer, n, root, one) for n, root in roots.items()}, fence)

    def _wire_dtype(self, layer: int, name: str) -> np.dtype[Any]:
        wire = self._wire.get((layer, name))
        if wire is not None:
            return wire
        comps = self.pages.get(layer) or self.states[layer]
        dtype: np.dtype[Any] = np.dtype(numpy_dtype(comps[name].dtype))
        return dtype

    def _to_wire(self, layer: int, name: str, root: np.ndarray, one: bool) -> np.ndarray:
        """A view of a budget buffer's `root` in wire form (a view: the budget holds the
        bytes while it lives)."""
        wire = self._wire.get((layer, name))
        array = root if wire is None else root.view(wire)
        return array[0] if one else array

    @staticmethod
    def _layer(where: Mapping[int, Tensors], what: str, layer: int) -> Tensors:
        comps = where.get(layer)
        if comps is None:
            raise PageError(f"layer {layer} is not a {what} layer of this pool")
        return comps


def _movable(what: str, comps: Tensors, min_ndim: int) -> dict[str, torch.Tensor]:
    """`comps` as views torch can index and numpy can hold (bfloat16 and fp8 as integers)."""
    if not comps:
        raise ValueError(f"{what} has no components")
    out = {}
    for name, tensor in comps.items():
        if not isinstance(tensor, torch.Tensor) or tensor.ndim < min_ndim:
            raise ValueError(
                f"{what}[{name!r}] must be a torch tensor with >= {min_ndim} dims, got "
                f"{type(tensor).__name__} {getattr(tensor, 'shape', None)}"
            )
        out[name] = movable(tensor)
        numpy_dtype(out[name].dtype)  # raises for a dtype the wire cannot carry
    if len({t.shape[0] for t in out.values()}) != 1:
        raise ValueError(f"{what} components disagree on their count")
    return out
