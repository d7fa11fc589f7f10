"""Benchmark: the gateway's routing-decision cost and its added latency / maximum rate.

Part 1 (in process): cost of one routing decision at 1K, 32K and 128K prompt tokens, split
into parse (JSON + fields), tokenize (byte-level), hash (chained xxh3-64 blocks), index
lookup (global KV index holding 150K blocks over 3 instances, half the prompt cached) and
policy (snapshot + PrfaaS rule). Medians of repeated calls. Also the cost of one KV event
batch of 1, 16 and 64 new blocks: the publisher's encode, the gateway's decode (msgspec,
typed, token ids left packed as its feed leaves them), and decode + index apply (which
buffers; the blocks' token ids are re-hashed when it applies), each call a new batch.

Part 2 (real processes, loopback): the same OpenAI `/v1/completions` request straight to a
null engine, through `prfaas serve`, and through SGLang's router (`sglang-router` from
PyPI, PD mode, own virtual environment) over the same null engines (2 prefill + 1 decode;
the null server answers instantly: it measures overhead only). What is compared, exactly:
- the request: non-streaming `/v1/completions`, a ~540-token text prompt, `max_tokens` 8,
  from one Python aiohttp client process (same session, same keep-alive pool) to each;
- `direct`: the decode null engine itself (one hop, no prefill call): the base;
- `prfaas-gateway`: tokenizes, looks up the KV index (hashing blocks lazily, up to the first
  block no engine caches; the null engines publish no KV events, so here the index is empty
  and no block is hashed: part 1 prices a full hash), routes by threshold 256 (this
  prompt goes to the PrfaaS prefill instance), then POSTs SGLang's `/generate` with
  `input_ids` and bootstrap fields to that prefill engine and to the decode engine at once,
  waits for both, answers in OpenAI form;
- `sglang-router`: its PD mode with default policies: picks one of the 2 prefill engines,
  forwards the OpenAI body plus bootstrap fields to it and to the decode engine at once,
  waits for both, answers with the decode engine's body.
The null engines cost about the same CPU per request for either body (the id list is
checked in C), so the engine side of both paths is alike.

Server bake-off: the same gateway app (`GatewayApp.dispatch`, same routes, same engine
session) also runs behind two maintained HTTP servers instead of prfaas/http/server.py, each
in its own process (benchmarks/gateway_server.py; benchmarks/gateway_asgi.py adapts the
routes): `prfaas-on-granian` (granian, ASGI), `prfaas-on-granian-rsgi` (granian's RSGI) and
`prfaas-on-uvicorn` (uvicorn, httptools protocol, uvloop). granian and uvicorn are installed
on first use into a folder of their own ($PRFAAS_ASGI_SERVERS_DIR, default
/tmp/prfaas-asgi-servers) that only those processes see. A second table puts added p50, p99
and max rate of ours, each of them and sglang-router side by side, with ratios to ours.
Added latency = p50/p99 of a target minus the `direct` p50/p99 of the same round (sequential
requests, interleaved request by request across the targets: the goal's measure); a second
view, `block_added_p50_ms`, sends each target its requests in a row instead (a router's
threads then never idle between requests; the two can rank the routers differently, so both
are reported); max rate = completed requests
per second with 64 concurrent closed-loop clients, one target after the other. Every round
measures all targets, in an order that rotates from round to round; the table
shows medians over rounds, and the ratio ours / sglang-router is given both of the medians
and per round. The machine is shared and noisy (2 cores for client, router and 3 engines):
compare within one run only.

With `--dashboard`, a second gateway process like ours (`prfaas-gateway+dashboard`) is measured
in the same rounds while a client polls its `/admin/dashboard` once a second, as an open
`/dashboard` page does: the dashboard's cost on the request path is the difference between
the two gateways' added latency.

Part 3 (`--apis`, real processes, loopback): the gateway's added latency on Anthropic
`/v1/messages` and OpenAI `/v1/responses` against chat completions through the same gateway:
each API's request (the same ~540-token user turn, 8 output tokens, greedy; a Responses
request stored, as by default) straight to the null decode engine (`direct-API`), through the
gateway over null engines spoken to as SGLang servers (`prfaas-API`: Messages and Responses
forwarded whole with `bootstrap_*`, plain chat through `/generate`) and as vLLM servers
(`prfaas-forward-API`: every API forwarded whole with `kv_transfer_params`). A request
costs its engines twice (the prefill renders the body too, on the same two cores), and
differently per API (chat through `/generate` against Messages and Responses rendered by
the engine's own route): `pair-API` (vLLM's calls) and `pair-sglang-API` (SGLang's) are the
client sending the two engine calls the gateway makes itself, at once, so a gateway's own
work is its p50 over its pair (`prfaas-vs-pair-API`, `prfaas-forward-vs-pair-API`).
Sequential requests interleaved across all fifteen targets, the order rotating per round;
added p50 = a target's p50 minus its base's p50 in the same round; the ratio API / chat per
gateway, of the medians over rounds and per round (goal <= 1.1).

Usage: python benchmarks/gateway.py [--rounds 5] [--requests 200] [--json OUT]
       [--servers granian,granian-rsgi,uvicorn | --servers none] [--dashboard]
       python benchmarks/gateway.py --apis [--stream] [--rounds 5] [--requests 200] --skip-overhead
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prfaas.common.hashing import hash_blocks
from prfaas.common.ports import free_port
from prfaas.common.tokenizer import ByteTokenizer
from prfaas.engine_clients.sglang import forwarded_body
from prfaas.engine_clients.vllm import prefill_fields
from prfaas.gateway.instances import InstanceManager, InstanceState
from prfaas.gateway.kv_index import KVIndexManager
from prfaas.gateway.responses.conversation import engine_body
from prfaas.policies.routing import PrfaasPolicy, RoutingSnapshot
from prfaas.protocol.client_body import ClientBody
from prfaas.protocol.generate import Bootstrap, GenerateRequest
from prfaas.protocol.kv_events import BlockStored, KVEventBatch, decode_batch, encode_batch
from prfaas.protocol.openai_request import ModelLimits, load_json, parse_call, parse_sampling

BLOCK = 64
SGLANG_VENV = Path(os.environ.get("PRFAAS_SGLANG_ROUTER_VENV", "/tmp/sglang-router-venv"))
ASGI_SERVERS = Path(os.environ.get("PRFAAS_ASGI_SERVERS_DIR", "/tmp/prfaas-asgi-servers"))
LAUNCHER = Path(__file__).resolve().parent / "gateway_server.py"
OURS = "prfaas-gateway"
WATCHED = "prfaas-gateway+dashboard"
"""With `--dashboard`: a second gateway like ours, polled by a dashboard client throughout."""
FORWARD = "prfaas-gateway-forward"
"""The gateway in `forward` mode (the engines declared vLLM): the client's body travels whole."""
OTHER_SERVERS = ("granian", "granian-rsgi", "uvicorn")
"""The servers the gateway app is also measured on (benchmarks/gateway_server.py)."""
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # ~540 tokens
LIMITS = ModelLimits("null", 65536, None)
"""The model the part-3 gateways serve (`_gateway_config`)."""


