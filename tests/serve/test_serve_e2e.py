"""End to end: `prfaas serve` (embedded default: three reference engines as children, the
paced link, start-up profiling and the planner's `t`) through the official `openai` client.

Short prompts route pd, long uncached prompts route prfaas, a long prompt whose prefix the
PD cluster caches routes pd (the incremental rule, fed by the engines' real KV events), and
greedy outputs equal a direct aggregated (`--role both`) reference engine's. SIGTERM stops
the gateway and every child within seconds."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from metrics_helpers import Scrape
from serve_live_helpers import stop

from prfaas.common.tokenizer import ByteTokenizer, ChatMessage, chat_ids
from prfaas.policies.planner import plan
from prfaas.policies.profile import load_profile
from prfaas.serve.embedded import T_RANGE
from prfaas.testing.processes import child_pids

MODEL = "qwen3-next-tiny"
START_TIMEOUT_S = 240
LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
SUMMARY_END = re.compile(r"(Ctrl-C) stops")
ENGINE_READY = re.compile(r"prfaas engine ready: (http://\S+)")
ADMIN_KEY = "operator-key"


@dataclass
class Running:
    gateway: subprocess.Popen[str]
    direct: subprocess.Popen[str]
    gateway_url: str
    direct_url: str
    threshold: float
    output: list[str]
    profile: Path
    """Where `--profile-out` wrote the measured profile."""


def _wait_line(proc: subprocess.Popen[str], pattern: re.Pattern[str], seen: list[str]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited before ready:\n{''.join(seen)}")
        seen.append(line)
        if match := pattern.search(line):
            return match.group(1)
    raise AssertionError(f"not ready in {START_TIMEOUT_S}s:\n{''.join(seen)}")


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "prfaas.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    # t stays the planner's; the operator key lets a test pin the regime
    profile = tmp_path_factory.mktemp("serve") / "profile.toml"
    gateway = _spawn("serve", "--port", "0", "--no-scheduler", "--admin-key", ADMIN_KEY,
                     "--profile-out", str(profile))  # fmt: skip
    direct = _spawn("engine", "--role", "both", "--port", "0", "--threads", "1")
    seen: list[str] = []
    try:
        _wait_line(gateway, SUMMARY_END, seen)
        match = LISTENING.search("".join(seen))
        assert match is not None, seen
        url = match.group(1)
        direct_url = _wait_line(direct, ENGINE_READY, [])
        with urllib.request.urlopen(_admin(f"{url}/admin/state"), timeout=10) as reply:
            state = json.load(reply)
        yield Running(gateway, direct, url, direct_url, float(state["threshold"]), seen, profile)
    finally:
        for proc in (gateway, direct):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _admin(url: str) -> urllib.request.Request:
    """A GET of an admin route with the operator key (admin reads need it once one is set)."""
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def _words(n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    text = ""
    while len(text) < n_tokens:
        text += "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) + " "
    return text[:n_tokens]


def _gateway(r: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{r.gateway_url}/v1", api_key="x", max_retries=0, timeout=120)


def _direct_text(r: Running, ids: list[int], max_tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{r.direct_url}/v1", api_key="x", max_retries=0, timeout=120)
    done = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0)
    return done.choices[0].text


def test_summary_shows_planner_threshold(running: Running) -> None:
    """The start-up summary names the clusters, the link, the profile and the planner's t,
    and t leaves both routes in use for prompts of a few hundred to a few thousand tokens."""
    summary = "".join(running.output)
    for needle in ("prfaas-p0 (prefill)", "pd-d0 (decode)", "link ", "profile ", "planner "):
        assert needle in summary
    shared = re.search(r"sharing the cores: x([0-9.]+)", summary)
    assert shared is not None and float(shared.group(1)) >= 1.0, summary
    assert 256 <= running.threshold <= 4096
    measured = re.search(r"link ([0-9.]+) Mbit/s \(measured", summary)
    assert measured is not None, summary
    # probed over the PrfaaS prefill's transport, paced at the default 10 Mbit/s: a busy
    # machine can only slow it; the one-frame pacing burst lets it read a little high
    assert 5.0 <= float(measured.group(1)) <= 11.0


def test_the_measured_profile_is_written_for_the_planner_and_the_simulator(
    running: Running,
) -> None:
    """`--profile-out` writes what start-up measured in the `prfaas plan` format: the
    planner run on the file gives the gateway's `t`, on the measured link."""
    profile = load_profile(running.profile)
    summary = "".join(running.output)
    measured = re.search(r"link ([0-9.]+) Mbit/s \(measured", summary)
    assert measured is not None
    assert profile.prfaas.egress_gbps == pytest.approx(float(measured.group(1)) / 1000, rel=0.01)
    planned = plan(profile).prfaas_pd.threshold_tokens
    assert planned is not None and min(max(planned, T_RANGE[0]), T_RANGE[1]) == running.threshold
    shared = re.search(r"sharing the cores: x([0-9.]+)", summary)
    assert shared is not None and profile.machine is not None  # the twin simulates the machine
    assert profile.machine.shared_slowdown == pytest.approx(float(shared.group(1)), abs=0.006)


