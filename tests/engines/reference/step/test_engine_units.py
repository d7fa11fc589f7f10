"""Small pure pieces: sampling parameters and sampling, `/generate` parsing, engine config,
byte tokenizer, KV page storage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from prfaas.common.tokenizer import ByteTokenizer, ChatMessage
from prfaas.engines.reference.cache.storage import KVStorage
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.model.hybrid_cache import SeqState
from prfaas.engines.reference.model.presets import load_model, resolve
from prfaas.engines.reference.server.tokenizers import load_tokenizer
from prfaas.engines.reference.step.sampling import (
    InvalidRequest,
    SamplingParams,
    resolve_seed,
    sample,
)
from prfaas.protocol.generate import parse_generate


def test_sampling_params_parse_sglang_json() -> None:
    params = SamplingParams.from_json(
        {
            "max_new_tokens": 5,
            "temperature": 0,
            "stop": "x",
            "stop_token_ids": [3],
            "top_k": 4,
            "seed": 1,
            "ignore_eos": True,
        }
    )
    assert params == SamplingParams(5, 0.0, 1.0, 4, 0.0, ("x",), (3,), True, 1)
    assert params.greedy and SamplingParams.from_json(None) == SamplingParams()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"beam": 2}, "unknown sampling_params field(s): beam"),
        ([1], "must be an object"),
    ],
)
def test_sampling_params_reject_bad_values_by_name(raw: object, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams.from_json(raw)


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


def test_parse_generate_and_bootstrap() -> None:
    inp = parse_generate(
        {
            "input_ids": [1, 2],
            "stream": True,
            "rid": "r",
            "bootstrap_host": "h",
            "bootstrap_port": 9,
            "bootstrap_room": 2**64 - 1,
        }
    )
    assert inp.input_ids == [1, 2] and inp.stream and inp.rid == "r"
    assert inp.bootstrap is not None and inp.bootstrap.room == 2**64 - 1
    for bad in (
        {"text": 1},
        {"text": "a", "stream": "no"},
        {"text": "a", "bootstrap_room": -1, "bootstrap_host": "h", "bootstrap_port": 1},
        {"input_ids": [1.5]},
        "text",
    ):
        with pytest.raises(InvalidRequest):
            parse_generate(bad)


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


def test_byte_tokenizer_round_trip_and_chat() -> None:
    tok = ByteTokenizer()
    text = "héllo, 世界"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([*tok.encode("a"), tok.eos_token_id, 300, *tok.encode("b")]) == "ab"
    ids = tok.apply_chat_template([ChatMessage("user", "hi")])
    assert ids[0] == tok.bos_token_id and tok.decode(ids).endswith("<|assistant|>\n")
    assert max(ids) < tok.vocab_size


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
    """A local checkpoint directory loads by path, and its tokenizer.json replaces the byte
    tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    source = resolve("qwen3-next-mini", engine_model_cache)
    load_model(source)  # materialise
    ckpt = tmp_path / "my-hybrid"
    shutil.copytree(source.path, ckpt)
    assert isinstance(load_tokenizer(ckpt), ByteTokenizer)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    loaded = load_tokenizer(ckpt)
    assert loaded.encode("hello world") == [1, 2] and "tokenizer.json" in loaded.name
    assert loaded.decode([1, 2]) == "hello world"
    checkpoint = resolve(str(ckpt))
    assert not checkpoint.preset and load_model(checkpoint).config.model_type == "qwen3_next"