# ------------------------------------------------------------------ part 1: decision cost


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _index_with_blocks(ids: list[int]) -> KVIndexManager:
    index = KVIndexManager(block_size=BLOCK)
    filler = [7] * (50_000 * BLOCK)  # 50K blocks per instance of unrelated prefixes
    for n, inst in enumerate(("prfaas-p0", "pd-p0", "pd-d0")):
        tokens = [n + 1, *filler[1:]]
        index.apply(inst, [BlockStored(tuple(range(1, 50_001)), None, tuple(tokens), BLOCK)])
    half = len(ids) // 2 // BLOCK * BLOCK
    hashes = tuple(range(10**9, 10**9 + half // BLOCK))
    index.apply("pd-p0", [BlockStored(hashes, None, tuple(ids[:half]), BLOCK)])
    return index


def _instances() -> InstanceManager:
    manager = InstanceManager()
    for inst, cluster, role in (
        ("prfaas-p0", "prfaas", "prefill"), ("pd-p0", "pd", "prefill"), ("pd-d0", "pd", "decode")
    ):  # fmt: skip
        manager.add(InstanceState(inst, cluster, role, client=None))  # type: ignore[arg-type]
    return manager


def decision_cost(tokens: int, repeats: int) -> dict[str, Any]:
    text = ("abcdefgh" * (tokens // 8 + 1))[:tokens]
    raw = orjson.dumps({"model": "m", "prompt": text, "max_tokens": 16, "temperature": 0})
    tok = ByteTokenizer()
    ids = tok.encode(text)
    hashes = hash_blocks(ids, BLOCK)
    index, instances, policy = _index_with_blocks(ids), _instances(), PrfaasPolicy()
    cached = index.longest_prefix(hashes)

    def decide() -> object:
        snap = RoutingSnapshot(len(ids), instances.views(cached), threshold=4096.0)
        return policy.decide(snap)

    stages = {
        "parse": lambda: parse_sampling(load_json(raw)),
        "tokenize": lambda: tok.encode(text),
        "hash": lambda: hash_blocks(ids, BLOCK),
        "index_lookup": lambda: index.longest_prefix(hashes),
        "policy": decide,
    }
    row: dict[str, Any] = {"prompt_tokens": tokens, "index_blocks": len(index)}
    for name, fn in stages.items():
        row[f"{name}_us"] = _median_us(fn, repeats)
    row["total_us"] = sum(row[f"{n}_us"] for n in stages)
    return row


def kv_event_cost(blocks: int, repeats: int) -> dict[str, Any]:
    """Encode, decode, and decode + index apply of one batch holding one `BlockStored` of
    `blocks` blocks; every apply gets a batch of fresh hashes, so the index inserts."""
    rng = random.Random(blocks)
    batches = [
        KVEventBatch(
            1.0,
            (
                BlockStored(
                    tuple(rng.getrandbits(64) for _ in range(blocks)),
                    None,
                    tuple(rng.randrange(150_000) for _ in range(blocks * BLOCK)),
                    BLOCK,
                ),
            ),
            0,
        )
        for _ in range(repeats)
    ]
    payloads = [encode_batch(b) for b in batches]
    index, fresh = KVIndexManager(block_size=BLOCK), iter(payloads)
    row: dict[str, Any] = {"blocks": blocks, "payload_bytes": len(payloads[0])}
    row["encode_us"] = _median_us(lambda: encode_batch(batches[0]), repeats)
    decode = functools.partial(decode_batch, packed_ids=True)  # as the gateway's feed does
    row["decode_us"] = _median_us(lambda: decode(payloads[0]), repeats)
    row["decode_apply_us"] = _median_us(
        lambda: index.apply("e0", decode(next(fresh)).events), repeats
    )
    return row


# ------------------------------------------------------------------ part 2: overhead


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _gateway_config(path: Path, urls: list[str], engine: str = "sglang") -> Path:
    """The deployment over the null engines; `engine = "vllm"` makes the gateway forward the
    client's OpenAI body (`forward` mode, vLLM's protocol), which the null engines answer as
    if alone."""
    rows = [
        ("prfaas-p0", "prfaas", "prefill"),
        ("pd-p0", "pd", "prefill"),
        ("pd-d0", "pd", "decode"),
    ]
    text = '[model]\nname = "null"\nblock_size = 16\ncontext_length = 65536\n'
    text += "[gateway]\nthreshold = 256\nmax_running = 1024\n"
    for (inst, cluster, role), url in zip(rows, urls, strict=True):
        text += f'[[instances]]\nid = "{inst}"\ncluster = "{cluster}"\nrole = "{role}"\n'
        text += f'url = "{url}"\nengine = "{engine}"\n'
        text += "bootstrap_port = 8998\n" if role == "prefill" else ""
    path.write_text(text)
    return path


def ensure_sglang_router() -> Path | None:
    """The sglang-router venv's python, creating the venv if missing (needs PyPI)."""
    python = SGLANG_VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {SGLANG_VENV} and installing sglang-router from PyPI ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(SGLANG_VENV)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "sglang-router"])
        if done.returncode != 0:
            print("could not install sglang-router; skipping it", flush=True)
            return None
    return python


def ensure_asgi_servers() -> Path | None:
    """A folder holding granian and uvicorn for this Python, installing them if missing
    (needs PyPI). Only the bake-off's server processes get it on their PYTHONPATH."""
    if not all((ASGI_SERVERS / name).is_dir() for name in ("granian", "uvicorn")):
        print(f"installing granian and uvicorn into {ASGI_SERVERS} ...", flush=True)
        argv = [sys.executable, "-m", "pip", "install", "-q", "--target", str(ASGI_SERVERS)]
        if subprocess.run([*argv, "granian", "uvicorn"]).returncode != 0:
            print("could not install granian and uvicorn; skipping them", flush=True)
            return None
    return ASGI_SERVERS


def _spawn_gateway(
    server: str, config: Path, port: int, log: Path, pythonpath: Path | None = None
) -> subprocess.Popen[bytes]:
    """The gateway app on `server`, through benchmarks/gateway_server.py."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    argv = [sys.executable, str(LAUNCHER), "--server", server, "--config", str(config),
            "--port", str(port)]  # fmt: skip
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


async def _wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    body = {"model": "null", "prompt": "warm up", "max_tokens": 2}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.post(f"{url}/v1/completions", json=body) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not become ready")


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}) as r:  # fmt: skip
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")
    return time.perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def request_body(stream: bool) -> bytes:
    """The one request every target gets (streamed or whole)."""
    body = {"model": "null", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return orjson.dumps({**body, "stream": True} if stream else body)


async def _latency(
    session: aiohttp.ClientSession, urls: dict[str, str], order: list[str], n: int, body: bytes
) -> dict[str, tuple[float, float]]:
    """p50 and p99 of `n` sequential requests per target, interleaved request by request
    (one to each target in `order`, then again), so a burst of noise from other processes
    hits every target alike."""
    lat: dict[str, list[float]] = {name: [] for name in order}
    for _ in range(n):
        for name in order:
            lat[name].append(await _one(session, urls[name], body))
    return {name: (_pct(v, 0.5), _pct(v, 0.99)) for name, v in lat.items()}


async def _block_p50(session: aiohttp.ClientSession, url: str, n: int, body: bytes) -> float:
    """p50 of `n` sequential requests to one target in a row (no other target between
    them): a second view of the latency, where a router's threads never idle between
    requests."""
    return _pct([await _one(session, url, body) for _ in range(n)], 0.5)


async def _max_rate(session: aiohttp.ClientSession, url: str, seconds: float, body: bytes) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await _one(session, url, body)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(64)))
    return done / (time.perf_counter() - start)


async def _round(
    session: aiohttp.ClientSession,
    targets: dict[str, str],
    order: list[str],
    n: int,
    sec: float,
    body: bytes,
) -> dict[str, dict[str, float]]:
    """One round: every target in `order`; added latency against `direct` of this round."""
    latency = await _latency(session, targets, order, n, body)
    measured = {}
    for name in order:
        p50, p99 = latency[name]
        block = await _block_p50(session, targets[name], n, body)
        rate = await _max_rate(session, targets[name], sec, body)
        measured[name] = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "block_p50_ms": block * 1e3,
                          "max_rps": rate}  # fmt: skip
    base = measured["direct"]
    for row in measured.values():
        row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
        row["block_added_p50_ms"] = row["block_p50_ms"] - base["block_p50_ms"]
    return measured


async def _watch_dashboard(url: str) -> None:
    """What an open `/dashboard` page does to its gateway: GET `/admin/dashboard` once a
    second, on a connection of its own, passing the previous answer's `now` as `since`."""
    since: float | None = None
    async with aiohttp.ClientSession() as session:
        while True:
            query = "" if since is None else f"?since={since!r}"
            async with session.get(f"{url}/admin/dashboard{query}") as r:
                since = (await r.json())["now"]
            await asyncio.sleep(1.0)


async def overhead(
    targets: dict[str, str],
    rounds: int,
    n: int,
    seconds: float,
    watched: str | None = None,
    stream: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, dict[str, float]]]]:
    """Medians over rounds per target, and the rounds themselves. The order of the targets
    rotates from round to round, so no target always runs first or last. A dashboard client
    polls the target named `watched` throughout, if any."""
    names = list(targets)
    per_round = []
    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in targets.values():
            await _wait_ready(session, url)
        watcher = asyncio.create_task(_watch_dashboard(targets[watched])) if watched else None
        body = request_body(stream)
        await _latency(session, targets, names, 50, body)  # warm every path before measuring
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            per_round.append(await _round(session, targets, order, n, seconds, body))
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    rows = []
    for name in names:
        medians = {k: statistics.median(m[name][k] for m in per_round) for k in per_round[0][name]}
        rows.append({"target": name, **medians})
    return rows, per_round


