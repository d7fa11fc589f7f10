"""SGLang's KV memory, seen through `KVArgs`: byte views over the pointers a KV manager is
given, as a `PagePool` (full-attention pages and Mamba state slots) plus the aux
(metadata) buffers.

`KVArgs` carries raw pointers, lengths and per-item byte sizes, and the global layer id of
every entry. Everything here is bytes (uint8): K and V of one token are
`item_len // page_size` bytes, a Mamba state slot is `item_len` bytes. Both PD roles build
their views with the same code from their own `KVArgs`, so component names and layer ids
agree, and a decode checks the prefill's layout (`layout()`) before its first transfer.

The views are torch tensors on the pool's device (CPU tensors over host memory in tests,
CUDA tensors over device memory on GPU) so one code path gathers and scatters on both.
Reads return host numpy copies (through pinned memory on CUDA); writes take host arrays.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prfaas.engines.kv_pages import HostCopy, PageError

Arrays = Mapping[str, np.ndarray]
MAMBA = "mamba"  # StateType.MAMBA's value: the only state kind this backend moves


class _DeviceMemory:
    """An object exposing `__cuda_array_interface__` over a device pointer (no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


def raw_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `nbytes` of memory the engine owns at `ptr` (shared, no copy)."""
    if nbytes <= 0:
        raise ValueError(f"buffer at {ptr:#x} has {nbytes} bytes")
    if device.type == "cpu":
        array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        return torch.from_numpy(array)
    return torch.as_tensor(_DeviceMemory(ptr, nbytes), device=device)


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A host numpy copy of `tensor` (through pinned memory when it lives on a GPU)."""
    if tensor.device.type == "cpu":
        return tensor.numpy().copy()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host.numpy()


def _names(count: int) -> list[str]:
    return (
        ["kv"] if count == 1 else ["k", "v"] if count == 2 else [f"part{i}" for i in range(count)]
    )


@dataclass(frozen=True)
class KVLayout:
    """What must agree between a prefill and a decode (sent by the decode at registration)."""

    page_size: int
    pages: dict[int, dict[str, int]]
    """Layer -> component -> bytes per token."""
    states: dict[int, dict[str, int]]
    """Layer -> component -> bytes per slot."""
    aux_item_lens: list[int]

    def to_json(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "pages": {str(k): v for k, v in self.pages.items()},
            "states": {str(k): v for k, v in self.states.items()},
            "aux_item_lens": self.aux_item_lens,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KVLayout:
        return cls(
            page_size=int(data["page_size"]),
            pages={int(k): dict(v) for k, v in data["pages"].items()},
            states={int(k): dict(v) for k, v in data["states"].items()},
            aux_item_lens=[int(n) for n in data["aux_item_lens"]],
        )

    def mismatch(self, other: KVLayout) -> str | None:
        """Why `other` (a peer's layout) cannot exchange KV with this one, or None."""
        if other.page_size != self.page_size:
            return f"page size {other.page_size} != {self.page_size}"
        if other.pages != self.pages:
            return f"full-attention layers {other.pages} != {self.pages}"
        if other.states != self.states:
            return f"state layers {other.states} != {self.states}"
        if other.aux_item_lens != self.aux_item_lens:
            return f"metadata buffers {other.aux_item_lens} != {self.aux_item_lens}"
        return None


class SGLangPool:
    """A `PagePool` over the KV pages and Mamba state slots a `KVArgs` describes."""

    def __init__(self, kv_args: Any, device: torch.device, *, is_mla: bool) -> None:
        self.device = device
        self._page_size = int(kv_args.page_size)
        self.pages = _page_views(kv_args, device, self._page_size, is_mla=is_mla)
        self.states = _state_views(kv_args, device)

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def page_layers(self) -> Collection[int]:
        return self.pages.keys()

    @property
    def state_layers(self) -> Collection[int]:
        return self.states.keys()

    def layout(self, aux_item_lens: Sequence[int]) -> KVLayout:
        return KVLayout(
            page_size=self._page_size,
            pages={
                layer: {n: int(t.shape[2]) for n, t in comps.items()}
                for layer, comps in self.pages.items()
            },
            states={
                layer: {n: int(t.shape[1]) for n, t in comps.items()}
                for layer, comps in self.states.items()
            },
            aux_item_lens=[int(n) for n in aux_item_lens],
        )

    # -- PagePool ----------------------------------------------------------------------

    def gather(self, layer: int, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> HostCopy:
        """Host copies of `layer`'s pages `block_ids`, each `(n, page_size, token_bytes)`."""
        ids = self._index(block_ids)
        views = self._layer(self.pages, layer)
        return HostCopy({name: to_host(view[ids]) for name, view in views.items()})

    def scatter(
        self,
        layer: int,
        arrays: Arrays,
        first_token: int,
        block_ids: Sequence[int],
        *,
        skip: int = 0,
    ) -> int:
        """Write token-ordered pages (tokens `first_token ..`) into this request's
        `block_ids`; tokens past their capacity or below `skip` are not written. Returns the
        end of the tokens covered (as `PagedPool.scatter`)."""
        dest = self._layer(self.pages, layer)
        if set(arrays) != set(dest):
            raise PageError(f"layer {layer}: got {sorted(arrays)}, pool has {sorted(dest)}")
        for name, src in arrays.items():
            width = dest[name].shape[2]
            if src.dtype != np.uint8 or src.ndim != 3 or src.shape[2] != width:
                raise PageError(
                    f"layer {layer} {name!r}: {src.dtype}{list(src.shape)} does not fit "
                    f"{width} bytes per token"
                )
        capacity = len(block_ids) * self._page_size
        end = first_token
        table = torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
        for name, src in arrays.items():  # validated first: a refused message writes nothing
            tokens = src.reshape(-1, src.shape[2])
            end = max(first_token, min(first_token + len(tokens), capacity))
            positions = torch.arange(max(first_token, skip), end)
            rows = torch.from_numpy(np.ascontiguousarray(tokens[(positions - first_token).numpy()]))
            pages = table[positions // self._page_size].to(self.device)
            offsets = (positions % self._page_size).to(self.device)
            dest[name][pages, offsets] = rows.to(self.device)
        return end

    def read_state(self, layer: int, slot: int) -> HostCopy:
        views = self._layer(self.states, layer)
        return HostCopy({name: to_host(view[slot]) for name, view in views.items()})

    def write_state(self, layer: int, slot: int, arrays: Arrays) -> None:
        dest = self._layer(self.states, layer)
        if set(arrays) != set(dest):
            raise PageError(f"layer {layer}: got states {sorted(arrays)}, pool has {sorted(dest)}")
        for name, src in arrays.items():
            target = dest[name]
            if src.dtype != np.uint8 or src.shape != tuple(target.shape[1:]):
                raise PageError(
                    f"layer {layer} state {name!r}: {src.dtype}{list(src.shape)} does not fit "
                    f"{target.shape[1]} bytes per slot"
                )
            target[slot] = torch.from_numpy(np.ascontiguousarray(src)).to(self.device)

    def flush(self) -> None:
        """Wait until every write issued so far has landed (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _index(self, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        if isinstance(block_ids, torch.Tensor):
            return block_ids.to(self.device, torch.int64)
        return torch.as_tensor(np.asarray(block_ids, dtype=np.int64)).to(self.device)

    @staticmethod
    def _layer(table: Mapping[int, dict[str, torch.Tensor]], layer: int) -> dict[str, torch.Tensor]:
        comps = table.get(layer)
        if comps is None:
            raise PageError(f"layer {layer} is not in this pool")
        return comps


def _page_views(
    kv_args: Any, device: torch.device, page_size: int, *, is_mla: bool
) -> dict[int, dict[str, torch.Tensor]]:
    ptrs, lens, items = kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens
    layer_ids = list(kv_args.kv_layer_ids or []) or _positional_layer_ids(
        len(ptrs), int(getattr(kv_args, "num_draft_entries", 0) or 0), 1 if is_mla else 2
    )
    if len(layer_ids) != len(ptrs):
        raise ValueError(f"{len(layer_ids)} KV layer ids for {len(ptrs)} KV buffers")
    views: dict[int, list[torch.Tensor]] = {}
    for layer, ptr, nbytes, item in zip(layer_ids, ptrs, lens, items, strict=True):
        if int(item) % page_size:
            raise ValueError(f"KV item of {item} bytes is not a whole number of tokens")
        usable = int(nbytes) // int(item) * int(item)
        view = raw_bytes(int(ptr), usable, device)
        views.setdefault(int(layer), []).append(view.view(-1, page_size, int(item) // page_size))
    return {layer: dict(zip(_names(len(v)), v, strict=True)) for layer, v in views.items()}


def _positional_layer_ids(entries: int, draft: int, groups: int) -> list[int]:
    """Layer ids of pools that report none: per pool, K of every layer then V (MLA: one
    group); draft layers get ids in a band of their own above the target's."""
    ids: list[int] = []
    for count, base in ((entries - draft, 0), (draft, 1 << 12)):
        if count % groups:
            raise ValueError(f"{count} KV buffers do not split into {groups} groups per layer")
        ids += [base + i % (count // groups) for i in range(count)] if count else []
    return ids


def _state_views(kv_args: Any, device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    views: dict[int, dict[str, torch.Tensor]] = {}
    types = [getattr(t, "value", t) for t in (kv_args.state_types or [])]
    for c, kind in enumerate(types):
        if kind != MAMBA:
            raise ValueError(
                f"state kind {kind!r} is not supported by the prfaas transfer backend "
                f"(it moves full-attention pages and Mamba states)"
            )
        ptrs, lens = kv_args.state_data_ptrs[c], kv_args.state_data_lens[c]
        items, layer_ids = kv_args.state_item_lens[c], kv_args.state_layer_ids[c]
        if len(layer_ids) != len(ptrs):
            raise ValueError(f"{len(layer_ids)} state layer ids for {len(ptrs)} state buffers")
        for layer, ptr, nbytes, item in zip(layer_ids, ptrs, lens, items, strict=True):
            comps = views.setdefault(int(layer), {})
            usable = int(nbytes) // int(item) * int(item)
            comps[f"{c}.{len(comps)}"] = raw_bytes(int(ptr), usable, device).view(-1, int(item))
    return views


class AuxBuffers:
    """SGLang's metadata buffers (first token, logprobs, ...): one item per request slot in
    each buffer, always in host memory."""

    def __init__(self, kv_args: Any) -> None:
        cpu = torch.device("cpu")
        self.item_lens = [int(n) for n in kv_args.aux_item_lens]
        self.views = [
            raw_bytes(int(p), int(n) // int(i) * int(i), cpu).view(-1, int(i))
            for p, n, i in zip(
                kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens, strict=True
            )
        ]

    def read(self, index: int) -> bytes:
        """Every buffer's item `index`, concatenated."""
        return b"".join(view[index].numpy().tobytes() for view in self.views)

    def write(self, index: int, payload: bytes) -> None:
        """Split `payload` (as `read` made it) into every buffer's item `index`.

        Raises:
            PageError: the payload does not have the buffers' total item size.
        """
        if len(payload) != sum(self.item_lens):
            raise PageError(f"metadata of {len(payload)} bytes, expected {sum(self.item_lens)}")
        data = np.frombuffer(payload, dtype=np.uint8)
        offset = 0
        for view, size in zip(self.views, self.item_lens, strict=True):
            view[index] = torch.from_numpy(data[offset : offset + size].copy())
            offset += size
