"""The engine step: exact prefix reuse, multi-turn reuse, continuous batching, capacity
back-pressure, aborts, stop conditions and KV events — all against plain transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from engine_helpers import hf_greedy, random_prompt
from transformers import PreTrainedModel

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.engines.reference.step.core import EngineCore
from prfaas.engines.reference.step.request import Request, TokenEvent
from prfaas.engines.reference.step.sampling import SamplingParams, resolve_seed
from prfaas.protocol.kv_events import AllBlocksCleared, BlockStored, KVEvent

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    finish: dict[str, object] | None = None
    cached: int = 0

    def add(self, event: TokenEvent) -> None:
        self.tokens.extend(event.token_ids)
        self.finish = event.finish_reason or self.finish
        self.cached = event.cached_tokens


def make_core(runner: ModelRunner, **kw: int | str) -> EngineCore:
    config = EngineConfig(**{"block_size": 16, "kv_capacity_tokens": 4096, **kw})  # type: ignore[arg-type]
    return EngineCore(runner, config, ByteTokenizer().decode)


def submit(
    core: EngineCore, rid: str, prompt: list[int], **params: object
) -> tuple[Request, Outcome]:
    outcome = Outcome()
    sp = SamplingParams(**{"max_new_tokens": 8, **GREEDY, **params})  # type: ignore[arg-type]
    req = Request(rid, prompt, sp, emit=outcome.add, seed=resolve_seed(sp))
    core.submit(req)
    return req, outcome


def drain(core: EngineCore, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not core.has_work():
            core.pool.check_integrity()
            return
        core.step()
    raise AssertionError("engine did not finish")


def test_same_prompt_again_hits_the_prefix_cache_exactly(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner
) -> None:
    """The second run of a prompt reuses every full block before the last token (KV and
    the block-aligned linear state) and still produces the transformers output."""
    core, prompt = make_core(tiny_runner), random_prompt(11, 100)
    _, first = submit(core, "a", prompt)
    drain(core)
    _, second = submit(core, "b", prompt)
    drain(core)
    expected = hf_greedy(tiny_model, prompt, 8)
    assert (first.tokens, first.cached) == (expected, 0)
    assert (second.tokens, second.cached) == (expected, 96)
    assert core.counters.snapshot().prefix_hit_rate == pytest.approx(96 / 200)


def test_multi_turn_follow_up_reuses_prompt_and_answer(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner
) -> None:
    """Turn 2 = turn-1 prompt + answer + new text reuses the blocks decode filled and the
    linear state saved when decode crossed the last block boundary (48 of 70 tokens)."""
    core = make_core(tiny_runner)
    prompt = random_prompt(12, 40)
    _, turn1 = submit(core, "t1", prompt, max_new_tokens=20)
    drain(core)
    follow = prompt + turn1.tokens + random_prompt(13, 10)
    _, turn2 = submit(core, "t2", follow)
    drain(core)
    assert turn1.tokens == hf_greedy(tiny_model, prompt, 20)
    assert turn2.tokens == hf_greedy(tiny_model, follow, 8)
    assert turn2.cached == 48


def test_continuous_batching_caps_the_batch_and_matches_unbatched(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner
) -> None:
    """Requests join and leave the decode batch (never more than max_batch at once) and each
    one's greedy output equals transformers on its own."""
    core = make_core(tiny_runner, max_batch=3)
    prompts = [random_prompt(20 + i, 5 + 23 * i) for i in range(5)]
    outcomes = [
        submit(core, f"r{i}", p, max_new_tokens=4 + 3 * i)[1] for i, p in enumerate(prompts)
    ]
    peak = 0
    while core.has_work():
        core.step()
        peak = max(peak, len(core.running))
    assert peak == 3
    for i, (p, o) in enumerate(zip(prompts, outcomes, strict=True)):
        assert o.tokens == hf_greedy(tiny_model, p, 4 + 3 * i)
        assert o.finish == {"type": "length", "length": 4 + 3 * i}
    assert core.pool.stats().used_blocks == 0


def test_requests_wait_for_kv_capacity_instead_of_failing(tiny_runner: ModelRunner) -> None:
    """With room for one request at a time, the second waits (back-pressure) and runs once
    the first has freed its blocks; nothing is corrupted."""
    core = make_core(tiny_runner, kv_capacity_tokens=128)  # 8 blocks; each request needs 5
    _, a = submit(core, "a", random_prompt(30, 40), max_new_tokens=30)
    _, b = submit(core, "b", random_prompt(31, 40), max_new_tokens=30)
    for _ in range(3):  # prefill pieces [0, 32), [32, 40), then a decode step
        core.step()
    assert [r.rid for r in core.running] == ["a"] and [r.rid for r in core.waiting] == ["b"]
    assert core.prefilling is None
    drain(core)
    assert len(a.tokens) == len(b.tokens) == 30


