"""Benchmark: the cross-DC KV transport (prfaas.engines.transport).

1. loopback: goodput (GB/s) and CPU seconds per GB (sender + receiver processes) with 1,
   2, 4, 8 connections; sender and receiver are separate processes on 127.0.0.1. With
   --tls, each connection count also runs over transport TLS (TLS 1.3, a throwaway CA),
   interleaved with the plain runs: the cost of TLS side by side.
2. shaped: two network namespaces joined by a veth pair, `tc tbf` on the sender's side at
   1 Gbit/s and 200 Mbit/s; goodput with 1 and 4 connections as a fraction of the shaped
   rate (target >= 0.90). Needs root (ip netns); skipped with a message otherwise.
3. overlap: a prefill in a worker thread streams each layer's arrays as the layer finishes,
   on a paced link sized so transfer time ~= compute time. Two workloads: a real
   reference-engine prefill (its ModelRunner's layer hooks on a 32-layer Qwen3-Next-style
   hybrid, 1024 tokens) and a matmul loop stand-in. Reports compute_s, transfer_s,
   pipelined_s and sequential_s (pipelined=False: everything after the forward). Target:
   pipelined <= 1.15 x max(compute, transfer), sequential ~ compute + transfer.
Every figure is the median of --runs runs. The machine is shared and noisy (2 cores): read
ratios measured side by side, not absolute numbers.
Usage: python benchmarks/transport.py [--parts loopback,shaped,overlap] [--runs 3] [--tls]
       [--overlap reference,loop] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

from prfaas.engines.transport import (
    Kind,
    KVReceiver,
    KVSender,
    ReceiverConfig,
    SenderConfig,
    TlsConfig,
)
from prfaas.testing.tls_certs import CertAuthority

MIB = 2**20
GB = 1e9
SHAPED_RATES = {"1gbit": 1e9 / 8, "200mbit": 200e6 / 8}


# -- roles: one process each ----------------------------------------------------------------


def _payload(layer_mib: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, layer_mib * MIB, dtype=np.uint8)


async def _run_sender(args: argparse.Namespace) -> None:
    """Send `rooms` transfers of `layers` x `layer_mib` MiB, one after the other."""
    tls = None
    if args.tls_dir:
        tls = TlsConfig(Path(args.tls_dir, "prefill.pem"), Path(args.tls_dir, "prefill.key"))
    sender = KVSender(
        SenderConfig(host=args.host, connections=args.connections, register_timeout_s=60, tls=tls)
    )
    await sender.start()
    print(f"READY {sender.bootstrap_port}", flush=True)
    data = _payload(args.layer_mib)
    runs = []
    for room in range(args.rooms):
        handle = sender.open(room)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for layer in range(args.layers):
            handle.send_layer(layer, Kind.FULL_KV, {"kv": data})
        handle.finish()
        await handle.wait()
        runs.append({"wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0})
    telemetry = sender.telemetry()  # connections still up: TCP_INFO of the whole run
    stats = {
        "resent_bytes": telemetry.resent_bytes,
        "retransmission_rate": telemetry.retransmission_rate,
        "rtt_ms": (telemetry.rtt_s or 0.0) * 1e3,
    }
    print("RESULT " + orjson.dumps({"runs": runs, "tcp": stats}).decode())
    await sender.close()


async def _run_receiver(args: argparse.Namespace) -> None:
    """Fetch rooms 0..rooms-1 (registered up front), completing them in order."""
    tls = TlsConfig(ca_file=Path(args.tls_dir, "ca.pem")) if args.tls_dir else None
    receiver = KVReceiver(ReceiverConfig(connect_timeout_s=30, tls=tls))
    transfers = [
        await receiver.fetch(args.host, args.port, room, timeout_s=600)
        for room in range(args.rooms)
    ]
    runs = []
    for transfer in transfers:
        cpu0 = time.process_time()
        result = await transfer.complete()
        runs.append({"cpu_s": time.process_time() - cpu0, "bytes": result.nbytes})
        del result
    print("RESULT " + orjson.dumps({"runs": runs}).decode(), flush=True)
    await receiver.close()


# -- the driver ---------------------------------------------------------------------------------


def _role_cmd(role: str, netns: str | None, **kw: Any) -> list[str]:
    cmd = [sys.executable, __file__, "--role", role]
    for key, value in kw.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return (["ip", "netns", "exec", netns] if netns else []) + cmd


def _result(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = orjson.loads(line[7:])
            return parsed
    raise RuntimeError(f"{proc.args} failed (rc={proc.returncode}): {err[-2000:]}")


def transfer_runs(
    connections: int,
    layers: int,
    layer_mib: int,
    rooms: int,
    netns: tuple[str, str] | None,
    tls_dir: str = "",
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Start a sender and a receiver process; per-room goodput and CPU (first room: warm-up).
    With `tls_dir` (a CA and a `prefill` certificate for 127.0.0.1), over transport TLS."""
    host_s, host_r = ("10.77.0.1", "10.77.0.1") if netns else ("127.0.0.1", "127.0.0.1")
    sender = subprocess.Popen(
        _role_cmd("sender", netns[0] if netns else None, host=host_s, connections=connections,
                  layers=layers, layer_mib=layer_mib, rooms=rooms + 1, tls_dir=tls_dir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sender.stdout is not None
        port = int(sender.stdout.readline().split()[1])
        receiver = subprocess.Popen(
            _role_cmd("receiver", netns[1] if netns else None, host=host_r, port=port,
                      rooms=rooms + 1, tls_dir=tls_dir),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        got = _result(receiver, 600)
        sent = _result(sender, 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            sender.kill()
    nbytes = layers * layer_mib * MIB
    return [
        {
            "goodput_gbps": nbytes * 8 / s["wall_s"] / GB,
            "goodput_GBps": nbytes / s["wall_s"] / GB,
            "cpu_s_per_GB": (s["cpu_s"] + r["cpu_s"]) / (nbytes / GB),
            "sender_cpu_s_per_GB": s["cpu_s"] / (nbytes / GB),
            "receiver_cpu_s_per_GB": r["cpu_s"] / (nbytes / GB),
        }
        for s, r in zip(sent["runs"][1:], got["runs"][1:], strict=True)
    ], sent["tcp"]


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def bench_loopback(runs: int, tls: bool) -> list[dict[str, Any]]:
    """Plain TCP rows, and with `tls` a TLS row after each, run right after it (the same
    machine state, as far as a shared machine allows)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="prfaas-bench-tls-") as tls_dir:
        if tls:
            CertAuthority.create(Path(tls_dir)).issue("prefill")
        for connections in (1, 2, 4, 8):
            for mode in ("tcp", "tls") if tls else ("tcp",):
                measured, tcp = transfer_runs(
                    connections, 32, 8, runs, None, tls_dir if mode == "tls" else ""
                )
                med = _median(measured)
                plain = rows[-1]["goodput_GBps"] if mode == "tls" else med["goodput_GBps"]
                rows.append({"connections": connections, "transport": mode, **med,
                             "goodput_vs_tcp": med["goodput_GBps"] / plain, **tcp,
                             "runs": measured})  # fmt: skip
    return rows


@contextlib.contextmanager
def shaped_link(rate_bits: str) -> Iterator[tuple[str, str]]:
    """Two namespaces and a veth pair with tbf at `rate_bits` on the sender's egress."""
    tag = f"{os.getpid() % 100000}"
    ns_s, ns_r, dev_s, dev_r = f"pkvS{tag}", f"pkvR{tag}", f"pkvs{tag}", f"pkvr{tag}"
    rate = SHAPED_RATES[rate_bits]
    burst = max(int(rate * 0.01), 131072)  # 10 ms of tokens, at least two GSO packets
    steps = [
        ["ip", "netns", "add", ns_s],
        ["ip", "netns", "add", ns_r],
        ["ip", "link", "add", dev_s, "type", "veth", "peer", "name", dev_r],
        ["ip", "link", "set", dev_s, "netns", ns_s],
        ["ip", "link", "set", dev_r, "netns", ns_r],
        ["ip", "-n", ns_s, "addr", "add", "10.77.0.1/24", "dev", dev_s],
        ["ip", "-n", ns_r, "addr", "add", "10.77.0.2/24", "dev", dev_r],
        ["ip", "-n", ns_s, "link", "set", dev_s, "up"],
        ["ip", "-n", ns_r, "link", "set", dev_r, "up"],
        ["ip", "-n", ns_s, "link", "set", "lo", "up"],
        ["ip", "-n", ns_r, "link", "set", "lo", "up"],
        ["ip", "netns", "exec", ns_s, "tc", "qdisc", "add", "dev", dev_s, "root", "tbf",
         "rate", rate_bits, "burst", str(burst), "latency", "50ms"],
    ]  # fmt: skip
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True)
        yield ns_s, ns_r
    finally:
        for ns in (ns_s, ns_r):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def bench_shaped(runs: int) -> list[dict[str, Any]] | str:
    if os.geteuid() != 0:
        return "skipped: needs root for ip netns / tc"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "skipped: iproute2 (ip, tc) is not installed"
    rows = []
    for rate_bits, rate in SHAPED_RATES.items():
        layer_mib = 4 if rate < 1e8 else 16  # ~1.3 s (200 Mbit) / ~1.1 s (1 Gbit) per run
        for connections in (1, 4):
            try:
                with shaped_link(rate_bits) as namespaces:
                    measured, tcp = transfer_runs(connections, 8, layer_mib, runs, namespaces)
            except subprocess.CalledProcessError as exc:
                return f"skipped: could not build the shaped link: {exc.stderr.strip()}"
            med = _median(measured)
            shaped_gbps = rate * 8 / GB
            rows.append(
                {
                    "link": rate_bits,
                    "connections": connections,
                    "shaped_gbps": shaped_gbps,
                    "fraction_of_shaped": med["goodput_gbps"] / shaped_gbps,
                    **med,
                    **tcp,
                    "runs": measured,
                }
            )
    return rows


# -- overlap ---------------------------------------------------------------------------------------


OnLayer = Callable[[int, Kind, dict[str, np.ndarray]], None]


class LayerLoop:
    """A forward-pass stand-in: per layer, matmuls of a (tokens, hidden) activation, then
    that layer's `kv_mib` MiB of KV."""

    name = "matmul-loop"

    def __init__(self, layers: int, tokens: int, hidden: int, kv_mib: int) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(tokens, hidden, generator=gen)
        self.w = [torch.randn(hidden, hidden, generator=gen) / hidden**0.5 for _ in range(4)]
        self.layers = layers
        self.messages = [(i, Kind.FULL_KV, {"kv": _payload(kv_mib)}) for i in range(layers)]

    def run(self, on_layer: OnLayer | None = None) -> None:
        h = self.x
        for layer in range(self.layers):
            for w in self.w:
                h = self.torch.tanh(h @ w)  # (tokens, hidden)
            if on_layer is not None:
                on_layer(*self.messages[layer])


class ReferencePrefill:
    """A real prefill: the reference engine's ModelRunner on a Qwen3-Next-style hybrid
    (random weights, 3 linear : 1 full attention), each layer's KV or linear state taken
    from the engine's cache in the layer's forward hook, as the reference engine ships it."""

    name = "reference-prefill"

    def __init__(self, layers: int, tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, Qwen3NextConfig

        from prfaas.engines.reference.model.runner import ModelRunner

        torch.set_num_threads(1)
        torch.manual_seed(0)
        config = Qwen3NextConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
            linear_value_head_dim=32, num_experts=0, vocab_size=512,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.runner = ModelRunner(model)
        self.ids = torch.randint(0, 512, (1, tokens))
        self.layers = layers
        self.messages: list[tuple[int, Kind, dict[str, np.ndarray]]] = []
        self.run(lambda *message: self.messages.append(message))

    def run(self, on_layer: OnLayer | None = None) -> None:
        from prfaas.engines.reference.model.hybrid_cache import HybridCache, SeqState
        from prfaas.engines.reference.model.runner import FULL

        def listener(idx: int, kind: str, cache: Any) -> None:
            if on_layer is None:
                return
            if kind == FULL:
                k, v = cache.keys[idx][0].numpy(), cache.values[idx][0].numpy()
                on_layer(idx, Kind.FULL_KV, {"k": k.copy(), "v": v.copy()})
            else:
                conv, rec = cache.conv[idx][0].numpy(), cache.rec[idx][0].numpy()
                on_layer(idx, Kind.LINEAR_STATE, {"conv": conv.copy(), "rec": rec.copy()})

        self.runner.forward(HybridCache([SeqState()]), self.ids, listener)


Workload = LayerLoop | ReferencePrefill


async def _overlap_once(model: Workload, rate: float, mode: str) -> tuple[float, float]:
    """(end-to-end seconds, seconds the compute loop itself took in this run)."""
    config = SenderConfig(
        rate_bytes_per_s=rate,
        pipelined=mode == "pipelined",
        chunk_bytes=MIB,
        window_bytes=16 * MIB,
    )
    sender = KVSender(config)
    await sender.start()
    receiver = await asyncio.to_thread(
        subprocess.Popen,
        _role_cmd("receiver", None, host="127.0.0.1", port=sender.bootstrap_port, rooms=2),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        warm = sender.open(0)  # connections up before the clock starts
        warm.finish()
        await warm.wait()
        handle = sender.open(1)
        start = time.perf_counter()

        def send(layer: int, kind: Kind, arrays: dict[str, np.ndarray]) -> None:
            handle.send_layer(layer, kind, arrays)

        if mode == "transfer":
            for message in model.messages:
                send(*message)
        else:
            await asyncio.to_thread(model.run, send)  # the forward pass runs off the loop
        compute = time.perf_counter() - start if mode != "transfer" else 0.0
        handle.finish()
        await handle.wait()
        return time.perf_counter() - start, compute
    finally:
        await sender.close()
        await asyncio.to_thread(receiver.communicate, timeout=60)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_overlap(runs: int, model: Workload) -> dict[str, Any]:
    model.run()  # warm-up
    compute_s = statistics.median(_timed(model.run) for _ in range(3))
    total = sum(a.nbytes for _, _, arrays in model.messages for a in arrays.values())
    rate = total / compute_s  # a link that needs as long as the compute
    modes = ("compute", "transfer", "pipelined", "sequential")
    wall: dict[str, list[float]] = {mode: [] for mode in modes}
    in_run: dict[str, list[float]] = {"pipelined": [], "sequential": []}
    for _ in range(runs):  # interleaved, so the machine's noise hits every mode alike
        wall["compute"].append(_timed(model.run))
        for mode in modes[1:]:
            seconds, compute = asyncio.run(_overlap_once(model, rate, mode))
            wall[mode].append(seconds)
            if mode in in_run:
                in_run[mode].append(compute)
    med = {mode: statistics.median(v) for mode, v in wall.items()}
    # The same ratios with the compute time measured inside each run (the machine is shared:
    # compute speed drifts between runs, and this removes that drift from the ratio).
    pipe_in_run = [
        p / max(c, med["transfer"])
        for p, c in zip(wall["pipelined"], in_run["pipelined"], strict=True)
    ]
    seq_in_run = [
        s / (c + med["transfer"])
        for s, c in zip(wall["sequential"], in_run["sequential"], strict=True)
    ]
    return {
        "workload": model.name,
        "layers": model.layers,
        "bytes": total,
        "link_rate_bytes_per_s": rate,
        "compute_s": med["compute"],
        "transfer_s": med["transfer"],
        "pipelined_s": med["pipelined"],
        "sequential_s": med["sequential"],
        "pipelined_over_max": med["pipelined"] / max(med["compute"], med["transfer"]),
        "sequential_over_sum": med["sequential"] / (med["compute"] + med["transfer"]),
        "pipelined_over_max_in_run": statistics.median(pipe_in_run),
        "sequential_over_sum_in_run": statistics.median(seq_in_run),
        "target_pipelined_over_max": 1.15,
        "runs": {"wall": wall, "compute_in_run": in_run},
    }


# -- report ----------------------------------------------------------------------------------------


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            *(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns)
        )
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="loopback,shaped,overlap")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--tls", action="store_true", help="loopback: TLS rows next to TCP's")
    parser.add_argument(
        "--overlap", default="loop,reference", help="overlap workloads: loop, reference"
    )
    parser.add_argument("--role", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    for name in ("host", "port", "connections", "layers", "layer-mib", "rooms", "tls-dir"):
        parser.add_argument(
            f"--{name}", type=str if name in ("host", "tls-dir") else int, help=argparse.SUPPRESS
        )
    args = parser.parse_args()
    if args.role == "sender":
        asyncio.run(_run_sender(args))
        return 0
    if args.role == "receiver":
        asyncio.run(_run_receiver(args))
        return 0
    console, report = Console(width=150), {}
    parts = args.parts.split(",")
    if "loopback" in parts:
        report["loopback"] = bench_loopback(args.runs, args.tls)
        cols = ["connections", "transport", "goodput_GBps", "goodput_vs_tcp", "cpu_s_per_GB",
                "sender_cpu_s_per_GB", "receiver_cpu_s_per_GB"]  # fmt: skip
        console.print(_table("loopback goodput (median)", report["loopback"], cols))
    if "shaped" in parts:
        shaped = report["shaped"] = bench_shaped(args.runs)
        if isinstance(shaped, str):
            console.print(f"shaped link: {shaped}")
        else:
            cols = ["link", "connections", "goodput_gbps", "fraction_of_shaped", "cpu_s_per_GB",
                    "rtt_ms", "retransmission_rate", "resent_bytes"]  # fmt: skip
            console.print(_table("shaped link (tc tbf over veth, median)", shaped, cols))
    if "overlap" in parts:
        workloads = {
            "loop": lambda: LayerLoop(layers=16, tokens=1024, hidden=1024, kv_mib=4),
            "reference": lambda: ReferencePrefill(layers=32, tokens=1024),
        }
        rows = [bench_overlap(args.runs, workloads[w]()) for w in args.overlap.split(",")]
        report["overlap"] = rows
        cols = ["workload", "compute_s", "transfer_s", "pipelined_s", "sequential_s",
                "pipelined_over_max", "pipelined_over_max_in_run",
                "sequential_over_sum"]  # fmt: skip
        console.print(_table("layer-wise overlap (median)", rows, cols))
    if args.json_out:
        with open(args.json_out, "wb") as out:
            out.write(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
