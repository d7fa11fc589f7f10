"""The KV index's growing hash table against a dict: random inserts, deletes and column
writes while the table grows (preparing the next table, then moving its keys a few buckets
per insert) find every key with its values, with the C operations and with the numpy ones
that stand in where they are not built; a growth does not move the whole table in one call;
at its cap the table hands back what found no room instead of growing."""

from __future__ import annotations

import errno
import threading
from typing import Any

import numpy as np
import pytest

from prfaas.gateway.kv_index import growing
from prfaas.gateway.kv_index import table as table_module
from prfaas.gateway.kv_index.growing import GrowingTable
from prfaas.gateway.kv_index.table import WAYS, as_keys

COLUMNS = {"value": np.uint32, "owner": np.uint16}


def _check(table: GrowingTable, model: dict[int, tuple[int, int]]) -> None:
    keys = as_keys(list(model))
    slots = table.find(keys)
    assert (slots >= 0).all()
    assert len(np.unique(slots)) == len(slots)
    assert table.get("value", slots).tolist() == [v for v, _ in model.values()]
    assert table.get("owner", slots).tolist() == [o for _, o in model.values()]
    assert table.taken(slots).all()
    assert table.size == len(model)


def _some(rng: np.random.Generator, model: dict[int, tuple[int, int]], n: int) -> np.ndarray:
    """Up to `n` distinct keys of the model, sorted."""
    keys = list(model)
    picked = rng.choice(len(keys), size=min(n, len(keys)), replace=False)
    return np.unique(as_keys([keys[i] for i in picked.tolist()]))


def _slow_growth(patch: pytest.MonkeyPatch) -> None:
    """Growths over many inserts: a page or so faulted in, one bucket moved, per insert
    (so that keys overflow into a next table being prepared, and moves meet deletes)."""
    patch.setattr(growing, "_TOUCH_BYTES", 64)
    patch.setattr(growing, "_TOUCH_WITHIN", 0.5)
    patch.setattr(growing, "_STEP_BUCKETS", 1)


