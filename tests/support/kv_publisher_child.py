"""Run in the vLLM or SGLang environment by test_kv_events_foreign_replay.py: that
engine's own KV event publisher with its replay endpoint (`python kv_publisher_child.py
vllm|sglang PUB_PORT REPLAY_PORT BATCHES BUFFER`). It publishes BATCHES one-block
`BlockStored` batches (hash i + 1, tokens [i] * 4; the last one under the cache salt
"tenant", as that engine publishes a salt) with a replay buffer of BUFFER steps,
prints `published`, and serves until its stdin closes."""

from __future__ import annotations

import sys
import time
from typing import Any


def _publisher(kind: str, pub_port: int, replay_port: int, buffer: int) -> tuple[Any, Any]:
    """(publisher, the module with its BlockStored and KVEventBatch) of that engine."""
    endpoints = {"endpoint": f"tcp://*:{pub_port}", "replay_endpoint": f"tcp://*:{replay_port}"}
    if kind == "vllm":
        from vllm.distributed import kv_events as vllm

        pub = vllm.ZmqEventPublisher(0, buffer_steps=buffer, topic="kv-events", **endpoints)
        return pub, vllm
    from sglang.srt.disaggregation import kv_events as sglang

    return sglang.ZmqEventPublisher(0, buffer_steps=buffer, **endpoints), sglang


def main() -> None:
    kind = sys.argv[1]
    pub_port, replay_port, batches, buffer = (int(a) for a in sys.argv[2:6])
    publisher, events = _publisher(kind, pub_port, replay_port, buffer)
    extra = {"medium": "GPU", "lora_name": None} if kind == "vllm" else {}
    for i in range(batches):
        if i == batches - 1:  # the last one salted, as each engine publishes a salt
            extra["extra_keys" if kind == "vllm" else "cache_salt"] = (
                [("tenant",)] if kind == "vllm" else "tenant"
            )
        stored = events.BlockStored(
            block_hashes=[i + 1], parent_block_hash=None, token_ids=[i] * 4, block_size=4,
            lora_id=None, **extra,
        )  # fmt: skip
        publisher.publish(events.KVEventBatch(time.time(), [stored]))
    time.sleep(1.0)  # its thread sends them and fills the replay buffer
    print("published", flush=True)
    sys.stdin.read()
    publisher.shutdown()


if __name__ == "__main__":
    main()
