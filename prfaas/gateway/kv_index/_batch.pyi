from typing import Any

import numpy.typing as npt

def group(
    keys: npt.NDArray[Any],
    first: npt.NDArray[Any],
    inverse: npt.NDArray[Any],
    last: npt.NDArray[Any],
    /,
) -> int: ...
def salted_keys(
    hashes: list[int] | tuple[int, ...],
    bits: npt.NDArray[Any],
    salts: npt.NDArray[Any],
    out: npt.NDArray[Any],
    stand_in: int,
    /,
) -> None: ...
def chain_stores(
    events: list[Any],
    bits: npt.NDArray[Any],
    starts: list[int | None],
    block_size: int,
    salts: npt.NDArray[Any],
    block_bits: npt.NDArray[Any],
    keys: npt.NDArray[Any],
    ours: npt.NDArray[Any],
    stand_in: int,
    /,
) -> tuple[int, int]: ...
