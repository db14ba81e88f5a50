#!/usr/bin/env bash
# Multi-model fleet, end to end: kvlb vs sglang-router vs vllm-router in front of the same
# replicas, where the replicas do NOT all serve the same models, on the same slice of a real
# trace, in one invocation.
#
# Fleet (two `kvlb replica` processes, both with KV cache events on; `--count` gives every
# replica of a process the same flags, hence two processes):
#   2 replicas  --served-model-name Qwen/Qwen3-8B --enable-lora --lora-modules a1=... a8=...
#               --max-loras MAX_LORAS (eight LoRA adapters, MAX_LORAS of them in one batch as
#               vLLM schedules them; an adapter's KV cache is kept apart from its base's)
#   2 replicas  --served-model-name Qwen/Qwen3-0.6B, prefilling SMALL_PREFILL times the 8B's
#               time per token (the engine's 8B-on-H100 timing, its prefill terms scaled)
# A replica asked for a model it does not serve answers vLLM's 404.
#
# Load: traces/mooncake_conversation_trace.jsonl (no model column), models given by
# `kvlb replay --models MODELS`: per conversation, by weight (default 25% Qwen/Qwen3-8B,
# 3.125% each of a1..a8, 50% Qwen/Qwen3-0.6B: each half of the fleet gets half the
# conversations), the same for every balancer.
#
# Balancers (BALANCERS, in this order by default), and what each was given:
#   kvlb             kvlb serve --policy cache_aware --replica URL,kv_events=... per replica:
#                    no model configuration; it learns each replica's names (adapters
#                    included) from GET /v1/models and routes by the request's model
#   sglang-router    sglang-router, --policy cache_aware --worker-urls (all four). Its
#                    multi-model mode (--enable-igw) cannot be used: sglang-router 0.3.2 with
#                    --enable-igw ignores --worker-urls ("mode: Regular { worker_urls: [] }",
#                    workers must be POSTed to /workers) and panics at start-up offline
#                    ("Failed to load Harmony encoding: error downloading or loading vocab
#                    file"), so it runs in its regular, model-blind mode
#   vllm-router      vllm-router, --policy cache_aware --worker-urls (all four): regular
#                    mode, model-blind (the e2e_peers configuration)
#   vllm-router-igw  vllm-router --enable-igw --policy cache_aware, each replica registered
#                    with POST /workers {"url": URL, "model_id": BASE}: routing by model for
#                    the base models. It keeps one model_id per worker URL (a second POST for
#                    the same URL replaces the first), so the adapters cannot be registered
#                    beside their base: a request naming an adapter is not a model it knows
#                    and goes wherever its fallback sends it
#
# For each balancer in turn: every replica's prefix cache is reset, the balancer started, the
# slice replayed by `kvlb replay` (streaming chat at the trace's arrival times; TTFT = first
# SSE event; per-model hit rate from each answer's usage, cached_tokens / prompt_tokens), the
# balancer stopped. `kvlb replay report` then prints the overall table and the per-model one
# (requests, errors, TTFT p50/p90/p99, hit rate): a router that sends a request to a replica not
# serving its model shows it as errors (HTTP 404) of that model. TTFT percentiles are over the
# requests answered: a router whose 404s shed part of the load has less queueing for the rest,
# so read its TTFT beside its errors. Results: bench/results/multi-model-YYYYMMDD.txt (and the
# combined JSON of `kvlb replay report` where RESULTS_JSON says, if set).
#
# Time: replicas run TIME_SCALE times faster than a real GPU; arrivals are compressed by LOAD
# in engine time. Reported times are engine seconds (wall seconds * TIME_SCALE). Each balancer
# gets DURATION wall seconds of trace (DURATION * LOAD * TIME_SCALE trace seconds from START).
#
# Environment: TRACE (traces/mooncake_conversation_trace.jsonl), START (0), DURATION (40),
# LOAD (1), TIME_SCALE (5), MODELS (the mix above), MAX_OUTPUT (cap output tokens; default the
# trace's), MAX_LORAS (2), SMALL_PREFILL (0.25), ROUNDS (1: every balancer measured N times,
# the order reversed every other round, one report table per round), BALANCERS (all four), WARMUP (10: wall seconds of warm-up through kvlb, from trace
# second 3000, before any measurement; 0: none), PIN (1: fleet on core FLEET_CORE (1),
# balancer and replayer on BALANCER_CORE (0)), KVLB_BIN (a kvlb binary instead of building
# target/release/kvlb), RESULTS_NAME (multi-model-YYYYMMDD), RESULTS_JSON (unset: none).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=bench/lib/packages.sh
source bench/lib/packages.sh
# shellcheck source=bench/lib/peers.sh
source bench/lib/peers.sh

