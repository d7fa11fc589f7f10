"""A prefill engine's KV side in a process of its own, for the prefill-death test:
`python sglang_prefill_child.py BOOTSTRAP_PORT ROOM` starts SGLang's bootstrap server and a
prefill-mode `PrfaasKVManager`, prints `ready`, waits for the decode's metadata of ROOM,
sends its first chunk, prints `sent` and then waits to be killed."""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

import numpy as np
import sglang_helpers as sh
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend
from sglang.srt.plugins import load_plugins


def main(port: int, room: int) -> None:
    load_plugins()
    from sglang.srt.disaggregation.utils import get_kv_class  # the plugin's wrapped one

    args = sh.server_args(port)
    get_kv_class(TransferBackend.PRFAAS, KVClassType.BOOTSTRAP_SERVER)(host=sh.HOST, port=port)
    pool = sh.HybridPool(tokens=128, slots=4, aux_slots=4, seed=1)
    mgr = sh.manager(pool, DisaggregationMode.PREFILL, args)
    pair = sh.Pair(f"{sh.HOST}:{port}", pool, pool, mgr, None)
    sender = pair.sender(room)
    print("ready", flush=True)
    assert sh.wait_for(sender.poll, KVPoll.WaitingForInput, 60) == KVPoll.WaitingForInput
    sender.init(8, aux_index=0)
    sender.send(np.arange(2, dtype=np.int32), None, 8)
    print("sent", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
