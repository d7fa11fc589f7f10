"""Run a command's main coroutine on uvloop where it is installed, else on asyncio's loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def run_main(main: Coroutine[Any, Any, T]) -> T:
    """`uvloop.run(main)`, or `asyncio.run(main)` where uvloop is missing.

    uvloop is a dependency only off Windows, which it does not support; asyncio's own loop
    runs the same code, only with more overhead per socket event.
    """
    try:
        import uvloop
    except ImportError:
        logger.info("uvloop is not installed (it does not support Windows): using asyncio's loop")
        return asyncio.run(main)
    return uvloop.run(main)
