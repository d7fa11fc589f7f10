"""Random operation sequences on the block pool (hypothesis stateful), against a shadow model.

The machine plays an engine: it writes tokens into a shadow copy of the KV blocks and state
slots exactly where the pool says, and rebuilds the prefix index and the kept states from the
KV events as the gateway would. After every step: `check_integrity()`, the event-built index
equals the pool's, and every prefix match returns blocks (and a snapshot) whose shadow
contents are exactly the prompt's tokens: reuse is never of overwritten or foreign data.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prfaas.common.hashing import hash_block, hash_blocks
from prfaas.engines.reference.cache.block_pool import BlockPool, BlockPoolConfig, OutOfKVCapacity
from prfaas.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    StatesRemoved,
    StatesStored,
)

BS = 2
NUM_BLOCKS = 10
NUM_SLOTS = 3
# Prompts are a prefix of one of a few "conversations" plus a short random tail, so prefixes
# are shared often, and diverge inside blocks as well as at block boundaries.
BASES = ((0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 0, 2, 2, 1, 1), (1, 1, 1, 1, 0, 0, 0, 0))
prompts = st.builds(
    lambda base, n, tail: [*BASES[base][:n], *tail],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=4),
).filter(bool)


@dataclass
class Req:
    tokens: list[int]
    computed: int  # tokens whose KV is written
    transfer: bool


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(BlockPoolConfig(NUM_BLOCKS, BS, NUM_SLOTS))
        self.kv: dict[int, dict[int, int]] = {}  # block -> offset -> token written there
        self.states: dict[int, tuple[int, ...]] = {}  # slot -> prefix its snapshot summarises
        self.reqs: dict[str, Req] = {}
        self.indexed: set[int] = set()  # built from events only
        self.kept: set[int] = set()  # hashes with a state snapshot, built from events only
        self.next_id = 0

    # ------------------------------------------------------------------ helpers

    def _write(self, rid: str, start: int, stop: int) -> None:
        req, table = self.reqs[rid], self.pool.block_table(rid)
        for pos in range(start, stop):
            self.kv.setdefault(table[pos // BS], {})[pos % BS] = req.tokens[pos]

    def _check_match(self, prompt: list[int], ids: tuple[int, ...], slot: int | None) -> None:
        for i, block in enumerate(ids):
            expected = {o: prompt[i * BS + o] for o in range(BS)}
            assert self.kv.get(block) == expected, f"block {block} reused with wrong contents"
        if slot is not None:
            assert self.states[slot] == tuple(prompt[: len(ids) * BS]), "wrong state reused"

    def _pick(self, data: st.DataObject, ready: bool = False) -> str:
        rids = sorted(r for r, q in self.reqs.items() if not ready or q.computed == len(q.tokens))
        return data.draw(st.sampled_from(rids)) if rids else ""

    # ------------------------------------------------------------------ rules

    @rule(prompt=prompts, extra=st.integers(0, 4), hybrid=st.booleans(), transfer=st.booleans())
    def admit(self, prompt: list[int], extra: int, hybrid: bool, transfer: bool) -> None:
        m = self.pool.match_prefix(hash_blocks(prompt[:-1], BS))
        self._check_match(prompt, m.block_ids, m.state_slot)
        self._check_match(prompt, m.block_only_ids, None)
        m = m if hybrid else m.without_state()
        rid, before = f"r{self.next_id}", self.pool.stats()
        self.next_id += 1
        try:
            self.pool.allocate(rid, len(prompt) + extra, m, transfer=transfer)
        except OutOfKVCapacity as exc:
            assert self.pool.stats() == before and exc.requested > exc.available
            return
        self.reqs[rid] = Req(list(prompt), m.num_tokens, transfer)
        if transfer:  # the received tail lands in transfer-cache blocks at once
            self._write(rid, m.num_tokens, len(prompt))
            self.reqs[rid].computed = len(prompt)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), save=st.sampled_from(["no", "last", "any"]))
    def compute(self, data: st.DataObject, save: str) -> None:
        rid = self._pick(data)
        req = self.reqs[rid]
        if req.computed == len(req.tokens):
            return
        stop = data.draw(st.integers(req.computed + 1, len(req.tokens)))
        self._write(rid, req.computed, stop)
        req.computed = stop
        self.pool.cache_full_blocks(rid, req.tokens[:stop])
        if save != "no" and stop >= BS:
            at = stop // BS * BS if save == "last" else data.draw(st.integers(1, stop // BS)) * BS
            slot = self.pool.save_state(rid, at)
            if slot is not None:
                self.states[slot] = tuple(req.tokens[:at])

    @precondition(lambda self: any(q.computed == len(q.tokens) for q in self.reqs.values()))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = self._pick(data, ready=True)
        req, before = self.reqs[rid], self.pool.stats()
        try:
            self.pool.reserve(rid, len(req.tokens) + 1)
        except OutOfKVCapacity:
            assert self.pool.stats() == before
            return
        req.tokens.append(token)
        self._write(rid, req.computed, len(req.tokens))
        req.computed = len(req.tokens)
        self.pool.cache_full_blocks(rid, req.tokens)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = self._pick(data)
        self.pool.free(rid)
        del self.reqs[rid]

    @rule(roll=st.integers(0, 9))
    def flush(self, roll: int) -> None:
        if roll == 0:  # rarely, or the cache would seldom hold anything worth matching
            self.pool.clear()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_integrity()
        for rid, req in self.reqs.items():
            assert len(self.pool.block_table(rid)) * BS >= req.computed

    @invariant()
    def events_rebuild_the_index(self) -> None:
        for event in self.pool.take_events():
            self._apply(event)
        assert all(self.pool.is_cached(h) for h in self.indexed)
        assert len(self.indexed) == self.pool.stats().cached_blocks
        assert self.kept <= self.indexed
        assert len(self.kept) == self.pool.stats().held_state_slots

    def _apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            assert parent is None or parent in self.indexed
            for i, block_hash in enumerate(event.block_hashes):  # gateway-side re-hash
                parent = hash_block(parent, event.token_ids[i * BS : (i + 1) * BS])
                assert parent == block_hash and block_hash not in self.indexed
                self.indexed.add(block_hash)
        elif isinstance(event, BlockRemoved):  # a removed block's state goes with it
            assert set(event.block_hashes) <= self.indexed
            self.indexed -= set(event.block_hashes)
            self.kept -= set(event.block_hashes)
        elif isinstance(event, StatesStored):
            assert set(event.block_hashes) <= self.indexed - self.kept
            self.kept |= set(event.block_hashes)
        elif isinstance(event, StatesRemoved):
            assert set(event.block_hashes) <= self.kept
            self.kept -= set(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.indexed.clear()
            self.kept.clear()


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolRandom = PoolMachine.TestCase
