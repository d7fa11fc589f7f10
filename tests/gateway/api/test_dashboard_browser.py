"""The live dashboard in a real browser: Debian's `chromium`, headless, driven by Playwright,
against a running `prfaas serve --config` over three real reference engines (a PrfaaS
prefill with a paced KV egress, a PD prefill, a PD decode), started as separate processes so
the test can stop one. Also the Grafana dashboard against a real scrape of that gateway.

The tests share one deployment and run in file order: the last two stop parts of it (an
engine, then the gateway). `make test` installs chromium and Playwright's driver (never a
browser download); screenshots land in each test's tmp_path and their paths are printed.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from grafana_helpers import dashboard, metric_names, panels, queried
from metrics_helpers import Scrape
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from prfaas.common.ports import free_port
from prfaas.serve.processes import READY, EngineSpec

CHROMIUM = os.environ.get("PRFAAS_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
MODEL, BLOCK, THRESHOLD = "qwen3-next-tiny", 16, 64
LISTENING = re.compile(r"PrfaaS gateway listening on (http://\S+)")
START_TIMEOUT_S = 180
DESKTOP = {"width": 1440, "height": 900}
PHONE = {"width": 390, "height": 844}
ENGINES = (  # id, cluster, role, extra engine flags
    ("prfaas-p0", "prfaas", "prefill", ("--egress-rate-mbps", "20", "--transfer-chunk-kib", "64")),
    ("pd-p0", "pd", "prefill", ()),
    ("pd-d0", "pd", "decode", ()),
)

pytestmark = pytest.mark.timeout(420)


@dataclass
class Served:
    url: str
    gateway: subprocess.Popen[str]
    engines: dict[str, subprocess.Popen[bytes]]
    summary: str
    console: list[str] = field(default_factory=list)
    """Console errors and uncaught exceptions of every page the tests opened."""


def _line(proc: subprocess.Popen[Any], pattern: re.Pattern[Any], seen: list[Any]) -> re.Match[Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited before it was ready: {seen!r}")
        seen.append(line)
        if match := pattern.search(line):
            return match
    raise AssertionError(f"not ready in {START_TIMEOUT_S}s: {seen!r}")


def _config(path: Path, ready: dict[str, re.Match[bytes]], events: dict[str, int]) -> Path:
    text = f'[model]\nname = "{MODEL}"\nblock_size = {BLOCK}\n'
    text += f"[gateway]\nthreshold = {THRESHOLD}\nhealth_interval_s = 0.5\n"
    for name, cluster, role, _ in ENGINES:
        url, bootstrap = ready[name].group(1).decode(), ready[name].group(3).decode()
        text += f'[[instances]]\nid = "{name}"\ncluster = "{cluster}"\nrole = "{role}"\n'
        text += f'url = "{url}"\nkv_events = "tcp://127.0.0.1:{events[name]}"\n'
        text += f"bootstrap_port = {bootstrap}\n" if role != "decode" else ""
    path.write_text(text)
    return path


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("dashboard")
    engines: dict[str, subprocess.Popen[bytes]] = {}
    events = {name: free_port() for name, *_ in ENGINES}
    gateway: subprocess.Popen[str] | None = None
    try:
        for name, _, role, extra in ENGINES:
            spec = EngineSpec(name, role, MODEL, BLOCK, 1, events[name], extra)
            log = (folder / f"{name}.log").open("wb")
            engines[name] = subprocess.Popen(spec.argv("127.0.0.1"), stdout=subprocess.PIPE,
                                             stderr=log)  # fmt: skip
        ready = {name: _line(proc, READY, []) for name, proc in engines.items()}
        config = _config(folder / "deploy.toml", ready, events)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "prfaas.cli.main", "serve", "--config", str(config),
             "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        seen: list[str] = []
        _line(gateway, re.compile("Ctrl-C stops"), seen)
        summary = "".join(seen)
        match = LISTENING.search(summary)
        assert match is not None, summary
        yield Served(match.group(1), gateway, engines, summary)
    finally:
        for proc in [*([gateway] if gateway else []), *engines.values()]:
            _stop(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: `make test` installs chromium"
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _open(browser: Browser, served: Served, **context: Any) -> Page:
    page = browser.new_context(**context).new_page()

    def console(msg: ConsoleMessage) -> None:
        if msg.type == "error":
            served.console.append(f"{msg.text} ({msg.location})")

    page.on("console", console)
    page.on("pageerror", lambda exc: served.console.append(f"uncaught: {exc}"))
    page.goto(f"{served.url}/dashboard")
    _wait(page, "() => document.body.dataset.status === 'live'")
    return page


@pytest.fixture(scope="module")
def page(browser: Browser, served: Served) -> Page:
    """The desktop-sized page every test watches (it keeps polling between tests)."""
    return _open(browser, served, viewport=DESKTOP)


def _wait(page: Page, predicate: str, arg: Any = None, timeout_ms: float = 20_000) -> None:
    """Wait for a JS function of `arg` to hold (a function, not an expression: the page's
    CSP forbids evaluating strings, and Playwright would eval an expression)."""
    try:
        page.wait_for_function(predicate, arg=arg, timeout=timeout_ms)
    except PlaywrightTimeout:
        shown = page.evaluate(
            "() => [document.body.dataset.status, document.body.dataset.polls, "
            "document.getElementById('total-pd').textContent, "
            "document.getElementById('total-prfaas').textContent, document.title]"
        )
        raise AssertionError(f"{predicate} ({arg!r}) not true; page shows {shown}") from None


def _text(page: Page, selector: str) -> str:
    return page.locator(selector).inner_text()


def _points(page: Page, chart: str) -> int:
    return page.locator(f"#{chart} circle").count()


def _words(n: int, rng: random.Random) -> str:
    text = ""
    while len(text) < n:
        text += "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) + " "
    return text[:n]


def _burst(url: str, short: int, long: int, seed: int) -> None:
    """`short` prompts under t (route pd) and `long` prompts over it (route prfaas), all
    uncached, half of them streamed, eight at a time."""
    rng = random.Random(seed)
    prompts = [_words(rng.randint(20, 40), rng) for _ in range(short)]
    prompts += [_words(rng.randint(160, 240), rng) for _ in range(long)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

    def one(i: int) -> None:
        kw: dict[str, Any] = {"model": MODEL, "prompt": prompts[i], "max_tokens": 4}
        if i % 2:
            assert len(list(client.completions.create(stream=True, **kw))) >= 1
        else:
            assert client.completions.create(**kw).choices[0].text is not None

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(len(prompts))))


def _data(url: str) -> dict[str, Any]:
    """What the gateway holds now (`/admin/dashboard`), to compare the page against."""
    with urllib.request.urlopen(f"{url}/admin/dashboard", timeout=10) as reply:
        data: dict[str, Any] = json.load(reply)
        return data


def _scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return Scrape.parse(reply.read().decode())


def test_page_loads_live_without_console_errors(page: Page, served: Served) -> None:
    """`prfaas serve` prints the dashboard's address; the page shows every instance up with
    its role, the threshold in force, that it runs alone, and logs no console error."""
    assert f"dashboard  {served.url}/dashboard" in served.summary
    for name, _, role, _ in ENGINES:
        card = page.locator(f'[data-instance="{name}"]')
        assert card.get_attribute("data-health") == "up"
        assert card.locator(".role").inner_text() == role
    assert _text(page, "#kpi-threshold") == str(THRESHOLD)
    assert _text(page, "#kpi-replica") == "alone"  # no [coordination]: it decides by itself
    assert served.console == []


def test_grafana_dashboard_queries_exported_metrics(served: Served) -> None:
    """deploy/grafana/prfaas.json loads, every query parses as PromQL (Grafana's variables
    substituted) and every metric it names outside the `[coordination]` row is in a real
    scrape of the running gateway (that row's: tests/deploy/test_envoy_coordinated.py)."""
    _burst(served.url, 2, 2, seed=7)  # so each histogram has samples on both routes
    exported = {s.name for samples in _scrape(served.url).families.values() for s in samples}
    board = dashboard()
    assert board["uid"] == "prfaas-gateway" and board["panels"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    every = panels(board, coordination=False) + panels(board, coordination=True)
    assert all(t["datasource"]["uid"] == "${datasource}" for p in every for t in p["targets"])
    queried(every)  # every query parses (raises ValueError if one does not)
    named = queried(panels(board, coordination=False))
    named |= {
        name
        for a in board["annotations"]["list"]
        if "expr" in a
        for name in metric_names(a["expr"])
    }
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            named |= set(re.findall(r"label_values\((\w+)", variable["query"]["query"]))
    assert named and named <= exported, sorted(named - exported)
    families = {n for n in named if n.startswith("prfaas_egress") or n.startswith("prfaas_link")}
    assert len(families) == 5  # the link panels have telemetry to show here


def test_burst_moves_counters_and_charts(
    page: Page, browser: Browser, served: Served, tmp_path: Path
) -> None:
    """After a burst the route totals grow by what was sent on each route, the
    incremental-length chart gains one dot per request, the rate chart draws; screenshots at
    a desktop and a phone size, neither scrolling sideways."""
    before = _data(served.url)
    routed = sum(r["incremental_tokens"] is not None for r in before["requests"])
    _burst(served.url, 6, 6, seed=11)
    totals = "([pd, prfaas]) => document.getElementById('total-pd').textContent == pd && "
    totals += "document.getElementById('total-prfaas').textContent == prfaas"
    was = before["totals"]
    _wait(page, totals, [was.get("pd", 0) + 6, was.get("prfaas", 0) + 6])
    count = "(n) => document.querySelectorAll('#chart-incremental circle').length === n"
    _wait(page, count, routed + 12)
    assert int(page.locator("#chart-rate").get_attribute("data-points") or 0) > 0
    assert page.locator("#chart-rate path.series-prfaas").count() == 1
    assert served.console == []
    phone = _open(browser, served, viewport=PHONE, is_mobile=True, has_touch=True,
                  device_scale_factor=2)  # fmt: skip
    for name, shown in (("desktop", page), ("phone", phone)):
        path = tmp_path / f"dashboard-{name}.png"
        shown.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        assert path.stat().st_size > 10_000
        wide = shown.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert wide <= 0, f"{name}: the page is {wide}px wider than the window"
    phone.context.close()
    assert served.console == []


def test_stopped_engine_shows_down_within_seconds(
    page: Page, served: Served, tmp_path: Path
) -> None:
    """SIGTERM to the PD decode engine: once it has exited its card says DOWN within a few
    seconds (health checks every 0.5 s, the page polls every second); the others stay up."""
    start = time.monotonic()
    _stop(served.engines["pd-d0"])  # returns once it exited (a graceful stop takes a while)
    exited = time.monotonic()
    page.wait_for_selector('[data-instance="pd-d0"][data-health="down"]', timeout=5_000)
    print(f"pd-d0 exited {exited - start:.1f} s after SIGTERM, shown down "
          f"{time.monotonic() - exited:.1f} s after it exited")  # fmt: skip
    assert _text(page, '[data-instance="pd-d0"] .health') == "DOWN"
    assert page.locator('[data-health="up"]').count() == 2
    path = tmp_path / "dashboard-engine-down.png"
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    assert served.console == []


def test_unreachable_gateway_keeps_last_data(page: Page, served: Served) -> None:
    """With the gateway gone the page says so in a banner and keeps what it showed."""
    totals = _text(page, "#total-prfaas"), _text(page, "#total-pd")
    _stop(served.gateway)
    _wait(page, "() => document.body.dataset.status === 'unreachable'", timeout_ms=6_000)
    assert "Gateway unreachable" in _text(page, "#banner")
    assert (_text(page, "#total-prfaas"), _text(page, "#total-pd")) == totals
    assert page.locator('[data-instance="prfaas-p0"]').count() == 1