def run_overhead(
    rounds: int,
    n: int,
    seconds: float,
    servers: tuple[str, ...] = OTHER_SERVERS,
    dashboard: bool = False,
    stream: bool = False,
) -> tuple[tuple[list[dict[str, Any]], list[dict[str, dict[str, float]]]], str | None]:
    logs = Path(tempfile.mkdtemp(prefix="prfaas-bench-gw-"))
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    null = [sys.executable, "-m", "prfaas.testing.null_server", "--port"]
    procs = [_spawn([*null, str(p)], logs / f"null{p}.log") for p in ports]
    gw_port = free_port()
    config = _gateway_config(logs / "deploy.toml", urls)
    procs.append(_spawn_gateway("ours", config, gw_port, logs / "gateway.log"))
    targets = {"direct": urls[2], OURS: f"http://127.0.0.1:{gw_port}"}
    forward_port = free_port()  # the same engines spoken to as vLLM: the client's body forwarded
    forward = _gateway_config(logs / "deploy-forward.toml", urls, engine="vllm")
    procs.append(_spawn_gateway("ours", forward, forward_port, logs / "gateway-forward.log"))
    targets[FORWARD] = f"http://127.0.0.1:{forward_port}"
    if dashboard:  # the same gateway again, with a dashboard client polling it
        port = free_port()
        procs.append(_spawn_gateway("ours", config, port, logs / "gateway-watched.log"))
        targets[WATCHED] = f"http://127.0.0.1:{port}"
    notes = []
    folder = ensure_asgi_servers() if servers else None
    if servers and folder is None:
        notes.append("granian/uvicorn unavailable (see message above)")
    for server in servers if folder is not None else ():
        port = free_port()
        procs.append(_spawn_gateway(server, config, port, logs / f"{server}.log", folder))
        targets[f"prfaas-on-{server}"] = f"http://127.0.0.1:{port}"
    python = ensure_sglang_router()
    if python is not None:
        sr_port = free_port()
        argv = [str(python), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", urls[0], "8998", "--prefill", urls[1], "8999", "--decode", urls[2],
                "--host", "127.0.0.1", "--port", str(sr_port), "--log-level", "warn",
                "--prometheus-port", str(free_port())]  # fmt: skip
        procs.append(_spawn(argv, logs / "sglang-router.log"))
        targets["sglang-router"] = f"http://127.0.0.1:{sr_port}"
    else:
        notes.append("sglang-router unavailable (see message above)")
    try:
        watched = WATCHED if dashboard else None
        result = asyncio.run(overhead(targets, rounds, n, seconds, watched, stream))
        return result, "; ".join(notes) or None
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


