// The PrfaaS gateway's live dashboard: polls admin/dashboard once a second and draws
// small SVG charts by hand (no library, no build step). Times on the charts are seconds
// before the gateway's `now` (its event-loop clock), so no wall clock needs to agree.
"use strict";

const POLL_MS = 1000;
const TIMEOUT_MS = 2500;
const SPANS_S = [60, 120, 300]; // the charts show the shortest that holds the history
const KEEP_S = 600; // what the page keeps
const MAX_REQUESTS = 5000;
const RATE_WINDOW_S = 10; // requests per second are averaged over this long
const KEY_STORE = "prfaas-admin-key";
const COLORS = {
  prfaas: "#e8710a", pd: "#1a73e8", none: "#98a2b3", cap: "#5f6368", t: "#1d2330",
  a: "#1a73e8", b: "#d93025", c: "#188038", d: "#f9ab00", marker: "#8e24aa",
};
const SVG_NS = "http://www.w3.org/2000/svg";

const S = {
  runId: null, since: null, now: 0, time: 0, latest: null,
  requests: [], timeline: [], decisions: [],
  lastOk: null, failures: 0, polls: 0,
};

// ---------------------------------------------------------------- formatting

function fmtTokens(n) {
  if (n === null || n === undefined) return "–";
  if (n >= 1e6) return (n / 1e6).toFixed(n >= 1e7 ? 0 : 1) + "M";
  if (n >= 1e3) return (n / 1e3).toFixed(n >= 1e4 ? 0 : 1) + "K";
  return String(Math.round(n));
}
function fmtRate(x) {
  if (x === null || x === undefined) return "–";
  return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2);
}
function fmtMs(s) {
  if (s === null || s === undefined) return "–";
  const ms = s * 1e3;
  return ms >= 1000 ? (ms / 1e3).toFixed(2) + " s" : ms >= 10 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";
}
function fmtMbps(bytesPerS) {
  if (bytesPerS === null || bytesPerS === undefined) return "–";
  const mbps = (bytesPerS * 8) / 1e6;
  if (mbps >= 1000) return (mbps / 1e3).toFixed(1) + " Gbit/s";
  return (mbps >= 10 ? mbps.toFixed(0) : mbps.toFixed(2)) + " Mbit/s";
}
function fmtPct(x) {
  return x === null || x === undefined ? "–" : (x * 100).toFixed(x < 0.1 ? 2 : 1) + "%";
}
function fmtAgo(s) {
  if (s <= 0) return "now";
  return s >= 60 && s % 60 === 0 ? "-" + s / 60 + "m" : "-" + Math.round(s) + "s";
}
function fmtTick(step) {
  const digits = step >= 1 ? 0 : Math.min(4, Math.round(-Math.log10(step) + 0.4));
  return (v) => v.toFixed(digits);
}
function span() {
  const oldest = S.timeline.length ? S.now - S.timeline[0].at : 0;
  return SPANS_S.find((s) => oldest <= s) || SPANS_S[SPANS_S.length - 1];
}
function wallClock(at) {
  return new Date((S.time - (S.now - at)) * 1000).toLocaleTimeString();
}
function setText(id, text) {
  const el = document.getElementById(id);
  if (el && el.textContent !== text) el.textContent = text;
}

// ---------------------------------------------------------------- charts

function niceStep(v, integer) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= v);
  return integer ? Math.max(1, Math.round(step)) : step;
}

