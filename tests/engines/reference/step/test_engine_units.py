"""Small pure pieces: sampling, engine config, KV page storage, a checkpoint directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from prfaas.common.tokenizer import BYTE_LEVEL, ByteTokenizer, load_tokenizer
from prfaas.engines.reference.cache.storage import KVStorage
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.model.hybrid_cache import SeqState
from prfaas.engines.reference.model.presets import load_model, resolve
from prfaas.engines.reference.step.sampling import resolve_seed, sample
from prfaas.protocol.generate import SamplingParams


def test_sample_respects_top_k_top_p_and_seed() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0, 1.0])
    assert sample(logits, SamplingParams(temperature=0), 9, 0) == 1
    top2 = SamplingParams(top_k=2)
    assert {sample(logits, top2, 3, step) for step in range(40)} == {1, 2}
    assert {sample(logits, SamplingParams(top_p=0.01), 3, step) for step in range(10)} == {1}
    flat = torch.zeros(50)
    seeded = SamplingParams(seed=42)
    draws = [sample(flat, seeded, resolve_seed(seeded), step) for step in range(8)]
    assert draws == [sample(flat, seeded, 42, step) for step in range(8)]
    assert draws != [sample(flat, seeded, 43, step) for step in range(8)]
    assert resolve_seed(SamplingParams()) != resolve_seed(SamplingParams())


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"role": "router"}, "role"),
        ({"max_batch": 0}, "max_batch"),
        ({"kv_capacity_tokens": 10}, "kv_capacity_tokens"),
        ({"block_size": 0}, "block_size"),
        ({"handoff_timeout_s": 0}, "handoff_timeout_s"),
    ],
)
def test_engine_config_names_the_bad_value(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_storage_round_trips_pages_and_state_slots() -> None:
    """KV written into arbitrary pages and gathered back equals the original; state slots
    copy in and out."""
    storage = KVStorage(num_blocks=8, block_size=4, num_slots=2)
    keys = torch.arange(2 * 12 * 3, dtype=torch.float32).reshape(1, 2, 12, 3)
    state = SeqState(
        length=12,
        keys={3: keys},
        values={3: -keys},
        conv={0: torch.ones(1, 5, 4)},
        rec={0: torch.full((1, 2, 3, 3), 7.0)},
    )
    storage.write_blocks(state, [6, 1, 4], first=0)
    got = storage.gather([6, 1])
    assert got.length == 8 and torch.equal(got.keys[3], keys[..., :8, :])
    assert torch.equal(got.values[3], -keys[..., :8, :])
    storage.save_state(1, state)
    storage.load_state(1, got)
    assert torch.equal(got.conv[0], state.conv[0]) and torch.equal(got.rec[0], state.rec[0])
    with pytest.raises(ValueError, match="sequence has 12"):
        storage.write_blocks(state, [0, 2, 3, 5], first=0)


def test_a_checkpoint_directory_with_tokenizer_json(
    engine_model_cache: Path, tmp_path: Path
) -> None:
    """A local checkpoint directory loads by path; with a tokenizer.json, that is its
    tokenizer (without one, `load_tokenizer` refuses the directory: the engine serves it
    byte-level)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    source = resolve("qwen3-next-mini", engine_model_cache)
    load_model(source)  # materialise
    ckpt = tmp_path / "my-hybrid"
    shutil.copytree(source.path, ckpt)
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_tokenizer(ckpt)
    assert isinstance(load_tokenizer(BYTE_LEVEL), ByteTokenizer)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    loaded = load_tokenizer(ckpt)
    assert loaded.encode("hello world") == [1, 2] and loaded.name == str(ckpt)
    assert loaded.decode([1, 2]) == "hello world"
    checkpoint = resolve(str(ckpt))
    assert not checkpoint.preset and load_model(checkpoint).config.model_type == "qwen3_next"
