"""The predicted prefill queue per instance: FIFO from dispatches, corrected by real ends."""

from __future__ import annotations

import pytest

from prfaas.policies.backlog import BacklogLedger


def test_fifo_prediction_from_dispatches() -> None:
    """Three requests of 2, 3 and 1 s sent at t=0: the instance is busy until t=6."""
    ledger = BacklogLedger()
    for rid, s in (("a", 2.0), ("b", 3.0), ("c", 1.0)):
        ledger.admit("p0", rid, s, now=0.0)
    assert ledger.backlog("p0", 0.0) == 6.0
    assert ledger.backlog("p0", 1.5) == 4.5
    assert ledger.backlog("p0", 2.5) == 4.0  # head overran: its remaining time is 0, not < 0
    assert ledger.in_flight("p0") == 3
    assert ledger.backlog("idle", 3.0) == 0.0


def test_a_real_end_replaces_the_prediction() -> None:
    """The head ending late (t=4 instead of 2) restarts the queue at 4: b then c = 4 s left."""
    ledger = BacklogLedger()
    for rid, s in (("a", 2.0), ("b", 3.0), ("c", 1.0)):
        ledger.admit("p0", rid, s, now=0.0)
    ledger.finish("p0", "a", now=4.0)
    assert ledger.backlog("p0", 4.0) == 4.0
    assert ledger.backlog("p0", 5.0) == 3.0
    ledger.finish("p0", "c", now=5.0)  # not the head (aborted): b keeps its start
    assert ledger.backlog("p0", 5.0) == 2.0
    ledger.finish("p0", "b", now=6.0)
    assert ledger.backlog("p0", 6.0) == 0.0 and ledger.in_flight("p0") == 0
    assert ledger.backlogs(6.0) == {}


def test_idle_instance_starts_at_dispatch_time() -> None:
    """A request sent to an idle instance at t=10 is predicted to end at 10 + its time."""
    ledger = BacklogLedger()
    ledger.admit("p0", "a", 1.0, now=0.0)
    ledger.finish("p0", "a", now=1.0)
    ledger.admit("p0", "b", 2.0, now=10.0)
    assert ledger.backlog("p0", 10.5) == 1.5
    assert ledger.backlogs(10.5) == {"p0": 1.5}


def test_unknown_ends_are_ignored_and_duplicates_refused() -> None:
    ledger = BacklogLedger()
    ledger.finish("p0", "nope", now=1.0)
    ledger.admit("p0", "a", 1.0, now=0.0)
    ledger.finish("p0", "nope", now=1.0)
    assert ledger.in_flight("p0") == 1
    with pytest.raises(ValueError, match="already queued"):
        ledger.admit("p0", "a", 1.0, now=0.0)
    ledger.forget("p0")
    assert ledger.backlog("p0", 0.0) == 0.0
