"""SGLang's KV memory, seen through `KVArgs`: byte views over the pointers a KV manager is
given, as the device-aware page mover's pool (`kv_pages.torch_pool.TorchPagePool`: pages of
full-attention layers and Mamba state slots) plus the aux (metadata) buffers.

`KVArgs` carries raw pointers, lengths and per-item byte sizes, and the global layer id of
every entry. Everything here is bytes (uint8): K and V of one token are
`item_len // page_size` bytes, a Mamba state slot is `item_len` bytes. Both PD roles build
their views with the same code from their own `KVArgs`, so component names and layer ids
agree, and a decode checks the prefill's layout (`layout()`) before its first transfer.

The views are torch tensors on the pool's device (CPU tensors over host memory in tests,
CUDA tensors over device memory on GPU); every one must alias the memory it was built over
(`check_alias`, at build time): a view that silently became a copy would read stale pages
and, on the decode, lose every write. How they move (side-stream copies into a bounded
pinned budget on the prefill, pinned staging on a placing stream and a completion fence on
the decode) is `TorchPagePool`'s.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prfaas.engines.kv_pages import PageError
from prfaas.engines.kv_pages.torch_pool import TorchPagePool

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
    """A uint8 tensor over `nbytes` of memory the engine owns at `ptr` (shared, no copy:
    checked, see `check_alias`)."""
    if nbytes <= 0:
        raise ValueError(f"buffer at {ptr:#x} has {nbytes} bytes")
    if device.type == "cpu":
        array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        tensor = torch.from_numpy(array)
    else:
        tensor = torch.as_tensor(_DeviceMemory(ptr, nbytes), device=device)
    check_alias(tensor, ptr, nbytes, device, f"the buffer at {ptr:#x}")
    return tensor


def check_alias(view: torch.Tensor, ptr: int, nbytes: int, device: torch.device, what: str) -> None:
    """Raise unless `view` lies on `device` inside the `nbytes` registered at `ptr` and
    starts there: a view that does not alias the engine's memory (a copy torch made, e.g.
    of a pointer on another GPU) would read stale pages and lose the decode's writes.

    Raises:
        ValueError: naming `what`, the pointers and the extents.
    """
    problem = ""
    if view.device != device:
        problem = f"it is on {view.device}, the engine's memory on {device}"
    elif view.data_ptr() != ptr:
        problem = f"it starts at {view.data_ptr():#x}, not at the registered {ptr:#x}"
    else:
        extent = _extent(view)
        if extent > nbytes:
            problem = f"it spans {extent} bytes of the {nbytes} registered"
    if problem:
        raise ValueError(
            f"prfaas: the view of {what} does not alias the memory SGLang registered: "
            f"{problem} (a copy would lose the transfer's writes; refusing to start)"
        )


def _extent(view: torch.Tensor) -> int:
    """Bytes from a view's first element to the end of its last."""
    if view.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True))
    return (last + 1) * view.element_size()


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


class SGLangPool(TorchPagePool):
    """The `TorchPagePool` over the KV pages and Mamba state slots a `KVArgs` describes
    (`(num_pages, page_size, token_bytes)` and `(num_slots, slot_bytes)` uint8 views)."""

    def __init__(
        self,
        kv_args: Any,
        device: torch.device,
        *,
        is_mla: bool,
        send_budget_bytes: int | None = None,
    ) -> None:
        page_size = int(kv_args.page_size)
        registered: dict[tuple[str, int, str], tuple[int, int]] = {}
        pages = _page_views(kv_args, device, page_size, is_mla=is_mla, registered=registered)
        states = _state_views(kv_args, device, registered=registered)
        budget = {} if send_budget_bytes is None else {"send_budget_bytes": send_budget_bytes}
        super().__init__(pages, states, **budget)
        for (where, layer, name), (ptr, nbytes) in registered.items():
            view = (self.pages if where == "pages" else self.states)[layer][name]
            check_alias(view, ptr, nbytes, device, f"layer {layer} {name!r}")

    def layout(self, aux_item_lens: Sequence[int]) -> KVLayout:
        return KVLayout(
            page_size=self.page_size,
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


def _page_views(
    kv_args: Any,
    device: torch.device,
    page_size: int,
    *,
    is_mla: bool,
    registered: dict[tuple[str, int, str], tuple[int, int]],
) -> dict[int, dict[str, torch.Tensor]]:
    ptrs, lens, items = kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens
    layer_ids = list(kv_args.kv_layer_ids or []) or _positional_layer_ids(
        len(ptrs), int(getattr(kv_args, "num_draft_entries", 0) or 0), 1 if is_mla else 2
    )
    if len(layer_ids) != len(ptrs):
        raise ValueError(f"{len(layer_ids)} KV layer ids for {len(ptrs)} KV buffers")
    views: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
    for layer, ptr, nbytes, item in zip(layer_ids, ptrs, lens, items, strict=True):
        if int(item) % page_size:
            raise ValueError(f"KV item of {item} bytes is not a whole number of tokens")
        usable = int(nbytes) // int(item) * int(item)
        view = raw_bytes(int(ptr), usable, device).view(-1, page_size, int(item) // page_size)
        views.setdefault(int(layer), []).append((view, int(ptr), int(nbytes)))
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer, entries in views.items():
        for name, (view, ptr, nbytes) in zip(_names(len(entries)), entries, strict=True):
            check_alias(view, ptr, nbytes, device, f"layer {layer} {name!r}")
            registered[("pages", layer, name)] = (ptr, nbytes)
            out.setdefault(layer, {})[name] = view
    return out


def _positional_layer_ids(entries: int, draft: int, groups: int) -> list[int]:
    """Layer ids of pools that report none: per pool, K of every layer then V (MLA: one
    group); draft layers get ids in a band of their own above the target's."""
    ids: list[int] = []
    for count, base in ((entries - draft, 0), (draft, 1 << 12)):
        if count % groups:
            raise ValueError(f"{count} KV buffers do not split into {groups} groups per layer")
        ids += [base + i % (count // groups) for i in range(count)] if count else []
    return ids


def _state_views(
    kv_args: Any, device: torch.device, *, registered: dict[tuple[str, int, str], tuple[int, int]]
) -> dict[int, dict[str, torch.Tensor]]:
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
            name = f"{c}.{len(comps)}"
            comps[name] = raw_bytes(int(ptr), usable, device).view(-1, int(item))
            check_alias(comps[name], int(ptr), int(nbytes), device, f"layer {layer} {name!r}")
            registered[("states", int(layer), name)] = (int(ptr), int(nbytes))
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