def test_abort_frees_blocks_and_reports(tiny_runner: ModelRunner) -> None:
    """An aborted running request leaves the batch at the next step, gets an abort event,
    and gives its blocks back."""
    core = make_core(tiny_runner)
    req, outcome = submit(core, "x", random_prompt(40, 30), max_new_tokens=50)
    core.step()
    assert core.pool.stats().used_blocks > 0
    req.aborted = True
    drain(core)
    assert outcome.finish == {"type": "abort", "message": "request aborted"}
    assert core.pool.stats().used_blocks == 0 and not core.running


def test_stop_token_and_stop_string(tiny_model: PreTrainedModel, tiny_runner: ModelRunner) -> None:
    """Generation ends at a stop token id (kept in the output, as SGLang) or once the text
    contains a stop string."""
    prompt = random_prompt(50, 20)
    greedy = hf_greedy(tiny_model, prompt, 8)
    core = make_core(tiny_runner)
    _, by_id = submit(core, "i", prompt, stop_token_ids=(greedy[2],))
    drain(core)
    cut = greedy.index(greedy[2]) + 1
    assert by_id.tokens == greedy[:cut]
    assert by_id.finish == {"type": "stop", "matched": greedy[2]}
    stop_text = ByteTokenizer().decode(greedy[:4])[-1:]
    if stop_text and stop_text != "\ufffd":
        _, by_text = submit(core, "s", prompt, stop=(stop_text,))
        drain(core)
        assert by_text.finish == {"type": "stop", "matched": stop_text}
        assert stop_text in ByteTokenizer().decode(by_text.tokens)


def test_seeded_sampling_is_reproducible(tiny_runner: ModelRunner) -> None:
    """The same seed gives the same sampled tokens, also while batched with other work."""
    core, prompt = make_core(tiny_runner), random_prompt(60, 12)
    sampled = {"temperature": 1.0, "top_p": 0.9, "ignore_eos": True, "max_new_tokens": 12}
    _, a = submit(core, "a", prompt, seed=7, **sampled)
    drain(core)
    submit(core, "o", random_prompt(61, 30), seed=1, **sampled)
    _, b = submit(core, "b", prompt, seed=7, **sampled)
    _, c = submit(core, "c", prompt, seed=8, **sampled)
    drain(core)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    assert c.tokens != a.tokens


def test_kv_events_follow_prefix_cache_inserts_and_flush(tiny_runner: ModelRunner) -> None:
    """Every prefix-cache insert is a BlockStored carrying the blocks' token ids; a flush
    publishes AllBlocksCleared and the next run of the prompt gets no hit."""
    core, events = make_core(tiny_runner), []

    def sink(batch: list[KVEvent]) -> None:
        events.extend(batch)

    core.event_sink = sink
    prompt = random_prompt(70, 40)
    submit(core, "a", prompt, max_new_tokens=1)
    drain(core)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].block_size == 16
    assert list(stored[0].token_ids) == prompt[:32] and stored[0].parent_block_hash is None
    core.request_flush()
    _, again = submit(core, "b", prompt, max_new_tokens=1)
    drain(core)
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    assert again.cached == 0


def test_long_prompts_are_prefilled_in_pieces_between_decode_steps(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner
) -> None:
    """With a 32-token budget a 100-token prompt takes four steps ([0,32), [32,64), [64,96),
    [96,100)) while a running request keeps decoding; a state is saved at every piece end,
    so a prompt sharing only the first 70 tokens reuses 64 of them. Outputs stay exact."""
    core = make_core(tiny_runner, max_prefill_tokens=32)
    short, long_prompt = random_prompt(80, 5), random_prompt(81, 100)
    _, s = submit(core, "s", short, max_new_tokens=12)
    core.step()
    _, long_out = submit(core, "l", long_prompt)
    progress = []
    for _ in range(5):
        core.step()
        progress.append((len(s.tokens), len(long_out.tokens)))
    # the short request decodes at every step; the long one's first token comes with its
    # fourth piece (then it joins that step's decode batch)
    assert progress == [(3, 0), (4, 0), (5, 0), (6, 2), (7, 3)]
    drain(core)
    other = long_prompt[:70] + random_prompt(82, 20)
    _, o = submit(core, "o", other)
    drain(core)
    assert s.tokens == hf_greedy(tiny_model, short, 12)
    assert long_out.tokens == hf_greedy(tiny_model, long_prompt, 8)
    assert (o.tokens, o.cached) == (hf_greedy(tiny_model, other, 8), 64)
