"""Stand-in `torchvision.transforms.v2`: every attribute raises (see the package docstring)."""

from __future__ import annotations

from typing import NoReturn

from torchvision import missing


def __getattr__(name: str) -> NoReturn:
    missing("torchvision.transforms.v2", name)
