"""Stand-in `torchvision.transforms.functional`: `InterpolationMode` re-exported, a
`pil_to_tensor` that raises, nothing else (see the package docstring)."""

from __future__ import annotations

from typing import Any, NoReturn

from torchvision import missing, unavailable
from torchvision.transforms import InterpolationMode

__all__ = ["InterpolationMode", "pil_to_tensor"]


def pil_to_tensor(*args: Any, **kwargs: Any) -> NoReturn:
    unavailable("transforms.functional.pil_to_tensor")


def __getattr__(name: str) -> NoReturn:
    missing("torchvision.transforms.functional", name)
