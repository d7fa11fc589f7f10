"""The conformance battery against the embedded default (`prfaas serve`: three reference
engines, a PrfaaS prefill and a PD prefill/decode pair): every feature of every shape, streamed
and whole, chat and completions, either works (its effect is checked in the answer) or is
refused with a 400 (404 for the model) naming a field the shape sent. A shape answered 200
whose feature shows no effect fails: nothing is silently dropped.

The battery's short prompts route to the PD cluster, so the prefill and the decode are two
engines and the KV crosses between them: grammars, log-probabilities and penalties hold
across the hand-off (the first token is drawn on the prefill)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pydantic
import pytest
from openai_battery import (
    CHAT,
    GREEDY,
    PROMPT,
    SCHEMA,
    STREAM_ONLY,
    TOOL,
    USER,
    battery_cases,
    merged,
)

pytestmark = pytest.mark.timeout(600)
MODEL = "qwen3-next-tiny"
LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
READY = re.compile(r"(Ctrl-C) stops")
REFUSED = {
    "return-token-ids": "return_token_ids",
    "prompt-logprobs": "prompt_logprobs",
    "over-context": "prompt",
    "bad-temperature": "temperature",
    "batch": "prompt",
    "echo": "echo",
    "suffix": "suffix",
    "empty": "prompt",
}
"""Shapes the reference engine refuses, and the field its 400 names."""
REQUIRED_SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 300}
"""The tiny model's weights are random: greedy, it repeats the required array's items past
any token budget, so a required call samples (seeded) to reach the array's end."""
OVERRIDES = {"tools-required": REQUIRED_SAMPLED, "over-context": {"max_tokens": 10**6}}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", "serve", "--port", "0", "--no-scheduler"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "prfaas serve exited:\n" + "".join(seen)
            seen.append(line)
            if READY.search(line):
                break
        match = LISTENING.search("".join(seen))
        assert match is not None, "".join(seen)
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
    """Status, the answer (a stream as its events, `[DONE]` checked and dropped) and
    headers."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw, status, headers = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)
    if not body.get("stream"):
        return status, json.loads(raw), headers
    events = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    assert events and events[-1] == b"[DONE]", raw[-300:]
    return status, [json.loads(e) for e in events[:-1]], headers


def _as_message(answer: dict[str, Any]) -> dict[str, Any]:
    """A merged chat stream's deltas read as the whole answer's messages."""
    for choice in answer["choices"]:
        if "delta" in choice:
            choice["message"] = choice.pop("delta")
    return answer


def _text(answer: dict[str, Any], i: int = 0) -> str:
    choice = answer["choices"][i]
    return str(choice["text"] if "text" in choice else choice["message"].get("content") or "")


def _calls(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return list(answer["choices"][0]["message"].get("tool_calls") or [])


def _args(call: dict[str, Any]) -> dict[str, Any]:
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args, dict)
    return args


def _required(answer: dict[str, Any], parallel: bool = True) -> None:
    calls = _calls(answer)
    assert calls, answer
    assert parallel or len(calls) == 1
    for call in calls:
        name = call["function"]["name"]
        assert name in ("get_weather", "get_time")
        assert set(_args(call)) == {"city" if name == "get_weather" else "zone"}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def _named(answer: dict[str, Any]) -> None:
    (call,) = _calls(answer)
    assert call["function"]["name"] == "get_time" and set(_args(call)) == {"zone"}


def _json(answer: dict[str, Any], schema: bool = False) -> None:
    text = _text(answer)
    if answer["choices"][0]["finish_reason"] == "length":
        assert text.lstrip().startswith("{"), text  # cut short, but inside the grammar
        return
    value = json.loads(text)
    assert isinstance(value, dict)
    if schema:
        assert set(value) == {"answer"} and isinstance(value["answer"], str)
        assert len(value["answer"]) <= SCHEMA["properties"]["answer"]["maxLength"]


def _only(chars: str, stop_at: str = "") -> Callable[[dict[str, Any]], None]:
    def check(answer: dict[str, Any]) -> None:
        text = _text(answer)
        assert text and set(text) <= set(chars), text

    return check


def _excludes(chars: str, last_may: bool) -> Callable[[dict[str, Any]], None]:
    def check(answer: dict[str, Any]) -> None:
        text = _text(answer)
        body = text[:-1] if last_may else text
        assert not set(body) & set(chars), text

    return check


def _logprobs_chat(answer: dict[str, Any]) -> None:
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"] > 0
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6


def _logprobs_completions(answer: dict[str, Any]) -> None:
    lp = answer["choices"][0]["logprobs"]
    n = answer["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n > 0
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])


def _n2(answer: dict[str, Any]) -> None:
    assert [c["index"] for c in answer["choices"]] == [0, 1]


def _tokens(n: int) -> Callable[[dict[str, Any]], None]:
    def check(answer: dict[str, Any]) -> None:
        assert answer["usage"]["completion_tokens"] == n

    return check


def _no_calls(answer: dict[str, Any]) -> None:
    assert not _calls(answer)


def _any(answer: dict[str, Any]) -> None:
    assert answer["choices"] and answer["choices"][0]["finish_reason"] in ("stop", "length")


CHECKS: dict[str, dict[str, Callable[[dict[str, Any]], None]]] = {
    "chat": {
        "tools-required": _required, "tools-named": _named, "tools-none": _no_calls,
        "tools-not-parallel": lambda a: _required(a, parallel=False),
        "json-object": _json, "json-schema": lambda a: _json(a, schema=True),
        "choice": lambda a: _text(a) in ("yes", "no", "maybe") or pytest.fail(_text(a)),
        "regex": lambda a: re.fullmatch("[a-c]{3}-[0-9]{2}", _text(a)) or pytest.fail(_text(a)),
        "logit-bias": _only("A"), "stop-token-ids": _excludes("e ", last_may=True),
        "stop": _excludes("ea", last_may=False), "logprobs": _logprobs_chat, "n-2": _n2,
        "min-tokens": _tokens(10),
    },
    "completions": {
        "json-object": _json, "logprobs": _logprobs_completions, "n-2": _n2,
        "choice": lambda a: _text(a) in ("red", "green") or pytest.fail(_text(a)),
        "logit-bias": _only("e"), "stop-token-ids": _excludes(" ", last_may=True),
    },
}  # fmt: skip
"""What each feature's effect looks like in the answer (shapes without one, such as the
penalties or template options, must answer 200; their effect is tested on the engine)."""


@pytest.mark.parametrize(("api", "name", "extra", "stream"), battery_cases())
def test_every_feature_works_or_is_refused_by_name(
    url: str, api: str, name: str, extra: dict[str, Any], stream: bool
) -> None:
    base = {**GREEDY, "model": MODEL}
    base.update({"messages": USER} if api == "chat" else {"prompt": PROMPT})
    body = {**base, **extra, **OVERRIDES.get(name, {}), "stream": stream}
    if stream and "stream_options" not in body:
        body["stream_options"] = {"include_usage": True}  # the checks count tokens
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    status, answer, headers = post(url, path, body)
    if name == "unknown-model":
        assert status == 404 and answer["error"]["param"] == "model"
        return
    if name in REFUSED:
        assert status == 400, answer
        assert answer["error"]["param"].split(".")[0] == REFUSED[name], answer
        assert "Traceback" not in json.dumps(answer)
        return
    assert status == 200, answer
    assert headers["x-prfaas-route"] == "pd"  # a PD prefill and decode: the KV crossed
    whole = _as_message(merged(answer)) if stream else answer
    if name == "continuous-usage":
        assert all(e.get("usage") for e in answer if e.get("choices")), answer
    if name in STREAM_ONLY:
        assert whole["usage"]["completion_tokens"] > 0
    CHECKS[api].get(name, _any)(whole)


def test_seeded_sampling_repeats_and_prompt_options_reach_the_template(url: str) -> None:
    """A seeded request answers the same twice; the template options change the prompt
    (the engine rendered them, not the gateway alone)."""
    body = {**GREEDY, "model": MODEL, "messages": USER, **CHAT["seeded"]}
    first, second = (post(url, "/v1/chat/completions", body)[1] for _ in range(2))
    assert _text(first) == _text(second)
    plain = post(url, "/v1/chat/completions", {**GREEDY, "model": MODEL, "messages": USER})[1]
    for shape in ("no-generation-prompt", "agent-turn-2", "tools-auto", "system-developer"):
        other = post(url, "/v1/chat/completions",
                     {**GREEDY, "model": MODEL, "messages": USER, **CHAT[shape]})[1]  # fmt: skip
        assert other["usage"]["prompt_tokens"] != plain["usage"]["prompt_tokens"], shape


class Weather(pydantic.BaseModel):
    answer: str = pydantic.Field(max_length=8)


def test_sdk_parse_and_a_tool_loop(url: str) -> None:
    """The official SDK: `parse()` with a Pydantic model gets a valid instance; a tool call
    (required), its result, and the next turn are served."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    done = client.chat.completions.parse(
        model=MODEL,
        messages=USER,
        response_format=Weather,
        max_tokens=60,
        temperature=0,
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Weather) and len(parsed.answer) <= 8
    messages: list[Any] = list(USER)
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[TOOL], tool_choice="required",
        **REQUIRED_SAMPLED,
    )  # fmt: skip
    call = (first.choices[0].message.tool_calls or [None])[0]
    assert call is not None and call.type == "function"
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18}'},
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[TOOL],
        max_tokens=12,
        temperature=0,
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    "shape", ["plain", "tools-auto", "agent-turn-2", "system-developer", "continue-final"]
)
def test_routing_ids_equal_the_engines_prompt_ids(url: str, shape: str) -> None:
    """The gateway's rendering (`/tokenize`, what it hashes to route) counts the tokens the
    engine computed (`usage.prompt_tokens`): prefix hits are the engine's."""
    body = {**GREEDY, "model": MODEL, "messages": USER, **CHAT[shape]}
    status, answer, _ = post(url, "/v1/chat/completions", body)
    assert status == 200, answer
    status, tokens, _ = post(url, "/tokenize", {k: v for k, v in body.items() if k != "max_tokens"})
    assert status == 200, tokens
    assert tokens["count"] == answer["usage"]["prompt_tokens"]
