"""`prfaas bench`: drive a workload against a server (or, later, the simulator) and report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from prfaas.cli.extras import require_extra

if TYPE_CHECKING:
    from prfaas.loadgen.arrivals import Arrivals
    from prfaas.loadgen.spec import BenchSpec
    from prfaas.loadgen.stats import Slo
    from prfaas.loadgen.workload import Workload

HELP = "Benchmark an OpenAI-compatible endpoint with a workload; print a table, write JSON/plots."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--target", required=True, help="http(s)://HOST:PORT, or sim:CONFIG (simulator)")
    a(
        "--workload",
        default="lognormal",
        help="lognormal | mooncake:PATH | shared-prefix | multi-turn (default: lognormal)",
    )
    a("--api", default="completions", choices=("completions", "chat", "generate"))
    a("--model", help="model name for OpenAI APIs (default: the server's first /v1/models)")
    _arrival_arguments(parser)
    _workload_arguments(parser.add_argument_group("workload shape"))
    _output_arguments(parser.add_argument_group("run and output"))


def _arrival_arguments(parser: argparse.ArgumentParser) -> None:
    arr = parser.add_argument_group(
        "arrivals (default: trace timestamps for mooncake, else closed loop at concurrency 1)"
    )
    arr.add_argument("--rate", type=float, help="open loop, mean req/s (inf: all at once)")
    arr.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps with --rate (1 Poisson, <1 burstier)",
    )
    arr.add_argument("--concurrency", type=int, help="closed loop with this many in flight")
    arr.add_argument("--speedup", type=float, default=1.0, help="trace replay speed-up factor")
    stop = parser.add_argument_group("stopping (default: 100 requests)")
    stop.add_argument("--num-requests", type=int, help="requests (turns) to send")
    stop.add_argument("--duration", type=float, metavar="S", help="seconds to keep sending")


def _workload_arguments(w: argparse._ArgumentGroup) -> None:
    w.add_argument("--input-mu", type=float, default=9.90, help="lognormal: mean of ln L")
    w.add_argument("--input-sigma", type=float, default=1.00, help="lognormal: sd of ln L")
    w.add_argument("--input-min", type=int, default=128, help="lognormal: shortest input")
    w.add_argument("--input-max", type=int, default=131072, help="lognormal: longest input")
    w.add_argument(
        "--output-len",
        type=int,
        help="output tokens (default: 1024 lognormal, 256 others, trace's own)",
    )
    w.add_argument(
        "--output-range-ratio",
        type=float,
        default=0.0,
        help="output lengths uniform in +-ratio around --output-len",
    )
    w.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups")
    w.add_argument("--system-len", type=int, default=2048, help="shared-prefix: prefix tokens")
    w.add_argument("--question-len", type=int, default=256, help="shared-prefix: question")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--first-len", type=int, default=1024, help="multi-turn: first prompt")
    w.add_argument("--turn-len", type=int, default=256, help="multi-turn: each new turn")
    w.add_argument("--think-time", type=float, default=1.0, help="multi-turn: mean seconds")
    w.add_argument(
        "--vocab-size",
        type=int,
        default=10_000,
        help="token ids stay in [100, this); at most the model's vocabulary (260 for the "
        "reference engine's byte-level tiny model)",
    )


def _output_arguments(o: argparse._ArgumentGroup) -> None:
    o.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    o.add_argument("--timeout", type=float, default=600.0, help="per-request seconds")
    o.add_argument("--slo", help="goodput objectives, e.g. ttft=2s,tpot=50ms")
    o.add_argument("--json", type=Path, metavar="OUT", help="write summary + records as JSON")
    o.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots into DIR")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _arrivals(args: argparse.Namespace, trace: bool) -> Arrivals:
    from prfaas.loadgen.arrivals import ClosedLoop, RateArrivals, TraceArrivals

    if args.rate is not None and args.concurrency is not None:
        raise ValueError("give --rate or --concurrency, not both")
    if args.speedup != 1.0 and (args.rate is not None or args.concurrency is not None):
        raise ValueError("--speedup replays trace timestamps; drop it with --rate/--concurrency")
    if args.rate is not None:
        return RateArrivals(args.rate, args.burstiness)
    if args.burstiness != 1.0:
        raise ValueError("--burstiness shapes --rate arrivals; give --rate too")
    if args.concurrency is not None:
        return ClosedLoop(args.concurrency)
    if trace:
        return TraceArrivals(args.speedup)
    if args.speedup != 1.0:
        raise ValueError("--speedup replays trace timestamps; use it with mooncake:PATH")
    return ClosedLoop(1)


def _workload(args: argparse.Namespace) -> Workload:
    from prfaas.loadgen.tokens import TokenSpace
    from prfaas.loadgen.workloads import WorkloadOptions, create_workload
    from prfaas.loadgen.workloads.lengths import LogNormalLengths

    inputs = LogNormalLengths(args.input_mu, args.input_sigma, args.input_min, args.input_max)
    options = WorkloadOptions(
        inputs=inputs,
        output_tokens=args.output_len,
        output_range_ratio=args.output_range_ratio,
        space=TokenSpace(args.vocab_size),
        num_groups=args.num_groups,
        system_len=args.system_len,
        question_len=args.question_len,
        turns=args.turns,
        first_len=args.first_len,
        turn_len=args.turn_len,
        think_time_s=args.think_time,
        seed=args.seed,
    )
    return create_workload(args.workload, options)


def _spec(args: argparse.Namespace) -> BenchSpec:
    from prfaas.loadgen.spec import BenchSpec

    workload = _workload(args)
    count = args.num_requests
    if count is None and args.duration is None:
        count = 100
    arrivals = _arrivals(args, workload.has_timestamps)
    return BenchSpec(workload, arrivals, count, args.duration, args.seed)


def _header(args: argparse.Namespace, spec: BenchSpec, slo: Slo | None) -> dict[str, str]:
    limits = [
        f"{spec.num_requests} requests" if spec.num_requests else "",
        f"{spec.duration_s:g} s" if spec.duration_s else "",
    ]
    return {
        "target": args.target,
        "api": args.api,
        "workload": spec.workload.name,
        "arrivals": spec.arrivals.describe(),
        "stop after": " or ".join(filter(None, limits)),
        "seed": str(spec.seed),
        "SLO": slo.describe() if slo else "none",
    }


def run(args: argparse.Namespace) -> int:
    from prfaas.common.event_loop import run_main
    from prfaas.loadgen.progress import RichProgress
    from prfaas.loadgen.report import print_report, report_json, write_json
    from prfaas.loadgen.spec import BenchRunner, NoProgress, TargetError
    from prfaas.loadgen.stats import Slo, summarize
    from prfaas.loadgen.targets import HttpOptions, HttpRunner
    from prfaas.sim.bench_target import SIM_PREFIX, SimBenchRunner

    if args.plot is not None:  # before the run, not after it
        require_extra("plots", "--plot")
    try:
        slo = Slo.parse(args.slo) if args.slo else None
        spec = _spec(args)
        runner: BenchRunner
        if args.target.startswith(SIM_PREFIX):  # the simulator, on a virtual clock
            runner = SimBenchRunner.from_target(args.target)
        else:
            runner = HttpRunner(args.target, HttpOptions(args.api, args.model, args.timeout))
        progress = NoProgress() if args.no_progress else RichProgress()
        result = run_main(runner.run(spec, progress))
    except (ValueError, TargetError) as exc:  # TraceError is a ValueError
        print(f"prfaas bench: error: {exc}", file=sys.stderr)
        return 2
    summary = summarize(result.records, result.duration_s, slo)
    header = _header(args, spec, slo)
    print_report(result, summary, header)
    if args.json is not None:
        write_json(args.json, report_json(result, summary, header, slo))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None:
        from prfaas.loadgen.plots import write_plots

        for path in write_plots(result.records, args.plot, spec.workload.name):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if summary.completed else 1
