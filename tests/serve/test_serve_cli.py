"""`prfaas serve --config FILE` as a real process over null engines: serves, answers bad
config with exit code 2 naming the key, and stops on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import tomli_w
from profiling_helpers import MEASURED_ALONE

from prfaas.common.ports import free_port
from prfaas.serve.profiling import Workload, profile_document

LISTENING = re.compile(r"listening on (http://\S+)")


def _null(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "prfaas.testing.null_server", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _config(path: Path, ports: list[int], extra: str = "") -> Path:
    path.write_text(
        f"""
[model]
name = "null"
block_size = 16
[gateway]
threshold = 50
{extra}
[[instances]]
id = "prfaas-p0"
cluster = "prfaas"
role = "prefill"
url = "http://127.0.0.1:{ports[0]}"
bootstrap_port = 8998
[[instances]]
id = "pd-p0"
cluster = "pd"
role = "prefill"
url = "http://127.0.0.1:{ports[1]}"
bootstrap_port = 8999
[[instances]]
id = "pd-d0"
cluster = "pd"
role = "decode"
url = "http://127.0.0.1:{ports[2]}"
"""
    )
    return path


def _post(url: str, body: dict[str, object]) -> tuple[str, dict[str, object]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "x"})
    with urllib.request.urlopen(req, timeout=10) as reply:
        return reply.headers["x-prfaas-route"], json.load(reply)


def test_serve_with_config_file(tmp_path: Path) -> None:
    ports = [free_port() for _ in range(3)]
    engines = [_null(p) for p in ports]
    gateway = subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", "serve", "--port", "0",
         "--config", str(_config(tmp_path / "d.toml", ports))],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for e in engines:
            assert e.stdout is not None and "listening" in e.stdout.readline()
        assert gateway.stdout is not None
        match = LISTENING.search(gateway.stdout.readline())
        assert match is not None
        url = match.group(1)
        short, _ = _post(f"{url}/v1/completions", {"model": "null", "prompt": "hi"})
        long, body = _post(f"{url}/v1/completions", {"model": "null", "prompt": "w" * 80})
        assert (short, long) == ("pd", "prfaas")
        assert body["usage"]["prompt_tokens"] == 80  # type: ignore[index]
        start = time.monotonic()
        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(10) == 0
        assert time.monotonic() - start < 5
    finally:
        for proc in [gateway, *engines]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = _config(tmp_path / "bad.toml", [1, 2, 3], extra="max_running = 0")
    done = subprocess.run(
        [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "bad.toml: gateway.max_running: must be >= 1 (got 0)" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(path.with_name("x"))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "prfaas serve: error" in done.stderr


def test_profile_out_without_a_profile_to_write_exits_2(tmp_path: Path) -> None:
    """Only the embedded default measures a profile, and `--threshold` skips that: asking
    for the file then is an error, not a flag silently ignored."""
    path = _config(tmp_path / "ok.toml", [1, 2, 3])
    out = str(tmp_path / "profile.toml")
    for extra in (["--config", str(path)], ["--threshold", "2048"]):
        done = subprocess.run(
            [sys.executable, "-m", "prfaas.cli.main", "serve", *extra, "--profile-out", out],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "prfaas serve: error: --profile-out: " in done.stderr
    assert not Path(out).exists()


def test_a_recorded_profile_is_checked_before_any_engine_starts(tmp_path: Path) -> None:
    """`--profile FILE` replaces start-up profiling: a bad file, a PD cluster of another size,
    `--threshold` or `--profile-out` beside it, or a deployment file (which names its own)
    exit 2 at once, naming what is wrong."""
    document = profile_document(MEASURED_ALONE, Workload(), pd_instances=2)
    good = tmp_path / "profile.toml"
    good.write_text(tomli_w.dumps(document))
    document["clusters"]["prfaas"]["instances"] = 2
    two_prfaas = tmp_path / "two-prfaas.toml"
    two_prfaas.write_text(tomli_w.dumps(document))
    bad = tmp_path / "bad.toml"
    bad.write_text("[workload]\nmu = 1\n")
    config = _config(tmp_path / "ok.toml", [1, 2, 3])
    cases = {
        (str(bad),): f"{bad}",
        (str(good), "--pd-decodes", "2"): "its PD cluster has 2 instances, this deployment 3",
        (str(two_prfaas),): "its PrfaaS cluster has 2 instances, this deployment 1",
        (str(good), "--threshold", "2048"): "--profile: a recorded profile replaces",
        (str(good), "--profile-out", str(tmp_path / "out.toml")): "--profile: a recorded",
        (str(good), "--config", str(config)): "--profile: a deployment file names its own",
    }
    for args, needle in cases.items():
        done = subprocess.run(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--profile", *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, (args, done.stderr)
        assert "prfaas serve: error: " in done.stderr and needle in done.stderr, done.stderr
        assert "starting" not in done.stdout  # no engine was started