function el(name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// series: [{name, color, kind, points, dash}]: kind "line" or "step" with points
// [[ago_s, y], ...], "dots" likewise, "area" (a step band) with [[ago_s, top, base], ...].
// markers: [{ago, title}]; opts: {log, yFmt, minMax}
function drawChart(container, series, markers, opts) {
  const SPAN_S = span();
  const width = Math.max(container.clientWidth, 240);
  const cls = container.classList;
  const height = cls.contains("tall") ? 240 : cls.contains("short") ? 120 : 160;
  const m = { l: 44, r: 8, t: 8, b: 18 };
  const w = width - m.l - m.r, h = height - m.t - m.b;
  const values = series.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null && v > (opts.log ? 0 : -Infinity));
  const yStep = niceStep(Math.max(opts.minMax || 1, ...values) / 4, opts.integer);
  let lo = 0, hi = yStep * Math.max(1, Math.ceil(Math.max(opts.minMax || 1, ...values) / yStep));
  if (opts.log) {
    lo = 1;
    hi = Math.pow(10, Math.max(1, Math.ceil(Math.log10(Math.max(10, ...values)))));
  }
  const x = (ago) => m.l + w * (1 - ago / SPAN_S);
  const y = opts.log
    ? (v) => m.t + h * (1 - (Math.log10(Math.max(v, lo)) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo)))
    : (v) => m.t + h * (1 - (v - lo) / (hi - lo));
  const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  const ticks = opts.log
    ? Array.from({ length: Math.round(Math.log10(hi)) + 1 }, (_, i) => Math.pow(10, i))
    : Array.from({ length: Math.round(hi / yStep) + 1 }, (_, i) => i * yStep);
  const yFmt = opts.yFmt || fmtTick(yStep);
  for (const v of ticks) {
    svg.append(el("line", { class: "grid", x1: m.l, x2: m.l + w, y1: y(v), y2: y(v) }));
    svg.append(el("text", { class: "tick", x: m.l - 4, y: y(v) + 3, "text-anchor": "end" }, yFmt(v)));
  }
  const xStep = SPAN_S === 300 ? 60 : SPAN_S / 4;
  for (let ago = SPAN_S; ago >= 0; ago -= xStep) {
    svg.append(el("text", { class: "tick", x: x(ago), y: m.t + h + 13, "text-anchor": ago === SPAN_S ? "start" : ago === 0 ? "end" : "middle" }, fmtAgo(ago)));
  }
  svg.append(el("line", { class: "axis", x1: m.l, x2: m.l + w, y1: m.t + h, y2: m.t + h }));
  for (const mk of markers) {
    if (mk.ago > SPAN_S) continue;
    const line = el("line", { class: "marker", x1: x(mk.ago), x2: x(mk.ago), y1: m.t, y2: m.t + h });
    line.append(el("title", {}, mk.title));
    svg.append(line);
  }
  let drawn = 0;
  for (const s of series) {
    const pts = s.points.filter((p) => p[0] <= SPAN_S && p[1] !== null && p[1] !== undefined);
    drawn += pts.length;
    if (s.kind === "dots") {
      const g = el("g", { fill: s.color, "fill-opacity": 0.75, class: "dots-" + s.name });
      for (const [ago, v] of pts) g.append(el("circle", { cx: x(ago).toFixed(1), cy: y(v).toFixed(1), r: 2.6 }));
      svg.append(g);
      continue;
    }
    if (s.kind === "area") {
      if (!pts.length) continue;
      let d = "";
      for (const [ago, top] of pts) d += (d ? "H" + x(ago).toFixed(1) + "V" : `M${x(ago).toFixed(1)},`) + y(top).toFixed(1);
      d += "H" + x(0).toFixed(1);
      const back = [...pts].reverse();
      d += "V" + y(back[0][2]).toFixed(1);
      for (let i = 0; i < back.length; i++) {
        d += "H" + x(back[i][0]).toFixed(1);
        if (i + 1 < back.length) d += "V" + y(back[i + 1][2]).toFixed(1);
      }
      svg.append(el("path", { d: d + "Z", fill: s.color, "fill-opacity": 0.35, stroke: s.color, "stroke-width": 1.2, class: "series-" + s.name }));
      continue;
    }
    let d = "";
    let prev = null;
    for (const [ago, v] of pts) {
      const px = x(ago).toFixed(1), py = y(v).toFixed(1);
      if (prev === null) d += `M${px},${py}`;
      else d += s.kind === "step" ? `H${px}V${py}` : `L${px},${py}`;
      prev = py;
    }
    if (s.kind === "step" && prev !== null) d += `H${x(0).toFixed(1)}`;
    if (d) {
      svg.append(el("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.8, "stroke-dasharray": s.dash || "none", class: "series-" + s.name }));
    }
  }
  if (!drawn) svg.append(el("text", { class: "empty", x: m.l + w / 2, y: m.t + h / 2, "text-anchor": "middle" }, "no data yet"));
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const s of series) {
    const item = document.createElement("span");
    const sw = document.createElement("i");
    sw.className = "sw-" + (s.swatch || s.name);
    item.append(sw, document.createTextNode(s.label || s.name));
    legend.append(item);
  }
  if (markers.length) {
    const item = document.createElement("span");
    const sw = document.createElement("i");
    sw.className = "sw-marker";
    item.append(sw, document.createTextNode("decision"));
    legend.append(item);
  }
  container.replaceChildren(svg, legend);
  container.dataset.points = String(drawn);
}

// ---------------------------------------------------------------- sections

function ago(at) {
  return S.now - at;
}

function timelineSeries(pick, name, opts = {}) {
  return {
    name, kind: opts.kind || "line", color: COLORS[opts.swatch || name], swatch: opts.swatch,
    label: opts.label, dash: opts.dash,
    points: S.timeline.map((p) => [ago(p.at), pick(p)]),
  };
}

