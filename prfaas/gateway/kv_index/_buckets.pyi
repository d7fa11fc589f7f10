from typing import Any

import numpy as np
import numpy.typing as npt

Layout = tuple[
    npt.NDArray[np.uint64],
    npt.NDArray[np.uint16],
    npt.NDArray[np.int8],
    tuple[npt.NDArray[Any], ...],
    int,
    bool,
]

def find(
    layout: Layout,
    keys: npt.NDArray[Any],
    out: npt.NDArray[Any],
    column: int = -1,
    values: npt.NDArray[Any] | None = None,
    missing: int = 0,
    /,
) -> None: ...
def insert(
    layout: Layout,
    keys: npt.NDArray[Any],
    values: tuple[npt.NDArray[Any], ...],
    placed: npt.NDArray[Any],
    /,
) -> int: ...
def delete(layout: Layout, slots: npt.NDArray[Any], /) -> int: ...
def split(layout: Layout, buckets: int, count: int, /) -> int: ...
def as_keys(
    values: list[int] | tuple[int, ...], out: npt.NDArray[Any], stand_in: int, /
) -> None: ...