TRACE=${TRACE:-traces/mooncake_conversation_trace.jsonl}
START=${START:-0}
DURATION=${DURATION:-40}
LOAD=${LOAD:-1}
TIME_SCALE=${TIME_SCALE:-5}
ADAPTERS="a1 a2 a3 a4 a5 a6 a7 a8"
default_mix="Qwen/Qwen3-8B=0.25,Qwen/Qwen3-0.6B=0.5"
for a in $ADAPTERS; do default_mix+=",$a=0.03125"; done
MODELS=${MODELS:-$default_mix}
MAX_OUTPUT=${MAX_OUTPUT:-}
MAX_LORAS=${MAX_LORAS:-2}
SMALL_PREFILL=${SMALL_PREFILL:-0.25}
ROUNDS=${ROUNDS:-1}
BALANCERS=${BALANCERS:-kvlb sglang-router vllm-router vllm-router-igw}
WARMUP=${WARMUP:-10}
PIN=${PIN:-1}
FLEET_CORE=${FLEET_CORE:-1}
BALANCER_CORE=${BALANCER_CORE:-0}
RESULTS_NAME=${RESULTS_NAME:-multi-model-$(date -u +%Y%m%d)}
VENV=$ROOT/bench/.venv
LIB=$ROOT/bench/lib

kvlb_require number START DURATION LOAD TIME_SCALE WARMUP SMALL_PREFILL
kvlb_require count MAX_LORAS ROUNDS
for b in $BALANCERS; do
    case $b in
    kvlb | sglang-router | vllm-router | vllm-router-igw) ;;
    *)
        echo "error: unknown balancer '$b' in BALANCERS (known: kvlb sglang-router vllm-router vllm-router-igw)" >&2
        exit 2
        ;;
    esac
done
if [ ! -r "$TRACE" ]; then
    echo "error: TRACE=$TRACE is not readable (see traces/README.md)" >&2
    exit 2
fi
if [ "$PIN" = 1 ] && { [ "$FLEET_CORE" -ge "$(nproc)" ] || [ "$BALANCER_CORE" -ge "$(nproc)" ]; }; then
    echo "error: FLEET_CORE=$FLEET_CORE / BALANCER_CORE=$BALANCER_CORE, but this machine has $(nproc) cores" >&2
    exit 2
fi

# --- peers, installed idempotently (as bench/e2e_peers.sh) --------------------------------
kvlb_ensure_packages curl python3-venv
kvlb_peers_venv
kvlb_bench_binary
kvlb_peer_versions

# --- bookkeeping --------------------------------------------------------------------------
kvlb_bench_bookkeeping multi-model
RESULTS_JSON=${RESULTS_JSON:-}

