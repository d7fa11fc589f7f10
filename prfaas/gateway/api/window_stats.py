"""Pure statistics the activity recorder reports: latency percentiles over a window and
requests per second from two readings of cumulative counters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

QUANTILES = (50, 90, 99)


def percentiles(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """`{"p50", "p90", "p99", "count"}` of the values that are not None (numpy's linear
    interpolation, as the load generator's reports); the percentiles are None when there is
    no value."""
    present = [v for v in values if v is not None]
    if not present:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    p50, p90, p99 = (float(x) for x in np.percentile(present, QUANTILES))
    return {"p50": p50, "p90": p90, "p99": p99, "count": len(present)}


def rates(
    previous: tuple[float, Mapping[str, int]] | None, current: tuple[float, Mapping[str, int]]
) -> dict[str, float]:
    """Per-key rate between two `(time, cumulative counts)` readings; every key of
    `current` (a key new since `previous` counts from 0). Empty without a previous reading
    or when no time passed."""
    if previous is None or current[0] <= previous[0]:
        return {}
    (t0, before), (t1, after) = previous, current
    return {key: (n - before.get(key, 0)) / (t1 - t0) for key, n in after.items()}
