"""Forward passes of a `transformers` hybrid model over engine-owned state.

`ModelRunner` runs the unmodified model on a `HybridCache`: a prefill chunk of one sequence, or
one decode step of many. Masks and positions are built here from the rows' lengths, so padded
rows never see each other's padding. A `LayerListener` is called the moment each decoder
layer finishes (a forward hook), in layer order, so KV and states can be shipped while later
layers still compute.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from prfaas.engines.reference.model.hybrid_cache import HybridCache

FULL = "full_attention"
LINEAR = "linear_attention"

LayerListener = Callable[[int, str, HybridCache], None]
"""Called as `(layer_idx, layer_type, cache)` right after decoder layer `layer_idx` ran."""


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know about a loaded model."""

    model_type: str
    layer_types: tuple[str, ...]
    vocab_size: int
    eos_token_id: int | None


def model_shape(model: PreTrainedModel) -> ModelShape:
    """Read the layer pattern, vocabulary and EOS id from a loaded model's config.

    Raises:
        ValueError: if a layer type is neither full nor linear attention.
    """
    config = model.config
    layer_types = tuple(str(t) for t in config.layer_types)
    bad = sorted({t for t in layer_types if t not in (FULL, LINEAR)})
    if bad:
        raise ValueError(f"unsupported layer types {bad} in {config.model_type}")
    eos = config.eos_token_id
    eos_id = eos[0] if isinstance(eos, list) else eos
    return ModelShape(str(config.model_type), layer_types, int(config.vocab_size), eos_id)


def _full_mask(cache: HybridCache, n: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (B, 1, n, W+n) mask on `device`: causal over each row's real positions; None
    when SDPA's own causal mask is exact (no padding, nothing cached)."""
    width = cache.width
    if width == 0 and len(set(cache.lengths)) == 1:
        return None
    total = width + n
    cols = torch.arange(total, device=device).view(1, 1, 1, total)
    query_abs = (width + torch.arange(n, device=device)).view(1, 1, n, 1)
    starts = [width - length for length in cache.lengths]
    return (cols <= query_abs) & (cols >= torch.tensor(starts, device=device).view(-1, 1, 1, 1))


class _Active(threading.local):
    listener: LayerListener | None = None
    cache: HybridCache | None = None


class ModelRunner:
    """Runs a hybrid model on engine-owned `HybridCache`s. Several runners may share one
    model and run on different threads: the listener in force is per thread."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.shape = model_shape(model)
        self.device = model.device
        """Where the weights are: inputs, masks and the cache live there too."""
        self._active = _Active()
        for idx, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(idx))

    def _hook(self, idx: int) -> Callable[..., None]:
        kind = self.shape.layer_types[idx]

        def hook(module: Any, args: Any, output: Any) -> None:
            listener, cache = self._active.listener, self._active.cache
            if listener is not None and cache is not None:
                listener(idx, kind, cache)

        return hook

    @torch.inference_mode()
    def forward(
        self, cache: HybridCache, input_ids: torch.Tensor, listener: LayerListener | None = None
    ) -> torch.Tensor:
        """Run `input_ids` (B, n) after each row's cached tokens; return last-position logits
        (B, vocab) in float32, on the model's device. Mutates `cache` (appends n tokens to
        every row)."""
        n, device = input_ids.shape[1], self.device
        lengths = torch.tensor(cache.lengths, device=device).view(-1, 1)
        positions = lengths + torch.arange(n, device=device).view(1, n)
        masks = {FULL: _full_mask(cache, n, device), LINEAR: None}
        self._active.listener, self._active.cache = listener, cache
        try:
            out = self.model(
                input_ids=input_ids.to(device), attention_mask=masks, position_ids=positions,
                cache=cache, use_cache=True, logits_to_keep=1,
            )  # fmt: skip
        finally:
            self._active.listener, self._active.cache = None, None
        cache.advance(n)
        logits: torch.Tensor = out.logits[:, -1, :].float()
        return logits