# ------------------------------------------------------------------ part 3: APIs

APIS = ("chat", "messages", "responses")
API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages",
             "responses": "/v1/responses"}  # fmt: skip


def api_body(api: str, stream: bool) -> bytes:
    """The same user turn in each API's body."""
    turn = [{"role": "user", "content": PROMPT}]
    body: dict[str, Any] = {
        "chat": {"model": "null", "messages": turn, "max_tokens": 8, "temperature": 0},
        "messages": {"model": "null", "messages": turn, "max_tokens": 8, "temperature": 0},
        "responses": {"model": "null", "input": PROMPT, "max_output_tokens": 8, "temperature": 0},
    }[api]
    return orjson.dumps({**body, "stream": True} if stream else body)


Calls = list[tuple[str, bytes]]
"""One target's request: the (URL, body) posts sent at once, all awaited."""


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> None:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}")


async def _timed(session: aiohttp.ClientSession, calls: Calls) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(_post(session, url, body) for url, body in calls))
    return time.perf_counter() - start


def _pair(urls: list[str], api: str, stream: bool) -> Calls:
    """What the forwarding gateway sends the engines for one request, sent by the client
    itself: the prefill's one-token body and the decode's whole body, at once."""
    body = orjson.loads(api_body(api, stream))
    prefill = prefill_fields(ClientBody(api, body))  # type: ignore[arg-type]
    return [(urls[0] + API_PATHS[api], orjson.dumps(prefill)),
            (urls[2] + API_PATHS[api], api_body(api, stream))]  # fmt: skip


