"""Benchmark: the CPU reference engine against a bare `transformers` forward of the same model.

Measures, in one process and side by side (the machine is shared and noisy; ratios of
interleaved runs and medians are what to read):
  1. prompt tokens/s: engine prefill (scheduler, prefix-cache lookup, block-aligned pieces,
     KV page writes, state snapshot) vs a bare `model(ids, use_cache=True)`; target overhead
     <= 15%;
  2. decode tokens/s at batch 1, 8 and 32 (continuous batching, steady state);
  3. second-turn TTFT of a multi-turn conversation with and without prefix reuse.
Engine numbers are taken at the engine core (no HTTP), so they measure the engine, not
aiohttp. Usage: python benchmarks/engine.py [--model PRESET] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import orjson
import torch

from prfaas.common.tokenizer import ByteTokenizer
from prfaas.engines.reference.engine_config import EngineConfig
from prfaas.engines.reference.model.presets import load_model, resolve
from prfaas.engines.reference.model.runner import ModelRunner
from prfaas.engines.reference.step.core import EngineCore
from prfaas.engines.reference.step.request import Request, TokenEvent
from prfaas.engines.reference.step.sampling import SamplingParams


def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 256, (n,), generator=gen)]


def new_core(runner: ModelRunner, max_batch: int = 32, piece: int = 1024) -> EngineCore:
    config = EngineConfig(
        max_batch=max_batch, kv_capacity_tokens=262144, block_size=64, max_prefill_tokens=piece
    )
    return EngineCore(runner, config, ByteTokenizer().decode)


def submit(core: EngineCore, rid: str, ids: list[int], n: int, sink: list[float]) -> None:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    def emit(event: TokenEvent) -> None:
        if not sink:
            sink.append(time.perf_counter())

    core.submit(Request(rid, ids, params, emit=emit))


class Collector:
    """An `emit` callback that keeps the tokens."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def __call__(self, event: TokenEvent) -> None:
        self.tokens.extend(event.token_ids)


def drain(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def bench_prefill(model: Any, runner: ModelRunner, length: int, repeats: int) -> dict[str, Any]:
    """Interleaved: bare forward, engine prefill with the default 1024-token pieces, and
    engine prefill in one piece (plus the tail before the last token), all fresh prompts."""
    chunked, whole = new_core(runner), new_core(runner, piece=1 << 20)
    bare: list[float] = []
    engine: dict[str, list[float]] = {"chunked": [], "whole": []}
    for i in range(repeats + 1):
        ids = prompt(100 + i, length)
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            bare_s = time.perf_counter() - start
        runs = {}
        for name, core in (("chunked", chunked), ("whole", whole)):
            start, first = time.perf_counter(), []
            submit(core, f"p{i}", ids, 1, first)
            drain(core)
            runs[name] = length / (first[0] - start)
        if i:  # the first round warms up
            bare.append(length / bare_s)
            for name, rate in runs.items():
                engine[name].append(rate)
    ratio = {
        k: statistics.median([e / b for e, b in zip(v, bare, strict=True)])
        for k, v in engine.items()
    }
    return {
        "prompt_tokens": length,
        "bare_tok_s": statistics.median(bare),
        "engine_tok_s": statistics.median(engine["chunked"]),
        "engine_one_piece_tok_s": statistics.median(engine["whole"]),
        "engine_over_bare": ratio["chunked"],
        "engine_one_piece_over_bare": ratio["whole"],
        "repeats": repeats,
    }


def bench_decode(runner: ModelRunner, batch: int, steps: int) -> dict[str, Any]:
    """Steady-state decode: all `batch` requests running, tokens per second of steps."""
    core = new_core(runner, max_batch=batch)
    # each admission takes two steps (pieces [0, 64) and [64, 128)) while the others decode
    budget = steps + 3 * batch + 8
    for i in range(batch):
        submit(core, f"d{i}", prompt(500 + i, 128), budget, [])
    for _ in range(3 * batch + 8):
        if len(core.running) == batch:
            break
        core.step()
    if len(core.running) != batch:
        raise RuntimeError(f"only {len(core.running)} of {batch} requests running")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"batch": batch, "median_step_ms": step_s * 1e3, "tok_s": batch / step_s, "steps": steps}


def bench_ttft(
    runner: ModelRunner, turn1: int, answer: int, new: int, repeats: int
) -> dict[str, Any]:
    """Turn 2 = turn-1 prompt + answer + new text; TTFT with the cache warm vs flushed."""
    core, warm, cold = new_core(runner), [], []
    for i in range(repeats + 1):
        first_ids, out = prompt(700 + i, turn1), Collector()
        params = SamplingParams(max_new_tokens=answer, temperature=0.0, ignore_eos=True)
        core.submit(Request(f"t1-{i}", first_ids, params, emit=out))
        drain(core)
        follow = first_ids + out.tokens + prompt(900 + i, new)
        for label, sink in (("warm", warm), ("cold", cold)):
            if label == "cold":
                core.request_flush()
                drain(core)
            start, first = time.perf_counter(), []
            submit(core, f"t2-{label}-{i}", follow, 1, first)
            drain(core)
            if i:
                sink.append(first[0] - start)
    w, c = statistics.median(warm), statistics.median(cold)
    return {
        "turn1_tokens": turn1,
        "answer_tokens": answer,
        "new_tokens": new,
        "ttft_reuse_ms": w * 1e3,
        "ttft_no_reuse_ms": c * 1e3,
        "speedup": c / w,
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-next-tiny")
    parser.add_argument("--model-cache", type=Path)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, metavar="OUT")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(resolve(args.model, args.model_cache))
    runner = ModelRunner(model)
    result = {
        "model": args.model,
        "threads": args.threads,
        "prefill": [bench_prefill(model, runner, n, args.repeats) for n in (512, 2048)],
        "decode": [bench_decode(runner, b, 12) for b in (1, 8, 32)],
        "second_turn_ttft": bench_ttft(runner, 2000, 32, 64, args.repeats),
    }
    print(render(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json}")


def render(r: dict[str, Any]) -> str:
    lines = [f"reference engine benchmark: {r['model']}, {r['threads']} thread(s); medians", ""]
    head = f"{'prompt':>8}{'bare tok/s':>12}{'engine tok/s':>14}{'engine/bare':>13}"
    lines.append(head + f"{'1-piece tok/s':>15}{'1-piece/bare':>14}")
    for p in r["prefill"]:
        lines.append(
            f"{p['prompt_tokens']:>8}{p['bare_tok_s']:>12,.0f}{p['engine_tok_s']:>14,.0f}"
            f"{p['engine_over_bare']:>13.3f}{p['engine_one_piece_tok_s']:>15,.0f}"
            f"{p['engine_one_piece_over_bare']:>14.3f}"
        )
    lines.append("engine: 1024-token pieces (default); 1-piece: the whole prompt in one forward")
    lines.append("target: engine overhead <= 15% (engine/bare >= 0.85)")
    lines += ["", f"{'batch':>8}{'step ms':>10}{'decode tok/s':>14}"]
    for d in r["decode"]:
        lines.append(f"{d['batch']:>8}{d['median_step_ms']:>10.1f}{d['tok_s']:>14,.0f}")
    t = r["second_turn_ttft"]
    lines += [
        "",
        f"second-turn TTFT ({t['turn1_tokens']}+{t['answer_tokens']}+{t['new_tokens']} "
        f"tokens): reuse {t['ttft_reuse_ms']:.1f} ms, no reuse {t['ttft_no_reuse_ms']:.1f} ms "
        f"({t['speedup']:.1f}x)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
