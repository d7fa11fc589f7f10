"""Tensor storage beside the block pool: KV pages of full layers and linear-state slots.

`BlockPool` decides which block id or slot holds what; `KVStorage` holds the bytes. Pages are
allocated lazily from the first sequence written (their shapes, dtype and device come from
the model), as
`(num_blocks, heads, block_size, dim)` per full-attention layer and `(num_slots, ...)` per
linear layer for conv and recurrent states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prfaas.engines.reference.model.hybrid_cache import SeqState


class KVStorage:
    """Pages for `num_blocks` blocks of `block_size` tokens, and `num_slots` state slots."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._conv: dict[int, torch.Tensor] = {}
        self._rec: dict[int, torch.Tensor] = {}

    def write_blocks(self, state: SeqState, block_ids: Sequence[int], first: int) -> None:
        """Copy tokens of blocks `first, first+1, ...` of `state` into pages `block_ids`."""
        if not block_ids:
            return
        bs, n = self.block_size, len(block_ids)
        start, end = first * bs, (first + n) * bs
        if end > state.length:
            raise ValueError(f"blocks up to token {end} but the sequence has {state.length}")
        index: torch.Tensor | None = None
        for layer in state.keys:
            for src, pages in ((state.keys, self._k), (state.values, self._v)):
                t = src[layer][0, ..., start:end, :]  # (h, n*bs, d)
                t = t.reshape(*t.shape[:-2], n, bs, t.shape[-1])  # (h, n, bs, d)
                blocks = t.movedim(-3, 0)  # (n, h, bs, d)
                if layer not in pages:
                    pages[layer] = blocks.new_zeros((self.num_blocks, *blocks.shape[1:]))
                if index is None:
                    index = torch.tensor(list(block_ids), device=blocks.device)
                pages[layer].index_copy_(0, index, blocks)

    def gather(self, block_ids: Sequence[int]) -> SeqState:
        """A sequence state holding the KV of `block_ids` (no linear states)."""
        state = SeqState(length=len(block_ids) * self.block_size)
        if not block_ids:
            return state
        index: torch.Tensor | None = None
        for layer, pages in self._k.items():
            if index is None:
                index = torch.tensor(list(block_ids), device=pages.device)
            for dst, src in ((state.keys, pages), (state.values, self._v[layer])):
                blocks = src.index_select(0, index)  # (n, h, bs, d)
                dst[layer] = blocks.movedim(0, -3).flatten(-3, -2).unsqueeze(0)  # (1,h,T,d)
        return state

    def save_state(self, slot: int, state: SeqState) -> None:
        """Copy the linear states of `state` into `slot`."""
        for src, slots in ((state.conv, self._conv), (state.rec, self._rec)):
            for layer, t in src.items():
                if layer not in slots:
                    slots[layer] = t.new_zeros((self.num_slots, *t.shape[1:]))
                slots[layer][slot].copy_(t[0])

    def load_state(self, slot: int, into: SeqState) -> None:
        """Copy the linear states saved in `slot` into `into` (fresh tensors)."""
        for slots, dst in ((self._conv, into.conv), (self._rec, into.rec)):
            for layer, t in slots.items():
                dst[layer] = t[slot : slot + 1].clone()

    def nbytes(self) -> int:
        """Bytes allocated for pages and slots."""
        groups = (self._k, self._v, self._conv, self._rec)
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())