@pytest.mark.parametrize("ops", ["c", "numpy"])
@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("uniform", [True, False])
def test_random_operations_match_a_dict_while_the_table_grows(
    uniform: bool, slow: bool, ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ops == "numpy":
        monkeypatch.setattr(table_module, "_native", None)
    if slow:
        _slow_growth(monkeypatch)
    rng = np.random.default_rng(7)
    table = GrowingTable(COLUMNS, uniform=uniform)
    model: dict[int, tuple[int, int]] = {}
    saw_moving = saw_preparing = saw_overflow_into_next = False
    for step in range(400):
        # engine-like keys when not uniform: small sequential ints, and 0 (stored as a stand-in)
        if uniform:
            fresh = rng.integers(0, 2**64, size=int(rng.integers(1, 300)), dtype=np.uint64)
        else:
            fresh = np.arange(step * 300, step * 300 + int(rng.integers(1, 300)), dtype=np.uint64)
        keys = np.unique(as_keys(fresh))
        keys = keys[table.find(keys) < 0]
        values = rng.integers(0, 2**32, size=len(keys), dtype=np.uint32)
        owners = rng.integers(0, 2**16, size=len(keys), dtype=np.uint16)
        left, _ = table.insert(keys, {"value": values, "owner": owners})
        assert len(left) == 0  # no cap: it grows
        rows = zip(values.tolist(), owners.tolist(), strict=True)
        model.update(zip(keys.tolist(), rows, strict=True))
        saw_moving |= table.moving
        saw_preparing |= table.growing and not table.moving
        saw_overflow_into_next |= table.growing and not table.moving and table.tables[1].size > 0
        if step % 3 == 0 and model:  # delete some
            gone_keys = _some(rng, model, int(rng.integers(1, 100)))
            table.delete(table.find(gone_keys))
            for key in gone_keys.tolist():
                del model[key]
        if step % 5 == 0 and model:  # rewrite some values
            chosen = _some(rng, model, 50)
            new = rng.integers(0, 2**32, size=len(chosen), dtype=np.uint32)
            table.set("value", table.find(chosen), new)
            for key, value in zip(chosen.tolist(), new.tolist(), strict=True):
                model[key] = (value, model[key][1])
        absent = as_keys(rng.integers(0, 2**64, size=50, dtype=np.uint64))
        assert (table.find(absent[~np.isin(absent, as_keys(list(model)))]) < 0).all()
        if step % 20 == 0:
            _check(table, model)
    _check(table, model)
    assert saw_moving and saw_preparing and table.growths > 5
    assert saw_overflow_into_next or not slow
    owner = next(iter(model.values()))[1]
    expected = sorted(k for k, (_, o) in model.items() if o == owner)
    selected = table.select("owner", owner)
    assert sorted(table.get("value", selected).tolist()) == sorted(model[k][0] for k in expected)


def test_a_growth_moves_the_keys_over_later_inserts_not_at_once() -> None:
    rng = np.random.default_rng(1)
    table = GrowingTable({"value": np.uint32}, uniform=True)
    held = 0
    while not table.moving or table.tables[1].size < 50_000:
        keys = as_keys(rng.integers(0, 2**64, size=2_000, dtype=np.uint64))
        keys = np.unique(keys[table.find(keys) < 0])
        table.insert(keys, {"value": np.zeros(len(keys), np.uint32)})
        held += len(keys)
        assert held < 2_000_000
    old = table.tables[1]
    before = old.size
    keys = as_keys(rng.integers(0, 2**64, size=100, dtype=np.uint64))
    table.insert(keys, {"value": np.zeros(len(keys), np.uint32)})
    # one insert of 100 keys moves a few dozen buckets, not the old table's thousands
    assert 0 < before - old.size <= (32 + 50) * WAYS
    inserts = 0
    while table.moving:
        keys = as_keys(rng.integers(0, 2**64, size=100, dtype=np.uint64))
        table.insert(keys, {"value": np.zeros(len(keys), np.uint32)})
        inserts += 1
    assert inserts > 10
    assert table.size == held + 100 * (inserts + 1)


def test_at_its_cap_the_table_hands_back_what_found_no_room() -> None:
    rng = np.random.default_rng(2)
    table = GrowingTable({"value": np.uint32}, max_buckets=8, uniform=True)
    keys = as_keys(rng.integers(0, 2**64, size=400, dtype=np.uint64))
    left, rows = table.insert(keys, {"value": np.arange(400, dtype=np.uint32)})
    while table.moving:  # finish any move, so that only the capped table is left
        more, more_rows = table.insert(np.empty(0, np.uint64), {"value": np.empty(0, np.uint32)})
        left, rows = (
            np.concatenate([left, more]),
            {"value": np.concatenate([rows["value"], more_rows["value"]])},
        )
    assert table.tables[0].buckets == 8
    assert len(left) > 0 and table.size + len(left) == 400
    assert (table.find(left) < 0).all()
    # what came back kept its values; what stayed is found with its own
    stayed = table.find(keys)
    assert table.get("value", stayed[stayed >= 0]).tolist() == np.flatnonzero(stayed >= 0).tolist()
    assert sorted(rows["value"].tolist()) == np.flatnonzero(stayed < 0).tolist()
    victims = table.victims(left[:5], "value")
    assert len(victims) == 5 and table.taken(victims).all()


def test_at_its_cap_a_slow_growth_hands_back_keys_it_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys moved into the capped table that do not fit there come back from `insert` with
    their values (the owner evicts and inserts them again); none is lost or kept twice."""
    _slow_growth(monkeypatch)
    rng = np.random.default_rng(3)
    table = GrowingTable({"value": np.uint32}, max_buckets=64, uniform=True)
    inserted: dict[int, int] = {}
    out: dict[int, int] = {}  # handed back, not in the table
    held_came_back = False
    for step in range(200):
        keys = np.unique(as_keys(rng.integers(0, 2**64, size=40, dtype=np.uint64)))
        values = np.arange(step * 40, step * 40 + len(keys), dtype=np.uint32)
        held = {k for k in inserted if k not in out}
        left, rows = table.insert(keys, {"value": values})
        inserted.update(zip(keys.tolist(), values.tolist(), strict=True))
        back = dict(zip(left.tolist(), rows["value"].tolist(), strict=True))
        held_came_back |= bool(held & back.keys())
        out.update(back)
        assert all(inserted[k] == v for k, v in back.items())
        if table.moving or len(back) == 0:
            continue
        assert table.size + len(out) == len(inserted)
    assert held_came_back
    kept = np.array([k for k in inserted if k not in out], dtype=np.uint64)
    slots = table.find(kept)
    assert (slots >= 0).all() and table.size == len(kept)
    assert table.get("value", slots).tolist() == [inserted[k] for k in kept.tolist()]
    assert (table.find(np.array(list(out), dtype=np.uint64)) < 0).all()


@pytest.mark.parametrize("phase", [1.0, growing.GROWTH**0.5, 3.7])
def test_a_table_grows_through_the_sizes_of_its_phase(phase: float) -> None:
    rng = np.random.default_rng(3)
    table = GrowingTable(COLUMNS, uniform=True, phase=phase)
    sizes = {table.tables[0].buckets}
    for _ in range(300):
        keys = np.unique(as_keys(rng.integers(1, 2**63, 97).tolist()))
        table.insert(keys, {"value": np.zeros(len(keys)), "owner": np.zeros(len(keys))})
        sizes.update(t.buckets for t in table.tables)
    grid = {int(np.ceil(phase * growing.GROWTH**k)) for k in range(60)}
    assert len(sizes) >= 8 and sizes - {1} <= grid


def test_tables_of_phases_half_a_step_apart_move_at_different_times() -> None:
    """Two tables given the same keys: of one phase they move their keys at the same
    times; half a growth step apart, one's move ends before the other's starts."""
    rng = np.random.default_rng(5)
    batches = [np.unique(as_keys(rng.integers(1, 2**63, 256).tolist())) for _ in range(800)]

    def both_moving(second_phase: float) -> tuple[int, int]:
        pair = (
            GrowingTable(COLUMNS, uniform=True),
            GrowingTable(COLUMNS, uniform=True, phase=second_phase),
        )
        both = moving = 0
        for keys in batches:
            for table in pair:
                table.insert(keys, {"value": np.zeros(len(keys)), "owner": np.zeros(len(keys))})
            both += pair[0].moving and pair[1].moving
            moving += pair[0].moving
        return both, moving

    same, moving = both_moving(1.0)
    assert moving > 100 and same > 0.9 * moving
    apart, _ = both_moving(growing.GROWTH**0.5)
    assert apart < 0.1 * moving


@pytest.mark.parametrize("advice", [True, False])
def test_faulting_pages_in_keeps_what_the_table_holds(
    advice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table's next slice faulted in (one `madvise` call where the kernel has it, else a
    byte rewritten per page) leaves every key and value where it was."""
    if not advice:
        monkeypatch.setattr(table_module, "_POPULATE_WRITE", None)
    table = table_module.HashTable(COLUMNS, buckets=(2 << 20) // (WAYS * 8), uniform=True)
    keys = np.unique(as_keys(np.random.default_rng(1).integers(1, 2**63, 5000).tolist()))
    table.insert(keys, {"value": np.arange(len(keys)), "owner": np.ones(len(keys))})
    before = [array.copy() for array in table._arrays()]
    assert table.touch(0, table.nbytes) == table.nbytes
    assert all((a == b).all() for a, b in zip(table._arrays(), before, strict=True))
    assert table_module._mapping(table.keys) is not None  # over its own mapping


def test_popping_a_table_in_order_leaves_the_rest_as_it_was() -> None:
    """Buckets popped in order, in uneven steps (the whole pages among a step's rows given
    back): each step returns its buckets' keys and values, leaves them empty, and every
    later bucket as it was."""
    table = table_module.HashTable(COLUMNS, buckets=(3 << 20) // (WAYS * 8), uniform=True)
    keys = np.unique(as_keys(np.random.default_rng(2).integers(1, 2**63, 40_000).tolist()))
    table.insert(keys, {"value": keys % 1000, "owner": keys % 7})
    before = {name: array.copy() for name, array in table.columns.items()}
    before_keys = table.keys.copy()
    start, popped = 0, []
    for step in [1, 7, 300, 2, 1023, 4096, 5]:
        stop = min(table.buckets, start + step)
        got, values = table.pop_buckets(start, stop)
        want = before_keys[start:stop][before_keys[start:stop] != 0]
        assert got.tolist() == want.tolist()
        assert values["value"].tolist() == (want % 1000).tolist()
        popped.extend(got.tolist())
        assert not table.keys[:stop].any() and not table.fill[:stop].any()
        assert (table.keys[stop:] == before_keys[stop:]).all()
        for name, array in table.columns.items():
            assert not array[:stop].any() and (array[stop:] == before[name][stop:]).all()
        start = stop
    assert table.size == len(keys) - len(popped)
    assert (table.find(np.array(popped, dtype=np.uint64)) == -1).all()


@pytest.mark.parametrize("kernel", ["advises", "refuses"])
def test_a_large_next_table_is_faulted_in_by_a_thread_while_inserts_go_on(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A next table of `_FAULT_ASIDE_BYTES` and more is faulted in by a thread, not a slice
    per insert; inserts go on meanwhile (into the full table, what finds no room into the
    next one), its move starts once the thread ended, the old table is given back by a
    thread once moved out, and every key is found throughout."""
    monkeypatch.setattr(growing, "_FAULT_ASIDE_BYTES", 1 << 20)
    monkeypatch.setattr(table_module, "_POPULATE_WRITE", table_module._POPULATE_WRITE)
    if kernel != "advises":  # a kernel before 5.14: EINVAL, and writing from then on
        refusing = _Refusing(table_module._native)
        monkeypatch.setattr(table_module, "_native", refusing)
    touched: list[int] = []
    released: list[str] = []
    real_touch, real_release = table_module.HashTable.touch, table_module.HashTable.release

    def touch(self: table_module.HashTable, position: int, nbytes: int) -> int:
        touched.append(self.nbytes)
        return real_touch(self, position, nbytes)

    def release(self: table_module.HashTable) -> None:
        released.append(threading.current_thread().name)
        real_release(self)

    monkeypatch.setattr(table_module.HashTable, "touch", touch)
    monkeypatch.setattr(table_module.HashTable, "release", release)
    rng = np.random.default_rng(4)
    table = GrowingTable(COLUMNS, uniform=True)
    model: dict[int, tuple[int, int]] = {}
    threads = 0
    while table.growths < 12:
        keys = np.unique(as_keys(rng.integers(1, 2**63, 2_000).tolist()))
        values = rng.integers(0, 2**16, size=(2, len(keys)))
        left, _ = table.insert(keys, {"value": values[0], "owner": values[1]})
        assert not len(left)
        model.update(zip(keys.tolist(), zip(*values.tolist(), strict=True), strict=True))
        threads += table._faulting is not None
        _check(table, model)  # (while a thread may be faulting pages in)
    if table_module._POPULATE_WRITE is not None:  # large tables: none faulted on the loop
        assert kernel == "advises" and threads
        assert all(nbytes < 1 << 20 for nbytes in touched)
    else:  # refused (a kernel before 5.14): slices on the loop, as for small tables
        assert kernel != "advises" and any(nbytes >= 1 << 20 for nbytes in touched)
        # (the first array over its own mapping is a large table's, in the thread)
        assert refusing.refused_aside
    for thread in threading.enumerate():
        if thread.name == "kv-index-release":
            thread.join()
    assert released and set(released) == {"kv-index-release"}


class _Refusing:
    """The C operations, but `advise` answers as a kernel without the advice does."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.refused_aside = 0  # refusals in the fault-in thread

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def advise(self, *_: Any) -> int:
        self.refused_aside += threading.current_thread().name == "kv-index-fault-in"
        return errno.EINVAL
