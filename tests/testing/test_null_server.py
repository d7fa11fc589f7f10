"""The null server (not an engine): protocol shapes, OpenAI-style errors, toy prefix cache."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from prfaas.common.tokenizer import ByteTokenizer, ChatMessage, chat_ids
from prfaas.testing.null_server import NullConfig, PrefixCache


async def _post(url: str, path: str, body: object) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with http.post(url + path, data=data) as resp:
            return resp.status, await resp.read()


def _events(raw: bytes) -> list[object]:
    lines = [ln[6:] for ln in raw.split(b"\n\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [orjson.loads(x) for x in lines[:-1]]


async def test_completions_non_streaming_usage(null_url: str) -> None:
    status, raw = await _post(
        null_url, "/v1/completions", {"model": "any", "prompt": [5] * 9, "max_tokens": 3}
    )
    body = orjson.loads(raw)
    assert status == 200 and body["choices"][0]["text"] == " t0 t1 t2"
    assert body["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_chat_stream_usage_only_when_asked(null_url: str) -> None:
    message = {"role": "user", "content": "a b c"}
    body = {"model": "null", "messages": [message], "max_tokens": 2, "stream": True}
    _, raw = await _post(null_url, "/v1/chat/completions", body)
    events = _events(raw)
    assert [e["choices"][0]["delta"]["content"] for e in events] == [" t0", " t1"]  # type: ignore[index]
    body["stream_options"] = {"include_usage": True}
    _, raw = await _post(null_url, "/v1/chat/completions", body)
    usage = _events(raw)[-1]["usage"]  # type: ignore[index]
    prompt = len(chat_ids(ByteTokenizer(), [ChatMessage("user", "a b c")]))
    assert usage["prompt_tokens"] == prompt  # the second time: cached up to a full block of 4
    assert usage["prompt_tokens_details"]["cached_tokens"] == prompt // 4 * 4


async def test_generate_stream_matches_sglang_format(null_url: str) -> None:
    body = {
        "input_ids": list(range(10)),
        "sampling_params": {"max_new_tokens": 3},
        "stream": True,
        "rid": "abc",
    }
    _, raw = await _post(null_url, "/generate", body)
    events = _events(raw)
    assert [e["text"] for e in events] == [" t0", " t0 t1", " t0 t1 t2"]  # type: ignore[index]
    last = events[-1]
    assert last["output_ids"] == [100, 101, 102]  # type: ignore[index]
    assert last["meta_info"] == {
        "id": "abc",
        "prompt_tokens": 10,
        "completion_tokens": 3,  # type: ignore[index]
        "cached_tokens": 0,
        "finish_reason": {"type": "length", "length": 3},
        "e2e_latency": 0.0,
    }
    assert events[0]["meta_info"]["finish_reason"] is None  # type: ignore[index]


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", {"model": "m", "prompt": 5}, "'prompt' must be a string"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 0}, "'max_tokens' must"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "'messages' must be a non-empty"),
        ("/generate", {"input_ids": [1], "sampling_params": 3}, "sampling_params must be"),
    ],
)
async def test_bad_input_gets_openai_error(
    null_url: str, path: str, body: object, needle: str
) -> None:
    """The null server parses with the project's one parser of each protocol."""
    status, raw = await _post(null_url, path, body)
    error = orjson.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error"
    assert needle in error["message"]


async def test_unknown_path_is_json_404(null_url: str) -> None:
    status, raw = await _post(null_url, "/v2/nothing", {})
    assert status == 404 and orjson.loads(raw)["error"]["code"] == "not_found"


def test_prefix_cache_counts_full_shared_blocks_and_evicts() -> None:
    cache = PrefixCache(block_size=4, capacity=3)
    assert cache.lookup_and_insert(list(range(10))) == 0  # stores 2 full blocks
    assert cache.lookup_and_insert([*list(range(9)), 99]) == 8
    assert cache.lookup_and_insert([7, *list(range(1, 12))]) == 0  # first block differs
    assert cache.lookup_and_insert(list(range(10))) == 0  # LRU capacity 3: evicted


def test_config_validation_names_values() -> None:
    with pytest.raises(ValueError, match="token_delay_s must be >= 0, got -1"):
        NullConfig(token_delay_s=-1)