def _sglang_pair(urls: list[str], api: str, stream: bool) -> Calls:
    """What the gateway sends engines spoken to as SGLang servers for one request, sent by
    the client itself: the same body (with `bootstrap_*`) to the prefill and the decode, at
    once; plain chat as `/generate` from the routing ids, Messages and Responses (the
    gateway's stateless engine body) whole on their own route."""
    body = orjson.loads(api_body(api, stream))
    boot = Bootstrap("127.0.0.1", 8998, 1)
    if api == "chat":
        call = parse_call(body, "chat", LIMITS, ByteTokenizer(), "generate")
        assert call.body is None, "plain chat goes through /generate"
        raw, path = GenerateRequest("pair", call.input_ids, call.sampling, stream,
                                    bootstrap=boot).body, "/generate"  # fmt: skip
    else:
        fields = engine_body(body, None) if api == "responses" else body
        client = ClientBody(api, fields)  # type: ignore[arg-type]
        request = GenerateRequest("pair", (), bootstrap=boot, client_body=client)
        raw, path = orjson.dumps(forwarded_body(request)), API_PATHS[api]
    return [(urls[0] + path, raw), (urls[2] + path, raw)]


async def api_rounds(targets: dict[str, Calls], rounds: int, n: int) -> list[dict[str, float]]:
    """Per round, each target's p50 (ms): `n` sequential requests per target, one to each
    target in turn; the order rotates from round to round."""
    names = list(targets)
    per_round = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        for name in names:  # ready, and every path warm
            deadline = time.monotonic() + 60
            while True:
                try:
                    await _timed(session, targets[name])
                    break
                except (aiohttp.ClientError, RuntimeError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.25)
            for _ in range(50):
                await _timed(session, targets[name])
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            lat: dict[str, list[float]] = {name: [] for name in order}
            for _ in range(n):
                for name in order:
                    lat[name].append(await _timed(session, targets[name]))
            per_round.append({name: _pct(v, 0.5) * 1e3 for name, v in lat.items()})
    return per_round


