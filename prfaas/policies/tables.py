"""Piecewise-linear profile tables (latency or bytes against tokens)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray


@dataclass(frozen=True)
class PiecewiseLinear:
    """y(x) interpolated linearly between knots and extrapolated linearly past both ends.

    `xs` must be strictly increasing and hold at least two knots (validated by the profile
    loader, which names the offending key; asserted here for direct construction).
    """

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or len(self.xs) < 2:
            raise ValueError(f"need >= 2 knots of equal length, got {self.xs!r} / {self.ys!r}")
        if any(b <= a for a, b in itertools.pairwise(self.xs)):
            raise ValueError(f"knots must be strictly increasing, got {self.xs!r}")

    def __call__(self, x: ArrayLike) -> NDArray[np.float64]:
        """Evaluate at `x` (scalar or array); returns a float64 array of x's shape."""
        xa = np.asarray(x, dtype=np.float64)
        seg = np.clip(np.searchsorted(self.xs, xa, side="right") - 1, 0, len(self.xs) - 2)
        slope, intercept = self.segments()
        return np.asarray(slope[seg] * xa + intercept[seg], dtype=np.float64)

    def segments(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Slope and intercept of each of the len(xs)-1 segments (the outer two extend to ±inf)."""
        xs, ys = np.asarray(self.xs), np.asarray(self.ys)
        slope = np.diff(ys) / np.diff(xs)
        return slope, ys[:-1] - slope * xs[:-1]

    def breakpoints(self) -> NDArray[np.float64]:
        """The interior knots where the slope changes (segment boundaries)."""
        return np.asarray(self.xs[1:-1], dtype=np.float64)
