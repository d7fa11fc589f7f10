"""Grammar masks through llguidance (`prfaas/engines/reference/step/constraint.py`): greedy
decoding of random logits under each kind of request grammar yields text the grammar
describes; EOS only where it may end; ids the tokenizer lacks never; bad grammars a 400."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizer_helpers import write_byte_level_tokenizer

from prfaas.common.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from prfaas.engines.reference.step.constraint import GrammarVocab, TokenConstraint
from prfaas.protocol.errors import APIError
from prfaas.protocol.structured_output import StructuredOutput, structured_from_body

MODEL_VOCAB = 300  # wider than the byte tokenizer's 260 ids, as a padded model vocabulary
EOS = ByteTokenizer.eos_token_id
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_time"}},
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"days": {"type": "integer"}},
                "required": ["days"],
            },
        },
    },
]

BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
BAD_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/no"}}}]


@pytest.fixture(scope="module")
def vocab() -> GrammarVocab:
    return GrammarVocab(ByteTokenizer(), MODEL_VOCAB)


def greedy(
    body: dict[str, Any], vocab: GrammarVocab, seed: int, tokenizer: Tokenizer | None = None
) -> str:
    """Decode argmax of seeded random logits under the body's grammar until EOS or done."""
    spec = structured_from_body(body)
    assert spec is not None
    constraint = TokenConstraint.compile(spec, vocab)
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(20_000):
        logits = torch.randn(vocab.vocab_size, generator=generator)
        constraint.mask_(logits)
        token = int(torch.argmax(logits))
        constraint.accept(token)
        if token == vocab.eos_token_id:
            return (tokenizer or ByteTokenizer()).decode(out)
        out.append(token)
        if constraint.done:
            return (tokenizer or ByteTokenizer()).decode(out)
    raise AssertionError("the grammar never ended")


@pytest.mark.parametrize("seed", range(3))
def test_json_schema(vocab: GrammarVocab, seed: int) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    value = json.loads(greedy({"response_format": rf}, vocab, seed))
    assert isinstance(value, dict)
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)


@pytest.mark.parametrize("seed", range(3))
def test_json_object(vocab: GrammarVocab, seed: int) -> None:
    value = json.loads(greedy({"response_format": {"type": "json_object"}}, vocab, seed))
    assert isinstance(value, dict)


@pytest.mark.parametrize("seed", range(3))
def test_regex(vocab: GrammarVocab, seed: int) -> None:
    pattern = r"[a-z]{1,8}@[a-z]+\.(com|org)"
    text = greedy({"structured_outputs": {"regex": pattern}}, vocab, seed)
    assert re.fullmatch(pattern, text)


@pytest.mark.parametrize("seed", range(5))
def test_choice(vocab: GrammarVocab, seed: int) -> None:
    options = ["red", "green", "blue", "rebeccapurple"]
    assert greedy({"structured_outputs": {"choice": options}}, vocab, seed) in options


def test_lark_grammar(vocab: GrammarVocab) -> None:
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'
    text = greedy({"structured_outputs": {"grammar": grammar}}, vocab, 0)
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", text)


@pytest.mark.parametrize("seed", range(3))
def test_required_tools(vocab: GrammarVocab, seed: int) -> None:
    calls = json.loads(greedy({"tools": TOOLS, "tool_choice": "required"}, vocab, seed))
    assert isinstance(calls, list) and calls
    for call in calls:
        assert call["name"] in ("get_time", "get_weather")
        assert isinstance(call["parameters"], dict)
        if call["name"] == "get_weather":
            assert isinstance(call["parameters"]["days"], int)


def test_eos_only_where_the_grammar_may_end(vocab: GrammarVocab) -> None:
    constraint = TokenConstraint.compile(StructuredOutput("regex", "ab|abcd"), vocab)

    def allowed() -> set[int]:
        logits = torch.zeros(MODEL_VOCAB)
        constraint.mask_(logits)
        return set(torch.isfinite(logits).nonzero().flatten().tolist())

    assert allowed() == {ord("a")}
    constraint.accept(ord("a"))
    assert allowed() == {ord("b")}
    constraint.accept(ord("b"))
    assert allowed() == {ord("c"), EOS} and not constraint.done
    constraint.accept(ord("c"))
    assert allowed() == {ord("d")}
    constraint.accept(ord("d"))
    assert constraint.done


