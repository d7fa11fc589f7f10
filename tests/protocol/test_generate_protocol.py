"""SGLang's `/generate` wire format: sampling parameters, request parsing and encoding,
answer objects."""

from __future__ import annotations

import orjson
import pytest

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.protocol.errors import InvalidRequest
from prfaas.protocol.generate import (
    AnswerError,
    Bootstrap,
    GenerateRequest,
    SamplingParams,
    answer,
    parse_answer,
    parse_request,
)


def _encode(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


def _new_rid() -> str:
    return "fresh"


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


def test_parse_request_and_bootstrap() -> None:
    inp = parse_request(
        {
            "input_ids": [1, 2],
            "stream": True,
            "rid": "r",
            "bootstrap_host": "h",
            "bootstrap_port": 9,
            "bootstrap_room": 2**64 - 1,
        },
        _encode,
        _new_rid,
    )
    assert inp.input_ids == (1, 2) and inp.stream and inp.rid == "r"
    assert inp.bootstrap is not None and inp.bootstrap.room == 2**64 - 1
    for bad in (
        {"text": 1},
        {"text": "a", "stream": "no"},
        {"text": "a", "bootstrap_room": -1, "bootstrap_host": "h", "bootstrap_port": 1},
        {"input_ids": [1.5]},
        "text",
    ):
        with pytest.raises(InvalidRequest):
            parse_request(bad, _encode, _new_rid)


def test_text_is_tokenized_and_a_missing_rid_drawn() -> None:
    req = parse_request({"text": "hi"}, _encode, _new_rid)
    assert (req.rid, req.input_ids, req.stream) == ("fresh", (104, 105), False)


def test_an_encoded_request_parses_back_to_itself() -> None:
    """`GenerateRequest.body` (the gateway's side) and `parse_request` (the engines') are
    inverse: every sampling field and the bootstrap survive the round trip."""
    sampling = SamplingParams(7, 0.5, 0.9, 3, 0.1, ("x",), (5,), True, 11, False)
    request = GenerateRequest("r1", (1, 2, 3), sampling, True, Bootstrap("h", 9, 2**63))
    assert parse_request(orjson.loads(request.body), _encode, _new_rid) == request
    plain = GenerateRequest("r2", (4,))
    assert parse_request(orjson.loads(plain.body), _encode, _new_rid) == plain
    pull = GenerateRequest("r3", (5, 6), prefix_pull=Bootstrap("src", 7, 12))
    assert orjson.loads(pull.body)["prefix_pull"] == {"host": "src", "port": 7, "room": 12}
    assert parse_request(orjson.loads(pull.body), _encode, _new_rid) == pull


def test_answers_parse_into_chunks_and_bad_shapes_are_errors() -> None:
    obj = answer(rid="r", text="ab", output_ids=[97, 98], finish_reason={"type": "stop"},
                 prompt_tokens=3, cached_tokens=1, e2e_latency=0.5)  # fmt: skip
    chunk = parse_answer(obj)
    assert (chunk.token_ids, chunk.text, chunk.finish_reason) == ((97, 98), "ab", "stop")
    assert (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens) == (3, 2, 1)
    for bad, needle in (
        ([1], "JSON object"),
        ({"error": "boom"}, "boom"),
        ({"output_ids": ["x"]}, "malformed"),
        ({"meta_info": []}, "meta_info must be an object"),
    ):
        with pytest.raises(AnswerError, match=needle):
            parse_answer(bad)
