"""A lookup's walk along a request's chain of blocks: where each instance's match ends.

Each block of the chain names the set of instances holding it (a `HolderSets` id, a row
of its `bits`). An instance's match ends at the first block it does not hold. `walk` runs
in C (`_walk.c`) where the extension is built, else `walk_numpy`, which the tests hold
the C to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

Walk = Callable[
    [npt.NDArray[np.uint64], npt.NDArray[np.uint32], npt.NDArray[np.uint64], npt.NDArray[Any], int],
    int,
]


def walk_numpy(
    bits: npt.NDArray[np.uint64],
    holders: npt.NDArray[np.uint32],
    alive: npt.NDArray[np.uint64],
    ends: npt.NDArray[Any],
    offset: int,
) -> int:
    """Walk `holders` (holder-set ids, one per block, in chain order) against `bits` (a
    row of uint64 words per id), removing from `alive` (uint64 words, updated in place)
    the instances a block does not hold and writing `offset` plus that block's position
    into `ends` (int64, one per instance bit) for each. Returns how many blocks some
    instance holds (the position of the first block none holds, or all). A chain's blocks
    come in runs held by one set, so each run's row is read once."""
    starts = np.flatnonzero(np.concatenate(([True], holders[1:] != holders[:-1])))
    held = np.bitwise_and.accumulate(np.take(bits, holders[starts], axis=0) & alive, axis=0)
    before = np.vstack([alive, held[:-1]])
    for run in np.flatnonzero((held != before).any(axis=1)).tolist():
        gone = before[run] & ~held[run]
        for word in np.flatnonzero(gone).tolist():
            for bit in range(64):
                if (int(gone[word]) >> bit) & 1:
                    ends[word * 64 + bit] = offset + int(starts[run])
    alive[:] = held[-1]
    ended = np.flatnonzero(~held.any(axis=1))  # runs no instance holds
    return int(starts[ended[0]]) if len(ended) else len(holders)


def _native() -> Walk:
    """The C walk, or `walk_numpy` where the extension is not built (logged once)."""
    try:
        from prfaas.gateway.kv_index import _walk
    except ImportError:
        logging.getLogger(__name__).warning(
            "prfaas.gateway.kv_index._walk is not built for this interpreter: lookups walk "
            "their chains in numpy (slower; `pip install -e .` builds it)"
        )
        return walk_numpy
    native: Walk = _walk.walk
    return native


walk = _native()
