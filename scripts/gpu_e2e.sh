#!/usr/bin/env bash
# End-to-end check of the SGLang plugin on ONE GPU machine without network access.
#
# STATUS: NOT YET RUN ON A GPU. No GPU machine was available while it was written (nor
# when the two modes, the pacing and the prefill-side timestamps were added). What was
# checked on CPU: `--preflight` (builds the checkpoint, then parses all three servers'
# flags with sglang 0.5.23's own `prepare_server_args`, plugin loaded) passes; SGLang's
# full argument resolution needs an accelerator, so GPU-only constraints (Mamba cache
# strategy, page size, attention backend) are first checked by the real run. The plugin's
# transfer path, both modes included, is tested on CPU with the real sglang classes
# (tests/engines/sglang); the device-aware copies it relies on are exercised on a GPU by
# scripts/kv_device_check.py without SGLang. Expect to fix details on the first GPU run;
# record the outcome here.
#
# What it does (everything local, nothing downloaded):
#   1. builds a tiny random-weight hybrid checkpoint (`prfaas.testing.tiny_checkpoint`:
#      Qwen3-Next, 8 layers, every 4th full attention, gated-delta-net linear attention,
#      4 experts, a byte-level tokenizer.json) with transformers;
#   2. starts an aggregated SGLang server on the GPU (the reference) and its gateway;
#   3. for each mode in MODES, starts a prefill and a decode that move KV with
#      `--disaggregation-transfer-backend prfaas` (the prefill's egress paced at RATE) and a
#      PrfaaS gateway over them (threshold 0: every request takes the PrfaaS path):
#        layerwise   (PRFAAS_SGLANG_LAYERWISE=1, the default) each layer's pages, and in
#                    the last chunk its Mamba state, leave from the forward's layer hook;
#        send_after  (PRFAAS_SGLANG_LAYERWISE=0) everything leaves after the last chunk's
#                    forward, the baseline layer-wise sending is measured against;
#   4. sends the same prompts (several prefill chunks each) through the mode's gateway and
#      the aggregated one, greedy, one at a time, and requires identical completions;
#   5. reads both sides' logs: per transfer the decode's per-layer arrival times, and the
#      prefill's timestamps (each layer message queued by the forward / handed to the
#      transport, the last chunk's send(), the share of layer bytes handed over before it);
#      prints per mode and writes $WORK/summary.json.
#
# Usage: scripts/gpu_e2e.sh [--preflight]   (--preflight: build the checkpoint, check flags, stop)
#   PYTHON   interpreter with `prfaas[sglang]` installed (sglang==0.5.23 and its CUDA stack)
#   WORK     scratch folder (default: a new temporary one); logs stay there
#   GPU      GPU index (default 0)
#   MODES    modes to run, in order (default "layerwise send_after")
#   RATE     the prefill's paced egress in bytes/s, PRFAAS_SGLANG_RATE_BYTES_PER_S (default
#            125000000, a 1 Gbit/s link, so the tiny model's KV takes measurable time; 0: unpaced)
# Exit status 0 only if every completion matched in every mode.
set -euo pipefail

PYTHON=${PYTHON:-python}
WORK=${WORK:-$(mktemp -d -t prfaas-gpu-e2e.XXXXXX)}
GPU=${GPU:-0}
HOST=127.0.0.1
AGG_PORT=31000 PREFILL_PORT=31001 DECODE_PORT=31002 BOOTSTRAP_PORT=8998
PD_GATEWAY=8100 AGG_GATEWAY=8101
CHUNK=256        # prefill chunk size (tokens): prompts below span several chunks
MAX_TOKENS=32
PROMPTS=6
MODES=${MODES:-"layerwise send_after"}
RATE=${RATE:-125000000}

MODEL="$WORK/tiny-qwen3-next"
# The prefill engine runs without CUDA graphs for prefill (forward hooks do not fire on
# graph replay; the plugin refuses a layer-wise prefill whose resolved prefill graph backend
# is not "disabled"); the reference and the send-after prefill run the same way so every
# prefill computes alike and the two modes differ only in when KV leaves.
COMMON=(--model-path "$MODEL" --host "$HOST" --skip-tokenizer-init --dtype bfloat16
        --base-gpu-id "$GPU" --chunked-prefill-size "$CHUNK" --context-length 8192
        --max-running-requests 8 --disable-prefill-cuda-graph --log-level info)
