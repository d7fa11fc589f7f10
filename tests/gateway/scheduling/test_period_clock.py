"""The long-term loop's periods keep their length: each ends a period after the last one
ended, not a period after the last decision finished (live, each 20 s period ran its
decision's time longer, and the lag added up over a run)."""

from __future__ import annotations

import pytest

from prfaas.gateway.scheduling.scheduler import next_period_end


def test_a_period_ends_a_period_after_the_last_whatever_the_decision_took() -> None:
    end = 100.0
    for k in range(1, 6):  # the timer fires a millisecond late each time
        end = next_period_end(end, end + 0.001, 20.0, woken=False)
        assert end == pytest.approx(100.0 + 20.0 * k)


def test_a_woken_period_ends_a_period_after_the_wake() -> None:
    assert next_period_end(120.0, 107.5, 20.0, woken=True) == pytest.approx(127.5)


def test_a_period_that_overran_its_successor_starts_afresh() -> None:
    """A decision that took longer than a period (a stalled loop) does not leave a backlog
    of periods to run back to back."""
    assert next_period_end(120.0, 145.0, 20.0, woken=False) == pytest.approx(165.0)
