"""A narrow stand-in for torchvision in the SGLang test environment (NOT torchvision).

PyPI's torchvision wheels do not load against the CPU torch the tests use (its compiled
operators are missing), yet `sglang.srt.configs` imports torchvision's transforms for
vision-language models at import time. This package provides only the names those
imports bind; any other attribute is missing (AttributeError) and any use of an image
function raises RuntimeError at once. No test
runs a vision model. The Makefile puts it on the SGLang test environment's path.
"""

from __future__ import annotations

from typing import NoReturn

__version__ = "0.0.0+prfaas.standin"


def unavailable(name: str) -> NoReturn:
    """Raise for a torchvision function the stand-in does not provide."""
    raise RuntimeError(f"torchvision.{name} is not available: this is the test stand-in")


def missing(module: str, name: str) -> NoReturn:
    """A module `__getattr__` body: the stand-in does not have `name`."""
    raise AttributeError(f"{module}.{name} is not in the torchvision test stand-in")


def __getattr__(name: str) -> NoReturn:
    missing("torchvision", name)
