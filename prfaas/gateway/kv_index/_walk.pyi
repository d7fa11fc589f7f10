from typing import Any

import numpy as np
import numpy.typing as npt

def walk(
    bits: npt.NDArray[np.uint64],
    holders: npt.NDArray[np.uint32],
    alive: npt.NDArray[np.uint64],
    ends: npt.NDArray[Any],
    offset: int,
    /,
) -> int: ...
