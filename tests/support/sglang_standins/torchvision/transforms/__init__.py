"""Stand-in `torchvision.transforms`: `InterpolationMode` only (see the package docstring)."""

from __future__ import annotations

from enum import Enum
from typing import NoReturn

from torchvision import missing


class InterpolationMode(Enum):
    """The interpolation names SGLang's image processors refer to at import time."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> NoReturn:
    missing("torchvision.transforms", name)
