"""Several `prfaas serve` gateway processes over one set of reference engines started once,
coordinated through a real etcd: the engines, the deployment file every replica reads, the
replicas themselves (each its own process and port), and what a test asks of them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prfaas.examples
from prfaas.common.ports import free_port
from prfaas.common.secret import ENV_SECRET, DeploymentSecret
from prfaas.gateway.deployment import LaunchConfig
from prfaas.serve.processes import READY, EngineSpec

SECRET = DeploymentSecret.generate()
ENGINE_AUTH = {"Authorization": f"Bearer {SECRET.control_token()}"}
START_S = 60.0

LAUNCHES = (
    LaunchConfig("prfaas-p0", "prfaas", "prefill", egress_rate_mbps=10.0),
    LaunchConfig("pd-p0", "pd", "prefill"),
    LaunchConfig("pd-d0", "pd", "decode"),
    LaunchConfig("pd-d1", "pd", "decode"),
)
"""One PrfaaS prefill (its egress paced: the emulated link) and a PD cluster of one prefill
and two decodes (so the rebalancer can convert a decode)."""

PROFILE = (Path(prfaas.examples.__file__).parent / "reference_tiny_cpu.toml").read_text()
"""A planner profile for the tiny reference model on a CPU (made-up but plausible tables)."""


@dataclass
class Engine:
    """One `prfaas engine` process (started without an event loop, so a module's tests can
    share it)."""

    launch: LaunchConfig
    proc: subprocess.Popen[bytes]
    url: str
    bootstrap_port: int
    kv_events: str
    kv_events_replay: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engines(log_dir: Path) -> list[Engine]:
    """The `LAUNCHES` engines, holding `SECRET`, started together; ready when returned."""
    started = []
    for launch in LAUNCHES:
        events = f"tcp://127.0.0.1:{free_port()}"
        replay = f"tcp://127.0.0.1:{free_port()}"
        args = ("--kv-events", events, "--kv-events-replay", replay, *launch.engine_args())
        spec = EngineSpec(launch.id, launch.role, launch.model, 64, 1, None, extra_args=args)
        log = log_dir / f"{launch.id}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(spec.argv("127.0.0.1"), stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, ENV_SECRET: SECRET.hex()})  # fmt: skip
        started.append((launch, proc, log, events, replay))
    engines = []
    deadline = time.monotonic() + 180
    for launch, proc, log, events, replay in started:
        while (match := READY.search(log.read_bytes())) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                for _, p, *_ in started:
                    p.kill()
                raise AssertionError(f"engine {launch.id} did not start:\n{log.read_text()}")
            time.sleep(0.1)
        url, port = match.group(1).decode(), int(match.group(3))
        engines.append(Engine(launch, proc, url, port, events, replay))
    return engines


def write_deployment(
    folder: Path,
    engines: Sequence[Engine],
    *,
    etcd: str | None,
    prefix: str,
    period_s: float = 3.0,
    lease_ttl_s: float = 2.0,
    extra: str = "",
) -> Path:
    """The one deployment file every replica reads: the running engines as `[[instances]]`,
    the scheduler, and `[coordination]` at `etcd` (None: no coordination)."""
    (folder / "profile.toml").write_text(PROFILE)
    blocks = []
    for e in engines:
        la = e.launch
        blocks.append(
            f'[[instances]]\nid = "{la.id}"\ncluster = "{la.cluster}"\nrole = "{la.role}"\n'
            f'url = "{e.url}"\nbootstrap_port = {e.bootstrap_port}\nkv_events = "{e.kv_events}"\n'
            f'kv_events_replay = "{e.kv_events_replay}"\n'
        )
    coordination = (
        ""
        if etcd is None
        else f'[coordination]\netcd = "{etcd}"\nprefix = "{prefix}"\nlease_ttl_s = {lease_ttl_s}\n'
        "publish_s = 0.25\n"
    )
    path = folder / "deploy.toml"
    path.write_text(
        "[gateway]\nthreshold = 1024\n\n" + "\n".join(blocks)
        + f'\n[scheduler]\nprofile = "profile.toml"\nperiod_s = {period_s}\n'
        "[scheduler.estimate]\nmin_samples = 5.0\n"
        "[scheduler.rebalance]\nurgent_gain = inf\n" + extra + "\n" + coordination
    )  # fmt: skip
    return path


@dataclass
class Replica:
    """One `prfaas serve` process."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def state(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return get_json(f"{self.url}/admin/state", timeout_s=timeout_s)

    def coordination(self) -> dict[str, Any]:
        co: dict[str, Any] = self.state()["coordination"]
        return co

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples on `/metrics` that carry `labels`."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and line[len(name)] in " {" and all(w in line for w in wanted)
        )

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot exit
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def start_replica(config: Path, name: str, log_dir: Path, *args: str) -> Replica:
    """`prfaas serve --config CONFIG --replica-id NAME` on a free port, ready."""
    port = free_port()
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(config),
             "--port", str(port), "--replica-id", name, "--log-level", "INFO", *args],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, ENV_SECRET: SECRET.hex()},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"replica {name} exited:\n{log.read_text(errors='replace')}")
        if "Ctrl-C stops" in log.read_text(errors="replace"):
            return Replica(name, proc, url, log)
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"replica {name} not ready in {START_S} s:\n{log.read_text()[-3000:]}")


def get_json(url: str, headers: dict[str, str] | None = None, timeout_s: float = 5.0) -> Any:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.load(reply)


def post_json(
    url: str, body: Any, headers: dict[str, str] | None = None, timeout_s: float = 30.0
) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def leaders(replicas: Sequence[Replica]) -> list[str]:
    """The replicas that say they lead (asking each that answers)."""
    out = []
    for r in replicas:
        try:
            if r.coordination()["role"] == "leader":
                out.append(r.name)
        except (OSError, urllib.error.URLError):
            continue
    return out


def agreed_leader(replicas: Sequence[Replica], timeout_s: float = 20.0) -> tuple[str, int]:
    """Wait until exactly one replica leads and every one of `replicas` names it and the same
    epoch; (leader, epoch)."""

    def agreed() -> tuple[str, int] | None:
        views = [r.coordination() for r in replicas]
        named = {(v["leader"], v["epoch"]) for v in views}  # one pair: all agree
        leading = [v["replica"] for v in views if v["role"] == "leader"]
        if len(leading) == 1 and len(named) == 1 and views[0]["leader"] == leading[0]:
            return leading[0], int(views[0]["epoch"])
        return None

    found: tuple[str, int] = wait_for("one agreed leader", agreed, timeout_s)
    return found


def wait_for(what: str, check: Any, timeout_s: float, every_s: float = 0.05) -> Any:
    """Poll `check()` until it returns something truthy; its value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, urllib.error.URLError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


def reset_roles(engines: Sequence[Engine]) -> None:
    """Every engine back to its launch role, through its role API at the newest epoch it
    has seen (so no later leader is fenced out)."""
    for engine in engines:
        launch = engine.launch
        _, fence = post_json(f"{engine.url}/admin/fence", {"epoch": 0}, ENGINE_AUTH)
        status, body = post_json(
            f"{engine.url}/admin/role", {"role": launch.role, "epoch": fence["epoch"]}, ENGINE_AUTH
        )
        assert status == 200, body