function markers(kinds) {
  return S.decisions
    .filter((d) => kinds.includes(d.kind))
    .map((d) => ({ ago: ago(d.at), title: `${d.kind}: ${JSON.stringify(d.before)} → ${JSON.stringify(d.after)} (${d.reason})` }));
}

function renderClusters(state) {
  const root = document.getElementById("clusters");
  const names = { prfaas: "PrfaaS cluster", pd: "PD cluster" };
  const sections = [];
  for (const [cluster, members] of Object.entries(state.clusters)) {
    const sec = document.createElement("div");
    sec.className = "cluster";
    sec.dataset.cluster = cluster;
    const up = members.filter((i) => i.healthy).length;
    const h = document.createElement("h3");
    h.textContent = `${names[cluster] || cluster} · ${up}/${members.length} up`;
    const list = document.createElement("div");
    list.className = "instances";
    for (const inst of members) {
      const card = document.createElement("div");
      card.className = "instance";
      card.dataset.instance = inst.id;
      card.dataset.health = inst.healthy ? "up" : "down";
      const health = document.createElement("span");
      health.className = "health";
      health.textContent = inst.healthy ? "UP" : "DOWN";
      const id = document.createElement("div");
      id.className = "id";
      id.append(health, document.createTextNode(inst.id));
      const role = document.createElement("span");
      role.className = "role";
      role.textContent = inst.role;
      const load = document.createElement("div");
      load.className = "load";
      load.textContent = inst.healthy
        ? `in flight ${inst.in_flight} · queued ${inst.queued}`
        : "not answering health checks";
      card.append(id, role, load);
      if (inst.url) card.title = inst.url;
      list.append(card);
    }
    if (!members.length) {
      const none = document.createElement("div");
      none.className = "muted";
      none.textContent = "no instances";
      list.append(none);
    }
    sec.append(h, list);
    sections.push(sec);
  }
  root.replaceChildren(...sections);
}

// Requests per second by route over the `seconds` before each timeline point, from the
// cumulative counts (per-second rates alone are too spiky at a few requests per second).
function windowRates(route, seconds) {
  const out = [];
  let j = 0;
  for (let i = 0; i < S.timeline.length; i++) {
    const p = S.timeline[i];
    while (S.timeline[j].at < p.at - seconds) j++;
    const q = S.timeline[j];
    const dt = p.at - q.at;
    out.push([ago(p.at), dt > 0 ? ((p.totals[route] || 0) - (q.totals[route] || 0)) / dt : null]);
  }
  return out;
}

function meanRate(route, seconds) {
  const rates = windowRates(route, seconds);
  return rates.length ? rates[rates.length - 1][1] : null;
}

function renderRouting(data) {
  const st = data.state;
  setText("kpi-threshold", fmtTokens(st.threshold));
  setText("kpi-regime", st.regime.replace("bandwidth_", ""));
  renderReplica(st.coordination);
  setText("rate-prfaas", fmtRate(meanRate("prfaas", RATE_WINDOW_S)));
  setText("rate-pd", fmtRate(meanRate("pd", RATE_WINDOW_S)));
  setText("total-prfaas", String(data.totals.prfaas || 0));
  setText("total-pd", String(data.totals.pd || 0));
  setText("total-errors", String(data.errors));
  setText("kpi-queue", `${st.queue.running} / ${st.queue.waiting}`);
  const rate = (route) => ({ name: route, kind: "line", color: COLORS[route], points: windowRates(route, RATE_WINDOW_S) });
  const routes = data.totals.none ? ["prfaas", "pd", "none"] : ["prfaas", "pd"];
  drawChart(document.getElementById("chart-rate"), routes.map(rate), [], {});
}

// This gateway among its replicas: "alone" without [coordination], else its role, the
// leader's epoch and (for a follower) the leader; "store down" when etcd does not answer.
function renderReplica(co) {
  const el = document.getElementById("kpi-replica");
  if (!co) {
    el.textContent = "alone";
    el.title = "no [coordination]: this gateway decides by itself";
    return;
  }
  const who = co.role === "leader" ? "leader" : `follows ${co.leader || "?"}`;
  el.textContent = `${who} · epoch ${co.epoch}${co.store_up ? "" : " · store down"}`;
  el.title = `replica ${co.replica}; etcd ${co.etcd.join(", ")}`;
}