# --- the fleet: two processes, two models ---------------------------------------------------
REPLICA_URLS=()
REPLICA_EVENTS=()
REPLICA_BASE=()
lora_modules=()
for a in $ADAPTERS; do lora_modules+=("$a=/adapters/$a"); done
start_fleet() {
    local name=$1 base=$2 log=$TMP/fleet-$1.log
    shift 2
    on_core "$FLEET_CORE" "$KVLB" replica --listen 127.0.0.1:0 --count 2 \
        --time-scale "$TIME_SCALE" --kv-events tcp://127.0.0.1:0 --kv-events-format map-nil \
        --served-model-name "$base" "$@" 2>"$log" &
    FLEET_PIDS+=($!)
    for _ in $(seq 150); do
        grep -q '^kvlb replica: ready' "$log" && break
        sleep 0.1
    done
    if ! grep -q '^kvlb replica: ready' "$log"; then
        echo "error: kvlb replica ($name) did not start:" >&2
        cat "$log" >&2
        exit 1
    fi
    while read -r _ _ _ _ _ addr events; do
        REPLICA_URLS+=("http://$addr")
        REPLICA_EVENTS+=("${events#kv_events=}")
        REPLICA_BASE+=("$base")
    done < <(grep '^kvlb replica: replica ' "$log")
}
start_fleet big Qwen/Qwen3-8B --enable-lora --max-loras "$MAX_LORAS" --lora-modules "${lora_modules[@]}"
# The small model's prefill terms, scaled from the engine's defaults (read off its --help).
scaled() {
    "$KVLB" replica --help | python3 -c "
import re, sys
m = re.search(r'--$1 <[A-Z]+>.*?\[default: ([0-9.e-]+)\]', sys.stdin.read(), re.S)
print(float(m.group(1)) * $SMALL_PREFILL)"
}
start_fleet small Qwen/Qwen3-0.6B --prefill-a-s "$(scaled prefill-a-s)" \
    --prefill-b-s "$(scaled prefill-b-s)" --prefill-c-s "$(scaled prefill-c-s)"

SPEEDUP=$(python3 -c "print($LOAD * $TIME_SCALE)")
SLICE=$(python3 -c "print($DURATION * $LOAD * $TIME_SCALE)")
say "# multi-model fleet: kvlb vs peers ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $(uname -r))"
say "trace: $(basename "$TRACE"), trace seconds $START..$(python3 -c "print($START + $SLICE)"), load x$LOAD (engine time)"
say "fleet: 2 x kvlb replica serving Qwen/Qwen3-8B + LoRA $ADAPTERS, --max-loras $MAX_LORAS (${REPLICA_URLS[0]}, ${REPLICA_URLS[1]}),"
say "       2 x kvlb replica serving Qwen/Qwen3-0.6B, prefill x$SMALL_PREFILL (${REPLICA_URLS[2]}, ${REPLICA_URLS[3]}); time scale $TIME_SCALE, KV events on"
say "rounds: $ROUNDS (order reversed every other round; one table per round)"
say "models: kvlb replay --models $MODELS (per conversation)"
say "replay: speedup $SPEEDUP wall, streaming chat, ${MAX_OUTPUT:-trace} output tokens; times are engine seconds (wall x $TIME_SCALE)"
[ "$PIN" = 1 ] && say "pinning: fleet on core $FLEET_CORE; each balancer and the replayer on core $BALANCER_CORE"
say "peers: sglang-router $SGLANG_VERSION (regular mode: --enable-igw ignores --worker-urls and panics offline),"
say "       vllm-router $VLLM_ROUTER_VERSION (regular mode, and --enable-igw with each worker's base model POSTed to /workers)"
say ""

# Waits until kvlb's admin /replicas shows every replica's models.
kvlb_knows_models() {
    local admin=$1
    for _ in $(seq 100); do
        if curl -fsS --max-time 2 "http://127.0.0.1:$admin/replicas" 2>/dev/null |
            python3 -c 'import json, sys; r = json.load(sys.stdin)["replicas"]; sys.exit(0 if r and all(isinstance(x.get("models"), list) for x in r) else 1)'; then
            return 0
        fi
        sleep 0.1
    done
    return 1
}

