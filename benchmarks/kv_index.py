"""Benchmark: PrfaaS's global KV index against NVIDIA Dynamo's radix-tree index, side by side
on the same seeded agentic workload: memory per entry, ingest rate, lookup latency.

Why: the gateway keeps one index of every block every engine caches (fed by their KV
events) and looks every request up in it, on its event loop. At 100 instances x 100K blocks
(10M entries) its memory, the rate it can absorb events at, how long one event batch holds
the loop, and a 128K-token lookup decide whether one gateway can front a large cluster.
Dynamo's KV router (`dynamo._core.RadixTree`, Rust, from the PyPI wheel
`ai-dynamo-runtime==1.6.1`, CPU) is the maintained index of the same kind to compare with.

Workload (seeded; both sides generate the same tokens and engine hashes from the same
stdlib code): per size `I x B`, I instances each holding B blocks of 64 tokens (token ids
random in [0, 150000)). Every instance first stores a 32-block system prefix (the same
tokens everywhere, one `BlockStored`), then multi-turn conversations after it: 1-20 turns
(uniform) each, a turn 4-32 new blocks (uniform) in one `BlockStored` whose parent is the
previous turn's last block, until the instance holds B blocks. Every fourth instance
(a quarter) also holds a 1,500-block "long conversation" (its first 32 blocks the system
prefix, then 1,468 blocks in turns, the same tokens on each of them) within its B. Engine
hashes are random 64-bit ints (PrfaaS re-hashes the tokens itself): a conversation's own
blocks draw theirs per instance, while a shared block (system prefix, long conversation)
has one engine hash on every instance, as engines of one model hashing alike report it.
Dynamo's tree needs that: it keeps one engine hash per tree node, the first worker's, so
a second worker that reports the same tokens under another hash cannot chain a child to
it ("Failed to find parent block"; PrfaaS's index keeps each instance's own hashes). Events
reach the index round-robin across instances, one event per batch (a turn ends at one
scheduler step).

Lookup: a 2,000-block (128K-token) request whose first 1,500 blocks are the long
conversation (cached on a quarter of the instances; every other instance holds its first
32), the rest fresh; hashes precomputed, only the index call timed, `--reps` times, p50/p99.

Measured per side and size, each side alone in a fresh subprocess (so its RSS is its own):
- bytes/entry: anonymous RSS growth (`RssAnon`) from just before ingest to after it and
  `gc.collect()`, over the (instance, block) entries. The workload is pre-encoded as wire
  bytes before the first reading, so it is in the baseline; peak RSS is `VmHWM` (it
  includes those bytes: the table lists their size per side);
- ingest entries/s through each one's apply call (ours: `KVIndexManager.apply` with decoded
  events, their token ids left packed as the gateway's feed decodes them where the index
  takes them so; Dynamo: `RadixTree.apply_event` with its JSON bytes, so that is also its
  rate from the wire); ours also from wire bytes: `decode_batch` + `apply` timed together;
  the longest single apply call (the goal: a burst never holds the gateway's loop over 1
  ms). An index that buffers events and applies them later (the numpy rewrite does, in
  batches, at the latest at its next read) is read once after the last event (`len`), that
  call timed as one more apply call. Ours also reads this thread's CPU time and context
  switches in each apply call, and the machine's steal time over the ingest
  (`apply_calls_cpu`, `machine_steal_s`): a call that held the loop long on little CPU
  time was off the CPU, waiting (the GIL, a lock, a page) or preempted;
- lookup p50/p99 (ours `longest_prefix(hashes)`, Dynamo `find_matches(local_hashes)`);
- ours only, for checkouts before linear hashing (2026-12-07), whose tables grew in steps
  into a second table (`KVIndexManager.advance_growth`): an ingest could end in the middle
  of a growth, holding two tables (more memory, lookups searching both). The JSON says so
  (`growing_at_memory_reading`), and the growth is then ended as the gateway's feed ended
  it with no events arriving, back to back here, and memory and lookups read again
  (`settled`); the ingest rate counting those steps' time too is
  `wire_entries_per_s_growth_ended`. Since, a table grows with its keys and nothing is
  left to settle (`growing_at_memory_reading` null);
- hashing the 128K-token prompt, median (ours `hash_blocks` on a fresh heap, before ingest,
  and after it; in Dynamo's column its `compute_block_hash_for_seq`, for context);
- ours only, approximated: snapshot catch-up. A gateway that joins late asks each engine's
  publisher for a snapshot (`prfaas.protocol.kv_events`); here every instance's events go
  through the publisher's own `CacheMirror` and are cut as it answers (chains of at most 64
  blocks, 256 events per batch), then the whole index's content is replayed instance by
  instance from those wire bytes (decode + apply) into a fresh `KVIndexManager` in the same
  process (no sockets), each batch in the slices the gateway's feed applies it in (about
  `FLUSH_BLOCKS` blocks; the feed frees the loop between them), so its longest slice shows
  how long catching up holds the loop. `--no-snapshot` skips it.
Both sides answer the same cross-check lookups (cached prefix per instance); the JSON
records whether they agree. `--layout map` writes our side's events as vLLM 0.32 publishes
them (tagged maps, SGLang 0.5.23's layout too; one decoder per instance, as the gateway's
feed runs them) instead of PrfaaS's positional arrays; vLLM and SGLang serve no snapshot,
so the catch-up part is skipped then.

What differs between the two, by design of each: Dynamo's events carry per-block token
hashes its publisher computed in the engine process (`tokens_hash`), not token ids, so its
ingest hashes nothing; ours carry the token ids (SGLang's events) and the index re-hashes
them (chained xxh3-64) in the apply call. Dynamo's tree runs on a background thread of its
own (the binding releases the GIL), each call a synchronous round trip to it (errors come
back from the call), so its per-call cost swings with how soon that thread wakes: on this
shared 2-core machine its ingest ran at 0.29-1.6M entries/s at one size from run to run.
Its wire format here is the JSON its Python binding takes, ours msgpack.

Dynamo is never a dependency of the project: on first use this script makes a scratch
virtual environment (`.cache/kv-index-dynamo-venv`, git-ignored) with
`pip install ai-dynamo-runtime==1.6.1` and runs the Dynamo side with that environment's
python, running this same file with `--worker dynamo` (that side needs only the standard
library and `dynamo`). Dynamo's API used: `RadixTree()`, `apply_event(worker_id: int,
event_json: bytes)` with `{"event_id": n, "data": {"stored": {"parent_hash": h | null,
"blocks": [{"block_hash": h, "tokens_hash": local}, ...]}}, "dp_rank": 0}`,
`find_matches(local_hashes) -> OverlapScores` (`.scores`: `{(worker_id, dp_rank): matched
blocks}`, instances without a match left out), `compute_block_hash_for_seq(tokens, 64)`.

Numbers from a shared 2-core machine: compare within one run. The three default sizes take
about 9-12 minutes there (100x100000 most of it: generating its 640M tokens, the snapshot).
Usage: python benchmarks/kv_index.py [--sizes 16x10000,64x50000,100x100000] [--quick]
       [--reps 200] [--seed 0] [--no-snapshot] [--sides ours,dynamo] [--layout map]
       [--out OUT.json]
"""

