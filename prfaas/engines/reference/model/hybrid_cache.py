"""The model-facing cache: per-layer full-attention KV and linear-attention states for B rows.

`HybridCache` duck-types the part of `transformers`' `Cache` that the hybrid decoder layers
call (`update`, `get_conv_state`, `update_conv_state`, `get_recurrent_state`,
`update_recurrent_state`, `is_recording_past`), with the same semantics as `DynamicCache`, so
the unmodified `transformers` layers run on state the engine owns. Rows are left-padded to a
common length; `lengths[i]` says how many trailing positions of row i are real. A `SeqState` is
one row taken out (no padding), the unit the engine stores, ships and re-batches.

Tensors of full-attention layers have the sequence on dim -2 (GQA keys/values, or MLA's
compressed latents); linear layers keep a conv state `(B, C, K)` and a recurrent state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class SeqState:
    """One sequence's state after `length` tokens: KV of full layers, states of linear layers."""

    length: int = 0
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # (1, h, length, d)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # (1, C, K)
    rec: dict[int, torch.Tensor] = field(default_factory=dict)  # (1, H, dk, dv)

    def nbytes(self) -> int:
        """Bytes held by all tensors."""
        groups = (self.keys, self.values, self.conv, self.rec)
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())


def _left_pad(tensors: Sequence[torch.Tensor], lengths: Sequence[int]) -> torch.Tensor:
    width = max(lengths)
    padded = [
        F.pad(t, (0, 0, width - n, 0)) if n < width else t
        for t, n in zip(tensors, lengths, strict=True)
    ]
    return torch.cat(padded, dim=0)


def _append(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`cat([cached, new], dim=-2)`, in place when `cached` is a view of a buffer with room.

    The result is a view `buffer[..., :width, :]`; the buffer's spare positions past the
    view are never read (masks and `row` only look at real positions)."""
    width, n = cached.shape[-2], new.shape[-2]
    base = cached._base if cached._base is not None else cached
    room = base.shape[-2] if base.shape[:-2] == cached.shape[:-2] else width
    if width + n > room or base.data_ptr() != cached.data_ptr() or not base.is_contiguous():
        room = max(2 * width, width + n, 64)
        base = cached.new_empty((*cached.shape[:-2], room, cached.shape[-1]))
        base[..., :width, :] = cached
    base[..., width : width + n, :] = new
    return base[..., : width + n, :]


class HybridCache:
    """Batched hybrid state for one forward pass; mutated in place by the model's layers."""

    def __init__(self, states: Sequence[SeqState]) -> None:
        """Stack `states` (at least one) into left-padded batch tensors."""
        if not states:
            raise ValueError("HybridCache needs at least one sequence")
        self.lengths = [s.length for s in states]
        first = states[0]
        self.keys = {i: _left_pad([s.keys[i] for s in states], self.lengths) for i in first.keys}
        self.values = {
            i: _left_pad([s.values[i] for s in states], self.lengths) for i in first.values
        }
        self.conv = {i: torch.cat([s.conv[i] for s in states]) for i in first.conv}
        self.rec = {i: torch.cat([s.rec[i] for s in states]) for i in first.rec}

    @property
    def width(self) -> int:
        """Padded sequence length of the full-attention tensors."""
        return max(self.lengths)

    def row(self, i: int) -> SeqState:
        """Copy of row `i` without padding."""
        n = self.lengths[i]
        return SeqState(
            length=n,
            keys={k: v[i : i + 1, ..., v.shape[-2] - n :, :].clone() for k, v in self.keys.items()},
            values={
                k: v[i : i + 1, ..., v.shape[-2] - n :, :].clone() for k, v in self.values.items()
            },
            conv={k: v[i : i + 1].clone() for k, v in self.conv.items()},
            rec={k: v[i : i + 1].clone() for k, v in self.rec.items()},
        )

    def advance(self, n: int) -> None:
        """Record that every row grew by `n` tokens (call after the forward)."""
        self.lengths = [length + n for length in self.lengths]

    # --- the transformers Cache surface used by the hybrid layers ---------------------------

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values of a full-attention layer; return the whole KV.

        Appends go into a buffer with spare room (doubling when full), so a decode step
        writes one position instead of copying the whole cache."""
        if layer_idx not in self.keys:
            self.keys[layer_idx], self.values[layer_idx] = key, value
            return key, value
        self.keys[layer_idx] = _append(self.keys[layer_idx], key)
        self.values[layer_idx] = _append(self.values[layer_idx], value)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv.get(layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.rec.get(layer_idx)

    def update_conv_state(
        self, x: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """As `DynamicCache`: return previous state + `x` (left zero-padded to the kernel on a
        fresh sequence) and keep the last kernel-size columns as the new state."""
        kernel = int(kwargs.get("conv_kernel_size") or x.shape[-1])
        previous = self.conv.get(layer_idx)
        if previous is None:
            full = F.pad(x, (kernel - x.shape[-1], 0)) if x.shape[-1] < kernel else x
        else:
            full = torch.cat([previous, x], dim=-1)
        self.conv[layer_idx] = full[..., -kernel:].clone()
        return full

    def update_recurrent_state(
        self, state: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.rec[layer_idx] = state
        return state

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width