function renderIncremental() {
  const routed = S.requests.filter((r) => r.incremental_tokens !== null);
  const dots = (route) => ({
    name: route, kind: "dots", color: COLORS[route],
    points: routed.filter((r) => r.route === route).map((r) => [ago(r.at), Math.max(1, r.incremental_tokens)]),
  });
  const t = timelineSeries((p) => Math.max(1, p.threshold), "t", { kind: "step", label: "t" });
  drawChart(document.getElementById("chart-incremental"), [dots("prfaas"), dots("pd"), t],
    markers(["threshold", "regime"]), { log: true, yFmt: fmtTokens });
}

function renderLink(link) {
  const known = link && link.egress_bytes_per_s !== undefined;
  setText("kpi-egress", known ? fmtMbps(link.egress_bytes_per_s) : "no telemetry");
  setText("kpi-capacity", known ? fmtMbps(link.capacity_bytes_per_s) : "–");
  setText("kpi-utilisation", known ? fmtPct(link.egress_utilisation) : "–");
  setText("kpi-retrans", known ? fmtPct(link.retransmission_rate) : "–");
  setText("kpi-rtt", known ? fmtMs(link.rtt_s) : "–");
  setText("kpi-transfers", known ? String(link.active_transfers) : "–");
  const mbps = (v) => (v === null || v === undefined ? null : (v * 8) / 1e6);
  drawChart(document.getElementById("chart-egress"), [
    timelineSeries((p) => mbps(p.egress_bytes_per_s), "egress", { swatch: "prfaas", label: "egress" }),
    timelineSeries((p) => mbps(p.capacity_bytes_per_s), "capacity", { swatch: "cap", label: "capacity", dash: "5 4" }),
  ], [], {});
  const ms = (v) => (v === null || v === undefined ? null : v * 1e3);
  const pct = (v) => (v === null || v === undefined ? null : v * 100);
  drawChart(document.getElementById("chart-link"), [
    timelineSeries((p) => ms(p.rtt_s), "rtt", { swatch: "a", label: "RTT ms" }),
    timelineSeries((p) => pct(p.retransmission_rate), "retrans", { swatch: "b", label: "retransmitted %" }),
  ], [], {});
}

function renderScheduling() {
  drawChart(document.getElementById("chart-threshold"),
    [timelineSeries((p) => p.threshold, "t", { kind: "step", label: "t" })],
    markers(["threshold", "regime"]), { yFmt: fmtTokens });
  // The role split as stacked bands: healthy instances per (cluster, role).
  const order = ["pd/decode", "pd/both", "pd/prefill", "prfaas/prefill", "prfaas/both", "prfaas/decode"];
  const seen = new Set();
  for (const p of S.timeline) for (const [c, roles] of Object.entries(p.roles)) for (const r of Object.keys(roles)) seen.add(`${c}/${r}`);
  const keys = [...seen].sort((a, b) => (order.indexOf(a) + 99 * (order.indexOf(a) < 0)) - (order.indexOf(b) + 99 * (order.indexOf(b) < 0)));
  const swatches = ["a", "b", "c", "d"];
  const base = S.timeline.map(() => 0);
  const bands = keys.map((key, k) => {
    const [c, r] = key.split("/");
    const points = S.timeline.map((p, i) => {
      const top = base[i] + ((p.roles[c] || {})[r] || 0);
      const band = [ago(p.at), top, base[i]];
      base[i] = top;
      return band;
    });
    const sw = swatches[k % swatches.length];
    return { name: key.replace("/", "-"), kind: "area", color: COLORS[sw], swatch: sw, label: `${c} ${r}`, points };
  });
  drawChart(document.getElementById("chart-roles"), bands, markers(["roles"]), { integer: true, minMax: 2 });
  renderSchedulerState(S.latest.state.scheduler);
  const list = document.getElementById("decisions");
  const items = S.decisions.slice(-30).reverse().map((d) => {
    const li = document.createElement("li");
    const what = document.createElement("span");
    what.textContent = `${wallClock(d.at)} ${d.kind} ${JSON.stringify(d.before)} → ${JSON.stringify(d.after)} `;
    const why = document.createElement("span");
    why.className = "why";
    why.textContent = `${d.reason} (${d.source})`;
    li.append(what, why);
    return li;
  });
  if (!items.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "none yet";
    items.push(li);
  }
  list.replaceChildren(...items);
}

