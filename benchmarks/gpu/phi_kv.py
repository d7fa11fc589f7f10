#!/usr/bin/env python
"""Phi_kv(l) = S_kv(l) / T_prefill(l) (the paper's Eq. 1) for the Table 3 presets
(`prfaas.engines.reference.model.table3`): random-weight `transformers` models with the real
models' per-layer attention layout, scaled down to one device.

Per preset and prompt length: the KV bytes a prefill leaves as a serving engine keeps them
(`compact_kv_bytes`; the `transformers` cache's own bytes beside it as a cross-check), the
prefill's time (one forward of the whole prompt, timed to the device's end, median of
`--reps` after a warm-up), and Phi_kv in Gbit/s; then each hybrid's Phi_kv over its dense
twin's, the quantity the paper's Table 3 argues from. Which linear-attention layers ran on
`transformers`' PyTorch fallbacks instead of the fast kernels (`fla`, `causal_conv1d`) is
recorded per preset. Absolute numbers are those of scaled-down models on one device, not
the paper's; the ratios are what compare.

    python benchmarks/gpu/phi_kv.py --device cuda --json phi_kv.json
    python benchmarks/gpu/phi_kv.py --device cpu --size tiny --lengths 64 128 --reps 1
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import progress  # beside this script
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from prfaas.engines.reference.model import table3

GPU_LENGTHS = (1024, 4096, 8192, 16384, 32768, 65536)


class _Fallbacks(logging.Handler):
    """Collects `transformers`' "falling back to its reference PyTorch implementation"
    warnings (the kernels a model ran without)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "falling back" in message:
            self.seen.add(message.split("`")[1] if "`" in message else message[:80])


def build(name: str, size: table3.Size, device: torch.device, dtype: torch.dtype) -> Any:
    """Preset `name` with seeded random weights, built on `device`, with SDPA attention
    where `transformers` has it for the architecture, else eager (MiMo-V2-Flash: its
    attention sinks have no SDPA path)."""
    for attention in ("sdpa", "eager"):
        torch.manual_seed(0)
        try:
            with device:
                model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    table3.config(name, size), dtype=dtype, attn_implementation=attention
                )
            return model.eval()
        except ValueError as exc:
            if "scaled_dot_product_attention" not in str(exc):
                raise
    raise AssertionError("unreachable: eager attention is always available")


