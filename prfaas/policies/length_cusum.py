"""Page's two-sided CUSUM of ln L against the estimate's mean: the long-term loop's wake on a
step of incremental length. It keeps its evidence across periods, so a step that the
periods have half blended into the estimate before the mean-of-100 test saw it still
sounds it (see `prfaas/sim/SCHEDULING.md`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

CUSUM_K = 0.25
"""The CUSUM's slack in ln L: drifts of the incremental lengths' mean smaller than this
add nothing."""
CUSUM_H = 20.0
"""The CUSUM's alarm level in ln L (21.5 standard deviations of ln L at the case study's
0.93): with `CUSUM_K`, steady traffic raises a false alarm on one side about once in 1.4
million lengths (once in 300,000 with the estimate's mean a standard error off; Siegmund's
approximation), and a step of 0.59 (length-shift's) sounds it after about 60 lengths."""


@dataclass
class LengthCusum:
    """The upward and downward sums, and the lengths since each was last zero."""

    up: float = 0.0
    down: float = 0.0
    up_n: int = 0
    down_n: int = 0

    def add(self, lengths: Iterable[int], mu: float) -> None:
        """Add each length's ln L against the estimate's mean `mu`."""
        for x in lengths:
            d = math.log(max(x, 1)) - mu
            self.up, self.down = max(0.0, self.up + d - CUSUM_K), max(0.0, self.down - d - CUSUM_K)
            self.up_n = self.up_n + 1 if self.up > 0 else 0
            self.down_n = self.down_n + 1 if self.down > 0 else 0

    @property
    def alarm(self) -> int:
        """The lengths since the step began when a sum has reached `CUSUM_H` (0: none has)."""
        if self.up >= CUSUM_H:
            return self.up_n
        return self.down_n if self.down >= CUSUM_H else 0

    def reset(self) -> None:
        """Start both sums afresh (the step was taken, or there is no estimate to test)."""
        self.up, self.down, self.up_n, self.down_n = 0.0, 0.0, 0, 0
