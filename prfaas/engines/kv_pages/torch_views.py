"""Torch tensors as numpy views (torch-optional: imported only by adapters that have torch).

`as_numpy` shares memory with the tensor (CPU tensors only), so writes through a `PagedPool`
built from it land in the engine's cache. bfloat16 has no numpy dtype: it is viewed as
uint16, whose bits travel unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def as_numpy(tensor: Any) -> np.ndarray:
    """A numpy view of a CPU torch tensor (bfloat16 as uint16), any strides kept."""
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise ValueError(f"expected a CPU torch tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)  # same item size: a view, strides kept
    array: np.ndarray = tensor.detach().numpy()
    return array
