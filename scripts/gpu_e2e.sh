#!/usr/bin/env bash
# End-to-end check of the SGLang plugin on ONE GPU machine without network access.
#
# STATUS: NOT YET RUN ON A GPU. No GPU machine was available while it was written. What
# was checked on CPU: `--preflight` (builds the checkpoint, then parses all three servers'
# flags with sglang 0.5.23's own `prepare_server_args`, plugin loaded) passes; SGLang's
# full argument resolution needs an accelerator, so GPU-only constraints (Mamba cache
# strategy, page size, attention backend) are first checked by the real run. The plugin's
# transfer path is tested on CPU with the real sglang classes (tests/engines/sglang).
# Expect to fix details on the first GPU run; record the outcome here.
#
# What it does (everything local, nothing downloaded):
#   1. builds a tiny random-weight hybrid checkpoint (`prfaas.testing.tiny_checkpoint`:
#      Qwen3-Next, 8 layers, every 4th full attention, gated-delta-net linear attention,
#      4 experts, a byte-level tokenizer.json) with transformers;
#   2. starts three SGLang servers on the GPU: an aggregated one (the reference), a prefill
#      and a decode that move KV with `--disaggregation-transfer-backend prfaas`;
#   3. starts two PrfaaS gateways (`prfaas serve`): one over prefill+decode (threshold 0,
#      so every request takes the PrfaaS path), one over the aggregated server;
#   4. sends the same prompts (several prefill chunks each) through both, greedy, one at a
#      time, and requires identical completions;
#   5. prints per-layer arrival times of the transfers from the decode's log.
#
# Usage: scripts/gpu_e2e.sh [--preflight]   (--preflight: build the checkpoint, check flags, stop)
#   PYTHON   interpreter with `prfaas[sglang]` installed (sglang==0.5.23 and its CUDA stack)
#   WORK     scratch folder (default: a new temporary one); logs stay there
#   GPU      GPU index (default 0)
# Exit status 0 only if every completion matched.
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

MODEL="$WORK/tiny-qwen3-next"
# The prefill engine runs without CUDA graphs for prefill (forward hooks do not fire on
# graph replay); the reference runs the same way so both prefills compute alike.
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

# Engine side: loopback only, and the transport's own settings.
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
    "$PYTHON" - "$MODEL" "${#AGG_ARGS[@]}" "${AGG_ARGS[@]}" "${#PREFILL_ARGS[@]}" \
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
argv, i = sys.argv[2:], 0
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

start_server() {  # name port args...
    local name=$1 port=$2; shift 2
    log "starting SGLang $name on :$port (log: $WORK/$name.log)"
    "$PYTHON" -m sglang.launch_server "$@" > "$WORK/$name.log" 2>&1 &
    PIDS+=($!)
    wait_http "$name" "http://$HOST:$port/health" 600 "$!"
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
    PIDS+=($!)
    wait_http "$1" "http://$HOST:$3/v1/models" 120 "$!"
}

compare() {
    log "sending $PROMPTS prompts through both gateways (greedy, $MAX_TOKENS tokens each)"
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

layer_times() {
    log "per-layer arrival at the decode (ms after its fetch began; first arrival of each layer)"
    "$PYTHON" - "$WORK/decode.log" <<'PY'
import re, statistics, sys
rows = [m for m in re.finditer(
    r"prfaas transfer room=(\d+) bytes=(\d+) ms=([\d.]+) layer_ms=\[([^\]]*)\]",
    open(sys.argv[1]).read())]
if not rows:
    sys.exit("  no 'prfaas transfer' lines in the decode log: did the transfers run?")
per_layer = {}
for m in rows:
    seen = set()
    for item in m.group(4).split():
        layer, ms = item.split(":")
        if layer not in seen:  # a layer's first piece: when layer-wise streaming reached it
            seen.add(layer)
            per_layer.setdefault(int(layer), []).append(float(ms))
print(f"  {len(rows)} transfers, {sum(int(m.group(2)) for m in rows) / 1e6:.2f} MB, "
      f"median total {statistics.median(float(m.group(3)) for m in rows):.2f} ms")
for layer in sorted(per_layer):
    times = per_layer[layer]
    print(f"  layer {layer:2d}: median {statistics.median(times):8.2f} ms  "
          f"max {max(times):8.2f} ms  ({len(times)} transfers)")
PY
}

main() {
    mkdir -p "$WORK"
    log "work folder: $WORK"
    build_checkpoint
    preflight
    if [[ ${1:-} == --preflight ]]; then return; fi
    command -v nvidia-smi > /dev/null && nvidia-smi -L
    start_server aggregated "$AGG_PORT" "${AGG_ARGS[@]}"
    start_server prefill "$PREFILL_PORT" "${PREFILL_ARGS[@]}"
    start_server decode "$DECODE_PORT" "${DECODE_ARGS[@]}"
    write_deployments
    start_gateway gateway-pd "$WORK/pd.toml" "$PD_GATEWAY"
    start_gateway gateway-agg "$WORK/agg.toml" "$AGG_GATEWAY"
    local status=0
    compare || status=$?
    layer_times || status=$?
    log "done (status $status); logs in $WORK"
    return "$status"
}

main "$@"