# Three servers share one GPU: SGLang sizes each one's static memory from what is free when
# it starts, so each later one asks for a larger fraction (each gets about 12% of the GPU).
AGG_ARGS=("${COMMON[@]}" --port "$AGG_PORT" --mem-fraction-static 0.12)
PREFILL_ARGS=("${COMMON[@]}" --port "$PREFILL_PORT" --mem-fraction-static 0.25
        --disaggregation-mode prefill --disaggregation-transfer-backend prfaas
        --disaggregation-bootstrap-port "$BOOTSTRAP_PORT")
DECODE_ARGS=("${COMMON[@]}" --port "$DECODE_PORT" --mem-fraction-static 0.38
        --disaggregation-mode decode --disaggregation-transfer-backend prfaas)

# Engine side: loopback only, and the transport's own settings (the mode and the pacing are
# set per prefill server below).
export SGLANG_HOST_IP=$HOST PRFAAS_SGLANG_BIND_HOST=$HOST PRFAAS_SGLANG_CONNECTIONS=4
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

log() { printf '[gpu_e2e %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

preflight() {
    log "SGLang and plugin versions, entry point, and every server's flags (sglang's parser)"
    "$PYTHON" - "$MODEL" "$RATE" "${#AGG_ARGS[@]}" "${AGG_ARGS[@]}" "${#PREFILL_ARGS[@]}" \
        "${PREFILL_ARGS[@]}" "${#DECODE_ARGS[@]}" "${DECODE_ARGS[@]}" <<'PY'
import importlib.metadata, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from prfaas.engines.sglang import SGLANG_VERSION
from prfaas.engines.sglang.plugin import check_version
check_version()
points = {p.name for p in importlib.metadata.entry_points(group="sglang.srt.plugins")}
assert "prfaas" in points, points
from prfaas.engines.sglang.settings import BackendSettings
for layerwise in ("1", "0"):  # both modes' settings parse (the prefill's environment)
    BackendSettings.from_env({"PRFAAS_SGLANG_LAYERWISE": layerwise,
                              "PRFAAS_SGLANG_RATE_BYTES_PER_S": sys.argv[2]})
argv, i = sys.argv[3:], 0
for name in ("aggregated", "prefill", "decode"):
    n = int(argv[i]); args = argv[i + 1 : i + 1 + n]; i += 1 + n
    parsed = prepare_server_args(args)
    print(f"  {name}: ok (mode={parsed.disaggregation_mode}, "
          f"backend={parsed.disaggregation_transfer_backend})")
print(f"  sglang {SGLANG_VERSION}, entry point prfaas registered")
PY
}

build_checkpoint() {  # the same tiny checkpoint the vLLM tests serve (no hub, no network)
    log "tiny hybrid checkpoint in $MODEL (kept if complete)"
    "$PYTHON" -m prfaas.testing.tiny_checkpoint "$MODEL"
}

LAST_PID=
start_server() {  # name port args...  (environment: the caller's)
    local name=$1 port=$2; shift 2
    log "starting SGLang $name on :$port (log: $WORK/$name.log)"
    "$PYTHON" -m sglang.launch_server "$@" > "$WORK/$name.log" 2>&1 &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
    wait_http "$name" "http://$HOST:$port/health" 600 "$LAST_PID"
}

stop_pids() {  # pids...: the processes this script started for one mode
    for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
    for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

wait_http() {  # name url timeout_s pid
    local deadline=$((SECONDS + $3))
    until curl -sf -o /dev/null "$2"; do
        if ! kill -0 "$4" 2>/dev/null; then
            log "$1 exited; last lines of its log:"; tail -n 40 "$WORK/$1.log"; exit 1
        fi
        if (( SECONDS > deadline )); then log "$1 not healthy after $3 s"; exit 1; fi
        sleep 2
    done
}

write_deployments() {
    cat > "$WORK/pd.toml" <<EOF
[model]
name = "tiny-qwen3-next"
tokenizer = "$MODEL"
context_length = 8192
vocab_size = 384

[gateway]
threshold = 0   # every request is a long one: it takes the PrfaaS prefill

[[instances]]
id = "prfaas-p0"
cluster = "prfaas"
role = "prefill"
url = "http://$HOST:$PREFILL_PORT"
bootstrap_port = $BOOTSTRAP_PORT

[[instances]]
id = "pd-d0"
cluster = "pd"
role = "decode"
url = "http://$HOST:$DECODE_PORT"
EOF
    cat > "$WORK/agg.toml" <<EOF
[model]
name = "tiny-qwen3-next"
tokenizer = "$MODEL"
context_length = 8192
vocab_size = 384

[gateway]
threshold = 1000000000   # every request is a short one: it stays on the aggregated server

[[instances]]
id = "aggregated"
cluster = "pd"
role = "both"
url = "http://$HOST:$AGG_PORT"
EOF
}

start_gateway() {  # name config port
    log "starting gateway $1 on :$3"
    "$PYTHON" -m prfaas.cli.main serve --config "$2" --host "$HOST" --port "$3" \
        > "$WORK/$1.log" 2>&1 &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
    wait_http "$1" "http://$HOST:$3/v1/models" 120 "$LAST_PID"
}

compare() {  # mode
    log "[$1] sending $PROMPTS prompts through both gateways (greedy, $MAX_TOKENS tokens each)"
    "$PYTHON" - "$HOST" "$PD_GATEWAY" "$AGG_GATEWAY" "$PROMPTS" "$MAX_TOKENS" "$CHUNK" <<'PY'
import json, random, sys, urllib.request
host, pd, agg, n, max_tokens, chunk = sys.argv[1], *map(int, sys.argv[2:])
rng = random.Random(7)
words = "prefill decode layer page cache link token hybrid state stream".split()

def complete(port, prompt):
    body = json.dumps({"model": "tiny-qwen3-next", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{host}:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)["choices"][0]["text"]

bad = 0
for i in range(n):
    length = chunk * (1 + i) + rng.randrange(chunk)  # 1..n+1 chunks, partial last page
    prompt = " ".join(rng.choice(words) for _ in range(length))[:length]
    got, want = complete(pd, prompt), complete(agg, prompt)
    same = got == want
    bad += not same
    print(f"  prompt {i}: {len(prompt):5d} tokens  {'match' if same else 'MISMATCH'}"
          f"  {got[:40]!r}" + ("" if same else f" vs {want[:40]!r}"))
print(f"  {n - bad}/{n} completions identical to the aggregated server's")
sys.exit(1 if bad else 0)
PY
}

summarize() {  # modes...: both sides' logs of each mode -> a table and $WORK/summary.json
    log "per mode: prefill-side timestamps (ms after the room's first layer message was queued)"
    log "and decode-side arrivals (ms after its fetch began); summary in $WORK/summary.json"
    "$PYTHON" - "$WORK" "$RATE" "$@" <<'PY'
import json, re, statistics, sys
work, rate, modes = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
med = lambda xs: statistics.median(xs) if xs else None
summary = {"rate_bytes_per_s": rate, "modes": {}}
for mode in modes:
    prefill = open(f"{work}/prefill-{mode}.log").read()
    decode = open(f"{work}/decode-{mode}.log").read()
    sent = [m.groupdict() for m in re.finditer(
        r"prfaas prefill room=(?P<room>\d+) mode=(?P<mode>\w+) ok=(?P<ok>\d) "
        r"messages=(?P<n>\d+) layer_bytes=(?P<bytes>\d+) last_send_ms=(?P<last>[\d.-]+) "
        r"sent_before_last_send=(?P<share>[\d.]+) layer_ms=\[(?P<layers>[^\]]*)\]", prefill)]
    got = [m.groups() for m in re.finditer(
        r"prfaas transfer room=(\d+) bytes=(\d+) ms=([\d.]+) layer_ms=\[([^\]]*)\]", decode)]
    if not sent or not got:
        print(f"  {mode}: no prfaas log lines (prefill {len(sent)}, decode {len(got)}): "
              "did the transfers run, and does --log-level info reach the plugin's loggers?")
        summary["modes"][mode] = None
        continue
    pacing = re.search(r"prfaas prefill: ([\w-]+), .*pacing ([^,]+),", prefill)
    tails, queued = [], {}
    for row in sent:
        items = [tuple(map(float, i.split(":"))) for i in row["layers"].split()]
        for layer, q, _ in items:
            queued.setdefault(int(layer), []).append(q)
        if items and row["last"] != "-":
            tails.append(max(s for _, _, s in items) - float(row["last"]))
    arrivals = {}
    for _, _, _, layers in got:
        seen = set()
        for item in layers.split():
            layer, ms = item.split(":")
            if layer not in seen:
                seen.add(layer)
                arrivals.setdefault(int(layer), []).append(float(ms))
    entry = {
        "prefill_mode_logged": pacing.group(1) if pacing else None,
        "pacing": pacing.group(2) if pacing else None,
        "transfers": len(got),
        "failed_on_prefill": sum(r["ok"] != "1" for r in sent),
        "megabytes": sum(int(b) for _, b, _, _ in got) / 1e6,
        "decode_transfer_ms_median": med([float(ms) for _, _, ms, _ in got]),
        "prefill_last_send_ms_median": med([float(r["last"]) for r in sent if r["last"] != "-"]),
        "share_handed_over_before_last_send_median": med([float(r["share"]) for r in sent]),
        "handover_tail_after_last_send_ms_median": med(tails),
        "prefill_queued_ms_median_per_layer": {k: med(v) for k, v in sorted(queued.items())},
        "decode_first_arrival_ms_median_per_layer": {k: med(v) for k, v in sorted(arrivals.items())},
    }
    summary["modes"][mode] = entry
    print(f"  {mode}: {entry['transfers']} transfers, {entry['megabytes']:.2f} MB, pacing "
          f"{entry['pacing']}; decode median {entry['decode_transfer_ms_median']:.2f} ms; "
          f"prefill: last chunk's send() at {entry['prefill_last_send_ms_median']} ms, "
          f"{entry['share_handed_over_before_last_send_median']:.3f} of the layer bytes "
          f"handed over before it, the last {entry['handover_tail_after_last_send_ms_median']} ms after")
    for layer, ms in entry["decode_first_arrival_ms_median_per_layer"].items():
        q = entry["prefill_queued_ms_median_per_layer"].get(layer)
        print(f"    layer {layer:2d}: queued on the prefill at {q} ms (median of its messages), "
              f"first arrival at the decode {ms:8.2f} ms (median)")
json.dump(summary, open(f"{work}/summary.json", "w"), indent=2)
PY
}

run_mode() {  # mode: its prefill, decode and gateway; compare; stop them
    local mode=$1 layerwise pids=()
    case $mode in
        layerwise) layerwise=1 ;;
        send_after) layerwise=0 ;;
        *) log "unknown mode $mode (layerwise, send_after)"; return 2 ;;
    esac
    export PRFAAS_SGLANG_LAYERWISE=$layerwise PRFAAS_SGLANG_RATE_BYTES_PER_S=$RATE
    start_server "prefill-$mode" "$PREFILL_PORT" "${PREFILL_ARGS[@]}"
    pids+=("$LAST_PID")
    unset PRFAAS_SGLANG_LAYERWISE PRFAAS_SGLANG_RATE_BYTES_PER_S
    start_server "decode-$mode" "$DECODE_PORT" "${DECODE_ARGS[@]}"
    pids+=("$LAST_PID")
    start_gateway "gateway-pd-$mode" "$WORK/pd.toml" "$PD_GATEWAY"
    pids+=("$LAST_PID")
    local status=0
    compare "$mode" || status=$?
    stop_pids "${pids[@]}"
    return "$status"
}

main() {
    mkdir -p "$WORK"
    log "work folder: $WORK; modes: $MODES; prefill egress paced at $RATE B/s (0: unpaced)"
    build_checkpoint
    preflight
    if [[ ${1:-} == --preflight ]]; then return; fi
    command -v nvidia-smi > /dev/null && nvidia-smi -L
    start_server aggregated "$AGG_PORT" "${AGG_ARGS[@]}"
    write_deployments
    start_gateway gateway-agg "$WORK/agg.toml" "$AGG_GATEWAY"
    local status=0 mode
    for mode in $MODES; do
        run_mode "$mode" || status=$?
    done
    # shellcheck disable=SC2086
    summarize $MODES || status=$?
    log "done (status $status); logs in $WORK"
    return "$status"
}

main "$@"
