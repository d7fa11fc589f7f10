"""Catch-up from vLLM's and SGLang's own KV event publishers (vLLM 0.32 and SGLang 0.5.23,
run from their environments): they serve no snapshot, so a late subscriber replays their
bounded buffer from 0, in each one's reply layout (vLLM's `[b"", topic, seq, payload]`,
SGLang's `[b"", seq, payload]`). Best effort: the batches still buffered, nothing older.

SGLang 0.5.23 writes its events as tagged msgpack maps, as vLLM does (its `KVCacheEvent`
says so), not the positional arrays of `prfaas.protocol.kv_events.events`; the map-form
decoder reads them here, and the gateway's feed reads an SGLang instance's with it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from vllm_helpers import ROOT, VLLM_PYTHON, require_vllm

from prfaas.common.hashing import hash_blocks, salt_root
from prfaas.common.ports import free_port
from prfaas.gateway.deployment import MAP_EVENTS
from prfaas.gateway.kv_feed import KVEventFeed
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.protocol.kv_events import BlockStored, KVEventSubscriber, SaltedBlockStored
from prfaas.protocol.kv_events.vllm_events import VLLMEventDecoder

CHILD = Path(__file__).resolve().parents[1] / "support" / "kv_publisher_child.py"
SGLANG_PYTHON = ROOT / ".venv-sglang/bin/python"


def _python(kind: str) -> Path:
    """The engine's environment (fail, never skip, when it is missing: `make test`)."""
    if kind == "vllm":
        require_vllm()
        return VLLM_PYTHON
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"no SGLang environment at {SGLANG_PYTHON}: run `make test-sglang`")
    return SGLANG_PYTHON


def _publisher(kind: str, pub_port: int, replay_port: int) -> subprocess.Popen[str]:
    """The engine's publisher in a child: 5 batches published, a replay buffer of 3."""
    return subprocess.Popen(
        [str(_python(kind)), str(CHILD), kind, str(pub_port), str(replay_port), "5", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_a_late_subscriber_replays_what_the_buffer_still_holds(kind: str) -> None:
    """Five batches published, a buffer of three: `sync` gets batches 2, 3 and 4 (no
    snapshot), decoded into our events, with no gap reported for the window's start;
    batches 0 and 1 are the documented limit."""
    pub_port, replay_port = free_port(), free_port()
    child = _publisher(kind, pub_port, replay_port)
    sub = KVEventSubscriber(
        f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        replay_timeout_s=5.0,
        decode=VLLMEventDecoder().decode_frames,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "published"
        got = await sub.sync()
    finally:
        sub.close()
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
    assert [(g.seq, g.missed, g.snapshot) for g in got] == [(2, 0, False), (3, 0, False),
                                                            (4, 0, False)]  # fmt: skip
    assert [g.batch.events for g in got] == [
        *[(BlockStored((i + 1,), None, (i,) * 4, 4),) for i in (2, 3)],
        (SaltedBlockStored((5,), None, (4,) * 4, 4, None, "tenant"),),
    ]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_the_gateways_feed_reads_each_engines_own_events_into_the_index(kind: str) -> None:
    """An instance of that engine kind, fed as the gateway feeds it (`MAP_EVENTS`), catches
    up from its publisher's buffer: the index holds the three blocks still buffered, the
    salted one for prompts under its salt alone. (An SGLang instance's events read with the
    positional decoder were all rejected.)"""
    pub_port, replay_port = free_port(), free_port()
    child = _publisher(kind, pub_port, replay_port)
    index = KVIndexManager(block_size=4)
    feed = KVEventFeed(
        index,
        {"engine": f"tcp://127.0.0.1:{pub_port}"},
        map_events=frozenset({"engine"} if kind in MAP_EVENTS else ()),
        replay={"engine": f"tcp://127.0.0.1:{replay_port}"},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "published"
        feed.start()
        assert await feed.synced(10.0) == []
    finally:
        await feed.stop()
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
    held = [index.longest_prefix(hash_blocks([i] * 4, 4)) for i in range(5)]
    assert held == [{"engine": 0}] * 2 + [{"engine": 4}] * 2 + [{"engine": 0}]
    salted = hash_blocks([4] * 4, 4, parent=salt_root("tenant"))
    assert index.longest_prefix(salted) == {"engine": 4}
