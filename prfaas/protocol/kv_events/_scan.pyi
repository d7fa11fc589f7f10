from collections.abc import Callable

from msgspec import Raw

def scan_batch(
    payload: bytes | bytearray | memoryview | Raw, classes: tuple[Callable[..., object], ...], /
) -> object: ...
def scan_map_batch(
    payload: bytes | bytearray | memoryview | Raw, classes: tuple[Callable[..., object], ...], /
) -> object: ...
