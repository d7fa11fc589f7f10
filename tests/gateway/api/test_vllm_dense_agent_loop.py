"""An agent loop per API through `prfaas serve` over vLLM P/D of a dense model (the tiny
checkpoint's all-full-attention twin, paged in 64-token blocks): a dense model's prefix
cache hits at every block, so from the second turn on the gateway routes only what the
turn added, within one block, and credits exactly what vLLM's prefill reused. (The hybrid
checkpoint's loop, `test_vllm_agent_apis.py`, can only credit what vLLM keeps at its Mamba
checkpoints.)"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from agent_battery import messages_loop, post, responses_loop
from serve_live_helpers import ENGINE_AUTH, SECRET
from vllm_helpers import VLLM_PYTHON, dense_model, gauge, require_vllm, serve_listening

from prfaas.common.secret import ENV_SECRET
from prfaas.testing.launch_tables import vllm_pd_deployment

pytestmark = pytest.mark.timeout(1200)
BLOCK = 64
TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The gateway's URL and its PrfaaS prefill's (every prompt goes there: threshold 0)."""
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-dense")
    config = root / "deployment.toml"
    config.write_text(vllm_pd_deployment(dense_model(), VLLM_PYTHON, BLOCK, TOOLS))
    with (root / "gateway.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(config),
             "--port", "0", "--no-scheduler"],
            stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, ENV_SECRET: SECRET.hex()},
        )  # fmt: skip
    try:
        url = serve_listening(proc, root / "gateway.log")
        with urllib.request.urlopen(f"{url}/admin/state", timeout=30) as reply:
            state = json.load(reply)
        yield url, next(i["url"] for i in state["clusters"]["prfaas"])
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_an_agent_loop_routes_only_what_each_turn_added(gateway: tuple[str, str], api: str) -> None:
    """Ten turns offering a tool: every turn succeeds; from the second on the incremental
    length is at most what the turn added plus one block, and the prefix the gateway
    credited is what vLLM's prefill reused (the growth of its prefix-cache hit counter).
    (This random dense model's forced calls never close, vLLM's grammar letting it pad
    with whitespace to `max_tokens`, so its turns carry no calls; the hybrid checkpoint's
    loop asserts the calls.)"""
    url, prefill = gateway
    credited: list[tuple[int, int]] = []

    def hits() -> float:
        return gauge(prefill, "vllm:prefix_cache_hits_total", ENGINE_AUTH)

    def post_one(payload: dict[str, Any]) -> tuple[dict[str, str], Any]:
        before = hits()
        status, headers, answer = post(url, f"/v1/{api}", payload)
        assert status == 200, answer
        time.sleep(0.5)  # vLLM updates its counters after the step
        credited.append((int(headers["x-prfaas-incremental-tokens"]), round(hits() - before)))
        return headers, answer

    loop = messages_loop if api == "messages" else responses_loop
    turns = loop(post_one, "tiny")
    print(api, [(t.prompt_tokens, t.incremental_tokens) for t in turns])  # pytest -s
    assert len(turns) == 10, turns
    for turn, (incremental, reused) in zip(turns, credited, strict=True):
        # vLLM computes a prompt's last token whatever it caches: a whole prompt of full
        # blocks found cached reuses all blocks but the last (the gateway credits them all)
        last_block = (turn.prompt_tokens - 1) // BLOCK * BLOCK
        assert min(turn.prompt_tokens - incremental, last_block) == reused, (turns, credited)
    for before, turn in itertools.pairwise(turns):
        added = turn.prompt_tokens - before.prompt_tokens
        assert added > 0 and turn.incremental_tokens <= added + BLOCK, (turns, credited)
