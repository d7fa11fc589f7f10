"""KV cache events in SGLang's ZMQ wire format: msgspec structs, codec, publisher, subscriber.

Wire format (PrfaaS's positional layout, byte-compatible with SGLang's `ZmqEventPublisher`
before 0.5.23, whose events were `array_like=True` with `tag=True`; SGLang 0.5.23 writes its
events as tagged maps, vLLM's layout, which `vllm_events.py` reads):

* a ZMQ multipart message `[topic, seq, payload]`: `topic` the UTF-8 topic (often empty),
  `seq` the batch sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher),
  `payload` one msgpack `KVEventBatch`;
* `KVEventBatch` = array `[ts, events, attn_dp_rank]` (msgspec writes every field of an
  array-like struct, nil included; SGLang's publisher stamps its DP rank, 0 by default);
  the decoder also takes SGLang's older two-field `[ts, events]`;
* each event is an array whose first element is the class name as the tag:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`,
  `["BlockRemoved", block_hashes]` and `["AllBlocksCleared"]`. Two events of ours ride
  the same layout, `["StatesStored", block_hashes]` and `["StatesRemoved", block_hashes]`:
  where a hybrid engine kept linear-attention states (SGLang sends neither; the vLLM
  decoder makes them from its Mamba groups' events).

Decoding is typed (msgspec validates in C) and ignores unknown trailing fields, so newer
publishers stay readable (vLLM's array-form `medium` is skipped). Map-form events are
rejected with `KVEventDecodeError`, like any other malformed payload (the gateway's feed
then tries the map-form decoder: `gateway/kv_feed.py`).

Replay (SGLang's optional ROUTER endpoint): a request `[b"", start_seq]` (8 bytes
big-endian) is answered by one `[b"", seq, payload]` per buffered batch from `start_seq`,
then `[b"", END_SEQ, b""]` (END_SEQ = -1 as 8 signed bytes). vLLM's publisher answers the
same request with `[b"", topic, seq, payload]` and `[b"", b"", END_SEQ, b""]`; the
subscriber takes both.

Snapshot (PrfaaS extension on the same endpoint, so a subscriber that joins late, e.g. a
gateway started beside running engines, knows what is cached already): a request from
SNAPSHOT_SEQ (-2 as 8 signed bytes) is answered `[b"", SNAPSHOT_SEQ, S]`, then
`[b"", S, payload]` batches of `BlockStored` chains (parents first) and the kept states
(`StatesStored`, for a hybrid engine) that rebuild everything cached after every batch
before sequence number S and none after it, then END_SEQ; the subscriber then skips live
batches before S. The publisher keeps that state from its own events (`cache_mirror.py`).
SGLang's and vLLM's publishers read SNAPSHOT_SEQ as 2**64 - 2 and answer END_SEQ alone,
so the subscriber falls back to replaying their bounded buffer from 0 (best effort).

Modules: `prfaas.protocol.kv_events.events` (event structs, encode/decode), `publisher`
(`KVEventPublisher`, ZMQ PUB plus replay and snapshots), `cache_mirror` (what the published
events say is cached), `subscriber` (`KVEventSubscriber`, asyncio SUB with gap detection,
replay and catch-up). Everything is re-exported here.
"""

from __future__ import annotations

from prfaas.protocol.kv_events.events import (
    SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
    SaltedBlockStored,
    StatesRemoved,
    StatesStored,
    UnreadBlockStored,
    decode_batch,
    decode_frames,
    encode_batch,
    encode_frames,
    event_slices,
)
from prfaas.protocol.kv_events.publisher import END_SEQ, SNAPSHOT_SEQ, KVEventPublisher
from prfaas.protocol.kv_events.subscriber import KVEventSubscriber, ReceivedBatch

__all__ = [
    "END_SEQ",
    "SEQ_BYTES",
    "SNAPSHOT_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecodeError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "ReceivedBatch",
    "SaltedBlockStored",
    "StatesRemoved",
    "StatesStored",
    "UnreadBlockStored",
    "decode_batch",
    "decode_frames",
    "encode_batch",
    "encode_frames",
    "event_slices",
]
