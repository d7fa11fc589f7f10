"""Admission: slots, a bounded FIFO wait queue, refusal past it, cancelled waiters."""

from __future__ import annotations

import asyncio

import pytest

from prfaas.gateway.admission import AdmissionManager, QueueFull, QueueTimeout


async def _hold(
    manager: AdmissionManager, name: str, order: list[str], gate: asyncio.Event
) -> None:
    async with manager.slot():
        order.append(name)
        await gate.wait()


async def test_waiters_get_slots_first_come_first_served() -> None:
    manager = AdmissionManager(max_running=1, max_queued=3)
    order: list[str] = []
    gates = {name: asyncio.Event() for name in "abcd"}
    tasks = {}
    for name in "abcd":
        tasks[name] = asyncio.ensure_future(_hold(manager, name, order, gates[name]))
        await asyncio.sleep(0)
    assert (manager.running, manager.waiting) == (1, 3)
    for name in "abcd":
        gates[name].set()
        await tasks[name]
    assert order == list("abcd")
    assert (manager.running, manager.waiting) == (0, 0)


async def test_full_queue_refuses_at_once() -> None:
    manager = AdmissionManager(max_running=1, max_queued=1)
    gate = asyncio.Event()
    first = asyncio.ensure_future(_hold(manager, "a", [], gate))
    second = asyncio.ensure_future(_hold(manager, "b", [], gate))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await manager._acquire()
    gate.set()
    await asyncio.gather(first, second)
    assert (manager.running, manager.waiting) == (0, 0)


async def test_cancelled_waiter_leaves_the_queue_and_the_next_one_gets_the_slot() -> None:
    manager = AdmissionManager(max_running=1, max_queued=2)
    order: list[str] = []
    gate = asyncio.Event()
    holder = asyncio.ensure_future(_hold(manager, "a", order, gate))
    await asyncio.sleep(0)
    quitter = asyncio.ensure_future(_hold(manager, "b", order, gate))
    patient = asyncio.ensure_future(_hold(manager, "c", order, gate))
    await asyncio.sleep(0)
    quitter.cancel()
    await asyncio.sleep(0)
    assert manager.waiting == 1
    gate.set()
    await asyncio.gather(holder, patient)
    assert quitter.cancelled() and order == ["a", "c"]
    assert (manager.running, manager.waiting) == (0, 0)


async def test_waiter_cancelled_after_being_handed_a_slot_passes_it_on() -> None:
    """The slot is handed over, then the waiter is cancelled before it runs: the slot goes
    to the next waiter instead of leaking."""
    manager = AdmissionManager(max_running=1, max_queued=2)
    order: list[str] = []
    gate = asyncio.Event()
    held = manager.slot()
    await held.__aenter__()
    handed = asyncio.ensure_future(_hold(manager, "b", order, gate))
    nxt = asyncio.ensure_future(_hold(manager, "c", order, gate))
    await asyncio.sleep(0)
    await held.__aexit__(None, None, None)  # hands the slot to "b" ...
    handed.cancel()  # ... which is cancelled before it resumes
    gate.set()
    await asyncio.gather(handed, nxt, return_exceptions=True)
    assert handed.cancelled() and order == ["c"]
    assert (manager.running, manager.waiting) == (0, 0)


async def test_waiter_past_its_deadline_gives_up_without_a_slot() -> None:
    """A waiter that gets no slot within `queue_timeout_s` leaves with QueueTimeout, never
    having taken a slot; the waiter behind it keeps its place and gets the next slot."""
    manager = AdmissionManager(max_running=1, max_queued=2, queue_timeout_s=0.05)
    order: list[str] = []
    gate = asyncio.Event()
    holder = asyncio.ensure_future(_hold(manager, "a", order, gate))
    await asyncio.sleep(0)
    late = asyncio.ensure_future(_hold(manager, "b", order, gate))
    await asyncio.sleep(0)
    # Later waiters get a long deadline, so that on a loaded machine "c" cannot expire in
    # the same loop iteration as "b" (a wall-clock stagger did, in CI).
    manager.queue_timeout_s = 30.0
    patient = asyncio.ensure_future(_hold(manager, "c", order, gate))
    with pytest.raises(QueueTimeout, match=r"waited 0\.05 s for a slot"):
        await late
    assert (manager.running, manager.waiting, manager.timed_out) == (1, 1, 1)
    gate.set()  # "a" ends within c's deadline: c is served
    await asyncio.gather(holder, patient)
    assert order == ["a", "c"]
    assert (manager.running, manager.waiting) == (0, 0)


async def test_a_slot_handed_at_the_deadline_is_kept() -> None:
    """A slot handed over before the deadline fires wins: the waiter runs, no timeout."""
    manager = AdmissionManager(max_running=1, max_queued=1, queue_timeout_s=0.05)
    held = manager.slot()
    await held.__aenter__()
    waiter = asyncio.ensure_future(manager._acquire())
    await asyncio.sleep(0)
    await held.__aexit__(None, None, None)
    await asyncio.sleep(0.1)  # the deadline passes after the hand-over
    await waiter
    assert (manager.running, manager.timed_out) == (1, 0)
    manager._release()
    assert manager.running == 0
