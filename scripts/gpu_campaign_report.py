#!/usr/bin/env python
"""The GPU campaign's JSON (`scripts/gpu_campaign.py`) as markdown: the stages' status, the
issue's targets checked against the measurements, and one table per stage. Re-render a
committed run (adding the paper's Table 3 ratios, which the GPU machine does not have):

    python scripts/gpu_campaign_report.py benchmarks/results/gpu/<run>.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]
DEFAULT_FRAME_KIB, DEFAULT_SWITCH_MS = 1024, 5.0
"""What a run from before the transport variants were recorded ran: the engine's defaults."""


def _result(report: Row, stage: str) -> Row | None:
    record = report["stages"].get(stage, {})
    result: Row | None = record.get("result")
    return result


def targets(report: Row) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each of the issue's GPU targets."""
    out: list[tuple[str, str, str]] = []
    check, overlap, pd = (_result(report, s) for s in ("device_check", "overlap", "pd"))

    def add(name: str, values: list[Any], measured: Callable[[list[Any]], str],
            ok: Callable[[list[Any]], bool]) -> None:  # fmt: skip
        if not values:
            out.append((name, "not measured", "-"))
        else:
            out.append((name, measured(values), "met" if ok(values) else "NOT met"))

    exact = [] if check is None else [check["bit_exact"]]
    exact += [] if overlap is None else [overlap["bit_exact"]]
    add("every transfer bit-exact", exact, lambda v: f"{sum(v)}/{len(v)} stages exact", all)
    equal = [] if pd is None else [r["greedy_equal"] for r in pd["rows"]]
    add("P/D greedy = aggregated", equal, lambda v: f"{sum(v)}/{len(v)} cases equal", all)
    for label, rows in _variants(overlap):
        add(f"per-layer copies slow the forward <= 3%{label}", [r["slowdown"] for r in rows],
            lambda v: f"max {max(v):.3f}x", lambda v: max(v) <= 1.03)  # fmt: skip
        share = [r["share_before_forward_end"] for r in rows if r["link_faster_than_production"]]
        add(f">= 90% of KV on the wire before the forward ends (link faster){label}", share,
            lambda v: f"min {min(v):.3f}", lambda v: min(v) >= 0.90)  # fmt: skip
    over_max = [] if pd is None else [r["layerwise_over_max"] for r in pd["rows"]]
    add("layer-wise TTFT <= 1.1 x max(prefill, transfer)", over_max,
        lambda v: f"max {max(v):.3f}x", lambda v: max(v) <= 1.1)  # fmt: skip
    over_after = [] if pd is None else [r["layerwise_over_send_after"] for r in pd["rows"]]
    add("layer-wise TTFT <= 0.7 x send-after", over_after,
        lambda v: f"max {max(v):.3f}x", lambda v: max(v) <= 0.7)  # fmt: skip
    return out


def _variants(overlap: Row | None) -> list[tuple[str, list[Row]]]:
    """The overlap stage's rows per transport variant (frame size, GIL switch interval, where
    the sender ran), labelled; one unlabelled group for a run from before it measured
    variants."""
    if overlap is None:
        return [("", [])]
    groups: dict[str, list[Row]] = {}
    for r in overlap["rows"]:
        label = (
            f" ({r['frame_kib']} KiB frames, GIL {r['gil_switch_ms']:g} ms{_where(r)})"
            if "frame_kib" in r
            else ""
        )
        groups.setdefault(label, []).append(r)
    return list(groups.items())


def _where(row: Row) -> str:
    """ ", sender process" where the transport's sender ran in its own process (runs before
    2026-12-07 had none)."""
    return ", sender process" if row.get("sender") == "process" else ""


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _device(report: Row) -> str:
    env = _result(report, "env")
    if env is None:
        return str(report["device"])
    dev = env["device"]
    name = str(dev.get("name", dev["requested"]))
    libs = env["libraries"]
    versions = ", ".join(
        f"{k} {libs[k].get('version', 'missing')}" for k in ("torch", "transformers", "fla")
    )
    driver = f", driver {dev['driver']}" if dev.get("driver") else ""
    return f"{name}{driver}; {versions}"


