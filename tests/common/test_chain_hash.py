"""The C loops of the chained block hash (`prfaas.common._chain_hash`) against hashing.py's
Python loops, which define them: equal hashes for every input form (lists, tuples, uint32
bytes, msgpack arrays), range and parent, and the same errors for ids that are not uint32
integers."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.common import hashing

try:
    from prfaas.common._chain_hash import hash_range, packed_count, unpack_ids
except ImportError:  # every test here then fails: the project's setup builds it
    hash_range = unpack_ids = packed_count = None  # type: ignore[assignment]

IDS = st.lists(st.integers(0, 2**32 - 1), max_size=300)
PARENTS = st.none() | st.integers(0, 2**64 - 1)


def test_the_c_loop_is_what_hashing_runs() -> None:
    """The environment the tests run in has the extension built, and hashing.py uses it
    (where it is missing, hashing falls back to Python, about 10x slower)."""
    assert hash_range is not None, "prfaas.common._chain_hash is not built"
    assert hashing._hash_range is hash_range
    assert hashing._unpack_ids is unpack_ids
    assert hashing._packed_count is packed_count


@settings(max_examples=200, deadline=None)
@given(ids=IDS, block_size=st.integers(1, 70), parent=PARENTS, data=st.data())
def test_c_equals_python(
    ids: list[int], block_size: int, parent: int | None, data: st.DataObject
) -> None:
    """Lists, tuples and uint32 bytes, any block range, chained to any parent."""
    blocks = len(ids) // block_size
    start = data.draw(st.integers(0, blocks))
    stop = data.draw(st.integers(start, blocks))
    expected = hashing._hash_range_py(ids, block_size, parent, start, stop)
    raw = np.asarray(ids, dtype="<u4").tobytes()
    assert hashing._hash_range_py(raw, block_size, parent, start, stop) == expected
    for form in (ids, tuple(ids), raw):
        assert hash_range(form, block_size, parent, start, stop) == expected


def test_numpy_integers_in_a_list() -> None:
    """Items that are not ints but index like ints (numpy scalars) hash as their values."""
    ids: list[object] = [np.int64(7), np.uint32(2**32 - 1), 3, np.int16(0)]
    expected = hashing._hash_range_py([7, 2**32 - 1, 3, 0], 2, None, 0, 2)
    assert hash_range(ids, 2, None, 0, 2) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        ([1, -1], OverflowError),
        ([1, 2**32], OverflowError),
        ([1, 1.5], TypeError),
        ([1, "2"], TypeError),
    ],
)
def test_ids_that_are_not_uint32(ids: list[object], error: type[Exception]) -> None:
    """Both loops refuse the same ids with the same exception type."""
    with pytest.raises(error):
        hash_range(ids, 2, None, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(error):
        hashing._hash_range_py(ids, 2, None, 0, 1)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    """A block size, range, parent or byte length out of bounds is an error, not a read
    past the ids."""
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        hash_range([1], 0, None, 0, 0)
    with pytest.raises(ValueError, match="not within 5 tokens"):
        hash_range([1] * 5, 2, None, 0, 3)
    with pytest.raises(ValueError, match="not within"):
        hash_range([1] * 4, 2, None, 2, 1)
    with pytest.raises(ValueError, match="not within"):
        hash_range([1] * 4, 2, None, -1, 1)
    with pytest.raises(OverflowError):
        hash_range([1, 2], 2, -1, 0, 1)
    with pytest.raises(ValueError, match="multiple of 4"):
        hash_range(b"\x00" * 6, 1, None, 0, 1)
    with pytest.raises(TypeError):
        hash_range({1, 2}, 1, None, 0, 1)  # type: ignore[arg-type]


def test_a_list_emptied_while_read() -> None:
    """An id whose `__index__` empties the list mid-read raises (IndexError), no crash."""
    ids: list[object] = []

    class Emptying:
        def __index__(self) -> int:
            ids.clear()
            return 1

    ids.extend([1, Emptying(), 3, 4])
    with pytest.raises(IndexError):
        hash_range(ids, 2, None, 0, 2)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(ids=IDS, block_size=st.integers(1, 70), parent=PARENTS)
def test_packed_ids_unpack_to_their_values(
    ids: list[int], block_size: int, parent: int | None
) -> None:
    """Ids in their msgpack encoding (as KV events carry them; arrays of up to 300 take
    the fixarray and array-16 headers) unpack to their uint32 values, in C and in Python,
    and hash as the ids do."""
    packed = msgspec.msgpack.encode(ids)
    expected = np.array(ids, dtype="<u4").tobytes()
    assert unpack_ids(packed) == hashing._unpack_ids_py(packed) == expected
    assert unpack_ids(msgspec.Raw(packed)) == expected
    hashes = hashing._hash_range_py(ids, block_size, parent, 0, len(ids) // block_size)
    assert hashing.hash_blocks(memoryview(unpack_ids(packed)).cast("I"), block_size,
                               parent=parent) == hashes  # fmt: skip
    assert packed_count(packed) == hashing._packed_count_py(packed) == len(ids)


def test_packed_ids_in_every_integer_form() -> None:
    """Any msgpack integer form of an id in [0, 2**32) reads as that id (encoders write the
    shortest; others are valid msgpack too), and an array-32 header reads."""
    forms = [
        b"\x05",  # positive fixint
        b"\xcc\x05",  # uint 8
        b"\xcd\x00\x05",  # uint 16
        b"\xce\x00\x00\x00\x05",  # uint 32
        b"\xcf" + (5).to_bytes(8, "big"),  # uint 64
        b"\xd0\x05",  # int 8
        b"\xd1\x00\x05",  # int 16
        b"\xd2\x00\x00\x00\x05",  # int 32
        b"\xd3" + (5).to_bytes(8, "big"),  # int 64
    ]
    top = b"\xce\xff\xff\xff\xff"  # 2**32 - 1
    packed = b"\xdd" + (len(forms) + 1).to_bytes(4, "big") + b"".join(forms) + top
    expected = np.array([5] * len(forms) + [2**32 - 1], dtype="<u4").tobytes()
    assert unpack_ids(packed) == hashing._unpack_ids_py(packed) == expected
    assert packed_count(packed) == 10


@pytest.mark.parametrize(
    ("packed", "error"),
    [
        (b"\x92\x01\xff", OverflowError),  # negative fixint
        (b"\x92\x01\xd0\xff", OverflowError),  # int 8, negative
        (b"\x92\x01\xcf" + (2**32).to_bytes(8, "big"), OverflowError),
        (b"\x92\x01\xc0", TypeError),  # nil
        (b"\x92\x01\xa1a", TypeError),  # a string
        (b"\x92\x01\xcd\x00", ValueError),  # cut within an id
        (b"\x92\x01", ValueError),  # fewer ids than the header says
        (b"\x81\x01\x02", ValueError),  # a map, not an array
        (b"", ValueError),
    ],
)
def test_packed_ids_that_are_not_uint32(packed: bytes, error: type[Exception]) -> None:
    """Both readers refuse what is not an array of uint32 integers, with the same type."""
    with pytest.raises(error):
        unpack_ids(packed)
    with pytest.raises(error):
        hashing._unpack_ids_py(packed)


def test_index_like_arguments_and_blocks_larger_than_the_ids() -> None:
    """numpy integers as block size, parent and range read as their values; a block size
    past the ids hashes nothing (and allocates nothing) in every form."""
    ids = [1, 2, 3, 4]
    expected = hashing._hash_range_py(ids, 2, 5, 0, 2)
    assert hash_range(ids, np.int64(2), np.uint64(5), np.int8(0), np.int64(2)) == expected  # type: ignore[arg-type]
    assert hashing.hash_blocks(ids, 2**40) == []
    assert hash_range(ids, 2**40, None, 0, 0) == []


def test_a_count_past_the_bytes_is_refused_before_anything_is_read() -> None:
    """An array header claiming more ids than bytes follow is an error at once (not a
    list sized by the claim), in C and in Python."""
    packed = b"\xdd\xff\xff\xff\xff\x01\x02"
    for count in (packed_count, hashing._packed_count_py):
        with pytest.raises(ValueError, match="end before their count"):
            count(packed)
    for unpack in (unpack_ids, hashing._unpack_ids_py):
        with pytest.raises(ValueError, match="end before their count"):
            unpack(packed)


@pytest.mark.parametrize(
    ("packed", "error"),
    [
        (b"\x91\xa1x", TypeError),  # a string at the end
        (b"\x95\x01\x02\x03\x04\xff", OverflowError),  # a negative id at the end
        (b"\x94\x01\x02\x03\x04\x05", ValueError),  # a byte after the array
    ],
)
def test_packed_ids_are_checked_to_their_end(packed: bytes, error: type[Exception]) -> None:
    """Every id is checked, and the bytes hold the array alone."""
    with pytest.raises(error):
        unpack_ids(packed)
    with pytest.raises(error):
        hashing._unpack_ids_py(packed)


@pytest.mark.parametrize(
    ("parent", "error"), [(-1, OverflowError), (2**64, OverflowError), (1.5, TypeError)]
)
def test_a_bad_parent_is_refused_even_with_no_block(parent: object, error: type[Exception]) -> None:
    """Both loops check the parent first, whatever there is to hash."""
    for loop in (hash_range, hashing._hash_range_py):
        with pytest.raises(error):
            loop([1], 2, parent, 0, 0)  # type: ignore[operator]


def test_uint32_buffers_and_numpy_arrays() -> None:
    """Any buffer of uint32 ids hashes as its ids in both loops; a numpy array of ids is
    checked as a list is (no silent wrapping of ids outside uint32, no truncated floats)."""
    ids = [1, 2, 3, 2**32 - 1]
    expected = hashing._hash_range_py(ids, 2, None, 0, 2)
    raw = np.asarray(ids, dtype="<u4").tobytes()
    for form in (raw, bytearray(raw), memoryview(raw)):
        assert hash_range(form, 2, None, 0, 2) == expected
        assert hashing._hash_range_py(form, 2, None, 0, 2) == expected
    assert hashing.hash_blocks(np.asarray(ids, dtype=np.int64), 2) == expected
    with pytest.raises(OverflowError):
        hashing.hash_blocks(np.asarray([1, -1]), 2)
    with pytest.raises(OverflowError):
        hashing.hash_blocks(np.asarray([1, 2**33]), 2)
    with pytest.raises(TypeError):
        hashing.hash_blocks(np.asarray([1.0, 2.0]), 2)
