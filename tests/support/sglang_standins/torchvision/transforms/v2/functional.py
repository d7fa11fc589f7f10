"""Stand-in `torchvision.transforms.v2.functional`: no attributes (see the package
docstring)."""

from __future__ import annotations

from typing import NoReturn

from torchvision import missing


def __getattr__(name: str) -> NoReturn:
    missing("torchvision.transforms.v2.functional", name)
