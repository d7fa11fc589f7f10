"""Transfer events as JSON lines, for checking layer-wise streaming from both sides.

Timestamps are `time.monotonic()`: one system-wide clock on Linux, so the prefill's and the
decode's files compare directly on one machine.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson


class TransferTrace:
    """Appends `{"event", "room", "t", ...}` lines to a file; a no-op without a path."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._lock = threading.Lock()

    def __call__(self, event: str, room: int, **fields: Any) -> None:
        if self._path is None:
            return
        line = orjson.dumps({"event": event, "room": room, "t": time.monotonic(), **fields})
        with self._lock, open(self._path, "ab") as out:
            out.write(line + b"\n")
