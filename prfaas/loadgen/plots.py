"""`--plot DIR`: TTFT CDF by route, throughput and latency over time, input lengths by route."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prfaas.loadgen.records import RequestRecord


def _by_route(records: Sequence[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.ok:
            groups[r.route or "all"].append(r)
    return dict(sorted(groups.items()))


def _input_len(r: RequestRecord) -> int:
    return r.prompt_tokens if r.prompt_tokens is not None else r.sent_tokens


def write_plots(records: Sequence[RequestRecord], out_dir: Path, title: str) -> list[Path]:
    """Write the three PNGs into `out_dir` (created); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    with plt.rc_context({"axes.titlesize": 9}):
        return _write_all(plt, records, out_dir, title)


def _write_all(plt: Any, records: Sequence[RequestRecord], out_dir: Path, title: str) -> list[Path]:
    groups = _by_route(records)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for route, rs in groups.items():
        ttft = np.sort([r.ttft_s for r in rs if r.ttft_s is not None])
        ax.step(ttft * 1e3, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=route)
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"TTFT CDF by route\n{title}")
    ax.legend(title="route")
    paths.append(_save(fig, out_dir / "ttft_cdf_by_route.png"))
    paths.append(_over_time(plt, records, out_dir / "throughput_latency_over_time.png", title))
    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = [[_input_len(r) for r in rs] for rs in groups.values()]
    if lengths:
        ax.hist(lengths, bins=40, stacked=True, label=list(groups))
        ax.legend(title="route")
    ax.set(xlabel="input tokens", ylabel="requests", title=f"Input length by route\n{title}")
    paths.append(_save(fig, out_dir / "input_length_by_route.png"))
    return paths


def _over_time(plt: Any, records: Sequence[RequestRecord], path: Path, title: str) -> Path:
    ok = [r for r in records if r.ok and r.end_s is not None]
    end = max((r.end_s or 0.0 for r in ok), default=1.0)
    width = max(end / 60, 0.1)
    edges = np.arange(0.0, end + width, width)
    done = np.array([r.end_s for r in ok])
    counts, _ = np.histogram(done, bins=edges)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(edges[:-1], counts / width)
    top.set(ylabel="completed req/s", title=f"Throughput and latency over time\n{title}")
    starts = np.array([r.start_s for r in ok])
    for name, values in (("TTFT", [r.ttft_s for r in ok]), ("E2E", [r.e2e_s for r in ok])):
        v = np.array(values, dtype=float) * 1e3
        idx = np.digitize(starts, edges) - 1
        med = [np.median(v[idx == i]) if np.any(idx == i) else np.nan for i in range(len(counts))]
        bottom.plot(edges[:-1], med, label=f"median {name}")
    bottom.set(xlabel="time since start (s)", ylabel="latency (ms), by send time")
    bottom.legend()
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