def run_apis(rounds: int, n: int, stream: bool) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="prfaas-bench-apis-"))
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    null = [sys.executable, "-m", "prfaas.testing.null_server", "--port"]
    procs = [_spawn([*null, str(p)], logs / f"null{p}.log") for p in ports]
    gateways = {}
    for name, engine in (("prfaas", "sglang"), ("prfaas-forward", "vllm")):
        port = free_port()
        config = _gateway_config(logs / f"{name}.toml", urls, engine=engine)
        procs.append(_spawn_gateway("ours", config, port, logs / f"{name}.log"))
        gateways[name] = f"http://127.0.0.1:{port}"
    targets: dict[str, Calls] = {}
    for api in APIS:
        body = api_body(api, stream)
        targets[f"direct-{api}"] = [(urls[2] + API_PATHS[api], body)]
        targets[f"pair-{api}"] = _pair(urls, api, stream)
        targets[f"pair-sglang-{api}"] = _sglang_pair(urls, api, stream)
        for name, url in gateways.items():
            targets[f"{name}-{api}"] = [(url + API_PATHS[api], body)]
    try:
        per_round = asyncio.run(api_rounds(targets, rounds, n))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    return api_report(per_round, tuple(gateways))


PAIRS = {"prfaas": "pair-sglang", "prfaas-forward": "pair"}
"""Each gateway's pair: the engine calls it makes for one request, sent by the client."""