from __future__ import annotations

import argparse
import array
import datetime
import functools
import gc
import importlib
import itertools
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
DYNAMO_VENV = ROOT / ".cache" / "kv-index-dynamo-venv"
DYNAMO_PACKAGE = "ai-dynamo-runtime==1.6.1"
RESULTS = ROOT / "benchmarks" / "results" / "kv_index"

BLOCK = 64
VOCAB = 150_000
SYSTEM_BLOCKS = 32
LONG_BLOCKS = 1_500
"""The long conversation, its first SYSTEM_BLOCKS the system prefix."""
LOOKUP_BLOCKS = 2_000
TURN_BLOCKS = (4, 32)
CONVERSATION_TURNS = (1, 20)
SIZES = ("16x10000", "64x50000", "100x100000")
QUICK_SIZE = "4x2000"
HASH_REPS = 21

TARGET_BYTES_PER_ENTRY = 64.0
TARGET_WIRE_ENTRIES_PER_S = 500_000.0
TARGET_LOOKUP_P50_MS = 0.1
TARGET_LOOKUP_P99_MS = 1.0
TARGET_MAX_APPLY_MS = 1.0
TARGET_SIZE = "100x100000"
"""The size the targets are stated for (they are marked at every size)."""


# ------------------------------------------------------------- workload (standard library only)


class Turn(NamedTuple):
    """One `BlockStored`: blocks chained after `parent` (an engine hash; None: the root)."""

    parent: int | None
    hashes: list[int]
    """The engine's hashes of the blocks (random 64-bit ints)."""
    tokens: list[int]
    """BLOCK token ids per block."""


def _tokens(rng: random.Random, n: int) -> list[int]:
    """`n` token ids in [0, VOCAB) (uint32 draws modulo VOCAB, the same in any process)."""
    ids = array.array("I")
    assert ids.itemsize == 4
    ids.frombytes(rng.randbytes(4 * n))
    return [x % VOCAB for x in ids]