def test_a_recorded_profile_gives_the_same_t_without_profiling(running: Running) -> None:
    """`--profile` with what `--profile-out` wrote: nothing is measured at start-up, the
    planner gives the same `t`, and the schedulers run (on that profile)."""
    proc = _spawn("serve", "--port", "0", "--admin-key", ADMIN_KEY, "--profile",
                  str(running.profile))  # fmt: skip
    seen: list[str] = []
    try:
        _wait_line(proc, SUMMARY_END, seen)
        summary = "".join(seen)
        assert f"recorded: {running.profile}" in summary, summary
        assert "prefill latency (alone)" not in summary  # nothing measured
        assert "dual-timescale on the recorded profile" in summary
        match = LISTENING.search(summary)
        assert match is not None, summary
        with urllib.request.urlopen(_admin(f"{match.group(1)}/admin/state"), timeout=10) as r:
            state = json.load(r)
        assert float(state["threshold"]) == running.threshold
        assert state["scheduler"] is not None, state
    finally:
        stop(proc)


def test_short_prompt_routes_pd_and_matches_direct(running: Running) -> None:
    prompt = _words(120, seed=1)
    raw = _gateway(running).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0
    )
    assert raw.headers["x-prfaas-route"] == "pd"
    done = raw.parse()
    assert done.usage is not None and done.usage.completion_tokens == 12
    ids = ByteTokenizer().encode(prompt)
    assert done.choices[0].text == _direct_text(running, ids, 12)


def test_long_uncached_prompt_routes_prfaas_streaming_matches_direct(running: Running) -> None:
    """A prompt t+300 tokens long, nothing cached: computed in the PrfaaS cluster, its KV
    crosses the paced link to the PD decode engine, output equals the aggregated engine's."""
    prompt = _words(int(running.threshold) + 300, seed=2)
    with _gateway(running).completions.with_streaming_response.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True
    ) as response:
        assert response.headers["x-prfaas-route"] == "prfaas"
        assert int(response.headers["x-prfaas-incremental-tokens"]) == len(prompt)
        text = "".join(c.choices[0].text for c in response.parse())
    assert text == _direct_text(running, ByteTokenizer().encode(prompt), 10)


def _scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return Scrape.parse(reply.read().decode())


def _sent(scrape: Scrape) -> float:
    return scrape.value("prfaas_egress_bytes_sent", instance="prfaas-p0")


