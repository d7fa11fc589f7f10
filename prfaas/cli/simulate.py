"""`prfaas simulate`: the real Router and policies on a virtual clock against simulated
engines driven by a deployment profile. Every number it prints is SIMULATED."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prfaas.cli.extras import require_extra

if TYPE_CHECKING:
    from prfaas.loadgen.workload import Workload
    from prfaas.policies.profile import DeploymentProfile
    from prfaas.sim.deployments import Deployment, SimOptions

HELP = "Simulate a deployment profile on a virtual clock (real Router, simulated engines)."
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "paper_case_study.toml"
MIN_SEARCH_DURATION_S = 300.0  # find-max needs the system filled and a window to judge it
POLICY_DEPLOYMENT = {
    "prfaas": "prfaas_pd",
    "homogeneous": "homogeneous",
    "naive": "naive_heterogeneous",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help="deployment profile TOML (default: the paper's case study)",
    )
    a(
        "--policy",
        default="prfaas",
        help="prfaas | homogeneous | naive run their own deployment; any other policy "
        "(cache-aware, plug-ins) runs on the PrfaaS-PD instances",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--rate",
        type=float,
        help="Poisson arrivals, req/s (default: 90%% of the model's Lambda_max)",
    )
    mode.add_argument(
        "--find-max", action="store_true", help="bisect the highest sustained rate (lambda_max)"
    )
    mode.add_argument(
        "--table6", action="store_true", help="the paper's Table 6: paper vs model vs simulation"
    )
    mode.add_argument(
        "--scenario",
        metavar="NAME",
        help="dual-timescale scheduling scenario(s), comma-separated or 'all': "
        "bandwidth-drop, burst, length-shift, decode-heavy, diurnal, mooncake-2x; each run "
        "static, dual-timescale, oracle and oracle paying the drain",
    )
    a(
        "--duration",
        type=float,
        default=600.0,
        metavar="S",
        help="simulated seconds of arrivals (default 600)",
    )
    a(
        "--workload",
        default="lognormal",
        help="lognormal (the profile's lengths) | mooncake:PATH | shared-prefix | multi-turn",
    )
    a(
        "--speedup",
        type=float,
        default=1.0,
        help="mooncake without --rate: trace timestamps sped up by this",
    )
    a("--seed", type=int, default=0)
    a(
        "--json",
        nargs="?",
        const="-",
        metavar="OUT",
        help="print the JSON document (or write it to OUT)",
    )
    a("--plot", type=Path, metavar="DIR", help="write the load generator's PNG plots into DIR")
    sc = parser.add_argument_group("scenarios")
    sc.add_argument(
        "--variants",
        default="static,dual,oracle,oracle-drain",
        help="--scenario: which runs (default all four)",
    )
    sc.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="--scenario: multiply every phase's length (e.g. 0.1 for a quick look)",
    )
    sc.add_argument(
        "--period",
        type=float,
        default=60.0,
        metavar="S",
        help="--scenario: the long-term scheduling period (default 60 s)",
    )
    sc.add_argument("--trace", type=Path, help="--scenario mooncake-2x: the Mooncake trace")
    s = parser.add_argument_group("simulator")
    s.add_argument("--threshold", type=float, help="override the planner's threshold t (tokens)")
    s.add_argument(
        "--regime", default="bandwidth_scarce", choices=("bandwidth_scarce", "bandwidth_abundant")
    )
    s.add_argument("--egress-gbps", type=float, help="override the profile's cross-cluster link")
    s.add_argument(
        "--link-delay", type=float, default=0.005, metavar="S", help="one-way delay (default 5 ms)"
    )
    s.add_argument(
        "--partition-egress",
        action="store_true",
        help="give each PrfaaS instance a fixed 1/N of the link instead of fair sharing",
    )
    s.add_argument("--intra-gbps", type=float, default=800.0, help="PD-cluster RDMA (default 800)")
    s.add_argument(
        "--no-pipeline", action="store_true", help="ship KV after the prefill, not layer-wise"
    )
    s.add_argument(
        "--block-size",
        type=int,
        default=512,
        help="KV page size in tokens (default 512 = Mooncake hash block)",
    )
    s.add_argument(
        "--cache-blocks",
        type=int,
        default=32768,
        help="prefix-cache blocks per prefill instance (0: unbounded)",
    )


def _options(args: argparse.Namespace) -> SimOptions:
    from prfaas.sim.deployments import SimOptions

    return SimOptions(
        block_size=args.block_size,
        cache_blocks=args.cache_blocks or None,
        pipelined=not args.no_pipeline,
        link_delay_s=args.link_delay,
        intra_gbps=args.intra_gbps,
        egress_gbps=args.egress_gbps,
        partition_egress=args.partition_egress,
        threshold=args.threshold,
        regime=args.regime,
    )


def _workload(args: argparse.Namespace, profile: DeploymentProfile) -> Workload:
    from prfaas.loadgen.workloads import WorkloadOptions, create_workload
    from prfaas.loadgen.workloads.lengths import LogNormalLengths

    d = profile.workload.lengths
    inputs = LogNormalLengths(d.mu, d.sigma, round(d.lo), round(d.hi))
    options = WorkloadOptions(
        inputs=inputs,
        output_tokens=profile.workload.output_tokens if args.workload == "lognormal" else None,
        block_size=args.block_size,
        seed=args.seed,
    )
    return create_workload(args.workload, options)


def _deployment(
    args: argparse.Namespace, profile: DeploymentProfile, options: SimOptions
) -> tuple[Deployment, float]:
    """The deployment to simulate and the model's Lambda_max for it (exact costing)."""
    from prfaas.policies.planner import plan
    from prfaas.policies.registry import create_policy
    from prfaas.sim.deployments import deployments, with_policy
    from prfaas.sim.table6 import models_by_name

    create_policy(args.policy)  # unknown names fail here, listing the known ones
    name = POLICY_DEPLOYMENT.get(args.policy, "prfaas_pd")
    report = plan(profile)
    deps: dict[str, Deployment] = {
        str(k): v for k, v in deployments(profile, report, options).items()
    }
    if name not in deps:
        raise ValueError(
            f"{args.config}: the profile defines no {name} baseline for --policy {args.policy}"
        )
    model = models_by_name(plan(profile, exact=True))[name].lambda_max
    return with_policy(deps[name], args.policy), model


