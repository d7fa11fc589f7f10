"""`PagedPool`: an engine's paged KV pool and state slots, described as numpy views; and
`PagePool`, the interface `PageStream` and `PagePlacer` use (`PagedPool` implements it for
host memory; an adapter whose pages live in device memory implements it itself).

An engine adapter builds one over its own memory (no copy): for every full-attention layer,
each component ("k", "v", or one fused "kv" for MLA latents) as an array of shape
`(num_pages, page_size, *token_shape)`, pages first and tokens in page order (a strided
view of whatever layout the engine keeps, e.g. `cache[0].transpose(0, 2, 1, 3)` for a
`(2, pages, heads, page_size, dim)` tensor); for every linear-attention (or Mamba) layer,
each state component as `(num_slots, *state_shape)`. bfloat16 is viewed as uint16 (its
bits travel unchanged).

Reads (`gather`, `read_state`) copy, so the engine may reuse its pages at once; writes
(`scatter`, `write_state`) go through the views into the engine's memory.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from prfaas.engines.kv_pages.errors import PageError
from prfaas.engines.kv_pages.host_copy import HostCopy

Arrays = Mapping[str, np.ndarray]


class PagePool(Protocol):
    """What the mover needs from a pool: reads return host (numpy) copies, complete when
    their `HostCopy` is ready; writes take host arrays; both in the wire layout of `wire.py`
    (see `PagedPool` for the semantics). `PagedPool` (host memory) and `TorchPagePool`
    (torch views on any device) implement it."""

    @property
    def page_size(self) -> int: ...

    @property
    def page_layers(self) -> Collection[int]:
        """The full-attention (paged) layers."""
        ...

    @property
    def state_layers(self) -> Collection[int]:
        """The linear-attention (state slot) layers."""
        ...

    def gather(self, layer: int, block_ids: Sequence[int]) -> HostCopy: ...

    def scatter(
        self,
        layer: int,
        arrays: Arrays,
        first_token: int,
        block_ids: Sequence[int],
        *,
        skip: int = 0,
    ) -> int: ...

    def read_state(self, layer: int, slot: int) -> HostCopy: ...

    def write_state(self, layer: int, slot: int, arrays: Arrays) -> None: ...


@dataclass(frozen=True, eq=False)
class PagedPool:
    """Page and state-slot views of one engine's KV memory (see the module docstring)."""

    pages: Mapping[int, Arrays]
    """Full-attention layer -> component -> `(num_pages, page_size, *token_shape)` view."""
    states: Mapping[int, Arrays] = field(default_factory=dict)
    """Linear-attention layer -> component -> `(num_slots, *state_shape)` view."""

    def __post_init__(self) -> None:
        sizes = {a.shape[1] for comps in self.pages.values() for a in comps.values() if a.ndim > 1}
        for layer, comps in self.pages.items():
            _check_components("pages", layer, comps, min_ndim=2)
        for layer, comps in self.states.items():
            _check_components("states", layer, comps, min_ndim=1)
        if len(sizes) > 1:
            raise ValueError(f"every page component must share one page size, got {sorted(sizes)}")

    @property
    def page_layers(self) -> Collection[int]:
        """The full-attention (paged) layers."""
        return self.pages.keys()

    @property
    def state_layers(self) -> Collection[int]:
        """The linear-attention (state slot) layers."""
        return self.states.keys()

    @property
    def page_size(self) -> int:
        """Tokens per page (0 for a pool without full-attention layers)."""
        for comps in self.pages.values():
            for array in comps.values():
                return int(array.shape[1])
        return 0

    def gather(self, layer: int, block_ids: Sequence[int]) -> HostCopy:
        """A copy of `layer`'s pages `block_ids`, each component `(n, page_size, *token)`."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return HostCopy({name: array[ids] for name, array in self._layer_pages(layer).items()})

    def scatter(
        self,
        layer: int,
        arrays: Arrays,
        first_token: int,
        block_ids: Sequence[int],
        *,
        skip: int = 0,
    ) -> int:
        """Write token-ordered pages into this pool; returns the end of the tokens covered.

        `arrays` holds `(n, sender_page_size, *token_shape)` per component: tokens
        `first_token ..` of the request, whatever the sender's page size. `block_ids` is the
        request's block table here; tokens past its capacity (the sender's padding of a last,
        partial page) and tokens below `skip` (already held here) are not written.

        Raises:
            PageError: unknown layer, missing component, or a token shape/dtype mismatch.
        """
        dest = self._layer_pages(layer)
        check_pages(layer, arrays, {n: (a.shape, a.dtype) for n, a in dest.items()})
        where = Placement.of(arrays, first_token, block_ids, self.page_size, skip)
        for name, src in arrays.items():  # validated first: a refused message writes nothing
            dest[name][where.pages, where.offsets] = where.rows_of(src)
        return where.end

    def read_state(self, layer: int, slot: int) -> HostCopy:
        """A copy of `layer`'s state components in `slot`."""
        states = self._layer_states(layer)
        return HostCopy({name: array[slot].copy() for name, array in states.items()})

    def write_state(self, layer: int, slot: int, arrays: Arrays) -> None:
        """Write a state received for `layer` into `slot`.

        Raises:
            PageError: unknown layer, missing component, or a shape/dtype mismatch.
        """
        dest = self._layer_states(layer)
        if set(arrays) != set(dest):
            raise PageError(f"layer {layer}: got states {sorted(arrays)}, pool has {sorted(dest)}")
        for name, src in arrays.items():
            target = dest[name]
            if src.shape != target.shape[1:] or src.dtype != target.dtype:
                raise PageError(
                    f"layer {layer} state {name!r}: {src.dtype}{list(src.shape)} does not match "
                    f"the pool's {target.dtype}{list(target.shape[1:])}"
                )
            target[slot] = src

    def _layer_pages(self, layer: int) -> Arrays:
        comps = self.pages.get(layer)
        if comps is None:
            raise PageError(f"layer {layer} is not a paged (full-attention) layer of this pool")
        return comps

    def _layer_states(self, layer: int) -> Arrays:
        comps = self.states.get(layer)
        if comps is None:
            raise PageError(f"layer {layer} is not a state (linear-attention) layer of this pool")
        return comps


