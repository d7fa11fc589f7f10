"""vLLM's KV memory as page and state views for `kv_pages.TorchPagePool`: which layer is in
which KV-cache group, the views themselves, and the layout signature both sides compare.

vLLM 0.32 hands `register_kv_caches` one view per layer of shape `[B, H, N, C]`
(`kv_cache_interface.create_kv_cache_views`): B kernel blocks (a manager block is `ratio`
of them when the backend splits blocks), H head slots, N tokens per kernel block, C the
content of one (head, token) cell (keys then values for attention, the latent for MLA), in
the layer's dtype; strides follow the resolved `KVCacheLayout` (NHD = LBNHC, HND = LBHNC,
the block-outermost BLNHC/BLHNC). How a backend reads a page differs (FlashAttention K|V per
cell, the CPU backend all keys of a head then its values), so the connector does not
interpret pages: a full-attention layer's page is moved as its dense bytes, one component
"kv" of shape `(num_blocks, block_size, page_bytes // block_size)` uint8 over the memory of
each manager block (no copy: asserted to cover exactly the engine's bytes). MLA
`(B, 1, N, 576)` and fp8 caches move unchanged, as bytes. A row of such a page is a token
only for NHD; so both sides must have equal block sizes and a decode's local prefix hit
must end on a block boundary (`check_placement`), and both sides must lay pages out the
same way: `LayoutSignature`, compared before a single byte is placed.

A Mamba / gated-delta-net layer's page holds its state tensors one after the other
(`MambaSpec.shapes` / `dtypes`); those keep one view per state component,
`(num_blocks, *shape)` in their dtype.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

import orjson

from prfaas.engines.kv_pages import PageError

if TYPE_CHECKING:  # torch is imported where views are built (the module imports without it)
    import torch

_LAYER = re.compile(r"layers\.(\d+)\.")
KV = "kv"
"""The one component of a full-attention layer's page: its bytes."""
PAGED_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
"""Attention specs whose pages the connector moves (every token's KV is kept). Sliding
windows, chunked local attention, ring buffers and the rest are refused at start."""
STATE_SPECS = frozenset({"MambaSpec"})


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


