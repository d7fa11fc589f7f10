from typing import Any

from msgspec import Raw

def scan_batch(
    payload: bytes | bytearray | memoryview | Raw, classes: tuple[type, ...], /
) -> Any: ...
