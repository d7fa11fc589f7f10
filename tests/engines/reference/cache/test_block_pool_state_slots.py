"""Linear-state snapshot slots: exact-hash lookup, pins, LRU eviction, errors."""

from __future__ import annotations

import pytest

from prfaas.engines.reference.cache.state_slots import StateSlotPool


def test_save_hands_out_slots_in_order_and_lookup_is_exact() -> None:
    """Slots 0, 1, ... are used in order; a snapshot is found only by its own hash."""
    slots = StateSlotPool(3)
    assert slots.save(0xA) == 0 and slots.save(0xB) == 1
    assert slots.lookup(0xA) == 0 and slots.lookup(0xB) == 1 and slots.lookup(0xC) is None
    assert slots.key_of(1) == 0xB and slots.key_of(2) is None
    slots.check_integrity()


def test_saving_an_existing_hash_writes_nothing_but_refreshes_it() -> None:
    """A second save of the same hash returns None and makes it most recently used."""
    slots = StateSlotPool(2)
    slots.save(0xA)
    slots.save(0xB)
    assert slots.save(0xA) is None
    assert slots.save(0xC) == 1  # 0xB was least recently used
    assert slots.lookup(0xB) is None and slots.lookup(0xA) == 0
    slots.check_integrity()


def test_pinned_slots_are_not_evicted() -> None:
    """With every slot pinned, save returns None; unpinning makes room again."""
    slots = StateSlotPool(1)
    slots.save(0xA)
    slots.acquire(0)
    assert slots.save(0xB) is None
    with pytest.raises(ValueError, match="pinned"):
        slots.drop(0xA)
    slots.release(0)
    assert slots.save(0xB) == 0 and slots.lookup(0xA) is None
    slots.check_integrity()


def test_drop_and_clear_free_slots() -> None:
    """drop frees one snapshot; clear frees all, pins included."""
    slots = StateSlotPool(3)
    for key in (0xA, 0xB, 0xC):
        slots.save(key)
    slots.acquire(2)
    assert slots.drop(0xA) == 0 and slots.drop(0xA) is None
    slots.clear()
    assert slots.num_free == 3 and slots.num_held == 0 and slots.pins(2) == 0
    slots.check_integrity()


def test_misuse_is_a_clear_error() -> None:
    """Pinning an empty slot, unpinning an unpinned one, negative sizes: ValueError."""
    slots = StateSlotPool(2)
    with pytest.raises(ValueError, match="slot 0 holds no snapshot"):
        slots.acquire(0)
    slots.save(0xA)
    with pytest.raises(ValueError, match="slot 0 is not pinned"):
        slots.release(0)
    with pytest.raises(ValueError, match="-1"):
        StateSlotPool(-1)


def test_zero_slots_never_save() -> None:
    """A pool without slots (pure full-attention model) saves nothing."""
    slots = StateSlotPool(0)
    assert slots.save(0xA) is None
    slots.check_integrity()