def _check_components(what: str, layer: int, comps: Arrays, *, min_ndim: int) -> None:
    if not comps:
        raise ValueError(f"{what}[{layer}] has no components")
    leading = {a.shape[0] for a in comps.values() if a.ndim >= min_ndim}
    for name, array in comps.items():
        if not isinstance(array, np.ndarray) or array.ndim < min_ndim:
            raise ValueError(
                f"{what}[{layer}][{name!r}] must be a numpy array with >= {min_ndim} dims, "
                f"got {type(array).__name__} {getattr(array, 'shape', None)}"
            )
    if len(leading) != 1:
        raise ValueError(f"{what}[{layer}] components disagree on their count: {sorted(leading)}")


def check_pages(
    layer: int, arrays: Arrays, dest: Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]
) -> None:
    """Received pages `(n, page, *token)` of `layer` must have the pool's components, and
    each the pool's token shape and (wire) dtype (`dest`: component -> shape, dtype)."""
    if set(arrays) != set(dest):
        raise PageError(f"layer {layer}: got components {sorted(arrays)}, pool has {sorted(dest)}")
    for name, src in arrays.items():
        shape, dtype = dest[name]
        what = f"layer {layer} {name!r}"
        if src.ndim != len(shape) or tuple(src.shape[2:]) != tuple(shape[2:]):
            raise PageError(
                f"{what}: token shape {tuple(src.shape[2:])} does not match the pool's "
                f"{tuple(shape[2:])}"
            )
        if src.dtype != dtype:
            raise PageError(f"{what}: dtype {src.dtype} is not {dtype}")


@dataclass(frozen=True)
class Placement:
    """Where received token rows go in a pool: row `rows[i]` of the received tokens to page
    `pages[i]` at offset `offsets[i]`; `end` is the end of the tokens covered."""

    rows: np.ndarray
    pages: np.ndarray
    offsets: np.ndarray
    end: int

    @classmethod
    def of(
        cls,
        arrays: Arrays,
        first_token: int,
        block_ids: Sequence[int],
        page_size: int,
        skip: int,
    ) -> Placement:
        """Tokens `first_token ..` of a request (`arrays`: `(n, sender_page, *token)` per
        component) into the request's block table `block_ids` of pages of `page_size`:
        tokens past the table's capacity (the sender's padding) and below `skip` (already
        held here) are left out."""
        first = next(iter(arrays.values()))
        count = int(first.shape[0]) * int(first.shape[1]) if first.ndim > 1 else 0
        capacity = len(block_ids) * page_size
        end = max(first_token, min(first_token + count, capacity))
        positions = np.arange(max(first_token, skip), end)
        pages = np.asarray(block_ids, dtype=np.int64)[positions // page_size]
        return cls(positions - first_token, pages, positions % page_size, end)

    def rows_of(self, src: np.ndarray) -> np.ndarray:
        """The received rows of one component that land, in placement order (a copy)."""
        return np.take(src.reshape(-1, *src.shape[2:]), self.rows, axis=0)
