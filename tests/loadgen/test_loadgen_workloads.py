"""Workloads: trace replay reproduces the trace's block sharing; synthetic shapes hold."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from prfaas.common.hashing import hash_block
from prfaas.loadgen.tokens import TokenSpace, render_text
from prfaas.loadgen.workloads import TraceError, WorkloadOptions, create_workload
from prfaas.loadgen.workloads.lengths import LogNormalLengths, UniformLengths
from prfaas.loadgen.workloads.mooncake import MooncakeWorkload

TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/data/traces/mooncake_conversation.jsonl"
)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_trace_replay_reproduces_block_sharing() -> None:
    """Equal hash ids <=> equal 512-token blocks (content hash, unchained), over 1500 lines."""
    workload = MooncakeWorkload.from_file(TRACE)
    content_of: dict[int, int] = {}
    id_of: dict[int, int] = {}
    uses: dict[int, int] = {}
    for session in itertools.islice(workload.sessions(_rng()), 1500):
        entry = workload.entries[session.session_id]
        tokens = session.turns[0].tokens
        assert len(tokens) == entry.input_length
        for i, hash_id in enumerate(entry.hash_ids[:-1]):  # full blocks only
            digest = hash_block(None, tokens[i * 512 : (i + 1) * 512])
            assert content_of.setdefault(hash_id, digest) == digest  # same id, same tokens
            assert id_of.setdefault(digest, hash_id) == hash_id  # different ids, different
            uses[hash_id] = uses.get(hash_id, 0) + 1
        tail = tokens[512 * (len(entry.hash_ids) - 1) :]
        assert len(tail) == entry.input_length - 512 * (len(entry.hash_ids) - 1)
        full_last = workload.space.block(entry.hash_ids[-1], 0, 512)
        assert np.array_equal(tail, full_last[: len(tail)])
    shared = sum(1 for n in uses.values() if n > 1)
    assert len(content_of) > 1000 and shared > 50  # the trace's real sharing was exercised


def test_trace_sharing_counts_match_trace() -> None:
    """The number of distinct full blocks generated equals the number of distinct ids."""
    workload = MooncakeWorkload.from_file(TRACE)
    ids, digests = set(), set()
    for session in itertools.islice(workload.sessions(_rng()), 400):
        entry = workload.entries[session.session_id]
        toks = session.turns[0].tokens
        for i, h in enumerate(entry.hash_ids[:-1]):
            ids.add(h)
            digests.add(hash_block(None, toks[i * 512 : (i + 1) * 512]))
    assert len(ids) == len(digests) > 100


def test_trace_seed_changes_tokens_not_structure() -> None:
    """Another block seed gives other tokens with the same lengths."""
    a = MooncakeWorkload.from_file(TRACE)
    b = MooncakeWorkload.from_file(TRACE, block_seed=1)
    ta = next(a.sessions(_rng())).turns[0].tokens
    tb = next(b.sessions(_rng())).turns[0].tokens
    assert len(ta) == len(tb) and not np.array_equal(ta, tb)


def test_trace_timestamps_and_output_lengths() -> None:
    workload = MooncakeWorkload.from_file(TRACE)
    sessions = list(itertools.islice(workload.sessions(_rng()), 50))
    assert sessions[0].timestamp_s == 0.0
    times = [s.timestamp_s for s in sessions]
    assert times == sorted(times)
    assert sessions[0].turns[0].max_tokens == workload.entries[0].output_length
    fixed = MooncakeWorkload.from_file(TRACE, output_tokens=7)
    assert next(fixed.sessions(_rng())).turns[0].max_tokens == 7


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (
            b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}',
            "input_length 600 does not fit 1 blocks",
        ),
        (b'{"timestamp": -1, "input_length": 5, "output_length": 5, "hash_ids": [1]}', "timestamp"),
        (b'{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": []}', "hash_ids"),
        (b"not json", ":2:"),
    ],
)
def test_bad_trace_line_is_named(tmp_path: Path, line: bytes, needle: str) -> None:
    """A broken trace fails loudly with the file and line in the message."""
    path = tmp_path / "t.jsonl"
    ok = b'{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": [1]}'
    path.write_bytes(ok + b"\n" + line + b"\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:2") as info:
        MooncakeWorkload.from_file(path)
    assert needle in str(info.value)


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        create_workload(f"mooncake:{tmp_path / 'nope.jsonl'}", WorkloadOptions())


def test_lognormal_lengths_follow_truncated_distribution() -> None:
    """KS test of 3000 sampled lengths against the truncated log-normal CDF (paper params)."""
    lengths = LogNormalLengths()
    rng = _rng(7)
    samples = np.array([lengths.sample(rng) for _ in range(3000)])
    assert samples.min() >= 128 and samples.max() <= 131072
    result = stats.kstest(samples, lengths.distribution().cdf)
    assert result.pvalue > 0.01
    shifted = LogNormalLengths(mu=9.7)
    assert stats.kstest(samples, shifted.distribution().cdf).pvalue < 1e-6  # test has power


def test_lognormal_workload_is_reproducible_and_fresh() -> None:
    """Same seed, same prompts; prompts share no prefix; output length fixed at 1024."""
    w = create_workload("lognormal", WorkloadOptions(inputs=LogNormalLengths(lo=128, hi=4096)))
    a = list(itertools.islice(w.sessions(_rng(3)), 20))
    b = list(itertools.islice(w.sessions(_rng(3)), 20))
    assert all(
        np.array_equal(x.turns[0].tokens, y.turns[0].tokens) for x, y in zip(a, b, strict=True)
    )
    assert len({tuple(s.turns[0].tokens[:8]) for s in a}) == 20
    assert {s.turns[0].max_tokens for s in a} == {1024}


def test_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    options = WorkloadOptions(num_groups=3, system_len=64, question_len=16, output_tokens=4)
    sessions = list(
        itertools.islice(create_workload("shared-prefix", options).sessions(_rng()), 60)
    )
    prefix = {}
    for s in sessions:
        toks = s.turns[0].tokens
        assert len(toks) == 64 + 16
        assert s.group is not None
        assert np.array_equal(prefix.setdefault(s.group, toks[:64]), toks[:64])
    assert len(prefix) == 3
    assert not np.array_equal(prefix[0], prefix[1])


def test_multi_turn_sessions_shape() -> None:
    options = WorkloadOptions(turns=3, first_len=40, turn_len=10, think_time_s=0.5)
    session = next(create_workload("multi-turn", options).sessions(_rng()))
    assert [len(t.tokens) for t in session.turns] == [40, 10, 10]
    assert session.turns[0].think_time_s == 0.0
    assert all(t.think_time_s > 0 for t in session.turns[1:])


def test_output_range_ratio_spreads_lengths() -> None:
    lengths = UniformLengths(100, 0.5)
    rng = _rng()
    values = [lengths.sample(rng) for _ in range(2000)]
    assert min(values) == 50 and max(values) == 150


def test_unknown_workload_and_bad_options() -> None:
    with pytest.raises(ValueError, match="unknown workload 'zipf'"):
        create_workload("zipf", WorkloadOptions())
    with pytest.raises(ValueError, match="sigma must be > 0, got 0"):
        LogNormalLengths(sigma=0)
    with pytest.raises(ValueError, match="range ratio must be in"):
        UniformLengths(10, 1.5)


def test_token_space_blocks_and_text() -> None:
    """Blocks are pure functions of (id, seed) inside the vocabulary; text is one word per id."""
    space = TokenSpace(vocab_size=500, lowest=10)
    a, b = space.block(5, 0, 512), space.block(5, 0, 512)
    assert np.array_equal(a, b) and not np.array_equal(a, space.block(6, 0, 512))
    assert a.min() >= 10 and a.max() < 500
    words = render_text(np.arange(0, 20000, dtype=np.int64)).split()
    assert len(words) == len(set(words)) == 20000
    with pytest.raises(ValueError, match="vocab_size must exceed"):
        TokenSpace(vocab_size=10, lowest=10)
