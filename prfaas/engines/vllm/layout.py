"""vLLM's KV memory as a `PagedPool`: which layer is in which KV-cache group, and numpy views
of each layer's pages (full attention) or state slots (Mamba / gated delta net).

A hybrid model has one block table per KV-cache group; a group holds layers of one spec.
Attention layouts understood: the CPU backend's `(blocks, kv_heads, block_size,
2 * head_size)` (per block and head: the keys of every token, then the values) and the
`(2, blocks, block_size, kv_heads, head_size)` of the flash backends. A Mamba layer's page is
raw bytes holding its state tensors one after the other (`MambaSpec.shapes` / `dtypes`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from prfaas.engines.kv_pages import PagedPool
from prfaas.engines.kv_pages.torch_views import as_numpy

_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """The model layer number in a vLLM layer name (`model.layers.3.self_attn.attn` -> 3)."""
    found = _LAYER.search(name)
    if found is None:
        raise ValueError(f"no layer number in vLLM layer name {name!r}")
    return int(found.group(1))


@dataclass(frozen=True)
class GroupLayout:
    """The KV-cache groups of one engine: per layer its group, per group its block size and
    whether it holds states (Mamba) rather than pages."""

    group_of: Mapping[int, int]
    block_size: tuple[int, ...]
    is_state: tuple[bool, ...]

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> GroupLayout:
        group_of: dict[int, int] = {}
        sizes, states = [], []
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            sizes.append(int(spec.block_size))
            states.append(hasattr(spec, "shapes") and hasattr(spec, "dtypes"))
            for name in group.layer_names:
                group_of[layer_index(name)] = gid
        return cls(group_of, tuple(sizes), tuple(states))

    def state_slot(self, layer: int, block_ids: tuple[list[int], ...], num_tokens: int) -> int:
        """The block holding `layer`'s state after `num_tokens` tokens (the block of the
        last token, in its group's table)."""
        gid = self.group_of[layer]
        return block_ids[gid][(num_tokens - 1) // self.block_size[gid]]


def build_pool(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> PagedPool:
    """Views of every layer of `kv_caches` (vLLM's `register_kv_caches` argument).

    Raises:
        ValueError: a layout this adapter does not know (the message names the layer).
    """
    specs = {
        name: group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    pages: dict[int, dict[str, np.ndarray]] = {}
    states: dict[int, dict[str, np.ndarray]] = {}
    for name, tensor in kv_caches.items():
        spec = specs[name]
        if hasattr(spec, "shapes"):
            states[layer_index(name)] = _state_views(name, as_numpy(tensor), spec)
        else:
            pages[layer_index(name)] = _page_views(name, as_numpy(tensor), spec)
    return PagedPool(pages=pages, states=states)


def _page_views(name: str, cache: np.ndarray, spec: Any) -> dict[str, np.ndarray]:
    heads, dim, size = int(spec.num_kv_heads), int(spec.head_size), int(spec.block_size)
    if cache.ndim == 4 and cache.shape[1:] == (heads, size, 2 * dim):  # CPU backend
        both = _view(cache, (cache.shape[0], heads, 2 * size, dim))  # keys, then values
        return {
            "k": both[:, :, :size].transpose(0, 2, 1, 3),  # (blocks, size, heads, dim)
            "v": both[:, :, size:].transpose(0, 2, 1, 3),
        }
    if cache.ndim == 5 and cache.shape[0] == 2 and cache.shape[2:] == (size, heads, dim):
        return {"k": cache[0], "v": cache[1]}  # flash: (blocks, size, heads, dim) already
    raise ValueError(
        f"{name}: KV cache of shape {cache.shape} is neither the CPU "
        f"(blocks, {heads}, {size}, {2 * dim}) nor the flash (2, blocks, {size}, {heads}, {dim}) "
        "layout"
    )


_NUMPY = {"torch.bfloat16": np.uint16, "torch.float16": np.float16, "torch.float32": np.float32}


def _state_views(name: str, raw: np.ndarray, spec: Any) -> dict[str, np.ndarray]:
    blocks = raw.shape[0]
    page = _view(raw, (blocks, -1)).view(np.uint8)  # (blocks, page bytes)
    names = (
        ("conv", "ssm")
        if len(spec.shapes) == 2
        else tuple(f"s{i}" for i in range(len(spec.shapes)))
    )
    views, offset = {}, 0
    for label, shape, dtype in zip(names, spec.shapes, spec.dtypes, strict=True):
        np_dtype = _NUMPY.get(str(dtype))
        if np_dtype is None:
            raise ValueError(f"{name}: state dtype {dtype} is not supported")
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        if offset + nbytes > page.shape[1]:
            raise ValueError(f"{name}: states overrun the {page.shape[1]}-byte page")
        views[label] = _view(page[:, offset : offset + nbytes].view(np_dtype), (blocks, *shape))
        offset += nbytes
    return views


def _view(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`array` reshaped without a copy (a copy would silently detach it from the engine)."""
    return np.reshape(array, shape, copy=False)  # ValueError where only a copy could do it
