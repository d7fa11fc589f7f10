"""Tool calls from model output (`prfaas/protocol/tool_calls.py`) by vLLM 0.32's rules: the
Hermes parser whole and streamed (any split streams what the whole parse gives), the
required and named `tool_choice` paths, and the finish reasons."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas.protocol.tool_calls import (
    ForcedStream,
    HermesStream,
    ToolCall,
    named_call,
    parse_hermes,
    required_calls,
    tool_finish_reason,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {"tz": "Europe/Zürich"}}</tool_call>'


def pairs(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def run(stream: HermesStream | ForcedStream, deltas: list[str]) -> list[dict[str, Any]]:
    out = [d for delta in deltas for d in stream.feed(delta)]
    return out + stream.finish()


def streamed(out: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    """Concatenated content and the (name, arguments) of the calls, checking their shape."""
    calls = [c for d in out for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", c["id"]) for c in calls)
    assert all(c["type"] == "function" for c in calls)
    content = "".join(d["content"] for d in out if "content" in d)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_tool_call_json_is_openai_shape() -> None:
    call = ToolCall("f", '{"a": 1}')
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call.id)
    function = {"name": "f", "arguments": '{"a": 1}'}
    assert call.to_json() == {"id": call.id, "type": "function", "function": function}
    assert call.to_json(2) == {"index": 2, **call.to_json()}


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        ("", "", []),
        (WEATHER, None, [("get_weather", '{"city": "Paris"}')]),
        ("\n \n" + WEATHER, None, [("get_weather", '{"city": "Paris"}')]),
        ("Let me check.\n" + WEATHER, "Let me check.\n", [("get_weather", '{"city": "Paris"}')]),
        (WEATHER + "\nand " + TIME + " bye", None, [("get_weather", '{"city": "Paris"}'),
                                                   ("get_time", '{"tz": "Europe/Zürich"}')]),
        ('<tool_call>{"name": "f", "arguments": "x"}', None, [("f", '"x"')]),
        ('<tool_call>{"name": "f", "arguments": null}</tool_call>', None, [("f", "null")]),
        ("<tool_call>{oops}</tool_call>", "<tool_call>{oops}</tool_call>", []),
        ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
        ('<tool_call>{"name": 3, "arguments": {}}', '<tool_call>{"name": 3, "arguments": {}}', []),
        (WEATHER + "<tool_call>[1]</tool_call>", WEATHER + "<tool_call>[1]</tool_call>", []),
        ("hi <tool_call>", "hi <tool_call>", []),
    ],
)  # fmt: skip
def test_parse_hermes(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_hermes(text)
    assert (got_content, pairs(got_calls)) == (content, calls)


def test_stream_holds_back_a_possible_tag() -> None:
    stream = HermesStream()
    assert stream.feed("Sure <tool_") == [{"content": "Sure "}]
    assert stream.feed("call>") == []
    assert stream.feed('{"name": "f", "arguments": {"a": "é"}}</tool_') == []
    [delta] = stream.feed("call>")
    assert streamed([delta]) == ("", [("f", '{"a": "é"}')])
    assert stream.called and stream.finish() == []


def test_stream_flushes_what_never_became_a_tag() -> None:
    stream = HermesStream()
    assert stream.feed("a <tool") == [{"content": "a "}]
    assert stream.finish() == [{"content": "<tool"}]
    assert not stream.called


def test_stream_malformed_call_becomes_content() -> None:
    stream = HermesStream()
    out = run(stream, ["x <tool_call>", "{bad}</tool_call>", " more ", TIME])
    assert streamed(out) == ("x <tool_call>{bad}</tool_call> more " + TIME, [])
    assert not stream.called


def test_stream_cannot_take_back_a_call() -> None:
    """The documented exception: a malformed block after an emitted call is dropped."""
    text = WEATHER + "<tool_call>oops</tool_call>"
    assert parse_hermes(text) == (text, [])
    stream = HermesStream()
    out = run(stream, [WEATHER, "<tool_call>oops</tool_call>"])
    assert streamed(out) == ("", [("get_weather", '{"city": "Paris"}')])


_PREAMBLE = st.lists(
    st.sampled_from(["Hi", " ", "\n", "<", "<tool_", "call>", "</tool_call>", "é"])
)
_ARGS = st.dictionaries(
    st.text("abé", max_size=3), st.none() | st.booleans() | st.integers() | st.text("x<>\"'é")
)
_CALL = st.tuples(st.sampled_from(["f", "get_weather", "é"]), _ARGS, st.sampled_from(["", "\n"]))


@st.composite
def hermes_texts(draw: st.DrawFn) -> str:
    """A preamble (possibly forming tags), maybe a malformed first block, calls with text
    between them, and an ending that may leave the last block open."""
    text = "".join(draw(_PREAMBLE))
    if draw(st.booleans()):
        text += "<tool_call>" + draw(st.sampled_from(["{", "[]", '{"name": "f"}', ""]))
        text += "</tool_call>"
    for name, args, ws in draw(st.lists(_CALL, max_size=3)):
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=draw(st.booleans()))
        text += f"<tool_call>{ws}{body}{ws}</tool_call>" + draw(st.text(" \nab", max_size=3))
    return text[: -len("</tool_call>")] if draw(st.booleans()) and text.endswith(">") else text


@settings(max_examples=400, deadline=None)
@given(hermes_texts(), st.data())
def test_any_split_streams_the_whole_parse(text: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls = parse_hermes(text)
    stream = HermesStream()
    assert streamed(run(stream, deltas)) == (content or "", pairs(calls))
    assert stream.called == bool(calls)


def test_required_calls() -> None:
    text = '[{"name": "f", "parameters": {"a": "é"}}, {"name": "g", "description": "d"}]'
    assert pairs(required_calls(text)) == [("f", '{"a": "é"}'), ("g", "null")]
    assert required_calls("[]") == []
    for bad in ["", "[", '{"name": "f"}', '[{"name": 1}]', '[{"name": "f", "parameters": []}]',
                '[{"name": "f"}, 3]', '[{"name": "f", "description": 1}]']:  # fmt: skip
        assert required_calls(bad) == [], bad


def test_named_call_is_the_output_verbatim() -> None:
    call = named_call("f", ' {"a": 1} ')
    assert call is not None and (call.name, call.arguments) == ("f", ' {"a": 1} ')
    assert named_call("f", " \n") is None


def test_forced_streams_emit_at_finish() -> None:
    required = ForcedStream(None)
    text = '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"x": 1}}]'
    assert required.feed(text[:9]) == []
    assert streamed(run(required, [text[9:]])) == ("", [("f", "{}"), ("g", '{"x": 1}')])
    assert required.called
    named = ForcedStream("f")
    assert streamed(run(named, ['{"a"', ": 1}"])) == ("", [("f", '{"a": 1}')])
    blank = ForcedStream("f")
    assert run(blank, ["  "]) == [] and not blank.called


@pytest.mark.parametrize(
    ("reason", "mode", "called", "stream", "expected"),
    [
        ("stop", "auto", True, False, "tool_calls"),
        ("length", "auto", True, False, "tool_calls"),
        ("length", "auto", True, True, "length"),
        ("stop", "auto", True, True, "tool_calls"),
        ("stop", "auto", False, True, "stop"),
        ("stop", "required", False, False, "tool_calls"),
        ("stop", "required", False, True, "stop"),
        ("stop", "required", True, True, "tool_calls"),
        ("stop", "named", True, False, "stop"),
        ("stop", "named", True, True, "stop"),
        ("stop", "none", False, False, "stop"),
    ],
)
def test_finish_reason(reason: str, mode: Any, called: bool, stream: bool, expected: str) -> None:
    assert tool_finish_reason(reason, mode, called=called, stream=stream) == expected
