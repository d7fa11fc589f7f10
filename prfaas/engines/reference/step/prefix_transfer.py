"""Prefix pull across clusters (the bandwidth-abundant regime, paper 3.4.3): one engine
exports the KV and linear states of a prompt's longest cached prefix over the KV transport,
another imports them into its own prefix cache, so the request that follows computes only
the rest there.

`export_prefix` and `import_prefix` touch the pool and must run on the engine thread
(between steps); `send_prefix` and `prefix_from_received` are the message side.

Messages in one room: every full-attention layer's KV of the whole prefix (blocks `[0, n)`),
every linear layer's state at its end, then the meta `{"prefix_tokens", "block_size"}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

import orjson

from prfaas.common.hashing import hash_blocks
from prfaas.engines.kv_pages import META
from prfaas.engines.kv_pages.device_copy import DeviceCopier
from prfaas.engines.reference.cache.block_pool import BlockPool, OutOfKVCapacity
from prfaas.engines.reference.cache.storage import KVStorage
from prfaas.engines.reference.handoff.base import (
    FULL_KV,
    LINEAR_STATE,
    HandoffError,
    Outbox,
    Received,
)
from prfaas.engines.reference.model.hybrid_cache import SeqState
from prfaas.engines.reference.step.prefill import assemble_state, host_copy

_imports = count()


def export_prefix(pool: BlockPool, storage: KVStorage, prompt: Sequence[int]) -> SeqState | None:
    """A copy of the KV and linear states of the longest cached prefix of `prompt` that has
    a saved state at its end (all but the last token are matched, as admission does), or
    None when nothing is cached. Engine thread; does not mutate the pool."""
    bs = pool.config.block_size
    match = pool.match_prefix(hash_blocks(prompt[:-1], bs))
    if not match.block_ids or match.state_slot is None:
        return None
    state = storage.gather(match.block_ids)
    storage.load_state(match.state_slot, state)
    return state


def send_prefix(outbox: Outbox, state: SeqState, block_size: int, copier: DeviceCopier) -> None:
    """Queue the prefix's messages on `outbox` and finish it."""
    blocks = (0, state.length // block_size)
    for layer in sorted(state.keys):
        kv = {"k": state.keys[layer][0], "v": state.values[layer][0]}
        outbox.send_copy(layer, FULL_KV, host_copy(copier, kv), blocks=blocks)
    for layer in sorted(state.conv):
        states = {"conv": state.conv[layer][0], "rec": state.rec[layer][0]}
        outbox.send_copy(layer, LINEAR_STATE, host_copy(copier, states))
    outbox.send_meta({"prefix_tokens": state.length, "block_size": block_size})
    outbox.finish()


def prefix_from_received(
    received: Received, layer_types: tuple[str, ...], block_size: int, copier: DeviceCopier
) -> SeqState:
    """The exported prefix as engine state on the copier's device, checked complete.

    Raises:
        HandoffError: no meta, another block size, or missing or short layers.
    """
    raw = received.aux.get(META)
    if raw is None:
        raise HandoffError("the prefix transfer carried no meta")
    meta = orjson.loads(raw)
    if meta.get("block_size") != block_size:
        raise HandoffError(f"prefix of {meta.get('block_size')}-token blocks, this engine "
                           f"uses {block_size}")  # fmt: skip
    return assemble_state(received, int(meta["prefix_tokens"]), layer_types, copier)


def import_prefix(
    pool: BlockPool, storage: KVStorage, prompt: Sequence[int], state: SeqState
) -> int:
    """Enter `state` (the prefix of `prompt` it holds) into the prefix cache as if this
    engine had computed it: blocks indexed (KV events recorded), the linear states saved at
    its end. Returns the tokens newly cached (0: already cached, or no room). Engine thread.
    """
    bs, n = pool.config.block_size, state.length
    if n % bs or n > len(prompt) - 1:
        raise HandoffError(f"a {n}-token prefix does not fit a {len(prompt)}-token prompt "
                           f"in {bs}-token blocks")  # fmt: skip
    local = pool.match_prefix(hash_blocks(prompt[:n], bs))
    if local.num_tokens >= n:
        return 0
    rid = f"prefix-import-{next(_imports)}"
    try:
        table = pool.allocate(rid, n, local)
    except OutOfKVCapacity:
        return 0
    try:
        first = len(local.block_ids)
        storage.write_blocks(state, table[first:], first)
        pool.cache_full_blocks(rid, prompt[:n])
        slot = pool.save_state(rid, n)
        if slot is None:  # part of it is cached under another chain: the import is moot
            return 0
        storage.save_state(slot, state)
        return n - local.num_tokens
    finally:
        pool.free(rid)