class Workload:
    """The seeded workload of one size: every instance's turns, the lookup, the checks."""

    def __init__(self, seed: int, instances: int, blocks: int) -> None:
        if instances < 2 or blocks < LONG_BLOCKS:
            raise ValueError(f"need >= 2 instances and >= {LONG_BLOCKS} blocks per instance")
        self.seed, self.instances, self.blocks = seed, instances, blocks
        rng = random.Random(f"{seed}:system")
        self.system = _tokens(rng, SYSTEM_BLOCKS * BLOCK)
        # A shared block has one engine hash on every instance, as engines of one model
        # hashing alike report it (Dynamo's tree needs that: see the module docstring).
        self.system_hashes = [rng.getrandbits(64) for _ in range(SYSTEM_BLOCKS)]
        rng = random.Random(f"{seed}:long")
        self.long = self.system + _tokens(rng, (LONG_BLOCKS - SYSTEM_BLOCKS) * BLOCK)
        self.long_hashes = self.system_hashes + [
            rng.getrandbits(64) for _ in range(LONG_BLOCKS - SYSTEM_BLOCKS)
        ]
        self.long_turns: list[tuple[int, int]] = []  # block ranges after the system prefix
        start = SYSTEM_BLOCKS
        while start < LONG_BLOCKS:
            stop = min(start + rng.randint(*TURN_BLOCKS), LONG_BLOCKS)
            self.long_turns.append((start, stop))
            start = stop

    @property
    def entries(self) -> int:
        return self.instances * self.blocks

    @staticmethod
    def holds_long(instance: int) -> bool:
        return instance % 4 == 0

    def turns(self, instance: int) -> Iterator[Turn]:
        """The instance's events in the order its engine published them."""
        rng = random.Random(f"{self.seed}:instance:{instance}")

        def new_hashes(n: int) -> list[int]:
            return [rng.getrandbits(64) for _ in range(n)]

        yield Turn(None, self.system_hashes, self.system)
        held = SYSTEM_BLOCKS
        if self.holds_long(instance):
            for start, stop in self.long_turns:
                hashes = self.long_hashes[start:stop]
                tokens = self.long[start * BLOCK : stop * BLOCK]
                yield Turn(self.long_hashes[start - 1], hashes, tokens)
            held = LONG_BLOCKS
        while held < self.blocks:
            parent = self.system_hashes[-1]
            for _ in range(rng.randint(*CONVERSATION_TURNS)):
                n = min(rng.randint(*TURN_BLOCKS), self.blocks - held)
                if n == 0:
                    break
                hashes = new_hashes(n)
                yield Turn(parent, hashes, _tokens(rng, n * BLOCK))
                parent, held = hashes[-1], held + n

    def lookup(self) -> list[int]:
        """The timed request: the long conversation, then fresh blocks (128K tokens)."""
        fresh = _tokens(random.Random(f"{self.seed}:lookup"), (LOOKUP_BLOCKS - LONG_BLOCKS) * BLOCK)
        return self.long + fresh

    def checks(self) -> dict[str, list[int]]:
        """Requests both sides must answer alike (cached prefix per instance)."""
        conversation: list[int] = list(self.system)
        last: int | None = None
        for n, turn in enumerate(self.turns(1)):  # instance 1: no long conversation
            if n == 0:
                last = turn.hashes[-1]
                continue
            if turn.parent != last or n > 3:  # its first conversation's first turns
                break
            conversation += turn.tokens
            last = turn.hashes[-1]

        def fresh(name: str, blocks: int) -> list[int]:
            return _tokens(random.Random(f"{self.seed}:check:{name}"), blocks * BLOCK)

        return {
            "long+fresh (the timed lookup)": self.lookup(),
            "system+fresh": self.system + fresh("system", 8),
            "long[:700]+fresh": self.long[: 700 * BLOCK] + fresh("long700", 8),
            "instance 1's conversation+fresh": conversation + fresh("conversation", 4),
            "fresh": fresh("fresh", 16),
        }

    def expected_lookup(self) -> dict[str, int]:
        """The timed lookup's cached tokens per instance, by construction."""
        return {
            str(i): (LONG_BLOCKS if self.holds_long(i) else SYSTEM_BLOCKS) * BLOCK
            for i in range(self.instances)
        }


def _round_robin(per_instance: Sequence[Sequence[bytes]]) -> Iterator[tuple[int, bytes]]:
    """Each instance's payloads in order, interleaved across instances."""
    for row in itertools.zip_longest(*per_instance):
        for instance, payload in enumerate(row):
            if payload is not None:
                yield instance, payload


# ------------------------------------------------------------------ measuring (stdlib only)


def _proc_status() -> dict[str, int]:
    """`RssAnon` and `VmHWM` of this process in KiB (Linux; empty elsewhere), read once
    the index's short-lived threads have ended (checkouts before linear hashing: they
    faulted a growing table's next pages in, or gave a moved-out table back)."""
    for thread in threading.enumerate():
        if thread.name.startswith("kv-index-"):
            thread.join()
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "VmHWM", "VmRSS"):
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of ascending values."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _time_lookups(fn: Callable[[], object], reps: int) -> dict[str, float]:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "p50_ms": _quantile(times, 0.5) * 1e3,
        "p99_ms": _quantile(times, 0.99) * 1e3,
        "max_ms": times[-1] * 1e3,
        "reps": reps,
    }


def _durations_summary(durations: array.array[float], total_s: float) -> dict[str, float]:
    ordered = sorted(durations)
    return {
        "max_ms": ordered[-1] * 1e3,
        "p99_ms": _quantile(ordered, 0.99) * 1e3,
        "p50_ms": _quantile(ordered, 0.5) * 1e3,
        "over_1ms": sum(1 for d in ordered if d > 1e-3),
        "calls": len(ordered),
        "total_s": total_s,
    }


class Usage(NamedTuple):
    """What `_thread_usage` reads."""

    cpu_s: float
    voluntary: int
    involuntary: int
    threads: int


def _thread_usage() -> Usage:
    """This thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`, to the nanosecond; getrusage's
    times count whole clock ticks here, 4 ms), its voluntary and involuntary context
    switches so far (getrusage), and the other threads alive (the index's helpers, in
    checkouts before linear hashing)."""
    u = resource.getrusage(resource.RUSAGE_THREAD)
    return Usage(time.thread_time(), u.ru_nvcsw, u.ru_nivcsw, threading.active_count() - 1)


class _CallUsage:
    """Per apply call: this thread's CPU time, and whether it gave the core up (a voluntary
    switch: it waited, for the GIL, a lock or a page) or had it taken (an involuntary one:
    another thread or process ran on it). A call that held the loop long on little CPU time
    was off the CPU; its switches say which way."""

    def __init__(self, calls: int) -> None:
        self.cpu = array.array("d", bytes(8 * calls))
        self.voluntary = array.array("q", bytes(8 * calls))
        self.involuntary = array.array("q", bytes(8 * calls))
        self.threads = array.array("q", bytes(8 * calls))

    def record(self, n: int, start: Usage, end: Usage) -> None:
        self.cpu[n] = end.cpu_s - start.cpu_s
        self.voluntary[n] = end.voluntary - start.voluntary
        self.involuntary[n] = end.involuntary - start.involuntary
        self.threads[n] = max(start.threads, end.threads)

    def summary(self, wall: array.array[float]) -> dict[str, float | int]:
        """The longest wall call's CPU time, switches and the index's helper threads alive at
        its start or end; the CPU times' p99 and longest; the calls over 1 ms of CPU time;
        and the calls off the CPU over 1 ms (wall time less CPU time), by whether they only
        waited (voluntary switches) or were preempted, and how many began or ended beside a
        helper thread (one faulting a next table in or giving a moved-out one back)."""
        longest = max(range(len(wall)), key=wall.__getitem__)
        ordered = sorted(self.cpu)
        off_cpu = [n for n, (w, c) in enumerate(zip(wall, self.cpu, strict=True)) if w - c > 1e-3]
        preempted = sum(1 for n in off_cpu if self.involuntary[n])
        return {
            "longest_wall_call_cpu_ms": self.cpu[longest] * 1e3,
            "longest_wall_call_voluntary_switches": self.voluntary[longest],
            "longest_wall_call_involuntary_switches": self.involuntary[longest],
            "longest_wall_call_helper_threads": self.threads[longest],
            "max_ms": ordered[-1] * 1e3,
            "p99_ms": _quantile(ordered, 0.99) * 1e3,
            "over_1ms": sum(1 for d in ordered if d > 1e-3),
            "over_1ms_off_cpu": len(off_cpu),
            "of_those_preempted": preempted,
            "of_those_waiting": len(off_cpu) - preempted,
            "of_those_beside_a_helper_thread": sum(1 for n in off_cpu if self.threads[n]),
            "calls_beside_a_helper_thread": sum(1 for t in self.threads if t),
        }


