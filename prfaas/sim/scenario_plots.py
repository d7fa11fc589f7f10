"""`prfaas simulate --scenario NAME --plot DIR`: the threshold, the PD split, egress and
TTFT over time, one line per variant, phase boundaries marked. Labelled SIMULATED."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from prfaas.sim.scenario_report import ScenarioResult
from prfaas.sim.scenario_run import VariantRun

TTFT_BIN_S = 30.0


def write_scenario_plots(result: ScenarioResult, out_dir: Path) -> list[Path]:
    """One PNG of four panels per scenario; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for run in result.runs:
        _plot_run(axes, run)
    s = result.scenario
    for ax in axes:
        for phase in s.phases[1:]:
            ax.axvline(phase.start_s / 60, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="threshold t (tokens)")
    axes[1].set(ylabel="PD prefill instances")
    axes[2].set(ylabel="egress (Gbps)")
    axes[3].set(ylabel=f"TTFT P90 per {TTFT_BIN_S:.0f} s (s)", xlabel="time (min)")
    axes[3].set_yscale("log")
    axes[0].legend(fontsize=8, ncol=4)
    fig.suptitle(f"SIMULATED scenario {s.name}: {s.description}", fontsize=10)
    fig.tight_layout()
    path = out_dir / f"scenario_{s.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _plot_run(axes: Any, run: VariantRun) -> None:
    t = np.array([p.at for p in run.timeline]) / 60
    axes[0].step(t, [p.threshold for p in run.timeline], where="post", label=run.variant)
    axes[1].step(t, [p.n_prefill for p in run.timeline], where="post", label=run.variant)
    axes[2].plot(t, [p.egress_gbps for p in run.timeline], linewidth=0.8, label=run.variant)
    if run.variant == "static":
        axes[2].plot(t, [p.link_gbps for p in run.timeline], "k--", linewidth=0.8, label="link")
    starts = np.array([r.scheduled_s for r in run.records if r.ok and r.ttft_s is not None])
    ttft = np.array([r.ttft_s for r in run.records if r.ok and r.ttft_s is not None])
    if starts.size:
        bins = np.floor(starts / TTFT_BIN_S).astype(int)
        xs, ys = [], []
        for b in np.unique(bins):
            xs.append((b + 0.5) * TTFT_BIN_S / 60)
            ys.append(float(np.percentile(ttft[bins == b], 90)))
        axes[3].plot(xs, ys, linewidth=0.9, label=run.variant)
