"""Agents in front of vLLM: Anthropic Messages and OpenAI Responses sent to vLLM's own server
(aggregated, the tiny checkpoint, tools on, its render routes on) and through `prfaas serve`
over vLLM P/D (a PrfaaS prefill and a PD decode it launched, our connector between them,
their KV events feeding the gateway's index).

- The gateway's routing ids equal vLLM's own prompt ids for every shape
  (`/v1/messages/render`, `/v1/responses/render`).
- The battery, whole and streamed: the same status; for a 200 the same body structure (the
  same keys, ids and clocks aside), the same event sequence and equal greedy text and calls.
- The official SDKs through the gateway, and a conversation continued with
  `previous_response_id` answering as vLLM's own stateful server does.
- A 10-turn agent loop per API with tool calls: every turn succeeds, the prefix the
  gateway's index credits the prefill with is exactly what vLLM's prefill reused (its own
  prefix-cache hit counter), and from the second turn on the gateway routes at most what
  the turn added plus one block. vLLM keeps a hybrid model's states at the last full block
  of each prompt it computed, so what a turn routes is what it added plus the previous
  prompt's tail past that block (less than one block).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest
from agent_battery import (
    FUNCTION,
    GREEDY_MESSAGES,
    GREEDY_RESPONSES,
    MESSAGES,
    RESPONSES,
    STREAMABLE_ERRORS,
    TOOL,
    USER,
    assembled_message,
    assembled_response,
    body,
    cases,
    message_text,
    messages_loop,
    post,
    responses_loop,
    sse_events,
)
from serve_live_helpers import ENGINE_AUTH, SECRET
from vllm_helpers import (
    MODEL,
    VLLM_PYTHON,
    gauge,
    require_vllm,
    serve_listening,
    server,
    start_all,
    stop_all,
)

from prfaas.common.secret import ENV_SECRET
from prfaas.common.tokenizer import load_tokenizer
from prfaas.engines.vllm.launch import VLLMProcess
from prfaas.protocol import anthropic_messages, openai_responses
from prfaas.protocol.openai_request import chat_body_ids
from prfaas.testing.launch_tables import vllm_pd_deployment
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

pytestmark = pytest.mark.timeout(1500)
TOOLS_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
SAMPLED = ("top-k-top-p", "top-p")
VOLATILE = {"id", "created_at", "item_id", "call_id", "signature", "kv_transfer_params",
            "input_tokens_details", "cache_read_input_tokens", "cache_creation_input_tokens",
            "input_tokens"}  # fmt: skip
"""Keys whose values differ between two runs (random ids, clocks, the prefix cache's state:
Anthropic's `input_tokens` is the prompt less its cached part)."""


@dataclass
class Servers:
    vllm: str
    prfaas: str
    prefill: str
    """The PrfaaS prefill vLLM server the gateway launched (its `/metrics`)."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-agents")
    store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}  # its own stateful path, to compare
    agg = server("agg", extra_args=(*TOOLS_FLAGS, "--enable-scale-out"), environment=store)
    engines: dict[str, VLLMProcess] = {}
    gateway = None
    try:
        engines = start_all({"agg": agg}, root)
        config = root / "deployment.toml"
        config.write_text(vllm_pd_deployment(MODEL, VLLM_PYTHON, TINY_BLOCK_SIZE, TOOLS_FLAGS))
        log = (root / "gateway.log").open("w")
        gateway = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(config),
             "--port", "0", "--no-scheduler"],
            stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, ENV_SECRET: SECRET.hex()},
        )  # fmt: skip
        url = serve_listening(gateway, root / "gateway.log")
        state = _get_json(f"{url}/admin/state")
        prefill = next(i["url"] for i in state["clusters"]["prfaas"])
        yield Servers(engines["agg"].url, url, prefill)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(60)
        stop_all(engines)


def _get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                timeout=30) as r:  # fmt: skip
        return json.loads(r.read())


# ------------------------------------------------------------------ routing ids


def _ours(api: str, payload: dict[str, Any]) -> list[int]:
    tok = load_tokenizer(str(MODEL))
    if api == "messages":
        chat = anthropic_messages.to_chat(payload, anthropic_messages.template_rules(tok))
    else:
        chat = openai_responses.to_chat(payload)
    return chat_body_ids(tok, chat)


@pytest.mark.parametrize(("api", "name"), [(a, n) for a, shapes in (("messages", MESSAGES),
                                           ("responses", RESPONSES)) for n in shapes
                                           if n not in STREAMABLE_ERRORS])  # fmt: skip
def test_routing_ids_equal_vllms_render(servers: Servers, api: str, name: str) -> None:
    shapes = MESSAGES if api == "messages" else RESPONSES
    base = GREEDY_MESSAGES if api == "messages" else GREEDY_RESPONSES
    payload = body(base, shapes[name], False, "tiny")
    status, _, rendered = post(servers.vllm, f"/v1/{api}/render", payload)
    assert status == 200, rendered
    assert _ours(api, payload) == rendered["token_ids"]


# ------------------------------------------------------------------ the battery


def strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def keys(value: Any) -> Any:
    """The structure of a JSON value: its keys, recursively (list items by position)."""
    if isinstance(value, dict):
        return {k: keys(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [keys(v) for v in value]
    return type(value).__name__ if value is not None else None


def _kinds(events: list[tuple[str | None, Any]]) -> list[str | None]:
    """Event names, consecutive repeats once (how a stream splits its deltas into events
    depends on the engine's steps, not on the answer)."""
    out: list[str | None] = []
    for name, _ in events:
        if not out or out[-1] != name:
            out.append(name)
    return out


@pytest.mark.parametrize(("api", "name", "extra", "stream"), cases())
def test_answers_equal_vllms_own(
    servers: Servers, api: str, name: str, extra: dict[str, Any], stream: bool
) -> None:
    base = GREEDY_MESSAGES if api == "messages" else GREEDY_RESPONSES
    payload = body(base, extra, stream, "tiny")
    want_status, _, want = post(servers.vllm, f"/v1/{api}", payload)
    got_status, headers, got = post(servers.prfaas, f"/v1/{api}", payload)
    assert got_status == want_status, f"prfaas {got}\nvllm {want}"
    if got_status != 200:
        if api == "messages":  # always Anthropic's body (vLLM's pydantic errors are OpenAI's)
            assert got["type"] == "error" and got["error"]["message"], got
        else:
            assert got["error"]["message"], got
        return
    assert "x-prfaas-incremental-tokens" in headers
    if stream:
        got_events, want_events = sse_events(got), sse_events(want)
        assert _kinds(got_events) == _kinds(want_events)
        assemble = assembled_message if api == "messages" else assembled_response
        got, want = assemble(got_events), assemble(want_events)
    if name in SAMPLED:
        assert keys(got) == keys(want)
        return
    assert strip(got) == strip(want), f"prfaas {strip(got)}\nvllm {strip(want)}"


# ------------------------------------------------------------------ clients and state


def test_anthropic_sdk_through_prfaas_equals_vllm(servers: Servers) -> None:
    """create (a forced tool use), its tool result sent back streamed, count_tokens: the
    same greedy answers through PrfaaS as from vLLM."""
    answers = []
    for url in (servers.vllm, servers.prfaas):
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        first = client.messages.create(
            model="tiny", max_tokens=150, tools=[TOOL], messages=USER,  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0},
        )  # fmt: skip
        use = first.content[0]
        assert use.type == "tool_use"
        turns = [*USER, {"role": "assistant", "content": [use.model_dump()]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "18 C"}]}]  # fmt: skip
        with client.messages.stream(
            model="tiny",
            max_tokens=10,
            tools=[TOOL],  # type: ignore[list-item]
            messages=turns,
            extra_body={"temperature": 0},
        ) as stream:  # type: ignore[arg-type]
            final = stream.get_final_message()
        count = client.messages.count_tokens(model="tiny", tools=[TOOL], messages=turns)  # type: ignore[arg-type,list-item]
        answers.append((use.input, message_text(final.model_dump()), count.input_tokens))
    assert answers[0] == answers[1]