def _steal_s() -> float:
    """Seconds the hypervisor ran something else on this machine's cores (all of them,
    `/proc/stat`'s steal column; 0 where it is not kept)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _log(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- ours


def _vllm_payload(turn: Turn) -> bytes:
    """One turn as vLLM 0.32 publishes it (`--layout map`): a batch `[ts, [event], rank]`
    of one full-attention `BlockStored` map, its keys in vLLM's field order, those with no
    default always written (`lora_id`, `medium`, `lora_name`), `extra_keys` one None per
    block, int hashes (its default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`)."""
    import msgspec

    event = {"type": "BlockStored", "block_hashes": turn.hashes,
             "parent_block_hash": turn.parent, "token_ids": turn.tokens, "block_size": BLOCK,
             "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [None] * len(turn.hashes), "group_idx": 0,
             "kv_cache_spec_kind": "full_attention"}  # fmt: skip
    return msgspec.msgpack.encode([0.0, [event], None])


def run_ours(w: Workload, reps: int, snapshot: bool, layout: str) -> dict[str, Any]:
    """PrfaaS's `KVIndexManager`, in this process (the project's environment); the events
    in PrfaaS's positional `layout` or vLLM's tagged maps (`map`)."""
    from prfaas.common.hashing import hash_blocks
    from prfaas.gateway.kv_index import KVIndexManager
    from prfaas.protocol.kv_events import BlockStored, KVEventBatch, encode_batch

    def new_index() -> tuple[Any, str]:
        """A `KVIndexManager` (Any: its constructor's arguments change with the rewrite)."""
        cls: Any = KVIndexManager
        try:
            return cls(block_size=BLOCK, max_index_mb=16384), "max_index_mb=16384"
        except TypeError:  # the index before its rewrite
            return cls(block_size=BLOCK, max_blocks=50_000_000), "max_blocks=50_000_000"

    start = time.perf_counter()
    payloads: list[list[bytes]] = []
    for i in range(w.instances):
        payloads.append(
            [
                _vllm_payload(t)
                if layout == "map"
                else encode_batch(
                    KVEventBatch(
                        0.0,
                        (BlockStored(tuple(t.hashes), t.parent, tuple(t.tokens), BLOCK),),
                    )
                )
                for t in w.turns(i)
            ]
        )
    batches = sum(len(p) for p in payloads)
    wire_bytes = sum(len(b) for p in payloads for b in p)
    ids = [f"i{i}" for i in range(w.instances)]
    prompt = w.lookup()
    checks = w.checks()
    gen_s = time.perf_counter() - start
    _log(
        f"ours: workload encoded ({batches} batches, {wire_bytes / 2**20:.0f} MiB) in {gen_s:.1f} s"
    )

    index, api = new_index()
    decoders = [_feed_decoder(layout) for _ in range(w.instances)]  # (one per publisher)
    hash_fresh_ms = _median_ms(lambda: hash_blocks(prompt, BLOCK), HASH_REPS)
    decode_times = array.array("d", bytes(8 * batches))
    apply_times = array.array("d", bytes(8 * (batches + 1)))  # the last: the flushing read
    usage = _CallUsage(batches + 1)  # this thread's CPU time and context switches in each
    gc.collect()
    before = _proc_status()
    steal_before = _steal_s()
    perf = time.perf_counter
    for n, (i, payload) in enumerate(_round_robin(payloads)):
        t0 = perf()
        batch = decoders[i](payload)
        t1 = perf()
        begun = _thread_usage()  # (a system call: read outside the timed span)
        t2 = perf()
        index.apply(ids[i], batch.events)
        t3 = perf()
        usage.record(n, begun, _thread_usage())
        decode_times[n] = t1 - t0
        apply_times[n] = t3 - t2
    del batch
    begun = _thread_usage()
    t0 = perf()
    held = len(index)  # a read: an index that buffers events applies what still waits
    apply_times[batches] = perf() - t0
    usage.record(batches, begun, _thread_usage())
    steal = _steal_s() - steal_before
    gc.collect()
    after = _proc_status()
    apply_s, decode_s = math.fsum(apply_times), math.fsum(decode_times)
    _log(f"ours: ingested in {apply_s + decode_s:.1f} s (apply {apply_s:.1f} s)")

    hashes = hash_blocks(prompt, BLOCK)
    lookup = _time_lookups(functools.partial(index.longest_prefix, hashes), reps)
    growing = getattr(index, "growing", None)
    settled = _settle(index, before, w.entries, hashes, reps) if growing else None
    hash_after_ms = _median_ms(lambda: hash_blocks(prompt, BLOCK), HASH_REPS)
    answers: dict[str, dict[str, int]] = {}
    for name, tokens in checks.items():
        found: dict[str, int] = index.longest_prefix(hash_blocks(tokens, BLOCK))
        answers[name] = {k.removeprefix("i"): v for k, v in found.items() if v}
    result: dict[str, Any] = {
        "layout": layout,
        "index_api": api,
        "index_module": sys.modules[KVIndexManager.__module__].__file__,
        "entries_held": held,
        # a table growing when memory was read holds two tables (see kv_index/INDEX.md)
        "growing_at_memory_reading": growing,
        "settled": settled,
        **_memory_fields(w.entries, batches, wire_bytes, gen_s, before, after),
        "ingest": {
            "apply_entries_per_s": w.entries / apply_s,
            "wire_entries_per_s": w.entries / (apply_s + decode_s),
            # the growth the ingest left under way ended too: how far into a growth an
            # ingest ends depends on how long a thread took to fault the next table in
            "wire_entries_per_s_growth_ended": w.entries
            / (apply_s + decode_s + (settled["steps_s"] if settled else 0.0)),
            "apply_s": apply_s,
            "decode_s": decode_s,
            "apply_calls": _durations_summary(apply_times, apply_s),
            "apply_calls_cpu": usage.summary(apply_times),
            "machine_steal_s": steal,
        },
        "lookup": lookup,
        "hash_128k_ms": {"fresh": hash_fresh_ms, "after_ingest": hash_after_ms},
        "checks": answers,
    }
    del index, decode_times, apply_times, usage
    if snapshot and layout == "map":  # (vLLM and SGLang serve a replay buffer, no snapshot)
        result["snapshot_catchup"] = None
    elif snapshot:
        result["snapshot_catchup"] = _ours_snapshot(payloads, ids, new_index, hashes, lookup)
    return result


def _feed_decoder(layout: str = "positional") -> Callable[[bytes], Any]:
    """`decode_batch` as the gateway's feed calls it: token ids left packed, where this
    checkout can (before it could, they were decoded); for `map`, a publisher's
    `VLLMEventDecoder`, as the feed makes one per vLLM or SGLang instance."""
    from prfaas.protocol.kv_events import decode_batch

    if layout == "map":
        from prfaas.protocol.kv_events.vllm_events import VLLMEventDecoder

        return VLLMEventDecoder(packed_ids=True).decode_batch

    try:
        decode_batch(b"\x92\xcb" + bytes(8) + b"\x90", packed_ids=True)
    except TypeError:
        return decode_batch
    return functools.partial(decode_batch, packed_ids=True)


def _settle(
    index: Any, before: dict[str, int], entries: int, hashes: list[int], reps: int
) -> dict[str, Any]:
    """An index left growing at the end of ingest, its growth ended as the gateway's feed
    ends it while no events arrive (`advance_growth` steps, one every 20 ms there, run here
    back to back): memory and lookups again, one table per kind."""
    steps = 0
    start = time.perf_counter()
    while index.advance_growth():
        steps += 1
    seconds = time.perf_counter() - start
    gc.collect()
    after = _proc_status()
    return {
        "steps": steps,
        "steps_s": seconds,
        "bytes_per_entry": _per_entry(before, after, entries),
        "lookup": _time_lookups(functools.partial(index.longest_prefix, hashes), reps),
    }


def _memory_fields(
    entries: int,
    batches: int,
    wire_bytes: int,
    gen_s: float,
    before: dict[str, int],
    after: dict[str, int],
) -> dict[str, Any]:
    """The workload's size and the RSS readings around the ingest, as both sides report."""
    return {
        "entries": entries,
        "batches": batches,
        "wire_mib": wire_bytes / 2**20,
        "generate_s": gen_s,
        "rss_before_kib": before.get("RssAnon"),
        "rss_after_kib": after.get("RssAnon"),
        "bytes_per_entry": _per_entry(before, after, entries),
        "peak_rss_mib": after["VmHWM"] / 1024 if "VmHWM" in after else None,
    }


def _per_entry(before: dict[str, int], after: dict[str, int], entries: int) -> float | None:
    if "RssAnon" not in before or "RssAnon" not in after:
        return None
    return (after["RssAnon"] - before["RssAnon"]) * 1024 / entries


def _ours_snapshot(
    payloads: list[list[bytes]],
    ids: list[str],
    new_index: Callable[[], tuple[Any, str]],
    hashes: list[int],
    lookup: dict[str, float],
) -> dict[str, Any]:
    """Approximate snapshot catch-up: every instance's content as its publisher's snapshot
    (`CacheMirror.snapshot`, cut into batches as the publisher sends them), replayed from
    wire bytes into a fresh index, instance by instance, each batch applied in the slices
    the gateway's feed cuts it into (the loop is free between slices: a slice is what holds
    it). Frees `payloads` as it goes."""
    from prfaas.gateway.kv_index import FLUSH_BLOCKS
    from prfaas.protocol.kv_events import KVEventBatch, decode_batch, encode_batch, event_slices
    from prfaas.protocol.kv_events.cache_mirror import CacheMirror
    from prfaas.protocol.kv_events.publisher import SNAPSHOT_BLOCKS_PER_BATCH

    gc.collect()
    start = time.perf_counter()
    snapshots: list[list[bytes]] = []
    for i in range(len(payloads)):
        mirror = CacheMirror()
        for payload in payloads[i]:
            mirror.apply(decode_batch(payload).events)
        payloads[i] = []
        events = mirror.snapshot()
        del mirror
        snapshots.append(
            [
                encode_batch(KVEventBatch(0.0, piece))
                for piece in event_slices(events, SNAPSHOT_BLOCKS_PER_BATCH)
            ]
        )
        del events
    prepare_s = time.perf_counter() - start
    _log(f"ours: snapshots prepared in {prepare_s:.1f} s; replaying them")
    index, _ = new_index()
    decode = _feed_decoder()
    gc.collect()
    n = sum(len(s) for s in snapshots)
    batch_times = array.array("d", bytes(8 * (n + 1)))  # the last: the flushing read
    slice_times = array.array("d")
    n = 0
    perf = time.perf_counter
    for i, batches in enumerate(snapshots):
        for payload in batches:
            t0 = perf()
            received = decode(payload).events
            for piece in event_slices(received, FLUSH_BLOCKS):  # as the feed applies it
                t1 = perf()
                index.apply(ids[i], piece)
                slice_times.append(perf() - t1)
            batch_times[n] = perf() - t0
            n += 1
    t0 = perf()
    len(index)  # applies what a buffering index still holds
    batch_times[n] = perf() - t0
    slice_times.append(batch_times[n])
    total_s = math.fsum(batch_times)
    replayed = index.longest_prefix(hashes)
    return {
        "approximation": "in-process replay of CacheMirror snapshots from wire bytes "
        "(decode_batch + apply), instance by instance, into a fresh index; no sockets",
        "seconds": total_s,
        "entries_per_s": len(index) / total_s,
        "entries": len(index),
        "batches": n,
        "blocks_per_event_max": 64,
        "blocks_per_batch": SNAPSHOT_BLOCKS_PER_BATCH,
        "wire_mib": sum(len(b) for s in snapshots for b in s) / 2**20,
        "batch_decode_apply": _durations_summary(batch_times, total_s),
        "slice_apply": _durations_summary(slice_times, math.fsum(slice_times)),
        "prepare_s": prepare_s,
        "lookup_instances_matched": sum(1 for v in replayed.values() if v),
        "lookup_p50_ms_before": lookup["p50_ms"],
    }


# ----------------------------------------------------------------- Dynamo (stdlib + dynamo)


def run_dynamo(w: Workload, reps: int) -> dict[str, Any]:
    """Dynamo's `RadixTree`, in this process (the scratch environment's python)."""
    from importlib.metadata import version

    core: Any = importlib.import_module("dynamo._core")
    local_hashes: Callable[[list[int], int], list[int]] = core.compute_block_hash_for_seq

    start = time.perf_counter()
    payloads: list[list[bytes]] = []
    for i in range(w.instances):
        events = []
        for event_id, t in enumerate(w.turns(i)):
            local = local_hashes(t.tokens, BLOCK)
            blocks = [
                {"block_hash": h, "tokens_hash": x} for h, x in zip(t.hashes, local, strict=True)
            ]
            stored = {"parent_hash": t.parent, "blocks": blocks}
            event = {"event_id": event_id, "data": {"stored": stored}, "dp_rank": 0}
            events.append(json.dumps(event, separators=(",", ":")).encode())
        payloads.append(events)
    batches = sum(len(p) for p in payloads)
    wire_bytes = sum(len(b) for p in payloads for b in p)
    prompt = w.lookup()
    checks = w.checks()
    gen_s = time.perf_counter() - start
    mib = wire_bytes / 2**20
    _log(f"dynamo: workload encoded ({batches} events, {mib:.0f} MiB) in {gen_s:.1f} s")

    tree = core.RadixTree()
    hash_ms = _median_ms(lambda: local_hashes(prompt, BLOCK), HASH_REPS)
    apply_times = array.array("d", bytes(8 * batches))
    gc.collect()
    before = _proc_status()
    perf = time.perf_counter
    apply_event = tree.apply_event
    for n, (i, payload) in enumerate(_round_robin(payloads)):
        t0 = perf()
        apply_event(i, payload)
        apply_times[n] = perf() - t0
    gc.collect()
    after = _proc_status()
    apply_s = math.fsum(apply_times)
    _log(f"dynamo: ingested in {apply_s:.1f} s")

    hashes = local_hashes(prompt, BLOCK)
    lookup = _time_lookups(lambda: tree.find_matches(hashes), reps)

    def cached(tokens: list[int]) -> dict[str, int]:
        scores: dict[tuple[int, int], int] = tree.find_matches(local_hashes(tokens, BLOCK)).scores
        return {str(worker): blocks * BLOCK for (worker, _), blocks in scores.items() if blocks}

    answers = {name: cached(tokens) for name, tokens in checks.items()}
    return {
        "package": f"ai-dynamo-runtime=={version('ai-dynamo-runtime')}",
        **_memory_fields(w.entries, batches, wire_bytes, gen_s, before, after),
        "ingest": {
            "apply_entries_per_s": w.entries / apply_s,
            "wire_entries_per_s": w.entries / apply_s,
            "apply_s": apply_s,
            "apply_calls": _durations_summary(apply_times, apply_s),
        },
        "lookup": lookup,
        "hash_128k_ms": {"compute_block_hash_for_seq": hash_ms},
        "checks": answers,
    }


# ------------------------------------------------------------------------------- driver


def _dynamo_python() -> Path:
    """The scratch environment's python with Dynamo installed (made on first use)."""
    python = DYNAMO_VENV / "bin" / "python"
    probe = [str(python), "-c", "import dynamo._core"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {DYNAMO_VENV} and installing {DYNAMO_PACKAGE} from PyPI ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(DYNAMO_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", DYNAMO_PACKAGE], check=True)
    subprocess.run(probe, check=True)
    return python


def _run_worker(python: Path, side: str, size: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), str(Path(__file__).resolve()), "--worker", side, "--sizes", size]
        cmd += ["--seed", str(args.seed), "--reps", str(args.reps), "--out", str(out)]
        cmd += ["--layout", args.layout]
        if args.no_snapshot:
            cmd.append("--no-snapshot")
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        result: dict[str, Any] = json.loads(out.read_text())
        result["wall_s"] = time.perf_counter() - start
        return result


def _parse_size(size: str) -> tuple[int, int]:
    instances, _, blocks = size.partition("x")
    return int(instances), int(blocks)


def _cross_check(w: Workload, ours: dict[str, Any], dynamo: dict[str, Any]) -> dict[str, Any]:
    names = list(ours["checks"])
    same = {name: ours["checks"][name] == dynamo["checks"].get(name) for name in names}
    timed = next(iter(names))
    return {
        "identical": all(same.values()),
        "per_lookup": same,
        "timed_lookup_as_constructed": ours["checks"][timed] == w.expected_lookup(),
    }


def _mark(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _targets(ours: dict[str, Any]) -> dict[str, bool]:
    out = {
        "wire_entries_per_s": ours["ingest"]["wire_entries_per_s"] >= TARGET_WIRE_ENTRIES_PER_S,
        "lookup_p50_ms": ours["lookup"]["p50_ms"] <= TARGET_LOOKUP_P50_MS,
        "lookup_p99_ms": ours["lookup"]["p99_ms"] <= TARGET_LOOKUP_P99_MS,
        "max_apply_ms": ours["ingest"]["apply_calls"]["max_ms"] <= TARGET_MAX_APPLY_MS,
    }
    if ours["bytes_per_entry"] is not None:
        out["bytes_per_entry"] = ours["bytes_per_entry"] <= TARGET_BYTES_PER_ENTRY
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if abs(value) >= 10_000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _table(size: str, row: dict[str, Any]) -> None:
    ours: dict[str, Any] = row.get("ours") or {}
    dyn: dict[str, Any] = row.get("dynamo") or {}
    marks: dict[str, bool] = row.get("targets", {})

    def get(side: dict[str, Any], *path: str) -> float | None:
        value: Any = side
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return float(value) if value is not None else None

    def target(key: str, text: str) -> str:
        return f"{text} {_mark(marks[key])}" if key in marks else text

    lines: list[tuple[str, float | None, float | None, int, str]] = [
        ("bytes / entry (RssAnon growth)", get(ours, "bytes_per_entry"),
         get(dyn, "bytes_per_entry"), 1, target("bytes_per_entry", "<= 64")),
        ("peak RSS incl. the workload's bytes (MiB)", get(ours, "peak_rss_mib"),
         get(dyn, "peak_rss_mib"), 0, ""),
        ("ingest, apply only (entries/s)", get(ours, "ingest", "apply_entries_per_s"),
         get(dyn, "ingest", "apply_entries_per_s"), 0, ""),
        ("ingest from wire bytes (entries/s)", get(ours, "ingest", "wire_entries_per_s"),
         get(dyn, "ingest", "wire_entries_per_s"), 0,
         target("wire_entries_per_s", ">= 500,000")),
        ("  the same, counting the growth's steps left", get(ours, "ingest",
         "wire_entries_per_s_growth_ended"), None, 0, ""),
        ("longest apply call (ms)", get(ours, "ingest", "apply_calls", "max_ms"),
         get(dyn, "ingest", "apply_calls", "max_ms"), 2, target("max_apply_ms", "<= 1")),
        ("apply call p99 (ms)", get(ours, "ingest", "apply_calls", "p99_ms"),
         get(dyn, "ingest", "apply_calls", "p99_ms"), 3, ""),
        ("apply calls over 1 ms", get(ours, "ingest", "apply_calls", "over_1ms"),
         get(dyn, "ingest", "apply_calls", "over_1ms"), 0, ""),
        ("  the longest call's own CPU time (ms)",
         get(ours, "ingest", "apply_calls_cpu", "longest_wall_call_cpu_ms"), None, 2, ""),
        ("  calls over 1 ms of this thread's CPU time",
         get(ours, "ingest", "apply_calls_cpu", "over_1ms"), None, 0, ""),
        ("  calls off the CPU over 1 ms: preempted",
         get(ours, "ingest", "apply_calls_cpu", "of_those_preempted"), None, 0, ""),
        ("  calls off the CPU over 1 ms: waiting (GIL, lock, page)",
         get(ours, "ingest", "apply_calls_cpu", "of_those_waiting"), None, 0, ""),
        ("  of those, beside the index's own helper thread",
         get(ours, "ingest", "apply_calls_cpu", "of_those_beside_a_helper_thread"), None, 0, ""),
        ("  machine's steal time during the ingest (s)",
         get(ours, "ingest", "machine_steal_s"), None, 2, ""),
        ("lookup 128K p50 (ms)", get(ours, "lookup", "p50_ms"), get(dyn, "lookup", "p50_ms"),
         3, target("lookup_p50_ms", "<= 0.1")),
        ("lookup 128K p99 (ms)", get(ours, "lookup", "p99_ms"), get(dyn, "lookup", "p99_ms"),
         3, target("lookup_p99_ms", "<= 1")),
        ("growth ended after ingest: steps", get(ours, "settled", "steps"), None, 0, ""),
        ("  then bytes / entry", get(ours, "settled", "bytes_per_entry"),
         get(dyn, "bytes_per_entry"), 1, ""),
        ("  then lookup 128K p50 (ms)", get(ours, "settled", "lookup", "p50_ms"),
         get(dyn, "lookup", "p50_ms"), 3, ""),
        ("hash 128K prompt, before ingest (ms)", get(ours, "hash_128k_ms", "fresh"),
         get(dyn, "hash_128k_ms", "compute_block_hash_for_seq"), 2, ""),
        ("hash 128K prompt, after ingest (ms)", get(ours, "hash_128k_ms", "after_ingest"),
         None, 2, ""),
        ("snapshot catch-up, approx. (s)", get(ours, "snapshot_catchup", "seconds"), None, 1, ""),
        ("snapshot catch-up (entries/s)", get(ours, "snapshot_catchup", "entries_per_s"),
         None, 0, ""),
        ("longest snapshot slice applied (ms)",
         get(ours, "snapshot_catchup", "slice_apply", "max_ms"), None, 1, ""),
        ("wire bytes of the workload (MiB)", get(ours, "wire_mib"), get(dyn, "wire_mib"), 0, ""),
        ("subprocess wall time (s)", get(ours, "wall_s"), get(dyn, "wall_s"), 1, ""),
    ]  # fmt: skip
    instances, blocks = _parse_size(size)
    check = row.get("cross_check", {})
    same = "-" if not check else ("identical" if check["identical"] else "DIFFERENT")
    print(f"\n### {size} ({instances} instances x {blocks:,} blocks = "
          f"{instances * blocks:,} entries; cross-checked lookups: {same})\n")  # fmt: skip
    print("| metric | ours | Dynamo | ours / Dynamo | target (ours) |")
    print("|---|---:|---:|---:|---|")
    for name, a, b, digits, goal in lines:
        if a is None and b is None:
            continue
        print(f"| {name} | {_fmt(a, digits)} | {_fmt(b, digits)} | {_ratio(a, b)} | {goal} |")
    if size != TARGET_SIZE and marks:
        print(f"\n(targets are stated for {TARGET_SIZE}; marked here for reference)")


def _machine() -> dict[str, Any]:
    memory = None
    try:
        with open("/proc/meminfo") as f:
            memory = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu_count": os.cpu_count(),
        "memory_gib": memory,
        "python": sys.version,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }


def _git_head() -> str | None:
    """The checkout's commit (which `prfaas` was measured: see each side's `index_module`)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help="instances x blocks per instance, comma-separated"
    )
    parser.add_argument("--quick", action="store_true", help=f"one tiny size ({QUICK_SIZE})")
    parser.add_argument("--reps", type=int, default=200, help="timed lookups per side and size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-snapshot", action="store_true", help="skip the catch-up part")
    parser.add_argument("--sides", default="ours,dynamo", help="ours, dynamo or both")
    parser.add_argument("--layout", choices=("positional", "map"), default="positional",
                        help="our events' wire layout: PrfaaS's positional arrays or "
                        "vLLM's tagged maps (SGLang 0.5.23's too)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/"
                        "kv_index/<date>.json, <date>-quick.json with --quick)")  # fmt: skip
    parser.add_argument("--worker", choices=("ours", "dynamo"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [QUICK_SIZE] if args.quick else args.sizes.split(",")
    for size in sizes:
        try:
            Workload(args.seed, *_parse_size(size))
        except ValueError as exc:
            parser.error(f"size {size!r}: {exc}")

    if args.worker:  # one side, one size, in this (fresh) process
        w = Workload(args.seed, *_parse_size(sizes[0]))
        if args.worker == "ours":
            result = run_ours(w, args.reps, not args.no_snapshot, args.layout)
        else:
            result = run_dynamo(w, args.reps)
        result["final_peak_rss_mib"] = _proc_status().get("VmHWM", 0) / 1024
        args.out.write_text(json.dumps(result))
        return

    sides = args.sides.split(",")
    if unknown := set(sides) - {"ours", "dynamo"}:
        parser.error(f"--sides: unknown {sorted(unknown)}")
    today = datetime.date.today().isoformat()
    out = args.out or RESULTS / f"{today}{'-quick' if args.quick else ''}.json"
    pythons = {"ours": Path(sys.executable)}
    if "dynamo" in sides:
        pythons["dynamo"] = _dynamo_python()
    report: dict[str, Any] = {
        "date": today,
        "machine": _machine(),
        "git_head": _git_head(),
        "dynamo_package": DYNAMO_PACKAGE,
        "seed": args.seed,
        "layout": args.layout,
        "block_size": BLOCK,
        "lookup_blocks": LOOKUP_BLOCKS,
        "targets": {
            "size": TARGET_SIZE,
            "bytes_per_entry": TARGET_BYTES_PER_ENTRY,
            "wire_entries_per_s": TARGET_WIRE_ENTRIES_PER_S,
            "lookup_p50_ms": TARGET_LOOKUP_P50_MS,
            "lookup_p99_ms": TARGET_LOOKUP_P99_MS,
            "max_apply_ms": TARGET_MAX_APPLY_MS,
        },
        "sizes": {},
    }
    for size in sizes:
        row: dict[str, Any] = {}
        for side in sides:
            print(f"{size}: {side} ...", flush=True)
            row[side] = _run_worker(pythons[side], side, size, args)
            print(f"{size}: {side} done in {row[side]['wall_s']:.0f} s", flush=True)
        if "ours" in row:
            row["targets"] = _targets(row["ours"])
        if "ours" in row and "dynamo" in row:
            row["cross_check"] = _cross_check(
                Workload(args.seed, *_parse_size(size)), row["ours"], row["dynamo"]
            )
        row["wall_s"] = sum(row[side]["wall_s"] for side in sides)
        report["sizes"][size] = row
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")  # after every size: partial runs
        _table(size, row)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
