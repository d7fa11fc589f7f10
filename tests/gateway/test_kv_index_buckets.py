"""The KV index's table operations in C (`prfaas.gateway.kv_index._buckets`) against the
numpy ones in table.py, which define them: the same slots found in a table either filled,
the same arrays after a delete, and inserts that keep the table's invariants (every key
placed is found with its values, buckets packed, a key handed back only when its two
buckets are full and no resident of theirs can move)."""

from __future__ import annotations

import numpy as np
import pytest

from prfaas.gateway.kv_index import table as table_module
from prfaas.gateway.kv_index.table import WAYS, HashTable, as_keys

try:
    from prfaas.gateway.kv_index import _buckets
except ImportError:  # every test here then fails: the project's setup builds it
    _buckets = None  # type: ignore[assignment]

COLUMNS = {"value": np.uint32, "owner": np.uint16, "wide": np.uint64}


def test_the_c_operations_are_what_the_tables_run() -> None:
    """The environment the tests run in has the extension built, and table.py uses it."""
    assert _buckets is not None, "prfaas.gateway.kv_index._buckets is not built"
    assert table_module._native is _buckets


def _filled(
    rng: np.random.Generator, buckets: int, n: int, uniform: bool
) -> tuple[HashTable, np.ndarray]:
    """A table (of `buckets`) given `n` random keys with random values; returns it and the
    keys it took."""
    table = HashTable(COLUMNS, buckets=buckets, uniform=uniform)
    keys = np.unique(as_keys(_random_keys(rng, n, uniform)))
    rng.shuffle(keys)
    left, _ = table.insert(keys, _random_values(rng, len(keys)))
    return table, keys[~np.isin(keys, left)]