// `state.scheduler` (when the gateway runs schedulers): their current inputs and targets,
// shown as name/value pairs, one level of nesting flattened ("short_term.utilisation").
function renderSchedulerState(scheduler) {
  const box = document.getElementById("scheduler-state");
  box.hidden = !scheduler;
  if (!scheduler) return;
  const rows = [];
  const add = (name, value) => {
    const dt = document.createElement("dt");
    dt.textContent = name;
    const dd = document.createElement("dd");
    dd.textContent = typeof value === "number" ? fmtRate(value) : JSON.stringify(value);
    rows.push(dt, dd);
  };
  for (const [k, v] of Object.entries(scheduler)) {
    if (v && typeof v === "object" && !Array.isArray(v)) for (const [k2, v2] of Object.entries(v)) add(`${k}.${k2}`, v2);
    else add(k, v);
  }
  document.getElementById("scheduler-fields").replaceChildren(...rows);
}

function renderLatency(data) {
  setText("latency-window", `last ${Math.round(data.window_s)} s (${data.latency.requests} req)`);
  for (const metric of ["ttft", "tpot", "e2e"]) {
    const q = data.latency[metric + "_s"];
    for (const p of ["p50", "p90", "p99"]) setText(`${metric}-${p}`, fmtMs(q[p]));
  }
  const ms = (v) => (v === null || v === undefined ? null : v * 1e3);
  for (const metric of ["ttft", "tpot"]) {
    drawChart(document.getElementById(`chart-${metric}`), [
      timelineSeries((p) => ms(p[metric + "_s"].p50), "p50", { swatch: "a", label: "p50" }),
      timelineSeries((p) => ms(p[metric + "_s"].p99), "p99", { swatch: "b", label: "p99" }),
    ], [], {});
  }
}

function render() {
  const data = S.latest;
  if (!data) return;
  const st = data.state;
  setText("identity", `${st.model} · policy ${st.policy} · ${fmtTokens(data.totals.prfaas || 0)} prfaas / ${fmtTokens(data.totals.pd || 0)} pd requests`);
  renderClusters(st);
  renderRouting(data);
  renderIncremental();
  renderLink(st.link);
  renderScheduling();
  renderLatency(data);
}

// ---------------------------------------------------------------- polling

function merge(data) {
  if (data.run_id !== S.runId) {
    S.runId = data.run_id;
    S.requests = []; S.timeline = []; S.decisions = [];
  }
  S.requests.push(...data.requests);
  S.timeline.push(...data.timeline);
  S.decisions.push(...data.decisions);
  const keep = data.now - KEEP_S;
  S.requests = S.requests.filter((r) => r.at > data.now - SPANS_S[SPANS_S.length - 1]).slice(-MAX_REQUESTS);
  S.timeline = S.timeline.filter((p) => p.at > keep);
  S.decisions = S.decisions.filter((d) => d.at > keep);
  S.since = data.now;
  S.now = data.now;
  S.time = data.time;
  S.latest = data;
}

function setStatus(status, text) {
  document.body.dataset.status = status;
  setText("status", text);
}

function showBanner(text) {
  const banner = document.getElementById("banner");
  banner.hidden = !text;
  if (text) banner.textContent = text;
}

async function poll() {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.Authorization = "Bearer " + key;
  const url = "admin/dashboard" + (S.since === null ? "" : "?since=" + encodeURIComponent(S.since));
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
  try {
    const reply = await fetch(url, { headers, cache: "no-store", signal: abort.signal });
    if (reply.status === 401 || reply.status === 403) {
      document.getElementById("auth").hidden = false;
      setStatus("auth", "admin key needed");
      return;
    }
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    const data = await reply.json();
    document.getElementById("auth").hidden = true;
    merge(data);
    S.lastOk = new Date();
    S.failures = 0;
    showBanner("");
    setStatus("live", "live");
    render();
  } catch (err) {
    S.failures += 1;
    const since = S.lastOk ? `since ${S.lastOk.toLocaleTimeString()}` : "";
    showBanner(`Gateway unreachable ${since} (${err.name === "AbortError" ? "timed out" : "no answer"}); ` +
      (S.latest ? "showing the last data received, " : "") + "retrying every second.");
    setStatus("unreachable", "unreachable");
  } finally {
    clearTimeout(timer);
    S.polls += 1;
    document.body.dataset.polls = String(S.polls);
  }
}

async function loop() {
  for (;;) {
    const started = performance.now();
    await poll();
    await new Promise((r) => setTimeout(r, Math.max(100, POLL_MS - (performance.now() - started))));
  }
}

function init() {
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.get("key")) {
    sessionStorage.setItem(KEY_STORE, hash.get("key"));
    history.replaceState(null, "", location.pathname + location.search);
  }
  document.getElementById("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY_STORE, document.getElementById("auth-key").value.trim());
    poll();
  });
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(render, 100);
  });
  loop();
}

init();
