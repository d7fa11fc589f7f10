"""A real vLLM server's own KV events, salted: vLLM keys a request's blocks by its
`cache_salt` too (and publishes the salt as the first block's extra key), so a prompt is
reused only under the salt that cached it. The gateway's feed and index, fed that server's
events, credit each prompt what vLLM then reuses for it: the salted chain to the same salt
(looked up from `salt_root`), nothing to the same tokens unsalted or under another salt.
Before the index read the salt, it credited the salted chain to the unsalted prompt, which
vLLM then computed whole (an over-report), and nothing to the salted one."""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

import pytest
from vllm_helpers import completion, require_vllm, server, start_all, stop_all

from prfaas.common.hashing import iter_block_hashes, salt_root
from prfaas.gateway.kv_feed import KVEventFeed
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

pytestmark = pytest.mark.timeout(900)


def _reused(url: str, ids: list[int], salt: str | None) -> int:
    """Prompt tokens vLLM took from its prefix cache for `ids` under `salt`."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    usage = completion(url, body)["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def _said_and_reused(url: str, events: str) -> list[tuple[str, str | None, int, int]]:
    """Requests in order, each as (what, salt, index said, vLLM reused): a salted prefix,
    extended twice under its salt (vLLM keeps a hybrid prefix reusable only where it kept
    the linear states: not where a prefix is first computed), then the longest prompt
    unsalted and under another salt."""
    index = KVIndexManager(block_size=TINY_BLOCK_SIZE)
    feed = KVEventFeed(index, {"vllm": events}, map_events=frozenset({"vllm"}))
    feed.start()
    rng = random.Random(7)
    prompt = [rng.randrange(256) for _ in range(3 * TINY_BLOCK_SIZE + 10)]
    steps = [("prefix", "tenant-1", 0), ("extended", "tenant-1", 2 * TINY_BLOCK_SIZE),
             ("extended again", "tenant-1", 3 * TINY_BLOCK_SIZE),
             ("unsalted", None, 0), ("another salt", "tenant-2", 0)]  # fmt: skip
    rows = []
    try:
        await asyncio.sleep(1.0)  # the subscription joins
        for what, salt, extra in steps:
            ids = prompt + [rng.randrange(256) for _ in range(extra)]
            prompt = ids if salt == "tenant-1" else prompt
            root = None if salt is None else salt_root(salt)
            said = index.longest_prefix(iter_block_hashes(ids, TINY_BLOCK_SIZE, parent=root))
            got = await asyncio.to_thread(_reused, url, ids, salt)
            rows.append((what, salt, said.get("vllm", 0), got))
            await asyncio.sleep(1.0)  # its events reach the feed
    finally:
        await feed.stop()
    return rows


def test_the_index_credits_a_salted_prefix_as_vllm_reuses_it() -> None:
    require_vllm()
    logs = Path(tempfile.mkdtemp(prefix="vllm-salt-"))
    events = f"ipc://{logs}/events"
    engines = start_all({"vllm": server("vllm", kv_events=events)}, logs)
    try:
        rows = asyncio.run(_said_and_reused(engines["vllm"].url, events))
    finally:
        stop_all(engines)
    assert all(said == reused for _, _, said, reused in rows), rows
    by_what = {what: reused for what, _, _, reused in rows}
    assert by_what["extended again"] > 0, rows  # a salted prefix reused under its salt
    assert by_what["unsalted"] == by_what["another salt"] == 0, rows