# Starts balancer $1 on port $2 (metrics/admin port $3); sets BALANCER_PID.
start_balancer() {
    local name=$1 port=$2 mport=$3 args=() i
    case $name in
    kvlb | kvlb-warmup)
        local policy=cache_aware
        [ "$name" = kvlb-warmup ] && policy=round_robin
        for i in "${!REPLICA_URLS[@]}"; do
            args+=(--replica "${REPLICA_URLS[$i]},kv_events=${REPLICA_EVENTS[$i]}")
        done
        on_core "$BALANCER_CORE" "$KVLB" serve --listen "127.0.0.1:$port" \
            --admin "127.0.0.1:$mport" --workers 1 --cores "$BALANCER_CORE" \
            --policy "$policy" "${args[@]}" >"$TMP/$name.log" 2>&1 &
        BALANCER_PID=$!
        wait_http "http://127.0.0.1:$port/v1/models" "$BALANCER_PID" 60 || return 1
        kvlb_knows_models "$mport"
        ;;
    sglang-router)
        on_core "$BALANCER_CORE" "$VENV/bin/python" -m sglang_router.launch_router \
            --host 127.0.0.1 --port "$port" --worker-urls "${REPLICA_URLS[@]}" \
            --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warn >"$TMP/$name.log" 2>&1 &
        BALANCER_PID=$!
        wait_http "http://127.0.0.1:$port/v1/models" "$BALANCER_PID" 60
        ;;
    vllm-router)
        on_core "$BALANCER_CORE" "$VENV/bin/vllm-router" \
            --host 127.0.0.1 --port "$port" --worker-urls "${REPLICA_URLS[@]}" \
            --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warning >"$TMP/$name.log" 2>&1 &
        BALANCER_PID=$!
        wait_http "http://127.0.0.1:$port/v1/models" "$BALANCER_PID" 60
        ;;
    vllm-router-igw)
        on_core "$BALANCER_CORE" "$VENV/bin/vllm-router" --enable-igw \
            --host 127.0.0.1 --port "$port" --worker-urls "${REPLICA_URLS[@]}" \
            --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warning >"$TMP/$name.log" 2>&1 &
        BALANCER_PID=$!
        wait_http "http://127.0.0.1:$port/workers" "$BALANCER_PID" 60 || return 1
        for i in "${!REPLICA_URLS[@]}"; do
            curl -fsS -o /dev/null --max-time 5 -X POST "http://127.0.0.1:$port/workers" \
                -H 'Content-Type: application/json' \
                -d "{\"url\": \"${REPLICA_URLS[$i]}\", \"model_id\": \"${REPLICA_BASE[$i]}\"}" || return 1
        done
        wait_http "http://127.0.0.1:$port/v1/models" "$BALANCER_PID" 30
        ;;
    esac
}

ports2() { python3 "$LIB/procstat.py" ports 2; }

if [ "$WARMUP" != 0 ]; then
    mapfile -t ports < <(ports2)
    if start_balancer kvlb-warmup "${ports[0]}" "${ports[1]}"; then
        on_core "$BALANCER_CORE" "$KVLB" replay --target "http://127.0.0.1:${ports[0]}" \
            --trace "$TRACE" --start 3000 --duration "$(python3 -c "print($WARMUP * $LOAD * $TIME_SCALE)")" \
            --speedup "$SPEEDUP" --time-scale "$TIME_SCALE" --models "$MODELS" --quiet \
            --label warmup >"$TMP/warmup.txt" 2>&1 || true
        say "warm-up: $(grep -E "^warmup " "$TMP/warmup.txt" | head -n 1 | awk '{print $2 " requests, " $3 " errors"}') in ${WARMUP} s through a round-robin kvlb (trace from 3000 s)"
    else
        say "warm-up: skipped, the warm-up balancer did not start"
    fi
    stop_tree "$BALANCER_PID"
    BALANCER_PID=""
fi