def test_ids_beyond_the_tokenizer_and_specials_are_never_allowed(vocab: GrammarVocab) -> None:
    constraint = TokenConstraint.compile(StructuredOutput("regex", "(?s:.*)"), vocab)
    logits = torch.zeros(MODEL_VOCAB)
    constraint.mask_(logits)
    assert vocab.tokenizer_size == ByteTokenizer.vocab_size
    assert torch.isneginf(logits[ByteTokenizer.vocab_size :]).all()
    assert torch.isfinite(logits[: ord("z") + 1]).all() and torch.isfinite(logits[EOS])
    for special in (ByteTokenizer.bos_token_id, ByteTokenizer.pad_token_id, EOS + 2):
        assert torch.isneginf(logits[special])
    with pytest.raises(ValueError, match="not allowed"):
        constraint.accept(MODEL_VOCAB - 1)


def test_a_forbidden_token_is_refused_and_changes_nothing(vocab: GrammarVocab) -> None:
    constraint = TokenConstraint.compile(StructuredOutput("choice", ("yes", "no")), vocab)
    with pytest.raises(ValueError, match="not allowed"):
        constraint.accept(ord("x"))
    for byte in b"no":
        constraint.accept(byte)
    assert constraint.done


def test_forks_and_cached_compiles_are_independent(vocab: GrammarVocab) -> None:
    spec = StructuredOutput("choice", ("ab", "ac"))
    first = TokenConstraint.compile(spec, vocab)
    first.accept(ord("a"))
    fork = first.fork()
    fork.accept(ord("b"))
    first.accept(ord("c"))  # the fork's "b" did not move the original
    again = TokenConstraint.compile(spec, vocab)  # from the cache: at the start
    again.accept(ord("a"))
    assert fork.done and first.done and not again.done


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"response_format": BAD_SCHEMA}, "response_format"),
        ({"tools": BAD_TOOLS, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_an_invalid_grammar_is_a_400_naming_the_param(
    vocab: GrammarVocab, body: dict[str, Any], param: str
) -> None:
    spec = structured_from_body(body)
    assert spec is not None
    with pytest.raises(APIError) as info:
        TokenConstraint.compile(spec, vocab)
    assert info.value.status == 400 and info.value.param == param
    with pytest.raises(APIError) as info:
        TokenConstraint.compile(spec, vocab, "tools")
    assert info.value.param == "tools"


def test_hf_tokenizer(tmp_path: Path) -> None:
    tokenizer = HFTokenizer(write_byte_level_tokenizer(tmp_path))
    vocab = GrammarVocab(tokenizer, MODEL_VOCAB)
    assert vocab.eos_token_id == tokenizer.eos_token_id is not None
    assert vocab.tokenizer_size == 259  # 256 byte symbols and the three ChatML specials
    pattern = r"(héllo|wörld) [0-9]{2}"
    for seed in range(3):
        text = greedy({"structured_outputs": {"regex": pattern}}, vocab, seed, tokenizer)
        assert re.fullmatch(pattern, text)


def test_objects_that_list_properties_are_closed_and_property_maps_are_not_schemas(
    vocab: GrammarVocab,
) -> None:
    """As vLLM's default backend reads a schema: an object listing `properties` takes no
    other keys unless it says so; a `properties` map is names, not a schema (closing it would
    forbid a key named `additionalProperties` that the schema allows)."""
    inner = {"type": "object", "properties": {"properties": {"type": "integer"}}}
    closed = TokenConstraint.compile(StructuredOutput("json", inner), vocab)
    for token in b'{"properties":1}':
        closed.accept(token)
    assert closed.done
    extra = TokenConstraint.compile(StructuredOutput("json", inner), vocab)
    for token in b'{"':
        extra.accept(token)
    with pytest.raises(ValueError):
        extra.accept(ord("x"))  # only "properties" may follow
    outer = {"type": "object", "additionalProperties": True,
             "properties": {"properties": inner}}  # fmt: skip
    open_ = TokenConstraint.compile(StructuredOutput("json", outer), vocab)
    for token in b'{"additionalProperties":2}':
        open_.accept(token)
    assert open_.done
