"""Presets, the engine-owned hybrid cache and the model runner against plain transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import hf_greedy, random_prompt
from transformers import PreTrainedModel

from prfaas.engines.reference.model.hybrid_cache import HybridCache, SeqState
from prfaas.engines.reference.model.presets import PRESETS, load_model, resolve
from prfaas.engines.reference.model.runner import FULL, LINEAR, ModelRunner


def greedy(runner: ModelRunner, prompt: list[int], n: int, split: int | None = None) -> list[int]:
    """Engine-style greedy: prefill (optionally in two pieces), then one token per step."""
    state, out = SeqState(), []
    pieces = [prompt] if split is None else [prompt[:split], prompt[split:]]
    for piece in pieces:
        cache = HybridCache([state])
        logits = runner.forward(cache, torch.tensor([piece]))
        state = cache.row(0)
    for _ in range(n):
        out.append(int(logits.argmax(-1)))
        cache = HybridCache([state])
        logits = runner.forward(cache, torch.tensor([[out[-1]]]))
        state = cache.row(0)
    return out


@pytest.mark.parametrize("length", [1, 17, 64, 130])
def test_runner_matches_transformers_generate(
    tiny_model: PreTrainedModel, tiny_runner: ModelRunner, length: int
) -> None:
    """Greedy output over the engine's cache equals `generate`, also when the prompt is
    computed in two pieces split at a block boundary (as prefix reuse does)."""
    prompt = random_prompt(length, length)
    expected = hf_greedy(tiny_model, prompt, 10)
    assert greedy(tiny_runner, prompt, 10) == expected
    if length > 64:
        assert greedy(tiny_runner, prompt, 10, split=64) == expected


def test_batched_decode_equals_unbatched(tiny_runner: ModelRunner) -> None:
    """A left-padded batch of sequences of different lengths decodes each row exactly as
    that sequence alone would (greedy tokens)."""
    prompts = [random_prompt(s, n) for s, n in ((1, 3), (2, 50), (3, 97), (4, 64))]
    states, last = [], []
    for p in prompts:
        cache = HybridCache([SeqState()])
        last.append(int(tiny_runner.forward(cache, torch.tensor([p])).argmax(-1)))
        states.append(cache.row(0))
    batch, outs = HybridCache(states), [[t] for t in last]
    for _ in range(9):
        logits = tiny_runner.forward(batch, torch.tensor([[o[-1]] for o in outs]))
        for o, t in zip(outs, logits.argmax(-1).tolist(), strict=True):
            o.append(int(t))
    assert outs == [greedy(tiny_runner, p, 10) for p in prompts]
    assert batch.lengths == [len(p) + 9 for p in prompts]


def test_layer_listener_sees_each_layer_in_order_when_it_finishes(
    tiny_runner: ModelRunner,
) -> None:
    """The listener fires once per decoder layer, in layer order, and at that moment the
    layer's own KV (full) or state (linear) is already in the cache while later layers'
    are not yet."""
    seen: list[tuple[int, str, bool, bool]] = []

    def listener(idx: int, kind: str, cache: HybridCache) -> None:
        later = idx + 1 if idx + 1 < len(tiny_runner.shape.layer_types) else None
        mine = idx in (cache.keys if kind == FULL else cache.rec)
        theirs = later is not None and (later in cache.keys or later in cache.rec)
        seen.append((idx, kind, mine, theirs))

    tiny_runner.forward(HybridCache([SeqState()]), torch.tensor([[1, 2, 3]]), listener)
    kinds = tiny_runner.shape.layer_types
    assert seen == [(i, k, True, False) for i, k in enumerate(kinds)]
    assert kinds == (LINEAR, LINEAR, LINEAR, FULL) * 2


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "kimi-linear-tiny"])
def test_other_architectures_run_exactly(engine_model_cache: Path, preset: str) -> None:
    """Qwen3.5 (GDN + gated GQA) and Kimi-Linear (KDA + MLA latents) presets load from
    their materialised directory and match `generate` through the engine's cache."""
    model = load_model(resolve(preset, engine_model_cache))
    runner = ModelRunner(model)
    prompt = random_prompt(7, 70)
    assert greedy(runner, prompt, 6, split=64) == hf_greedy(model, prompt, 6)


def test_presets_are_deterministic_and_materialised_once(engine_model_cache: Path) -> None:
    """A preset is written once (seeded) and reloaded from disk with identical weights."""
    source = resolve("qwen3-next-mini", engine_model_cache)
    first = load_model(source)
    stamp = (source.path / "config.json").stat().st_mtime_ns
    second = load_model(source)
    assert (source.path / "config.json").stat().st_mtime_ns == stamp
    for (name, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert set(PRESETS) >= {"qwen3-next-tiny", "qwen3.5-tiny", "kimi-linear-tiny"}


def test_resolve_rejects_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        resolve(str(tmp_path / "missing"), tmp_path)
