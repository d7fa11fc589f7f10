"""KV cache events in SGLang's ZMQ wire format: msgspec structs, codec, publisher, subscriber.

Wire format (byte-compatible with SGLang's `ZmqEventPublisher`: our events are msgspec
structs declared as SGLang declares its own, `array_like=True` with `tag=True` on events):

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
rejected with `KVEventDecodeError`, like any other malformed payload.

Replay (SGLang's optional ROUTER endpoint): a request `[b"", start_seq]` (8 bytes
big-endian) is answered by one `[b"", seq, payload]` per buffered batch from `start_seq`,
then `[b"", END_SEQ, b""]` (END_SEQ = -1 as 8 signed bytes).

Modules: `prfaas.protocol.kv_events.events` (event structs, encode/decode), `publisher`
(`KVEventPublisher`, ZMQ PUB plus replay), `subscriber` (`KVEventSubscriber`, asyncio SUB
with gap detection and replay). Everything is re-exported here.
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
    StatesRemoved,
    StatesStored,
    decode_batch,
    decode_frames,
    encode_batch,
    encode_frames,
)
from prfaas.protocol.kv_events.publisher import END_SEQ, KVEventPublisher
from prfaas.protocol.kv_events.subscriber import KVEventSubscriber, ReceivedBatch

__all__ = [
    "END_SEQ",
    "SEQ_BYTES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecodeError",
    "KVEventPublisher",
    "KVEventSubscriber",
    "ReceivedBatch",
    "StatesRemoved",
    "StatesStored",
    "decode_batch",
    "decode_frames",
    "encode_batch",
    "encode_frames",
]
