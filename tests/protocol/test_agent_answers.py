"""Chat answers as Anthropic Messages and OpenAI Responses answers (what the reference engine
and the null server answer with), what the gateway reads from each API's relayed answers,
and each API's SSE framing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from agent_battery import assembled_message

from prfaas.protocol import anthropic_answer, relayed_answer, responses_answer, sse
from prfaas.protocol.errors import APIError

USAGE = {"prompt_tokens": 50, "completion_tokens": 6, "total_tokens": 56,
         "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip


def whole(content: str | None, calls: list[Any], finish: str, stop: Any = None) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    choice = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [choice], "usage": USAGE}  # fmt: skip


def chunks(content: list[str], calls: list[Any], finish: str) -> list[dict[str, Any]]:
    """A chat stream: role, content pieces, the calls, the finish, then the usage chunk."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    deltas = [{"role": "assistant", "content": ""}, *({"content": c} for c in content)]
    if calls:
        deltas.append({"tool_calls": [{**c, "index": i} for i, c in enumerate(calls)]})
    out = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    out[-1]["choices"][0]["finish_reason"] = finish
    return [*out, {**head, "choices": [], "usage": USAGE}]


@pytest.mark.parametrize(
    ("answer", "reason", "sequence"),
    [
        (whole("Hi", [], "length"), "max_tokens", None),
        (whole("Hi", [], "stop"), "end_turn", None),
        (whole("Hi", [], "stop", "END"), "stop_sequence", "END"),
        (whole(None, [CALL], "tool_calls"), "tool_use", None),
    ],
)
def test_message_stop_reasons(answer: dict[str, Any], reason: str, sequence: str | None) -> None:
    message = anthropic_answer.message(answer)
    assert message["stop_reason"] == reason and message.get("stop_sequence") == sequence
    assert message["usage"] == {"input_tokens": 18, "output_tokens": 6,
                                "cache_read_input_tokens": 32}  # fmt: skip


def test_message_content_blocks() -> None:
    message = anthropic_answer.message(whole("Let me see.", [CALL], "tool_calls"))
    assert message["content"] == [
        {"type": "text", "text": "Let me see."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    cut = {**CALL, "function": {"name": "get_weather", "arguments": '{"ci'}}
    assert anthropic_answer.message(whole(None, [cut], "length"))["content"][0]["input"] == {}
    assert anthropic_answer.message(whole("", [], "stop"))["content"] == [
        {"type": "text", "text": ""}
    ]


def test_message_stream_builds_the_whole_message() -> None:
    stream = anthropic_answer.MessageStream()
    events = [e for c in chunks(["Let me", " see."], [CALL], "tool_calls") for e in stream.feed(c)]
    events += stream.done()
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2
    built = assembled_message(list(events))
    want = anthropic_answer.message(whole("Let me see.", [CALL], "tool_calls"))
    assert built["content"] == want["content"]
    assert (built["stop_reason"], built["usage"]) == (want["stop_reason"], want["usage"])


def test_responses_whole_answer() -> None:
    request = {"input": "Hi", "tools": [], "include": ["message.output_text.logprobs"]}
    answer = whole("Hi there", [CALL], "length")
    answer["choices"][0]["logprobs"] = {"content": [{"token": "Hi", "logprob": -0.5}]}
    response = responses_answer.response(request, answer, "resp_1")
    assert (response["id"], response["status"], response["object"]) == (
        "resp_1", "incomplete", "response")  # fmt: skip
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    message, call = response["output"]
    assert message["content"][0]["text"] == "Hi there"
    assert message["content"][0]["logprobs"] == [{"token": "Hi", "logprob": -0.5}]
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == (
        "function_call", "call_1", "get_weather", '{"city": "Paris"}')  # fmt: skip
    assert response["usage"] == {
        "input_tokens": 50, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 56,
    }  # fmt: skip


def test_responses_stream_numbers_events_and_ends_with_the_whole_response() -> None:
    stream = responses_answer.ResponseStream({"input": "Hi"}, "resp_1", 7, "m")
    events = stream.start()
    for chunk in chunks(["Hi", " there"], [CALL], "tool_calls"):
        if chunk["choices"]:
            events += stream.feed(chunk)
    events += stream.finish(USAGE)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == "Hi there" == final["output"][0]["content"][0]["text"]
    assert final["output"][1]["arguments"] == '{"city": "Paris"}'
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 6
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


@pytest.mark.parametrize(
    ("api", "event", "prompt", "completion", "cached"),
    [
        ("chat", {"choices": [], "usage": USAGE}, 50, 6, 32),
        ("messages", {"type": "message_delta", "usage": {"input_tokens": 18, "output_tokens": 6,
         "cache_read_input_tokens": 32}}, 50, 6, 32),
        ("messages", {"type": "message_start", "message": {"usage": {"input_tokens": 9,
         "output_tokens": 0}}}, 9, 0, 0),
        ("responses", {"type": "response.completed", "response": {"usage": {
         "input_tokens": 50, "output_tokens": 6,
         "input_tokens_details": {"cached_tokens": 32}}}}, 50, 6, 32),
        ("responses", {"object": "response", "usage": {"input_tokens": 5, "output_tokens": 1}},
         5, 1, 0),
    ],
)  # fmt: skip
def test_usage_of_each_api(
    api: Any, event: dict[str, Any], prompt: int, completion: int, cached: int
) -> None:
    assert relayed_answer.usage(api, event) == relayed_answer.Usage(prompt, completion, cached)


def test_errors_event_names_and_finish_of_each_api() -> None:
    assert relayed_answer.error("messages", {"type": "error", "error": {"message": "x"}}) == "x"
    assert relayed_answer.error("responses", {"type": "error", "message": "y"}) == "y"
    failed = {"type": "response.failed", "response": {"status": "failed",
                                                      "error": {"message": "z"}}}  # fmt: skip
    assert relayed_answer.error("responses", failed) == "z"
    assert relayed_answer.error("responses", {"object": "response", "error": None}) is None
    assert relayed_answer.error("chat", {"choices": [{"finish_reason": "error"}]}) is not None
    assert relayed_answer.event_name("messages", {"type": "message_stop"}) == "message_stop"
    assert relayed_answer.event_name("chat", {"type": "x"}) is None
    delta = {"type": "message_delta", "delta": {"stop_reason": "tool_use"}}
    assert relayed_answer.finish("messages", delta) == "tool_use"
    assert relayed_answer.finish("responses", {"status": "incomplete"}) == "incomplete"
    assert relayed_answer.output_event("responses", {"type": "response.output_text.delta"})


def test_sse_frames_of_each_api() -> None:
    assert sse.frame("chat", b"{}") == b"data: {}\n\n"
    assert sse.frame("messages", b"{}", "message_stop") == b"event: message_stop\ndata: {}\n\n"
    assert (sse.end("chat"), sse.end("responses")) == (b"data: [DONE]\n\n", b"")
    error = APIError(502, "boom", code="engine_error")
    assert sse.error_event("messages", error) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n'
    )
    assert json.loads(sse.error_event("responses", error, 4).split(b"data: ")[1]) == {
        "type": "error", "code": "engine_error", "message": "boom", "param": None,
        "sequence_number": 4}  # fmt: skip
