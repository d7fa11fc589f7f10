"""`prfaas plan`: solve a deployment profile with the throughput model and print the result."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from prfaas.cli.extras import require_extra
from prfaas.policies.planner import DEFAULT_T_STEP, DeploymentResult, PlanReport, plan
from prfaas.policies.profile import load_profile

HELP = "Choose the routing threshold and prefill/decode split for a deployment profile."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="deployment profile (TOML)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write Figure 5 PNGs to DIR")
    parser.add_argument(
        "--exact-expectation",
        action="store_true",
        help="cost each class as E[T(L)|class] instead of the paper's T(E[L|class])",
    )
    parser.add_argument(
        "--t-step", type=int, default=DEFAULT_T_STEP, help="threshold grid step in tokens"
    )


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        require_extra("plots", "--plot")
    try:
        profile = load_profile(args.config)
        report = plan(profile, t_step=args.t_step, exact=args.exact_expectation)
    except ValueError as exc:  # ConfigError included
        print(f"prfaas plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2).decode())
        sys.stdout.write("\n")
    else:
        print(render(report, profile_name=profile.model.name))
    if args.plot is not None:
        from prfaas.cli.plan_plot import write_figure5  # matplotlib only when asked

        for path in write_figure5(report, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


_ROWS: list[tuple[str, str]] = [
    ("instances (PrfaaS / PD-P / PD-D)", "instances"),
    ("threshold t (tokens)", "threshold_tokens"),
    ("offloaded to PrfaaS, p", "p_offload"),
    ("l_long = E[L | L > t] (tokens)", "l_long"),
    ("l_short = E[L | L <= t] (tokens)", "l_short"),
    ("Theta_prfaas (req/s)", "theta_prfaas"),
    ("Theta_pd_p (req/s)", "theta_pd_p"),
    ("Theta_pd_d (req/s)", "theta_pd_d"),
    ("Lambda_max (req/s)", "lambda_max"),
    ("bottleneck", "bottleneck"),
    ("egress at Lambda_max (Gbps)", "egress_gbps"),
    ("link utilisation", "link_utilisation"),
]

_FORMATS = {
    "threshold_tokens": ",.0f",
    "l_long": ",.0f",
    "l_short": ",.0f",
    "p_offload": ".1%",
    "link_utilisation": ".1%",
    "egress_gbps": ".2f",
}


def _cell(result: DeploymentResult | None, key: str) -> str:
    if result is None:
        return "n/a"
    if key == "instances":
        return f"{result.n_prfaas} / {result.n_p} / {result.n_d}"
    if key == "bottleneck":
        return result.bottleneck
    value = result.link_utilisation if key == "link_utilisation" else getattr(result, key)
    return _fmt(value, _FORMATS.get(key, ".3f"))


def render(report: PlanReport, *, profile_name: str) -> str:
    """The terminal table: the three deployments side by side, then ratios and a mode note."""
    cols = [report.prfaas_pd, report.homogeneous, report.naive_heterogeneous]
    header = ["", "PrfaaS-PD", "homogeneous PD", "naive heterogeneous"]
    rows = [header] + [[label] + [_cell(c, key) for c in cols] for label, key in _ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"PrfaaS plan for {profile_name}", ""]
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        f"PrfaaS-PD vs homogeneous: {_fmt(report.ratio_vs_homogeneous, '.2f', 'x')}"
        f"   vs naive heterogeneous: {_fmt(report.ratio_vs_naive, '.2f', 'x')}",
        "",
    ]
    if report.exact_expectation:
        lines.append("Evaluation: exact expectation, each class costs E[T(L) | class].")
    else:
        lines.append(
            "Evaluation: representative lengths (the paper's), each class costs T(E[L | class]);"
            "\nprefill latency is convex in length, so this flatters throughput a little: "
            "compare --exact-expectation."
        )
    return "\n".join(lines)