def test_prfaas_request_shows_egress_in_metrics_and_state(running: Running) -> None:
    """The PrfaaS prefill's own transport carries the KV (no relay): after a PrfaaS-routed
    request, the egress bytes its telemetry reports grow by more than a megabyte in
    `/metrics` and `/admin/state`, against the emulated link's capacity."""
    before = _sent(_scrape(running.gateway_url))
    raw = _gateway(running).completions.with_raw_response.create(
        model=MODEL, prompt=_words(int(running.threshold) + 200, seed=6), max_tokens=2
    )
    assert raw.headers["x-prfaas-route"] == "prfaas"
    deadline = time.monotonic() + 10
    while _sent(after := _scrape(running.gateway_url)) - before < 1e6:
        assert time.monotonic() < deadline, (before, _sent(after))
        time.sleep(0.2)  # telemetry is polled on the health cadence (1 s)
    assert 0 <= after.value("prfaas_egress_utilisation") <= 1.5
    with urllib.request.urlopen(_admin(f"{running.gateway_url}/admin/state"), timeout=10) as reply:
        link = json.load(reply)["link"]
    assert link["egress_bytes_total"] >= _sent(after)
    assert link["capacity_bytes_per_s"] == link["emulated_rate_bytes_per_s"] == 10e6 / 8
    assert "relay_port" not in link and link["rtt_s"] is not None


def test_long_prompt_with_prefix_cached_in_pd_routes_pd(running: Running) -> None:
    """Incremental rule: prompt A (< t) runs in PD and its blocks reach the KV index through
    the engine's KV events; A + extra (> t in total, but <= t uncached) then routes pd."""
    t = int(running.threshold)
    first = _words(t - 100, seed=3)
    extra = _words(min(400, t // 2), seed=4)
    client = _gateway(running)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=first, max_tokens=2)
    assert raw.headers["x-prfaas-route"] == "pd"
    time.sleep(0.5)  # KV events are asynchronous
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=first + extra, max_tokens=2, temperature=0
    )
    assert len(first + extra) > t
    assert raw.headers["x-prfaas-route"] == "pd"
    incremental = int(raw.headers["x-prfaas-incremental-tokens"])
    assert incremental <= t and incremental < len(first + extra)
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= len(first) // 64 * 64 - 64


def test_chat_streaming_and_not_match_direct(running: Running) -> None:
    """Chat (both modes) uses the byte-level chat template; output equals the direct engine's
    on the same template ids."""
    messages = [{"role": "user", "content": _words(200, seed=5)}]
    client = _gateway(running)
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    ids = chat_ids(ByteTokenizer(), [ChatMessage("user", messages[0]["content"])])
    assert whole.choices[0].message.content == streamed == _direct_text(running, ids, 8)