def test_previous_response_id_answers_as_vllms_stateful_server(servers: Servers) -> None:
    """A text conversation chained with `previous_response_id`: the gateway's stored
    conversation gives the answer vLLM's own store gives (vLLM started with
    VLLM_ENABLE_RESPONSES_API_STORE); streamed follow-ups too."""
    texts = []
    for url in (servers.vllm, servers.prfaas):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        first = client.responses.create(model="tiny", input="Tell me about Paris.",
                                        max_output_tokens=10, temperature=0)  # fmt: skip
        second = client.responses.create(model="tiny", input="And Lyon?", temperature=0,
                                         max_output_tokens=10,
                                         previous_response_id=first.id)  # fmt: skip
        with client.responses.stream(model="tiny", input="And Nice?", temperature=0,
                                     max_output_tokens=10,
                                     previous_response_id=second.id) as stream:  # fmt: skip
            third = stream.get_final_response()
        assert third.previous_response_id == second.id
        assert client.responses.retrieve(second.id).output_text == second.output_text
        assert second.usage is not None and third.usage is not None
        texts.append((first.output_text, second.output_text, third.output_text,
                      second.usage.input_tokens, third.usage.input_tokens))  # fmt: skip
    assert texts[0] == texts[1]


def test_a_streamed_background_response_resumes_as_on_vllms_own_server(servers: Servers) -> None:
    """`background` with `stream` (vLLM keeps the events in its own store, the gateway in its
    event log): the same event sequence and greedy text, and `GET ?stream=true&
    starting_after=N` resumes after the same event to the same end."""
    seen = []
    for url in (servers.vllm, servers.prfaas):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        events = list(client.responses.create(model="tiny", input="Tell me about Paris.",
                                              max_output_tokens=10, temperature=0,
                                              background=True, stream=True))  # fmt: skip
        response_id = events[0].response.id
        again = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].response.id == response_id and events[-1].response.background
        assert [e.model_dump() for e in again] == [e.model_dump() for e in events[4:]]
        seen.append(([e.type for e in events], text))
    assert seen[0] == seen[1]