# -- the layout signature ----------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutSignature:
    """What must be equal on a prefill and a decode for page bytes to mean the same thing:
    the page layout (the physical order of heads and tokens in a page), the attention
    backend, the tensor-parallel size and rank (which heads a worker holds), the block size,
    and per layer its spec: dtype, heads, head sizes, page bytes; or its state shapes."""

    layout: str
    backend: str
    tp_size: int
    tp_rank: int
    block_size: int
    layers: Mapping[int, tuple[Any, ...]] = field(default_factory=dict)
    cache_dtype: str = "auto"
    """vLLM's `--kv-cache-dtype` (fp8_e4m3 and fp8_e5m2 caches are both uint8 pages)."""

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "layout": self.layout,
                "backend": self.backend,
                "tp_size": self.tp_size,
                "tp_rank": self.tp_rank,
                "block_size": self.block_size,
                "cache_dtype": self.cache_dtype,
                "layers": {str(k): list(v) for k, v in sorted(self.layers.items())},
            }
        )

    @classmethod
    def from_json(cls, payload: bytes) -> LayoutSignature:
        raw = orjson.loads(payload)
        if not isinstance(raw, dict):
            raise PageError("the prefill's layout signature is not a JSON object")
        try:
            layers = {int(k): _tuples(v) for k, v in raw["layers"].items()}
            return cls(
                str(raw["layout"]), str(raw["backend"]), int(raw["tp_size"]),
                int(raw["tp_rank"]), int(raw["block_size"]), layers, str(raw["cache_dtype"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PageError(f"the prefill's layout signature is malformed: {exc!r}") from None

    def mismatch(self, remote: LayoutSignature) -> str | None:
        """Why pages from a prefill with signature `remote` cannot be placed here (None:
        they can). The first difference, named."""
        if remote.tp_size != self.tp_size:
            return (f"tensor-parallel size differs: the prefill runs TP={remote.tp_size}, this "
                    f"decode TP={self.tp_size} (PrfaaS pairs rank r with rank r: equal TP "
                    "sizes are required)")  # fmt: skip
        if remote.tp_rank != self.tp_rank:
            return (f"prefill TP rank {remote.tp_rank} answered this decode's rank "
                    f"{self.tp_rank} (bootstrap ports overlap? each instance uses its port + "
                    "rank for every rank)")  # fmt: skip
        if remote.layout != self.layout:
            return (f"KV cache layout differs: the prefill's pages are {remote.layout}, this "
                    f"decode's {self.layout} (pin one with kv_connector_extra_config "
                    "kv_cache_layout, or VLLM_KV_CACHE_LAYOUT, on both)")  # fmt: skip
        if remote.backend != self.backend:
            return (f"attention backend differs: the prefill runs {remote.backend or '?'}, "
                    f"this decode {self.backend or '?'} (backends lay a page's bytes out "
                    "differently; choose one with --attention-backend on both)")  # fmt: skip
        if remote.block_size != self.block_size:
            return (f"block size differs: the prefill's is {remote.block_size}, this decode's "
                    f"{self.block_size} (pages move as bytes; set --block-size equal on "
                    "both)")  # fmt: skip
        if remote.cache_dtype != self.cache_dtype:
            return (f"KV cache dtype differs: the prefill's is {remote.cache_dtype}, this "
                    f"decode's {self.cache_dtype} (set one --kv-cache-dtype on both)")  # fmt: skip
        if set(remote.layers) != set(self.layers):
            return (f"KV layers differ: the prefill has {sorted(remote.layers)}, this decode "
                    f"{sorted(self.layers)} (another model?)")  # fmt: skip
        for layer in sorted(self.layers):
            if remote.layers[layer] != self.layers[layer]:
                return (f"layer {layer} differs: the prefill's {list(remote.layers[layer])}, "
                        f"this decode's {list(self.layers[layer])} (another model, dtype, "
                        "kv-cache-dtype or head split?)")  # fmt: skip
        return None


def _tuples(value: Any) -> tuple[Any, ...]:
    """JSON lists back into (nested) tuples, as a signature holds them."""
    return tuple(_tuples(v) if isinstance(v, list) else v for v in value)


# -- the views ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolViews:
    """The views `TorchPagePool` takes, and what the connector needs to check a transfer."""

    pages: Mapping[int, Mapping[str, torch.Tensor]]
    """Full-attention layer -> {"kv": (num_blocks, block_size, row_bytes) uint8}."""
    states: Mapping[int, Mapping[str, torch.Tensor]]
    """State layer -> component -> (num_blocks, *shape) in its dtype."""
    block_size: int
    """Tokens per manager block of the full-attention layers (0 without any)."""
    signature: LayoutSignature


def build_views(
    kv_caches: Mapping[str, torch.Tensor],
    kv_cache_config: Any,
    *,
    backend: str = "",
    cache_dtype: str = "auto",
    tp_size: int = 1,
    tp_rank: int = 0,
) -> PoolViews:
    """Views of every layer of `kv_caches` (vLLM's `register_kv_caches` argument) over
    `kv_cache_config.num_blocks` manager blocks.

    Raises:
        ValueError: a spec or layout this connector does not move (the message names the
            layer and why).
    """
    specs = {
        name: group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        for name in group.layer_names
    }
    num_blocks = int(kv_cache_config.num_blocks)
    pages: dict[int, dict[str, torch.Tensor]] = {}
    states: dict[int, dict[str, torch.Tensor]] = {}
    layers: dict[int, tuple[Any, ...]] = {}
    orders: set[str] = set()
    block_sizes: set[int] = set()
    for name, cache in kv_caches.items():
        spec = specs.get(name)
        if spec is None:  # a layer sharing another's cache (vLLM adds it to its own copy)
            continue
        kind = type(spec).__name__
        layer = layer_index(name)
        if kind in STATE_SPECS:
            states[layer] = state_views(name, cache, spec, num_blocks)
            layers[layer] = (
                "state",
                tuple(tuple(int(d) for d in s) for s in spec.shapes),
                tuple(str(d) for d in spec.dtypes),
            )
        elif kind in PAGED_SPECS:
            view, order = page_view(name, cache, spec, num_blocks)
            pages[layer] = {KV: view}
            orders.add(order)
            block_sizes.add(int(spec.block_size))
            layers[layer] = (
                kind, str(spec.dtype), int(spec.num_kv_heads), int(spec.head_size),
                int(spec.head_size_v), int(view.shape[1] * view.shape[2]),
            )  # fmt: skip
        else:
            raise ValueError(
                f"{name}: PrfaasConnector does not move {kind} KV caches (it moves "
                f"{sorted(PAGED_SPECS | STATE_SPECS)}): every token's KV must be kept"
            )
    if len(block_sizes) > 1:
        raise ValueError(f"full-attention layers disagree on their block size: {block_sizes}")
    signature = LayoutSignature(
        layout="/".join(sorted(orders)) or "-",
        backend=backend,
        tp_size=tp_size,
        tp_rank=tp_rank,
        block_size=block_sizes.pop() if block_sizes else 0,
        layers=layers,
        cache_dtype=cache_dtype,
    )
    return PoolViews(pages, states, signature.block_size, signature)


def page_view(
    name: str, cache: torch.Tensor, spec: Any, num_blocks: int
) -> tuple[torch.Tensor, str]:
    """A full-attention layer's `[B, H, N, C]` view as `(num_blocks, block_size, row_bytes)`
    uint8 over each manager block's dense bytes, and the page's head/token order ("NHD" or
    "HND")."""
    if cache.ndim != 4:
        raise ValueError(f"{name}: expected vLLM's [blocks, heads, tokens, content] view, "
                         f"got shape {tuple(cache.shape)}")  # fmt: skip
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    if tokens_per_state != 1:
        raise ValueError(f"{name}: {tokens_per_state} tokens per stored state (compressed "
                         "KV) is not supported")  # fmt: skip
    block_size = int(spec.block_size)
    kernel_blocks = int(cache.shape[0])
    if kernel_blocks % num_blocks:
        raise ValueError(f"{name}: {kernel_blocks} kernel blocks do not split "
                         f"{num_blocks} manager blocks evenly")  # fmt: skip
    ratio = kernel_blocks // num_blocks
    if ratio * int(cache.shape[2]) != block_size:
        raise ValueError(f"{name}: {ratio} kernel blocks of {cache.shape[2]} tokens are not "
                         f"one {block_size}-token block")  # fmt: skip
    raw = _bytes(name, cache)
    raw = raw.view(num_blocks, ratio, *raw.shape[1:])  # (blocks, ratio, H, N, Cb), a view
    page = _dense(name, raw, "a block")
    order = "HND" if cache.stride(1) >= cache.stride(2) or cache.shape[1] == 1 else "NHD"
    if page % block_size:
        raise ValueError(f"{name}: a {page}-byte page is not {block_size} equal rows")
    import torch

    view = torch.as_strided(
        raw, (num_blocks, block_size, page // block_size),
        (raw.stride(0) if num_blocks > 1 else page, page // block_size, 1),
        raw.storage_offset(),
    )  # fmt: skip
    check_alias(name, view, cache)
    return view, order


def state_views(
    name: str, cache: torch.Tensor, spec: Any, num_blocks: int
) -> dict[str, torch.Tensor]:
    """A Mamba layer's page (raw bytes, `[B, 1, 1, C]` or any dense per-block shape) as one
    `(num_blocks, *shape)` view per state component, in its dtype."""
    if int(cache.shape[0]) != num_blocks:
        raise ValueError(f"{name}: {cache.shape[0]} state blocks, expected {num_blocks}")
    raw = _bytes(name, cache)
    page = _dense(name, raw, "a state page")
    import torch

    flat = torch.as_strided(
        raw, (num_blocks, page), (raw.stride(0) if num_blocks > 1 else page, 1),
        raw.storage_offset(),
    )  # fmt: skip
    names = (
        ("conv", "ssm")
        if len(spec.shapes) == 2
        else tuple(f"s{i}" for i in range(len(spec.shapes)))
    )
    views, offset = {}, 0
    for label, shape, dtype in zip(names, spec.shapes, spec.dtypes, strict=True):
        size = torch.empty((), dtype=dtype).element_size()
        nbytes = prod(int(d) for d in shape) * size
        if offset + nbytes > page:
            raise ValueError(f"{name}: states overrun the {page}-byte page")
        part = flat[:, offset : offset + nbytes]
        try:
            typed = part.view(dtype)
        except RuntimeError as exc:
            raise ValueError(f"{name}: state {label!r} is not aligned for {dtype}: {exc}") from None
        views[label] = typed.view(num_blocks, *(int(d) for d in shape))
        check_alias(name, views[label], cache, whole=False)
        offset += nbytes
    return views


def _bytes(name: str, cache: torch.Tensor) -> torch.Tensor:
    """`cache` viewed as uint8 (its content axis in bytes), no copy."""
    import torch

    if cache.stride(-1) != 1:
        raise ValueError(f"{name}: the content axis is not contiguous (strides {cache.stride()})")
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def _dense(name: str, raw: torch.Tensor, what: str) -> int:
    """Bytes of one leading-axis entry of `raw`, asserting they form one dense run
    (whatever the order of the inner axes)."""
    dims = sorted((raw.stride(d), raw.shape[d]) for d in range(1, raw.ndim) if raw.shape[d] > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise ValueError(
                f"{name}: {what} is not one dense byte range (shape {tuple(raw.shape)}, byte "
                f"strides {raw.stride()}): a layout such as LHBNC or BHLNC interleaves blocks "
                "or layers; use NHD (LBNHC) or HND (LBHNC)"
            )
        expected *= size
    return expected


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte addresses a strided tensor touches."""
    size = tensor.element_size()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr(), tensor.data_ptr() + last * size + size - 1


def check_alias(name: str, view: torch.Tensor, cache: torch.Tensor, *, whole: bool = True) -> None:
    """Assert `view` lies on `cache`'s memory (the same storage, within its bytes; with
    `whole`, starting and ending where it does): a copy would silently lose the decode's
    writes."""
    same = view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    (v0, v1), (c0, c1) = _extent(view), _extent(cache)
    inside = c0 <= v0 and v1 <= c1
    if not same or not inside or (whole and (v0, v1) != (c0, c1)):
        raise AssertionError(
            f"{name}: the page view [{v0:#x}, {v1:#x}] does not alias the engine's KV cache "
            f"[{c0:#x}, {c1:#x}]"
        )


def check_placement(block_size: int, skip_tokens: int, sender_block_size: int) -> None:
    """Pages move as bytes, whose rows are tokens only in NHD: refuse what would need them
    to be (a sender's other block size, a local hit ending inside a block).

    Raises:
        PageError: naming the mismatch.
    """
    if sender_block_size != block_size:
        raise PageError(f"the prefill's pages hold {sender_block_size} tokens, this decode's "
                        f"{block_size}: set the same --block-size on both")  # fmt: skip
    if block_size and skip_tokens % block_size:
        raise PageError(f"the local prefix hit ends at token {skip_tokens}, inside a "
                        f"{block_size}-token block (pages move whole)")  # fmt: skip