def _random_values(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """A value of each column for `n` keys, any in its dtype's range."""
    return {
        name: rng.integers(0, np.iinfo(dtype).max, size=n, dtype=dtype, endpoint=True)
        for name, dtype in COLUMNS.items()
    }


def _random_keys(rng: np.random.Generator, n: int, uniform: bool) -> np.ndarray:
    if uniform:
        return rng.integers(0, 2**64, size=n, dtype=np.uint64)
    small = rng.integers(0, 2**24, size=n, dtype=np.uint64)  # engine-like: small ints, and 0
    small[0] = 0
    return small


def _find_both(table: HashTable, keys: np.ndarray, patch: pytest.MonkeyPatch) -> tuple:
    native = table.find(keys)
    with patch.context() as numpy_only:
        numpy_only.setattr(table_module, "_native", None)
        reference = table.find(keys)
    return native, reference


def _arrays(table: HashTable) -> list[np.ndarray]:
    return [table.keys, table.tags, table.fill, *table.columns.values()]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("filled_by", ["c", "numpy"])
def test_find_gives_the_numpy_slots(
    seed: int, uniform: bool, filled_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Present keys, absent ones, and keys whose tag another key in their buckets shares,
    in tables filled (to 95% and past) by either implementation, after deletes; with each
    column's values read in the same pass (`find_values`), a value of its own width where
    the key is absent."""
    rng = np.random.default_rng(seed)
    with monkeypatch.context() as patch:
        if filled_by == "numpy":
            patch.setattr(table_module, "_native", None)
        table, held = _filled(rng, buckets=64, n=64 * WAYS, uniform=uniform)
        table.delete(table.find(held[: len(held) // 5]))
    assert table.size / (64 * WAYS) > 0.7
    absent = as_keys(_random_keys(rng, 2_000, uniform))
    absent = np.concatenate([absent, _tag_twins(table, rng, uniform)])
    absent = absent[~np.isin(absent, held)]
    queries = np.concatenate([held, absent, held[::-1]])
    native, reference = _find_both(table, queries, monkeypatch)
    assert native.tolist() == reference.tolist()
    assert (native[len(held) // 5 : len(held)] >= 0).all()
    assert (native[: len(held) // 5] < 0).all()
    assert (native[len(held) : len(held) + len(absent)] < 0).all()
    for name, missing in (("value", 7), ("owner", 2**16 - 1), ("wide", 2**63 + 5)):
        slots, values = table.find_values(queries, name, missing)
        with monkeypatch.context() as numpy_only:
            numpy_only.setattr(table_module, "_native", None)
            want_slots, want = table.find_values(queries, name, missing)
        assert slots.tolist() == want_slots.tolist() == native.tolist()
        assert values.dtype == want.dtype == COLUMNS[name]
        assert values.tolist() == want.tolist()
        assert values[native < 0].tolist() == [missing] * int((native < 0).sum())
        assert values[native >= 0].tolist() == table.column(name)[native[native >= 0]].tolist()


def _tag_twins(table: HashTable, rng: np.random.Generator, uniform: bool) -> np.ndarray:
    """Keys not held whose tag a held key in one of their buckets has (what makes a find
    compare keys after a tag matched): found among many random ones."""
    slots = np.flatnonzero(table.keys.reshape(-1))
    held = (slots // WAYS) * 2**16 + table.tags.reshape(-1)[slots]
    candidates = as_keys(_random_keys(rng, 300_000, uniform))
    first, second, tags = table._choices(candidates)
    twins = np.isin(first * 2**16 + tags, held) | np.isin(second * 2**16 + tags, held)
    assert twins.sum() > 10
    return candidates[twins]


@pytest.mark.parametrize("seed", range(6))
def test_delete_leaves_the_arrays_numpy_leaves(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots deleted (several per bucket, in any order) repack their buckets as numpy's
    stable sort does, in every array, and the sizes agree."""
    rng = np.random.default_rng(seed)
    table, held = _filled(rng, buckets=32, n=32 * WAYS, uniform=True)
    twin = HashTable(COLUMNS, buckets=32, uniform=True)
    for mine, theirs in zip(_arrays(table), _arrays(twin), strict=True):
        theirs[...] = mine
    twin.size = table.size
    for _ in range(4):
        gone = table.find(held[rng.random(len(held)) < 0.3])
        gone = gone[gone >= 0]
        rng.shuffle(gone)
        table.delete(gone)
        with monkeypatch.context() as patch:
            patch.setattr(table_module, "_native", None)
            twin.delete(gone.copy())
        for mine, theirs in zip(_arrays(table), _arrays(twin), strict=True):
            assert np.array_equal(mine, theirs)
        assert table.size == twin.size == int((table.keys != 0).sum())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("uniform", [True, False])
def test_inserts_keep_the_invariants_and_hand_back_only_what_cannot_fit(
    seed: int, uniform: bool
) -> None:
    """Filled past capacity in batches with keys sharing buckets: every key placed is found
    with its values; each handed back has both buckets full and no resident of either
    bucket with room in its other one; buckets stay packed and `fill` counts them."""
    rng = np.random.default_rng(seed)
    table = HashTable(COLUMNS, buckets=48, uniform=uniform)
    model: dict[int, tuple[int, int, int]] = {}
    handed_back = 0
    for _ in range(12):
        keys = np.unique(as_keys(_random_keys(rng, 100, uniform)))
        keys = keys[table.find(keys) < 0]
        rng.shuffle(keys)
        values = _random_values(rng, len(keys))
        left, left_values = table.insert(keys, values)
        placed = ~np.isin(keys, left)
        rows = zip(*(values[n][placed].tolist() for n in COLUMNS), strict=True)
        model.update(zip(keys[placed].tolist(), rows, strict=True))
        for name in COLUMNS:
            assert left_values[name].tolist() == values[name][~placed].tolist()
        handed_back += len(left)
        first, second, _ = table._choices(left)
        for one, two in zip(first.tolist(), second.tolist(), strict=True):
            assert table.fill[one] == table.fill[two] == WAYS
            for bucket in {one, two}:
                a, b, _ = table._choices(table.keys[bucket])
                other = np.where(a == bucket, b, a)
                assert ((other == bucket) | (table.fill[other] == WAYS)).all()
    assert handed_back > 0 and table.size / (48 * WAYS) > 0.9
    slots = table.find(as_keys(list(model)))
    assert (slots >= 0).all() and table.size == len(model)
    for name, column in zip(COLUMNS, zip(*model.values(), strict=True), strict=True):
        assert table.column(name)[slots].tolist() == list(column)
    taken = table.keys != 0
    assert (taken.sum(axis=1) == table.fill).all()
    assert (taken == (np.arange(WAYS) < table.fill[:, None])).all()  # packed at the start


def test_bad_arguments_raise_and_change_nothing() -> None:
    """A slot outside the table, a column not the table's, or arrays of the wrong size,
    raise before any write."""
    assert _buckets is not None
    rng = np.random.default_rng(0)
    table, held = _filled(rng, buckets=4, n=40, uniform=True)
    before = [array.copy() for array in _arrays(table)]
    with pytest.raises(IndexError, match="not in the table"):
        _buckets.delete(table._layout, np.array([0, 4 * WAYS], dtype=np.int64))
    with pytest.raises(IndexError):
        _buckets.delete(table._layout, np.array([-1], dtype=np.int64))
    with pytest.raises(ValueError, match="out"):
        _buckets.find(table._layout, held, np.empty(len(held) - 1, dtype=np.int64))
    with pytest.raises(ValueError, match="values"):
        keys = as_keys(_random_keys(rng, 3, True))
        short = (np.zeros(3, np.uint32), np.zeros(3, np.uint16), np.zeros(2, np.uint64))
        _buckets.insert(table._layout, keys, short, np.empty(3, dtype=bool))
    with pytest.raises(ValueError, match="sizes disagree"):
        layout = (table.keys[:2], *table._layout[1:])
        _buckets.find(layout, held, np.empty(len(held), dtype=np.int64))
    slots = np.empty(len(held), dtype=np.int64)
    with pytest.raises(ValueError, match="column 3 is not one of 3"):
        _buckets.find(table._layout, held, slots, 3, np.empty(len(held), np.uint64), 0)
    with pytest.raises(ValueError, match="values"):  # the column's values are 4 bytes wide
        _buckets.find(table._layout, held, slots, 0, np.empty(len(held), np.uint64), 0)
    with pytest.raises(TypeError):
        _buckets.find(table._layout, held, slots, 0)
    for array, saved in zip(_arrays(table), before, strict=True):
        assert np.array_equal(array, saved)


@pytest.mark.parametrize("container", [list, tuple])
def test_as_keys_reads_ints_as_numpy_does(container: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists and tuples of ints (0 and 2**64 - 1 among them, numpy integers too) give the
    keys `np.fromiter` gives; ids that are not uint64 integers raise."""
    rng = np.random.default_rng(1)
    values = [0, 1, 2**63, 2**64 - 1, np.uint64(5), np.int64(7)]
    values += rng.integers(0, 2**64, size=500, dtype=np.uint64).tolist()
    got = as_keys(container(values))
    with monkeypatch.context() as patch:
        patch.setattr(table_module, "_native", None)
        want = as_keys(container(values))
    assert got.dtype == want.dtype == np.uint64
    assert got.tolist() == want.tolist()
    assert 0 not in got.tolist()
    with pytest.raises(OverflowError):
        as_keys(container([1, -1]))
    with pytest.raises(OverflowError):
        as_keys(container([2**64]))
    with pytest.raises(TypeError):
        as_keys(container([1, "2"]))