def prefill_s(model: PreTrainedModel, ids: torch.Tensor) -> tuple[float, Any]:
    """One prefill of `ids`, timed until the device finished it; and its cache."""
    _sync(ids.device)
    began = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    _sync(ids.device)
    return time.perf_counter() - began, out.past_key_values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Measured:
    """One preset built on the device, and what was measured of it."""

    def __init__(self, name: str, size: table3.Size, device: torch.device) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.name, self.device = name, device
        began = time.monotonic()
        self.model = build(name, size, device, dtype)
        self.build_s = time.monotonic() - began
        self.warm_up_s: float | None = None
        self.rows: list[dict[str, Any]] = []
        self.fallbacks: set[str] = set()
        self.error: str | None = None
        self.done = False
        """No longer lengths: it ran out of memory, or failed."""

    def warm_up(self, tokens: int) -> None:
        """A first forward, noting the kernels `transformers` fell back from (it warns once
        a process: its once-cache is cleared so every preset reports its own)."""
        handler = _Fallbacks()
        logging.getLogger("transformers").addHandler(handler)
        once = getattr(logging.Logger, "warning_once", None)
        if once is not None and hasattr(once, "cache_clear"):
            once.cache_clear()
        began = time.monotonic()
        try:
            prefill_s(self.model, self._ids(tokens))
        finally:
            logging.getLogger("transformers").removeHandler(handler)
        self.warm_up_s = time.monotonic() - began
        self.fallbacks = handler.seen

    def measure(self, length: int, reps: int) -> None:
        """Prefill time at `length` (median of the reps after the first, which may tune
        kernels for the new shape) and the KV bytes; an out-of-memory ends the preset."""
        ids = self._ids(length)
        try:
            first, cache = prefill_s(self.model, ids)
            held = table3.cache_bytes(cache)
            del cache
            times = [first] + [prefill_s(self.model, ids)[0] for _ in range(reps - 1)]
        except torch.OutOfMemoryError:
            self.rows.append({"tokens": length, "skipped": "out of memory"})
            self.done = True
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        seconds = statistics.median(times[1:] if len(times) > 2 else times)
        kv = table3.compact_kv_bytes(self.model.config, length)
        self.rows.append({
            "tokens": length, "kv_bytes": kv, "cache_bytes": held,
            "prefill_ms": round(seconds * 1e3, 3),
            "phi_kv_gbps": round(kv * 8 / seconds / 1e9, 4),
        })  # fmt: skip

    def _ids(self, tokens: int) -> torch.Tensor:
        return torch.randint(0, int(self.model.config.vocab_size), (1, tokens), device=self.device)

    def report(self) -> dict[str, Any]:
        cfg = self.model.config
        out = {
            "preset": self.name,
            "model_type": cfg.model_type,
            "attention": cfg._attn_implementation,
            "layer_types": list(cfg.layer_types),
            "params_b": round(sum(p.numel() for p in self.model.parameters()) / 1e9, 3),
            "fallbacks": sorted(self.fallbacks),
            # the first forward compiles and tunes the kernels (Triton's, fla's)
            "build_s": round(self.build_s, 2),
            "warm_up_s": None if self.warm_up_s is None else round(self.warm_up_s, 2),
            "rows": self.rows,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


def measure_all(
    names: list[str], size: table3.Size, lengths: list[int], device: torch.device, reps: int,
    deadline: float, keep: Callable[[dict[str, dict[str, Any]]], None],
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every preset built once (they fit one GPU together), then every length across all
    presets before the next, so running out of time loses the longest lengths, not a
    twin (a length skipped is recorded); one preset's failure does not stop the others.
    `keep` gets the reports so far after each preset's build and each length (a run cut
    short keeps them)."""
    built: dict[str, Measured] = {}
    failed: dict[str, dict[str, Any]] = {}

    def reports() -> dict[str, dict[str, Any]]:
        return {n: built[n].report() if n in built else failed[n]
                for n in names if n in built or n in failed}  # fmt: skip

    for name in names:
        try:
            built[name] = Measured(name, size, device)
            built[name].warm_up(min(lengths))
            progress.say("phi_kv", f"{name}: built in {built[name].build_s:.1f} s, warmed up in "
                 f"{built[name].warm_up_s:.1f} s")  # fmt: skip
        except Exception as exc:
            failed[name] = {"preset": name, "error": f"{type(exc).__name__}: {exc}", "rows": []}
            built.pop(name, None)
            progress.say("phi_kv", f"{name}: {failed[name]['error']}")
        keep(reports())
    for length in sorted(lengths):
        for preset in built.values():
            if preset.done:
                continue
            if time.monotonic() > deadline:
                preset.rows.append({"tokens": length, "skipped": "out of time"})
                continue
            try:
                preset.measure(length, reps)
            except Exception as exc:
                preset.error, preset.done = f"{type(exc).__name__}: {exc}", True
            progress.say("phi_kv", f"{preset.name} at {length}: {preset.error or preset.rows[-1]}")
        keep(reports())
    return {name: built[name].report() if name in built else failed[name] for name in names}


def ratios(presets: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each hybrid's Phi_kv over its dense twin's per length, beside the paper's Table 3
    ratio of the real models where the paper has both rows at that length."""
    paper = table3.paper_table3()
    out = []
    for name, preset in table3.PRESETS.items():
        if preset.twin is None or name not in presets or preset.twin not in presets:
            continue
        mine = {r["tokens"]: r for r in presets[name]["rows"] if "phi_kv_gbps" in r}
        twin = {r["tokens"]: r for r in presets[preset.twin]["rows"] if "phi_kv_gbps" in r}
        for length in sorted(set(mine) & set(twin)):
            out.append({
                "preset": name, "twin": preset.twin, "tokens": length,
                "ratio": round(mine[length]["phi_kv_gbps"] / twin[length]["phi_kv_gbps"], 4),
                "paper_ratio": table3.paper_ratio(name, length, paper),
            })  # fmt: skip
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    deadline = time.monotonic() + args.budget_s

    def keep(presets: dict[str, dict[str, Any]]) -> None:
        if args.json:
            progress.write_json(args.json, report(args, device, presets))

    presets = measure_all(args.presets, args.size, args.lengths, device, args.reps, deadline,
                          keep)  # fmt: skip
    return report(args, device, presets)


def report(
    args: argparse.Namespace, device: torch.device, presets: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "size": args.size,
        "dims": vars(table3.DIMS[args.size]),
        "dtype": "bfloat16" if device.type == "cuda" else "float32",
        "reps": args.reps,
        "presets": presets,
        "ratios": ratios(presets),
        "label": "scaled-down random-weight models on one device; ratios compare with the "
        "paper's Table 3, absolute numbers do not",
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"Phi_kv on {report['device_name']} ({report['size']} size, {report['dtype']})")
    print(f"{'preset':15} {'tokens':>7} {'KV MB':>9} {'cache MB':>9} {'prefill ms':>11} "
          f"{'Gbps':>9}")  # fmt: skip
    for preset in report["presets"].values():
        if "error" in preset:
            print(f"{preset['preset']:15} error: {preset['error']}")
        for r in preset["rows"]:
            if "skipped" in r:
                print(f"{preset['preset']:15} {r['tokens']:7} skipped: {r['skipped']}")
                continue
            print(f"{preset['preset']:15} {r['tokens']:7} {r['kv_bytes'] / 1e6:9.2f} "
                  f"{r['cache_bytes'] / 1e6:9.2f} {r['prefill_ms']:11.2f} "
                  f"{r['phi_kv_gbps']:9.3f}")  # fmt: skip
    print(f"\n{'hybrid / dense twin':32} {'tokens':>7} {'ratio':>7} {'paper':>7}")
    for r in report["ratios"]:
        paper = "-" if r["paper_ratio"] is None else f"{r['paper_ratio']:.3f}"
        print(f"{r['preset'] + ' / ' + r['twin']:32} {r['tokens']:7} {r['ratio']:7.3f} {paper:>7}")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", choices=("gpu", "tiny"), default="gpu")
    p.add_argument(
        "--presets", nargs="+", choices=list(table3.PRESETS), default=list(table3.PRESETS)
    )
    p.add_argument("--lengths", nargs="+", type=int, default=list(GPU_LENGTHS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop adding lengths after this")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    report = run(args)
    print_table(report)
    if args.json:
        progress.write_json(args.json, report)
    failed = [p for p in report["presets"].values() if "error" in p]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
