#!/usr/bin/env python
"""The GPU campaign: one command that measures the paper's core claims on one GPU and
writes one JSON, a markdown table and every stage's output (`logs.txt`) into an output
folder.

Stages, each a child process with its own time limit, so one that fails (an import, an
out-of-memory, a hang) records its error and the next one runs:
  env           the device, driver, torch, transformers, fla, what was carried
                (`benchmarks/gpu/environment.py`);
  device_check  the KV data path on the device, synthetic forward (`kv_device_check.py`);
  overlap       layer-wise shipping inside a real prefill: the forward's slowdown and the
                share of KV on the wire before it ends (`benchmarks/gpu/handoff_overlap.py`);
  pd            prefill, decode and aggregated engine processes on the device with a real
                model, paced links: greedy equality and TTFT layer-wise vs send-after vs
                aggregated (`benchmarks/gpu/pd_engines.py`);
  phi_kv        Phi_kv(l) for every Table 3 preset and the hybrid/dense ratios beside the
                paper's (`benchmarks/gpu/phi_kv.py`), in whatever time is left.

Wheels brought along (`scripts/gpu_wheels.py` fills `.cache/gpu-wheels`) are installed
offline into `.cache/gpu-site*` first and put ahead of the machine's own packages for every
stage (the `transformers` family separately: if the carried one cannot be imported there,
the machine's own is used and the campaign says so).

    python scripts/gpu_campaign.py                       # on the GPU machine, into $OUT
    python scripts/gpu_campaign.py --device cpu --dry-run --out /tmp/campaign   # CI
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".cache" / "gpu-wheels"
HF_FAMILY = ("transformers", "tokenizers", "safetensors", "huggingface_hub", "httpx2",
             "httpcore2", "regex", "anyio", "h11", "sniffio", "idna", "truststore")  # fmt: skip
"""Wheels installed apart, so the machine's own `transformers` can stand in for them."""
MATERIALISE = """import sys
from prfaas.engines.reference.model.presets import materialise, resolve
materialise(resolve(sys.argv[1]))  # the preset's weights, written once on the CPU
"""
RESERVE_S = 10.0
"""Time kept back from the last stage for writing the report."""


@dataclass(frozen=True)
class Stage:
    """One stage: its command (given the output file) and its longest run."""

    name: str
    argv: Callable[[Path, float], list[str]]
    """(JSON path, seconds it may take) -> command line."""
    limit_s: float
    needs_model: bool = False
    """It loads the engine preset (`model`): wait for its materialisation first."""


def model(dry: bool) -> str:
    """The engine preset the overlap and P/D stages run."""
    return "qwen3.5-tiny" if dry else "qwen3.5-gpu"


def stages(device: str, dry: bool, carried: Path) -> list[Stage]:
    """The campaign's stages in order, sized for one GPU or (dry) for a CPU check."""
    py = sys.executable
    gpu = REPO / "benchmarks" / "gpu"
    if dry:
        check = ["--tokens", "256", "--layers", "8", "--reps", "1", "--layouts", "sglang",
                 "--rate-gbps", "1"]  # fmt: skip
        overlap = ["--lengths", "128", "--rates-gbps", "1", "0", "--reps", "1"]
        pd = ["--lengths", "128", "--rates-gbps", "1", "--reps", "1"]
        phi = ["--size", "tiny", "--lengths", "64", "128", "--reps", "1"]
    else:  # on the H200 the 10 Gbit/s rows said what the 25 ones did, and 25 what unpaced did
        check, overlap, pd, phi = [], ["--rates-gbps", "25"], [], []
    overlap += ["--model", model(dry)]  # its three transport variants side by side
    # the engines' defaults ran in the first H200 run (2026-12-04); the sender process
    # (`--kv-sender process`) is what the overlap stage's second run (8192:0.5) pointed to
    pd += ["--model", model(dry), "--transport", "1024:0.5:process"]
    return [
        Stage("env", lambda out, _: [py, str(gpu / "environment.py"), "--device", device,
                                     "--carried", str(carried), "--json", str(out)], 60),
        Stage("device_check", lambda out, _: [py, str(REPO / "scripts" / "kv_device_check.py"),
                                              "--device", device.split(":")[0], *check,
                                              "--json", str(out)], 90),
        Stage("overlap", lambda out, _: [py, str(gpu / "handoff_overlap.py"), "--device", device,
                                         *overlap, "--json", str(out)], 180, needs_model=True),
        Stage("pd", lambda out, _: [py, str(gpu / "pd_engines.py"), "--device", device, *pd,
                                    "--json", str(out)], 200, needs_model=True),
        Stage("phi_kv", lambda out, left: [py, str(gpu / "phi_kv.py"), "--device", device, *phi,
                                           "--budget-s", f"{max(left - 30, 10):.0f}",
                                           "--json", str(out)], 600),
    ]  # fmt: skip


def install_carried(carried: Path, work: Path) -> tuple[list[Path], dict[str, Any]]:
    """Install the wheels in `carried` offline under `work`; the folders to put first on
    PYTHONPATH and what happened."""
    wheels = sorted(carried.glob("*.whl")) if carried.is_dir() else []
    if not wheels:
        return [], {"wheels": 0}
    hf = [w for w in wheels if w.name.split("-")[0].lower() in HF_FAMILY]
    rest = [w for w in wheels if w not in hf]
    report: dict[str, Any] = {"wheels": len(wheels)}
    paths = []
    for name, group in (("gpu-site", rest), ("gpu-site-hf", hf)):
        target = work / name
        if not group:
            continue
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
               "--upgrade", "--target", str(target), *map(str, group)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        report[name] = "ok" if done.returncode == 0 else done.stderr[-1500:]
        if done.returncode == 0:
            paths.append(target)
    hf_site = work / "gpu-site-hf"
    if hf_site in paths and not _imports(paths):
        paths.remove(hf_site)
        report["carried_transformers"] = "not importable here: the machine's own is used"
    return paths, report


