"""A drop-in in front of vLLM: the same OpenAI requests to vLLM's own OpenAI server
(aggregated, the tiny checkpoint) and to `prfaas serve` over vLLM P/D (a PrfaaS prefill and a
PD decode, both with our connector, the KV crossing between them), raw HTTP and the official
`openai` SDK. Every answer must equal vLLM's, ids and timestamps aside, or carry the same
error status. Servers start once for the module (three vLLM servers and the gateway)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
from openai_battery import (
    CHAT,
    GREEDY,
    PROMPT,
    TOOL,
    TOOL_2,
    TURN_2,
    USER,
    battery_cases,
    merged,
)
from vllm_helpers import MODEL, require_vllm, server, start_all, stop_all

from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMProcess
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

pytestmark = pytest.mark.timeout(1200)

TOOLS_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
VOLATILE = {"id", "created", "system_fingerprint", "kv_transfer_params", "prompt_tokens_details"}
"""Keys whose values differ between two runs of one server (random ids, clocks, the prefix
cache's state) and are left out of the comparison."""
LOGPROB_TOL = 0.05
"""Log-probabilities compare within this (bf16 kernels over other chunkings of the prompt)."""


@dataclass
class Servers:
    vllm: str
    prfaas: str


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    require_vllm()
    root = tmp_path_factory.mktemp("conformance")
    specs = {
        "agg": server("agg", extra_args=TOOLS_FLAGS),
        "p0": server("p0", {"timeout_s": 60}, extra_args=TOOLS_FLAGS),
        "d0": server("d0", {"timeout_s": 60}, extra_args=TOOLS_FLAGS),
    }
    engines = start_all(specs, root)
    gateway = None
    try:
        port = free_port()
        config = root / "deployment.toml"
        config.write_text(_deployment(engines))
        log = (root / "gateway.log").open("wb")
        gateway = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(config),
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, gateway, root / "gateway.log")
        yield Servers(engines["agg"].url, url)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(30)
        stop_all(engines)