FAILED=()
NOTES=()
for round in $(seq "$ROUNDS"); do
for name in $(round_order "$round"); do
    for u in "${REPLICA_URLS[@]}"; do
        curl -fsS -o /dev/null -X POST "$u/reset_prefix_cache"
    done
    mapfile -t ports < <(ports2)
    echo "== round $round/$ROUNDS, $name: starting on 127.0.0.1:${ports[0]}" >&2
    if ! start_balancer "$name" "${ports[0]}" "${ports[1]}"; then
        why="did not start (log: $(tail -n 3 "$TMP/$name.log" 2>/dev/null | tr '\n' ' ' | cut -c1-300))"
        say "FAILED: $name $why"
        FAILED+=(--failed "$name=$why")
        echo "$name" >>"$TMP/failed"
        stop_tree "$BALANCER_PID"
        BALANCER_PID=""
        continue
    fi
    replay_args=(replay --target "http://127.0.0.1:${ports[0]}" --trace "$TRACE"
        --start "$START" --duration "$SLICE" --speedup "$SPEEDUP" --time-scale "$TIME_SCALE"
        --models "$MODELS" --label "$name" --json "$TMP/$name.r$round.json" --quiet)
    [ -n "$MAX_OUTPUT" ] && replay_args+=(--max-output "$MAX_OUTPUT")
    for u in "${REPLICA_URLS[@]}"; do replay_args+=(--replica "$u"); done
    if ! on_core "$BALANCER_CORE" "$KVLB" "${replay_args[@]}" >"$TMP/$name.replay.txt" 2>"$TMP/$name.replay.log"; then
        why="replay failed: $(tail -n 3 "$TMP/$name.replay.log" | tr '\n' ' ' | cut -c1-300)"
        say "FAILED: $name $why"
        FAILED+=(--failed "$name=$why")
        echo "$name" >>"$TMP/failed"
    fi
    if [ "$name" = kvlb ]; then
        # How often kvlb still sent an adapter's request to a replica with its LoRA slots full.
        NOTES+=("round $round, kvlb: $(curl -fsS --max-time 5 "http://127.0.0.1:${ports[1]}/metrics" 2>/dev/null |
            grep -E '^kvlb_(lora_slot_waits_total|decisions_total)' | tr '\n' ' ' || true)")
    fi
    stop_tree "$BALANCER_PID"
    BALANCER_PID=""
done
done

# --- report: one table per round ----------------------------------------------------------
SUMMARIES=()
for round in $(seq "$ROUNDS"); do
    runs=()
    for name in $BALANCERS; do
        [ -f "$TMP/$name.r$round.json" ] && runs+=("$TMP/$name.r$round.json")
    done
    [ "${#runs[@]}" -eq 0 ] && continue
    SUMMARIES+=("${runs[@]}")
    say "## round $round"
    json=""
    [ -n "$RESULTS_JSON" ] && json=${RESULTS_JSON%.json}.r$round.json
    "$KVLB" replay report --kvlb kvlb ${json:+--json "$json"} "${FAILED[@]}" "${runs[@]}" |
        tee -a "$RESULTS_TXT"
done
say ""
say "(times in engine seconds. Top table: hit_rate and requests per replica from the replicas'"
say " /metrics (order: two 8B+LoRA replicas, two 0.6B replicas). Per-model table: errors include"
say " every 404 a replica gave for a model it does not serve; hit_rate = cached_tokens / prompt_tokens"
say " of the answers' usage; TTFT is over answered requests only, so a router's 404s also shed load)"
for s in "${SUMMARIES[@]}"; do
    python3 - "$s" <<'PY' | tee -a "$RESULTS_TXT"
import json, sys
s = json.load(open(sys.argv[1]))
print("%s (%s): %d of %d requests failed%s" % (s["label"], sys.argv[1].rsplit(".", 2)[-2], s["errors"], s["requests"],
      "; first errors: " + " | ".join(e[:110] for e in s["error_samples"][:2]) if s["errors"] else ""))
PY
done
for n in "${NOTES[@]}"; do say "$n"; done
say "results: $RESULTS_TXT${RESULTS_JSON:+, $RESULTS_JSON}"
FINISHED=1
