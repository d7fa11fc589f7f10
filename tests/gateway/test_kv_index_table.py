"""The KV index's growing hash table against a dict: random inserts, deletes and column
writes while the table grows (splitting buckets as keys come, at its usual load and nearly
full) find every key with its values, with the C operations and with the numpy ones that
stand in where they are not built; growth is spread over the inserts in proportion to their
keys and the memory grows with them; a split leaves the arrays the numpy split leaves; a
large table reserves its cap once (or, refused, goes on doubling); at its cap the table
hands back what found no room instead of growing."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from prfaas.gateway.kv_index import growing
from prfaas.gateway.kv_index import table as table_module
from prfaas.gateway.kv_index.growing import GrowingTable
from prfaas.gateway.kv_index.table import WAYS, HashTable, as_keys

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


@pytest.mark.parametrize("ops", ["c", "numpy"])
@pytest.mark.parametrize("load", [growing._MAX_LOAD, 0.98])
@pytest.mark.parametrize("uniform", [True, False])
def test_random_operations_match_a_dict_while_the_table_grows(
    uniform: bool, load: float, ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ops == "numpy":
        monkeypatch.setattr(table_module, "_native", None)
    monkeypatch.setattr(growing, "_MAX_LOAD", load)  # 98%: most inserts meet full buckets
    rng = np.random.default_rng(7)
    table = GrowingTable(COLUMNS, uniform=uniform)
    model: dict[int, tuple[int, int]] = {}
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
        assert table.size <= max(load * table.slots, table.size - len(keys) + 1)
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
    assert table.buckets > 1000  # it grew through many levels
    owner = next(iter(model.values()))[1]
    expected = sorted(k for k, (_, o) in model.items() if o == owner)
    selected = table.select("owner", owner)
    assert sorted(table.get("value", selected).tolist()) == sorted(model[k][0] for k in expected)


def test_growth_follows_the_keys_a_few_buckets_per_insert() -> None:
    """Each insert splits about a bucket per dozen keys it adds, so the table's buckets (and
    bytes) follow its keys at about the load it keeps, whatever its size: no insert doubles
    the table."""
    rng = np.random.default_rng(1)
    table = GrowingTable({"value": np.uint32}, uniform=True)
    for _ in range(300):
        before = table.buckets
        keys = np.unique(as_keys(rng.integers(0, 2**64, size=1_000, dtype=np.uint64)))
        left, _ = table.insert(keys, {"value": np.zeros(len(keys), np.uint32)})
        assert len(left) == 0
        assert table.buckets - before <= len(keys) / (growing._MAX_LOAD * WAYS) + 2
        assert growing._MAX_LOAD * table.slots <= table.size + WAYS  # no more than it needs
    bucket_bytes = 8 * WAYS + 2 * WAYS + 1 + 4 + 4 * WAYS
    assert table.nbytes == table.buckets * bucket_bytes


@pytest.mark.parametrize("uniform", [True, False])
def test_a_split_leaves_the_arrays_numpy_leaves(
    uniform: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table split in C and its copy split in numpy, through several levels, end with
    identical arrays (the kept keys packed in order, the moved ones packed in order into
    the new bucket), and every key is found where it went."""
    rng = np.random.default_rng(4)
    table = HashTable(COLUMNS, buckets=3, uniform=uniform, capacity=400)
    keys = np.empty(0, np.uint64)
    for count in (1, 2, 5, 13, 40, 150):
        fresh = np.unique(as_keys(rng.integers(0, 2**64, size=10 * count, dtype=np.uint64)))
        values = {"value": np.arange(len(fresh)), "owner": np.ones(len(fresh))}
        left, _ = table.insert(fresh, values)
        keys = np.concatenate([keys, fresh[~np.isin(fresh, left)]])
        twin = copy.deepcopy(table)
        table.split(count)
        with monkeypatch.context() as numpy_ops:
            numpy_ops.setattr(table_module, "_native", None)
            twin.split(count)
        assert table.buckets == twin.buckets
        for name in ("keys", "tags", "fill"):
            assert (getattr(table, name) == getattr(twin, name)).all(), name
        for name in COLUMNS:
            assert (table.column(name) == twin.column(name)).all(), name
        assert (table.find(keys) >= 0).all()
    assert table.buckets == 3 + 211 and table.size == len(keys) > 1000
    with pytest.raises(ValueError, match="exceed"):
        table.split(400)


def test_at_its_cap_the_table_hands_back_what_found_no_room() -> None:
    rng = np.random.default_rng(2)
    table = GrowingTable({"value": np.uint32}, max_buckets=8, uniform=True)
    keys = as_keys(rng.integers(0, 2**64, size=400, dtype=np.uint64))
    left, rows = table.insert(keys, {"value": np.arange(400, dtype=np.uint32)})
    assert table.buckets == 8
    assert len(left) > 0 and table.size + len(left) == 400
    assert (table.find(left) < 0).all()
    # what came back kept its values; what stayed is found with its own
    stayed = table.find(keys)
    assert table.get("value", stayed[stayed >= 0]).tolist() == np.flatnonzero(stayed >= 0).tolist()
    assert sorted(rows["value"].tolist()) == np.flatnonzero(stayed < 0).tolist()
    victims = table.victims(left[:5], "value")
    assert len(victims) == 5 and table.taken(victims).all()


@pytest.mark.parametrize("kernel", ["reserves", "refuses"])
def test_a_large_table_reserves_its_cap_once_or_goes_on_doubling(
    kernel: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A small table doubles its capacity by copying; past 1 MB it reserves its whole cap at
    once (mapped, not copied, as it grows into it). Where the kernel refuses that reservation
    the table says so once and goes on doubling, and holds every key either way."""
    real_reserve = HashTable.reserve
    asked: list[int] = []

    def reserve(self: HashTable, capacity: int) -> None:
        asked.append(capacity)
        if kernel == "refuses" and capacity == cap:
            raise OSError(12, "Cannot allocate memory")
        real_reserve(self, capacity)

    monkeypatch.setattr(HashTable, "reserve", reserve)
    cap = 40_000  # buckets: about 8 MB of arrays
    table = GrowingTable({"value": np.uint32}, max_buckets=cap, uniform=True)
    rng = np.random.default_rng(6)
    held = []
    while table.buckets < 12_000:
        keys = np.unique(as_keys(rng.integers(0, 2**64, size=5_000, dtype=np.uint64)))
        left, _ = table.insert(keys, {"value": np.zeros(len(keys), np.uint32)})
        assert len(left) == 0
        held.append(keys)
    assert (table.find(np.concatenate(held)) >= 0).all()
    capacity = table._table.capacity
    if kernel == "reserves":
        assert capacity == cap and asked[-1] == cap  # no copy after it
        assert all(smaller < cap for smaller in asked[:-1])
        assert not [r for r in caplog.records if "reserving" in r.getMessage()]
    else:
        assert asked.count(cap) == 1  # tried once, not at each of the doublings after it
        assert len(asked) >= asked.index(cap) + 3 and table.buckets <= capacity < cap
        warned = [r for r in caplog.records if "reserving" in r.getMessage()]
        assert len(warned) == 1
