"""Stand-in `torchvision.io`: `ImageReadMode` and a `decode_image` that raises (see the
package docstring)."""

from __future__ import annotations

from enum import Enum
from typing import Any, NoReturn

from torchvision import missing, unavailable


class ImageReadMode(Enum):
    """The read modes transformers' image utilities name at import time."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def decode_image(*args: Any, **kwargs: Any) -> NoReturn:
    unavailable("io.decode_image")


def __getattr__(name: str) -> NoReturn:
    missing("torchvision.io", name)