def _deployment(e: dict[str, VLLMProcess]) -> str:
    return f"""
[model]
name = "tiny"
tokenizer = "{MODEL}"
context_length = 4096
block_size = {TINY_BLOCK_SIZE}
vocab_size = 384
[gateway]
threshold = 0
[[instances]]
id = "prfaas-p0"
cluster = "prfaas"
role = "prefill"
url = "{e["p0"].url}"
engine = "vllm"
bootstrap_port = {e["p0"].bootstrap_port}
[[instances]]
id = "pd-d0"
cluster = "pd"
role = "decode"
url = "{e["d0"].url}"
engine = "vllm"
"""


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"prfaas serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"prfaas serve not healthy in time: {log.read_text()[-2000:]}")


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST a JSON body: the status and the answer (a JSON value, or a stream's events)."""
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    if not body.get("stream"):
        return status, json.loads(raw)
    events = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    return status, [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def near(a: Any, b: Any) -> bool:
    """Equal, floats within `LOGPROB_TOL`."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(near(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(near(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return abs(a - b) <= LOGPROB_TOL
    return bool(a == b)


def strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def _body(api: str, extra: dict[str, Any], stream: bool) -> dict[str, Any]:
    base = {**GREEDY, "messages": USER} if api == "chat" else {**GREEDY, "prompt": PROMPT}
    return {**base, **extra, "stream": stream}


@pytest.mark.parametrize(("api", "name", "extra", "stream"), battery_cases())
def test_answers_equal_vllms_own(servers: Servers, api: str, name: str,
                                 extra: dict[str, Any], stream: bool) -> None:  # fmt: skip
    """The same body to both: the same status, and the same answer (whole, or every
    event of the stream) up to ids, timestamps and the prefix cache's counts."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    body = _body(api, extra, stream)
    want_status, want = post(servers.vllm, path, body)
    got_status, got = post(servers.prfaas, path, body)
    assert got_status == want_status, f"prfaas {got}\nvllm {want}"
    if want_status == 200 and stream:
        for events in (got, want):
            assert events and events[-1] == "[DONE]", "a whole stream ends with [DONE]"
        got, want = merged(got[:-1]), merged(want[:-1])
    if want_status == 200:
        assert near(strip(got), strip(want)), f"prfaas {strip(got)}\nvllm {strip(want)}"


def test_routing_ids_equal_vllms_prompt_ids(servers: Servers) -> None:
    """The gateway's routing tokenization (its `/tokenize`, the same rendering its router
    uses) equals vLLM's own prompt ids for chats with tools, tool calls and merged system
    turns."""
    for messages, extra in ((USER, {}), (TURN_2, {"tools": [TOOL, TOOL_2]}),
                            (CHAT["system-developer"]["messages"], {})):  # fmt: skip
        body = {**GREEDY, "messages": messages, **extra, "return_token_ids": True}
        status, answer = post(servers.vllm, "/v1/chat/completions", body)
        assert status == 200
        local = _gateway_ids(messages, extra)
        assert local == answer["prompt_token_ids"]


def _gateway_ids(messages: list[dict[str, Any]], extra: dict[str, Any]) -> list[int]:
    from prfaas.common.tokenizer import chat_ids, load_tokenizer
    from prfaas.protocol.openai_chat import chat_prompt

    tok = load_tokenizer(str(MODEL))
    body = {"messages": messages, **extra}
    return chat_ids(tok, chat_prompt(body, template=tok.chat_template))


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/version", "/ping"])
def test_utility_routes_answer_as_vllm(servers: Servers, path: str) -> None:
    bodies = {"/tokenize": {"model": "tiny", "messages": USER, "tools": [TOOL]},
              "/detokenize": {"model": "tiny", "tokens": [72, 105]}}  # fmt: skip
    if path in bodies:
        want, got = post(servers.vllm, path, bodies[path]), post(servers.prfaas, path, bodies[path])
    else:
        want, got = _get(servers.vllm + path), _get(servers.prfaas + path)
    assert got == want


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read()


class Answer(pydantic.BaseModel):
    answer: Literal["yes", "no", "maybe"]


def _sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_sdk_parse_and_its_streaming_helper(servers: Servers) -> None:
    """`client.chat.completions.parse(response_format=Model)` and the streaming helper give
    the same parsed object through PrfaaS as from vLLM."""
    parsed, streamed = [], []
    for url in (servers.vllm, servers.prfaas):
        client = _sdk(url)
        kw: dict[str, Any] = {"model": "tiny", "messages": USER, "max_tokens": 120,
                              "temperature": 0, "response_format": Answer}  # fmt: skip
        completion = client.chat.completions.parse(**kw)
        parsed.append(completion.choices[0].message.parsed)
        with client.chat.completions.stream(**kw) as stream:
            final = stream.get_final_completion()
        streamed.append(final.choices[0].message.parsed)
    assert parsed[0] is not None and parsed == parsed[1:] + parsed[:1]
    assert streamed == parsed


def test_three_turn_tool_loop_with_the_sdk(servers: Servers) -> None:
    """An agent loop with the SDK: a forced tool call, the assistant's call and the tool's
    result sent back (the random model's own call, or, where its grammar-bound output ran
    past max_tokens, the agent's), twice, then a free answer: every turn equal through
    PrfaaS and from vLLM."""
    transcripts = []
    for url in (servers.vllm, servers.prfaas):
        client, messages, turns = _sdk(url), list(USER), []
        for choice in ("required", "required", "auto"):
            reply = client.chat.completions.create(
                model="tiny", messages=messages, tools=[TOOL], tool_choice=choice,  # type: ignore[arg-type]
                max_tokens=120, temperature=0,
            ).choices[0].message  # fmt: skip
            calls = [(c.function.name, c.function.arguments) for c in reply.tool_calls or ()]
            turns.append((reply.content, calls))
            if reply.tool_calls:
                messages.append(reply.model_dump(exclude_none=True))
                messages += [{"role": "tool", "tool_call_id": c.id, "content": "18 C"}
                             for c in reply.tool_calls]  # fmt: skip
            else:
                messages += TURN_2[1:]
        transcripts.append(turns)
    assert len(transcripts[0]) == 3 and transcripts[0] == transcripts[1]