def run(args: argparse.Namespace) -> int:
    from prfaas.policies.profile import load_profile

    if args.plot is not None:  # before the run, not after it
        require_extra("plots", "--plot")
    try:
        profile = load_profile(args.config)
        options = _options(args)
        workload = _workload(args, profile)
        if (args.find_max or args.table6) and args.duration < MIN_SEARCH_DURATION_S:
            raise ValueError(
                f"--find-max/--table6 need --duration >= {MIN_SEARCH_DURATION_S:g} simulated "
                f"seconds to tell overload from warm-up, got {args.duration:g}"
            )
        if args.scenario:
            return _scenarios(args, profile, options)
        if args.table6:
            return _table6(args, profile, workload, options)
        return _single(args, profile, workload, options)
    except (ValueError, RuntimeError) as exc:  # ConfigError, TraceError are ValueErrors
        print(f"prfaas simulate: error: {exc}", file=sys.stderr)
        return 2


def _single(
    args: argparse.Namespace, profile: DeploymentProfile, workload: Workload, options: SimOptions
) -> int:
    from prfaas.loadgen.arrivals import RateArrivals, TraceArrivals
    from prfaas.sim.find_max import FindMaxOptions, find_max
    from prfaas.sim.report import print_table, run_json, run_table
    from prfaas.sim.runner import SimSpec, simulate

    deployment, model_max = _deployment(args, profile, options)
    trace = workload.has_timestamps and args.rate is None and not args.find_max
    arrivals = TraceArrivals(args.speedup) if trace else RateArrivals(args.rate or 0.9 * model_max)
    spec = SimSpec(deployment, workload, arrivals, args.duration, seed=args.seed)
    found = None
    if args.find_max:
        found = find_max(
            spec,
            lambda p: simulate(profile, p, options),
            FindMaxOptions(0.8 * model_max, 1.15 * model_max),
        )
        result = found.best
    else:
        result = simulate(profile, spec, options)
    _emit(args, run_json(result, found), lambda: print_table(run_table(result, found)))
    if args.plot is not None:
        from prfaas.loadgen.plots import write_plots

        for path in write_plots(result.records, args.plot, f"SIMULATED {deployment.name}"):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if result.metrics.completed else 1


def _table6(
    args: argparse.Namespace, profile: DeploymentProfile, workload: Workload, options: SimOptions
) -> int:
    from prfaas.sim.report import print_table, table6_table
    from prfaas.sim.table6 import Table6Options, run_table6

    t6 = run_table6(profile, workload, options, Table6Options(args.duration, args.seed))
    _emit(args, t6.to_json(), lambda: print_table(table6_table(t6)))
    return 0


def _scenarios(args: argparse.Namespace, profile: DeploymentProfile, options: SimOptions) -> int:
    from dataclasses import replace

    from rich.console import Console

    from prfaas.gateway.scheduling.config import SchedulerConfig
    from prfaas.sim.report import print_table
    from prfaas.sim.scenario_report import goal_table, phase_table, run_scenario
    from prfaas.sim.scenario_run import VARIANTS
    from prfaas.sim.scenarios import SCENARIOS, build_scenario

    names = SCENARIOS if args.scenario == "all" else tuple(args.scenario.split(","))
    variants = tuple(args.variants.split(","))
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    scheduler = replace(SchedulerConfig(), period_s=args.period)
    docs = []
    for name in names:
        scenario = build_scenario(name, profile, time_scale=args.time_scale, trace=args.trace)
        print(
            f"scenario {name}: {scenario.duration_s / 60:.0f} simulated minutes x "
            f"{len(variants)} runs ...",
            file=sys.stderr,
        )
        result = run_scenario(
            profile,
            scenario,
            scheduler=scheduler,
            options=options,
            variants=variants,
            seed=args.seed,
            on_run=lambda r: print(
                f"  {r.variant}: {len(r.records)} requests, {r.wall_s:.0f} s wall", file=sys.stderr
            ),
        )
        docs.append(result.to_json())
        if args.json != "-":
            wide = Console(width=max(Console().width, 160))
            print_table(phase_table(result), wide)
            if result.verdicts:
                print_table(goal_table(result), wide)
        if args.plot is not None:
            from prfaas.sim.scenario_plots import write_scenario_plots

            for path in write_scenario_plots(result, args.plot):
                print(f"wrote {path}", file=sys.stderr)
    doc: dict[str, Any] = {"simulated": True, "scenarios": docs}
    if args.json is not None:
        _emit(args, doc, lambda: None)
    return 0


def _emit(args: argparse.Namespace, doc: dict[str, Any], show: Callable[[], None]) -> None:
    import orjson

    if args.json != "-":
        show()
    if args.json is None:
        return
    data = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    if args.json == "-":
        sys.stdout.write(data.decode() + "\n")
    else:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(data)
        print(f"wrote {args.json}", file=sys.stderr)