def api_report(per_round: list[dict[str, float]], gateways: tuple[str, ...]) -> dict[str, Any]:
    """Added p50 per gateway and API (medians over rounds) and each API's ratio to chat: over
    the decode alone (`prfaas-*`, `prfaas-forward-*`), and each gateway's over the engine
    calls it makes, sent by the client itself (`*-vs-pair`: the gateway's own work only)."""
    added = [{f"{g}-{a}": m[f"{g}-{a}"] - m[f"direct-{a}"] for g in gateways for a in APIS}
             for m in per_round]  # fmt: skip
    for m, row in zip(per_round, added, strict=True):
        row.update({f"{g}-vs-pair-{a}": m[f"{g}-{a}"] - m[f"{PAIRS[g]}-{a}"]
                    for g in gateways for a in APIS})  # fmt: skip
    rows, ratios = [], {}
    for g in (*gateways, *(f"{g}-vs-pair" for g in gateways)):
        chat = statistics.median(r[f"{g}-chat"] for r in added)
        for api in APIS:
            value = statistics.median(r[f"{g}-{api}"] for r in added)
            per = [r[f"{g}-{api}"] / max(r[f"{g}-chat"], 1e-6) for r in added]
            base = PAIRS[g.removesuffix("-vs-pair")] if g.endswith("-vs-pair") else "direct"
            direct = statistics.median(m[f"{base}-{api}"] for m in per_round)
            rows.append({"target": f"{g}-{api}", "base_p50_ms": direct,
                         "added_p50_ms": value, "vs_chat": value / max(chat, 1e-6),
                         "vs_chat_median_of_rounds": statistics.median(per)})  # fmt: skip
            ratios[f"{g}-{api}"] = {"of_medians": value / max(chat, 1e-6), "per_round": per}
    _table("Part 3: added p50 per API through the same gateway (medians over rounds; ms)", rows)
    for name, r in ratios.items():
        if not name.endswith("-chat"):
            print(f"{name} / chat: {r['of_medians']:.2f} (rounds "
                  f"{', '.join(f'{x:.2f}' for x in r['per_round'])}; goal <= 1.1)")  # fmt: skip
    return {"apis": rows, "api_ratios": ratios, "api_rounds": per_round}


# ------------------------------------------------------------------ report


def _table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    first = max(14, *(len(str(row[keys[0]])) for row in rows))  # long target names
    widths = [first] + [14] * (len(keys) - 1)
    print("  ".join(f"{k:>{w}}" for k, w in zip(keys, widths, strict=True)))
    for row in rows:
        cells = (f"{v:>{w}.3f}" if isinstance(v, float) else f"{v!s:>{w}}"
                 for v, w in zip(row.values(), widths, strict=True))  # fmt: skip
        print("  ".join(cells))


def _ratios(
    rows: list[dict[str, Any]], per_round: list[dict[str, dict[str, float]]]
) -> dict[str, Any]:
    """Ours / sglang-router: of the medians, and the median of the per-round ratios."""
    by = {r["target"]: r for r in rows}
    ours, theirs = by[OURS], by["sglang-router"]
    rounds = [m[OURS]["added_p50_ms"] / max(m["sglang-router"]["added_p50_ms"], 1e-6)
              for m in per_round]  # fmt: skip
    out = {
        "added_p50_ratio_vs_sglang_router": ours["added_p50_ms"]
        / max(theirs["added_p50_ms"], 1e-6),
        "added_p50_ratio_per_round": rounds,
        "block_added_p50_ratio_vs_sglang_router": ours["block_added_p50_ms"]
        / max(theirs["block_added_p50_ms"], 1e-6),
        "max_rps_ratio_vs_sglang_router": ours["max_rps"] / max(theirs["max_rps"], 1e-6),
    }
    print(f"\nadded p50, ours / sglang-router: {out['added_p50_ratio_vs_sglang_router']:.2f} "
          f"(median of rounds {statistics.median(rounds):.2f}; each round "
          f"{', '.join(f'{r:.2f}' for r in rounds)}; goal <= 1)")  # fmt: skip
    print(f"added p50 in blocks (each target's requests in a row), ours / sglang-router: "
          f"{out['block_added_p50_ratio_vs_sglang_router']:.2f}")  # fmt: skip
    print(f"max req/s, ours / sglang-router: {out['max_rps_ratio_vs_sglang_router']:.2f}")
    fwd = by[FORWARD]["added_p50_ms"] / max(theirs["added_p50_ms"], 1e-6)
    fwd_rounds = [m[FORWARD]["added_p50_ms"] / max(m["sglang-router"]["added_p50_ms"], 1e-6)
                  for m in per_round]  # fmt: skip
    out.update(forward_added_p50_ratio_vs_sglang_router=fwd,
               forward_added_p50_ratio_per_round=fwd_rounds)  # fmt: skip
    print(
        f"added p50, ours forwarding the OpenAI body (vLLM protocol) / sglang-router: "
        f"{fwd:.2f} (each round {', '.join(f'{r:.2f}' for r in fwd_rounds)}; goal <= 1.05)"
    )
    return out


