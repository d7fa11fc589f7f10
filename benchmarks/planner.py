"""Benchmark: wall time of one full plan (grid over t and N_p, both baselines).

Target: under 1 s on a 2-core machine. Prints a table and writes JSON with --json OUT.
Usage: python benchmarks/planner.py [--config FILE] [--repeats N] [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import orjson

from prfaas.policies.planner import plan, threshold_grid
from prfaas.policies.profile import load_profile

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "prfaas/examples/paper_case_study.toml"


def _time_plan(config: Path, *, exact: bool, repeats: int) -> list[float]:
    profile = load_profile(config)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan(profile, exact=exact)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, metavar="OUT")
    args = parser.parse_args()
    profile = load_profile(args.config)
    cells = threshold_grid(profile.workload.lengths).size * (profile.pd.instances - 1)
    rows = []
    for mode, exact in (("representative", False), ("exact_expectation", True)):
        times = _time_plan(args.config, exact=exact, repeats=args.repeats)
        rows.append(
            {
                "mode": mode,
                "grid_cells": cells,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "repeats": len(times),
            }
        )
    print(f"{'mode':<20}{'grid cells':>12}{'median ms':>12}{'min ms':>10}{'max ms':>10}")
    for r in rows:
        print(
            f"{r['mode']:<20}{r['grid_cells']:>12,}{r['median_s'] * 1e3:>12.2f}"
            f"{r['min_s'] * 1e3:>10.2f}{r['max_s'] * 1e3:>10.2f}"
        )
    print("target: one full plan < 1000 ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(
            orjson.dumps({"benchmark": "planner", "results": rows}, option=orjson.OPT_INDENT_2)
        )


if __name__ == "__main__":
    main()