def _imports(paths: list[Path]) -> bool:
    """Whether the engine and the Table 3 presets import with `paths` first."""
    probe = "import transformers, prfaas.engines.reference.model.table3"
    done = subprocess.run([sys.executable, "-c", probe], env=_env(paths), capture_output=True,
                          timeout=120, check=False)  # fmt: skip
    return done.returncode == 0


def _env(paths: list[Path]) -> dict[str, str]:
    entries = [*map(str, paths), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(e for e in entries if e),
        # Triton's autotuning results kept on disk, so a kernel one stage tuned (fla's, in
        # a first forward) is not tuned again by the next stage's process
        "TRITON_CACHE_AUTOTUNING": "1",
    }


def run_stage(
    stage: Stage, work: Path, logs: Path, env: dict[str, str], left_s: float
) -> dict[str, Any]:
    """Run one stage (its JSON written under `work`, its output appended to `logs`); its
    result, or its error, never raising."""
    limit = min(stage.limit_s, left_s)
    if limit < 5:
        return {"status": "skipped", "reason": "out of time"}
    json_path = work / f"{stage.name}.json"
    began = time.monotonic()
    try:
        done = subprocess.run(stage.argv(json_path, limit), env=env, capture_output=True,
                              text=True, timeout=limit, check=False, cwd=REPO)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        record: dict[str, Any] = {"status": "timeout", "limit_s": round(limit),
                                  "seconds": round(limit, 1)}  # fmt: skip
        stdout, stderr = _text(exc.stdout), _text(exc.stderr)
    else:
        record = {"status": "ok" if done.returncode == 0 else "failed",
                  "returncode": done.returncode,
                  "seconds": round(time.monotonic() - began, 1)}  # fmt: skip
        stdout, stderr = done.stdout, done.stderr
    with logs.open("a") as log:
        log.write(f"=== {stage.name} ===\n{stdout}\n--- stderr ---\n{stderr}\n")
    if json_path.is_file():  # a stage cut short may have written what it had
        try:
            record["result"] = json.loads(json_path.read_text())
        except ValueError as exc:
            record["result_error"] = f"unreadable {json_path.name}: {exc}"
    if record["status"] != "ok":
        record["output_tail"] = (stdout[-2000:] + "\n" + stderr[-4000:]).strip()
    return record


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def campaign(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    paths, installed = install_carried(args.carried, REPO / ".cache")
    env = _env(paths)
    report: dict[str, Any] = {
        "campaign": "gpu", "device": args.device, "dry_run": args.dry_run,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "budget_s": args.budget_s, "carried": installed, "stages": {},
    }  # fmt: skip
    chosen = [s for s in stages(args.device, args.dry_run, args.carried)
              if not args.stages or s.name in args.stages]  # fmt: skip
    # writing the preset's random weights takes about a minute for a GPU-sized one: done
    # beside the first stages, waited for before one that loads it
    making: subprocess.Popen[bytes] | None = None
    if any(s.needs_model for s in chosen):
        making = subprocess.Popen([sys.executable, "-c", MATERIALISE, model(args.dry_run)],
                                  env=env, cwd=REPO, stdout=subprocess.DEVNULL)  # fmt: skip
    # into `out`, three files (what a device run brings back is limited in number)
    logs = out / "logs.txt"
    logs.write_text("")
    with tempfile.TemporaryDirectory(prefix="prfaas-campaign-") as scratch, _reaped(making):
        work = Path(scratch)
        for stage in chosen:
            if stage.needs_model and making is not None:
                left = args.budget_s - (time.monotonic() - began) - RESERVE_S
                try:
                    report["materialise_rc"] = making.wait(timeout=max(left, 1))
                except subprocess.TimeoutExpired:
                    report["materialise_rc"] = "out of time"
                report["materialised_after_s"] = round(time.monotonic() - began, 1)
                making = None
            left = args.budget_s - (time.monotonic() - began) - RESERVE_S
            print(f"[campaign] {stage.name} (up to {min(stage.limit_s, left):.0f} s)", flush=True)
            report["stages"][stage.name] = result = run_stage(stage, work, logs, env, left)
            print(f"[campaign] {stage.name}: {result['status']} in {result.get('seconds', 0)} s",
                  flush=True)  # fmt: skip
    report["seconds"] = round(time.monotonic() - began, 1)
    return report


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen[bytes] | None) -> Iterator[None]:
    """`proc` killed if still running when the block ends (a campaign stopped early)."""
    try:
        yield
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables (one per stage that produced a result)."""
    sys.path[:0] = [str(REPO)]  # the renderer reads the paper's numbers through prfaas
    from gpu_campaign_report import render  # beside this script

    return render(report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu-campaign")))
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole campaign's time")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (a CPU check of the shape)")
    p.add_argument("--stages", nargs="+", help="run only these stages")
    p.add_argument("--carried", type=Path, default=WHEELS, help="wheels to install first")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    report = campaign(args)
    (args.out / "campaign.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "campaign.md").write_text(table)
    print(table)
    failed = [n for n, s in report["stages"].items() if s["status"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