def _bakeoff(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours, the same app on the other servers, and sglang-router side by side: added p50,
    added p99 and max rate (medians over rounds), each with its ratio to ours (added
    latency: below 1 is less than ours; rate: above 1 is more than ours)."""
    by = {r["target"]: r for r in rows}
    ours = by[OURS]
    out = []
    for name, row in by.items():
        if name == "direct":
            continue
        out.append({
            "target": name,
            "added_p50_ms": row["added_p50_ms"],
            "added_p99_ms": row["added_p99_ms"],
            "max_rps": row["max_rps"],
            "p50_vs_ours": row["added_p50_ms"] / max(ours["added_p50_ms"], 1e-6),
            "p99_vs_ours": row["added_p99_ms"] / max(ours["added_p99_ms"], 1e-6),
            "rps_vs_ours": row["max_rps"] / max(ours["max_rps"], 1e-6),
        })  # fmt: skip
    _table("Server bake-off: the same app on each server (medians over rounds; ratio to ours)",
           out)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="sequential, per target/round")
    parser.add_argument("--rate-seconds", type=float, default=4.0)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--stream", action="store_true", help="stream every answer (SSE)")
    parser.add_argument("--json", type=Path, metavar="OUT")
    parser.add_argument(
        "--servers",
        default=",".join(OTHER_SERVERS),
        help="other servers to run the gateway app on, comma-separated, or 'none' "
        f"(default: {','.join(OTHER_SERVERS)})",
    )
    parser.add_argument(
        "--apis",
        action="store_true",
        help="part 3: added latency of /v1/messages and /v1/responses against chat "
        "completions through the same gateway",
    )
    parser.add_argument(
        "--dashboard",
        action="store_true",
        help=f"also measure target {WATCHED}: the same gateway with a dashboard client "
        "polling /admin/dashboard once a second (as an open /dashboard page does)",
    )
    args = parser.parse_args()
    servers = () if args.servers == "none" else tuple(args.servers.split(","))
    if unknown := set(servers) - set(OTHER_SERVERS):
        parser.error(f"--servers: unknown {sorted(unknown)}; choose from {OTHER_SERVERS}")
    decisions = [decision_cost(n, 30 if n < 100_000 else 10) for n in (1024, 32768, 131072)]
    _table("Part 1: routing decision cost (median us)", decisions)
    events = [kv_event_cost(n, 200) for n in (1, 16, 64)]
    _table(f"Part 1: KV event batch cost, {BLOCK}-token blocks (median us)", events)
    result: dict[str, Any] = {"decision_cost": decisions, "kv_event_cost": events}
    if not args.skip_overhead:
        (rows, per_round), note = run_overhead(
            args.rounds, args.requests, args.rate_seconds, servers, args.dashboard, args.stream
        )
        _table("Part 2: overhead over null engines (medians over rounds; ms, req/s)", rows)
        result.update(overhead=rows, overhead_rounds=per_round, overhead_note=note)
        result.update(server_bakeoff=_bakeoff(rows))
        result.update(rounds=args.rounds, requests=args.requests, stream=args.stream)
        if any(r["target"] == "sglang-router" for r in rows):
            result.update(_ratios(rows, per_round))
    if args.apis:
        result.update(run_apis(args.rounds, args.requests, args.stream), apis_stream=args.stream)
    if args.json:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
