"""Without the `engine` and `plots` extras (torch, transformers and matplotlib made
unimportable in a child process), the gateway, planner, load generator and simulator import
and run; a command that needs a missing extra exits 2 with the pip line that installs it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from prfaas.cli.extras import EXTRAS

EXTRA_MODULES = frozenset(m for modules in EXTRAS.values() for m in modules)
# Modules that are the extras' own code: the reference engine, the planner's Figure 5.
EXTRA_ONLY = (
    "prfaas.engines.reference.",
    "prfaas.cli.plan_plot",
    # run inside SGLang (its own environment); the package itself imports without it
    "prfaas.engines.sglang.",
    # run inside vLLM (its own environment); launch.py and the client need no vLLM
    "prfaas.engines.vllm.connector",
    "prfaas.engines.vllm.metadata",
    "prfaas.engines.vllm.scheduler_side",
    "prfaas.engines.vllm.worker_side",
    "prfaas.engines.vllm.bench_client",
    # the device-aware page mover runs inside engines (torch); the rest of kv_pages does not
    "prfaas.engines.kv_pages.torch_pool",
    "prfaas.engines.kv_pages.device_copy",
    "prfaas.engines.kv_pages.staging",
)
LISTENING = re.compile(r"listening on (http://\S+)")

# A meta-path finder that makes the blocked top-level modules raise ModuleNotFoundError, as
# if they were not installed.
_BLOCKER = """
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""


def _python(code: str, blocked: frozenset[str] = EXTRA_MODULES) -> list[str]:
    """argv of a Python child that cannot import `blocked`, then runs `code`."""
    return [sys.executable, "-c", _BLOCKER.format(blocked=set(blocked)) + code]


def _prfaas(*argv: str, blocked: frozenset[str] = EXTRA_MODULES) -> list[str]:
    main = f"from prfaas.cli.main import main\nraise SystemExit(main({list(argv)!r}))\n"
    return _python(main, blocked)


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_every_module_but_the_extras_own_imports_without_them() -> None:
    """Walking the whole package imports every module outside the reference engine and
    the Figure 5 plot, and none of them pulls torch, transformers or matplotlib."""
    code = f"""
import importlib, pkgutil, prfaas
names = [m.name for m in pkgutil.walk_packages(prfaas.__path__, "prfaas.")]
for name in names:
    if not name.startswith({EXTRA_ONLY!r}):
        importlib.import_module(name)
print("\\n".join(sorted(sys.modules)))
"""
    done = _run(_python(code))
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert not {m.partition(".")[0] for m in loaded} & EXTRA_MODULES
    assert {
        "prfaas.gateway.api.assembly",
        "prfaas.gateway.api.completions",
        "prfaas.http.server",
        "prfaas.protocol.generate",
        "prfaas.policies.planner",
        "prfaas.gateway.deployment",
        "prfaas.serve.launched",
        "prfaas.loadgen.driver",
        "prfaas.loadgen.plots",
        "prfaas.sim.runner",
        "prfaas.engine_clients.sglang",
        "prfaas.engines.transport.sender",
        "prfaas.cli.main",
    } <= loaded


def test_plan_simulate_and_bench_run_without_the_extras(
    case_study_path: Path, tmp_path: Path
) -> None:
    """The planner, the simulator and the load generator (against `sim:`) give their
    results; bench also runs without uvloop (asyncio's loop instead)."""
    case = str(case_study_path)
    plan = _run(_prfaas("plan", "--config", case, "--json"))
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["prfaas_pd"]["n_prfaas"] == 4
    sim = _run(_prfaas("simulate", "--config", case, "--rate", "1", "--duration", "30", "--json"))
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["simulated"] is True
    out = tmp_path / "bench.json"
    argv = ["bench", "--target", f"sim:{case}", "--num-requests", "10", "--rate", "2"]
    bench = _run(
        _prfaas(*argv, "--no-progress", "--json", str(out), blocked=EXTRA_MODULES | {"uvloop"})
    )
    assert bench.returncode == 0, bench.stderr
    assert json.loads(out.read_text())["summary"]["completed"] == 10


def test_gateway_serves_a_deployment_file_without_the_extras(
    null_process: str, tmp_path: Path
) -> None:
    """`prfaas serve --config` routes a completion over a running engine and stops on
    SIGTERM, with torch, transformers and matplotlib unimportable."""
    config = tmp_path / "d.toml"
    config.write_text(
        f"""
[model]
name = "null"
block_size = 16
[[instances]]
id = "pd-p0"
cluster = "pd"
role = "prefill"
url = "{null_process}"
bootstrap_port = 8999
[[instances]]
id = "pd-d0"
cluster = "pd"
role = "decode"
url = "{null_process}"
"""
    )
    argv = _prfaas("serve", "--port", "0", "--config", str(config))
    gateway = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert gateway.stdout is not None
        match = LISTENING.search(gateway.stdout.readline())
        assert match is not None, gateway.stderr.read() if gateway.stderr else ""
        body = json.dumps({"model": "null", "prompt": "hi", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"{match.group(1)}/v1/completions", body)
        with urllib.request.urlopen(req, timeout=10) as reply:
            assert reply.headers["x-prfaas-route"] == "pd"
            assert json.load(reply)["usage"]["completion_tokens"] == 3
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(10) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["engine"], "engine"),
        (["serve"], "engine"),
        (["plan", "--plot", "{out}"], "plots"),
        (["simulate", "--duration", "10", "--plot", "{out}"], "plots"),
        (["bench", "--target", "sim:{case}", "--plot", "{out}"], "plots"),
    ],
)
def test_command_needing_a_missing_extra_says_how_to_install_it(
    argv: list[str], extra: str, case_study_path: Path, tmp_path: Path
) -> None:
    """One line on stderr naming the pip command, exit code 2, no traceback, and nothing
    run or written first."""
    out = tmp_path / "plots"
    argv = [a.format(out=out, case=case_study_path) for a in argv]
    if argv[0] in ("plan", "simulate"):
        argv += ["--config", str(case_study_path)]
    done = _run(_prfaas(*argv))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"prfaas {argv[0]}: error: ")
    assert f"needs the '{extra}' extra" in done.stderr
    assert f"pip install 'prfaas[{extra}]'" in done.stderr
    assert done.stdout == "" and not out.exists()