def test_function_calls_with_previous_response_id_through_prfaas(servers: Servers) -> None:
    """The gateway's stored conversation keeps the function call before its output (vLLM's
    own store drops an answer's calls from the history: its prompt is shorter)."""
    client = openai.OpenAI(base_url=f"{servers.prfaas}/v1", api_key="none", max_retries=0)
    first = client.responses.create(
        model="tiny", input=USER[0]["content"], tools=[FUNCTION], temperature=0,  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=150,
    )  # fmt: skip
    call = first.output[0]
    assert call.type == "function_call"
    follow = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=[FUNCTION], temperature=0,  # type: ignore[list-item]
        max_output_tokens=10,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
    )  # fmt: skip
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    items = [{"role": "user", "content": USER[0]["content"]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments}, output]  # fmt: skip
    whole = _ours("responses", {"input": items, "tools": [FUNCTION]})
    assert follow.usage is not None and follow.usage.input_tokens == len(whole)


# ------------------------------------------------------------------ agent loops


def _prefill_hits(servers: Servers) -> float:
    return gauge(servers.prefill, "vllm:prefix_cache_hits_total", ENGINE_AUTH)


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_an_agent_loop_credits_exactly_what_vllm_reuses(servers: Servers, api: str) -> None:
    """Ten turns with tool calls through vLLM P/D: every turn succeeds, each turn's cached
    prefix as the gateway routed it (prompt less incremental tokens) is what vLLM's prefill
    reused (the growth of its prefix-cache hit counter), and from the second turn on the
    incremental length is at most what the turn added plus one block."""
    credited: list[tuple[int, int]] = []

    def post_one(payload: dict[str, Any]) -> tuple[dict[str, str], Any]:
        before = _prefill_hits(servers)
        status, headers, answer = post(servers.prfaas, f"/v1/{api}", payload)
        assert status == 200, answer
        time.sleep(0.5)  # vLLM updates its counters after the step
        credited.append((int(headers["x-prfaas-incremental-tokens"]),
                         round(_prefill_hits(servers) - before)))  # fmt: skip
        return headers, answer

    loop = messages_loop if api == "messages" else responses_loop
    turns = loop(post_one, "tiny")
    assert len(turns) == 10 and sum(t.tool_calls > 0 for t in turns) >= 6, turns
    for turn, (incremental, hits) in zip(turns, credited, strict=True):
        assert turn.prompt_tokens - incremental == hits, (turns, credited)
    for before, turn in itertools.pairwise(turns):
        added = turn.prompt_tokens - before.prompt_tokens
        assert added > 0 and turn.incremental_tokens <= added + TINY_BLOCK_SIZE, (turns, credited)


def test_a_salted_conversation_is_credited_what_vllm_reuses_under_its_salt(
    servers: Servers,
) -> None:
    """Chat turns through `prfaas serve` with a `cache_salt`: vLLM keys the blocks by the
    salt, and so do the gateway's index and its lookup, so each turn's cached prefix as the
    gateway routed it (prompt less incremental tokens) is what vLLM's prefill reused, under
    the salt and without it: the same last conversation unsalted, or under another salt, is
    credited nothing and reuses nothing."""
    words = " ".join(f"salted{i}" for i in range(120))  # (tokens of its own: no other test's)
    credited: list[tuple[str, int, int]] = []
    messages = [{"role": "user", "content": words}]

    def turn(what: str, salt: str | None) -> None:
        payload: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 1,
                                   "temperature": 0}  # fmt: skip
        if salt is not None:
            payload["cache_salt"] = salt
        before = _prefill_hits(servers)
        status, headers, answer = post(servers.prfaas, "/v1/chat/completions", payload)
        assert status == 200, answer
        time.sleep(0.5)  # vLLM updates its counters after the step
        routed = answer["usage"]["prompt_tokens"] - int(headers["x-prfaas-incremental-tokens"])
        credited.append((what, routed, round(_prefill_hits(servers) - before)))

    turn("first", "tenant-1")
    for n in range(2):
        messages.extend([{"role": "assistant", "content": f"noted {n}"},
                         {"role": "user", "content": f"{words[:500]} again {n}"}])  # fmt: skip
        turn(f"turn {n + 2}", "tenant-1")
    turn("unsalted", None)
    turn("another salt", "tenant-2")
    assert all(routed == hits for _, routed, hits in credited), credited
    assert credited[2][2] > 0, credited  # a salted prefix reused under its salt
    assert credited[3][1:] == credited[4][1:] == (0, 0), credited
