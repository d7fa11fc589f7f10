from collections.abc import Sequence

from msgspec import Raw

def hash_range(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    parent: int | None,
    start: int,
    stop: int,
    /,
) -> list[int]: ...
def unpack_ids(packed_ids: bytes | Raw, /) -> bytes: ...
def packed_count(packed_ids: bytes | Raw, /) -> int: ...