def _set_regime(url: str, regime: str) -> None:
    request = urllib.request.Request(
        f"{url}/admin/state",
        data=json.dumps({"regime": regime}).encode(),
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert json.load(reply)["regime"] == regime


def test_abundant_regime_pulls_the_prefix_across_clusters(running: Running) -> None:
    """Bandwidth-abundant regime, real engines: a long prompt computed in the PrfaaS cluster
    leaves its prefix cached there only. Sent again, its uncached remainder (against both
    clusters) is under t, so it routes pd, and the PD prefill pulls the prefix from the
    PrfaaS prefill over the KV transport (the paced link: the PrfaaS egress grows by the
    prefix's KV) instead of recomputing it; the answer is the same greedy text."""
    url = running.gateway_url
    prompt = _words(int(running.threshold) + 300, seed=8)
    client = _gateway(running)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0
    )
    assert raw.headers["x-prfaas-route"] == "prfaas"
    computed = raw.parse().choices[0].text
    _set_regime(url, "bandwidth_abundant")
    try:
        deadline = time.monotonic() + 10
        while True:  # the PrfaaS prefill's KV events reach the index asynchronously
            before = _sent(_scrape(url))
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0
            )
            if raw.headers["x-prfaas-route"] == "pd" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        _set_regime(url, "bandwidth_scarce")
    assert raw.headers["x-prfaas-route"] == "pd"
    assert int(raw.headers["x-prfaas-incremental-tokens"]) < 64 + 64
    done = raw.parse()
    assert done.choices[0].text == computed
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    pulled = done.usage.prompt_tokens_details.cached_tokens
    assert pulled >= len(prompt) // 64 * 64 - 64  # computed in PD: only the tail
    deadline = time.monotonic() + 10
    while _sent(after := _scrape(url)) - before < pulled * 1000:  # >1 KB of KV per token
        assert time.monotonic() < deadline, (before, _sent(after), pulled)
        time.sleep(0.2)
    assert after.value("prfaas_prefix_pulls_total", result="exported") >= 1


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(_admin(f"{url}/admin/state"), timeout=10) as reply:
        state: dict[str, Any] = json.load(reply)
    return state


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def test_a_killed_engine_comes_back_and_requests_survive(running: Running) -> None:
    """Finding 6: `kill -9` of the PD prefill. A request sent right away is retried on the
    PrfaaS prefill (200); the supervisor starts the engine again on its ports, the gateway
    readmits it within 30 s, counts the restart, and the restarted engine's KV events feed
    the index again (a prompt whose prefix it now caches routes pd)."""
    url = running.gateway_url
    victim = next(
        c for c in child_pids(running.gateway.pid)
        if "prefill" in _cmdline(c) and "--egress-rate-mbps" not in _cmdline(c)
    )  # fmt: skip
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    prompt = _words(100, seed=7)
    done = _gateway(running).completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0
    )
    assert done.choices[0].text == _direct_text(running, ByteTokenizer().encode(prompt), 4)

    def back() -> bool:
        pd = {i["id"]: i for i in _state(url)["clusters"]["pd"]}["pd-p0"]
        return pd["status"] == "healthy" and pd["ejections"] >= 1

    while not back():
        assert time.monotonic() - killed < 30, _state(url)
        time.sleep(0.25)
    assert victim not in child_pids(running.gateway.pid)
    assert _scrape(url).value("prfaas_engine_restarts_total", instance="pd-p0") == 1
    t = int(running.threshold)
    first, extra = _words(t - 100, seed=8), _words(min(400, t // 2), seed=9)
    client = _gateway(running)
    assert (
        client.completions.with_raw_response.create(
            model=MODEL, prompt=first, max_tokens=2
        ).headers["x-prfaas-route"]
        == "pd"
    )
    time.sleep(0.5)  # KV events are asynchronous
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=first + extra,
                                                      max_tokens=2)  # fmt: skip
    assert raw.headers["x-prfaas-route"] == "pd"
    assert int(raw.headers["x-prfaas-incremental-tokens"]) < len(first + extra)


def test_sigterm_stops_gateway_and_engines(running: Running) -> None:
    """SIGTERM: the gateway and its three engine children are gone within seconds."""
    pid = running.gateway.pid
    children = child_pids(pid)
    assert len(children) == 3
    start = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert running.gateway.wait(20) == 0
    assert time.monotonic() - start < 15
    assert not [c for c in children if Path(f"/proc/{c}").exists()]


def test_sigterm_during_startup_stops_thechild_pids() -> None:
    """SIGTERM while the engines are still loading: the started children are stopped too,
    and the gateway exits with a message instead of leaving orphans."""
    # t stays the planner's; the operator key lets a test pin the regime
    gateway = _spawn("serve", "--port", "0", "--no-scheduler", "--admin-key", ADMIN_KEY)
    try:
        deadline = time.monotonic() + 60
        while len(child_pids(gateway.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        children = child_pids(gateway.pid)
        assert len(children) == 3
        time.sleep(1.0)
        gateway.send_signal(signal.SIGTERM)
        out, _ = gateway.communicate(timeout=20)
    finally:
        if gateway.poll() is None:
            gateway.kill()
    assert gateway.returncode == 130, out
    assert "stopped during start-up" in out
    assert not [c for c in children if Path(f"/proc/{c}").exists()]