def render(report: Row) -> str:
    parts = [
        f"## GPU campaign: {_device(report)}",
        f"{report['started_utc']}, {report['seconds']} s of a {report['budget_s']:g} s budget"
        + (" (dry run: tiny sizes, not a measurement)" if report["dry_run"] else ""),
        _table(["stage", "status", "seconds"],
               [[n, s["status"], s.get("seconds", "-")] for n, s in report["stages"].items()]),
        "### Targets",
        _table(["target", "measured", "verdict"], [list(t) for t in targets(report)]),
    ]  # fmt: skip
    if (check := _result(report, "device_check")) is not None:
        rows = [[k, r["bit_exact"], r["forward_slowdown"], r["share_placed_before_forward_end"],
                 r["layer_latency_ms_p50"]] for k, r in check["results"].items()]  # fmt: skip
        parts += ["### Device check (synthetic forward)",
                  _table(["layout/mode", "exact", "slowdown", "placed before end", "layer p50 ms"],
                         rows)]  # fmt: skip
    if (overlap := _result(report, "overlap")) is not None:
        rows = [[r.get("frame_kib", DEFAULT_FRAME_KIB), r.get("gil_switch_ms", DEFAULT_SWITCH_MS),
                 r.get("sender", "loop"),
                 "max" if r["rate_gbps"] is None else r["rate_gbps"], r["tokens"],
                 round(r["kv_bytes"] / 1e6, 1), r["forward_alone_ms"], r["forward_shipping_ms"],
                 r["slowdown"], r["production_gbps"], r["share_before_forward_end"],
                 r.get("tail_after_forward_ms", "-"), r["bit_exact"]]
                for r in overlap["rows"]]  # fmt: skip
        parts += [f"### Layer-wise shipping in a real prefill ({overlap['model']})",
                  _table(["frame KiB", "GIL switch ms", "sender", "Gbps", "tokens", "KV MB",
                          "alone ms",
                          "shipping ms", "slowdown",
                          "production Gbps", "on wire before end", "last byte after end ms",
                          "exact"], rows)]  # fmt: skip
    if (pd := _result(report, "pd")) is not None:
        rows = [[r["rate_gbps"], r["tokens"], round(r["kv_bytes"] / 1e6, 1),
                 round(r["transfer_s"] * 1e3, 1), round(r["ttft_aggregated_s"] * 1e3, 1),
                 round(r["ttft_layerwise_s"] * 1e3, 1), round(r["ttft_send_after_s"] * 1e3, 1),
                 r["layerwise_over_max"], r["layerwise_over_send_after"], r["greedy_equal"]]
                for r in pd["rows"]]  # fmt: skip
        frames = (
            f"{pd.get('frame_kib', DEFAULT_FRAME_KIB)} KiB frames, "
            f"GIL {pd.get('gil_switch_ms', DEFAULT_SWITCH_MS):g} ms{_where(pd)}"
        )
        parts += [f"### P/D engine processes ({pd['model']}, {pd['delay_ms']:g} ms one way, "
                  f"{frames})",
                  _table(["Gbps", "tokens", "KV MB", "transfer ms", "aggregated TTFT ms",
                          "layer-wise ms", "send-after ms", "lw / max", "lw / after",
                          "greedy equal"], rows)]  # fmt: skip
    if (phi := _result(report, "phi_kv")) is not None:
        parts += _phi(phi)
    failed = {n: s for n, s in report["stages"].items() if s["status"] not in ("ok", "skipped")}
    for name, stage in failed.items():
        parts += [f"### {name}: {stage['status']}", "```", stage.get("output_tail", "")[-2500:],
                  "```"]  # fmt: skip
    return "\n\n".join(parts) + "\n"


def _paper_ratio(preset: str, tokens: int) -> float | str:
    """The paper's Table 3 ratio, where this checkout has the paper's data (a GPU machine
    does not: re-render there, see the module docstring)."""
    try:
        from prfaas.engines.reference.model import table3
    except ImportError:
        return "-"
    return table3.paper_ratio(preset, tokens, table3.paper_table3()) or "-"


def _phi(phi: Row) -> list[str]:
    rows = []
    for preset in phi["presets"].values():
        fallbacks = preset.get("fallbacks")
        kernels = "PyTorch fallbacks: " + ", ".join(fallbacks) if fallbacks else "no fallback"
        for r in preset["rows"]:
            if "phi_kv_gbps" in r:
                rows.append([preset["preset"], r["tokens"], round(r["kv_bytes"] / 1e6, 1),
                             r["prefill_ms"], r["phi_kv_gbps"],
                             f"{preset.get('attention', '?')}; {kernels}"])  # fmt: skip
            else:
                rows.append([preset["preset"], r["tokens"], "-", "-", "-", r.get("skipped")])
        if "error" in preset:
            rows.append([preset["preset"], "-", "-", "-", "-", preset["error"][:120]])
    ratios = [[f"{r['preset']} / {r['twin']}", r["tokens"], r["ratio"],
               r["paper_ratio"] or _paper_ratio(r["preset"], r["tokens"])]
              for r in phi["ratios"]]  # fmt: skip
    return [
        f"### Phi_kv ({phi['size']} presets, {phi['dtype']}: {phi['label']})",
        _table(["preset", "tokens", "KV MB", "prefill ms", "Phi_kv Gbps", "ran with"], rows),
        _table(["hybrid / dense twin", "tokens", "ratio", "paper Table 3 ratio"], ratios),
    ]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(render(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
