#!/usr/bin/env bash
# Prefill/decode disaggregation, live: the same four simulated GPUs as four aggregated replicas
# or as two prefill + two decode replicas, and kvlb's disaggregated mode against vllm-router's
# and sglang-router's on the same fleets, the same trace slice, in one invocation.
#
# Three `kvlb replica` fleets stay up for the whole run, all on core FLEET_CORE:
#   aggregated  4 replicas (--count 4), KV events on
#   vllm        2 --role prefill (KV events on) + 2 --role decode: vLLM's protocol
#               (kv_transfer_params; the decode replica pulls the KV from the prefill replica's
#               side channel and waits out the transfer: prompt tokens x 128 KiB over 25 GB/s)
#   sglang      the same under --pd-protocol sglang (bootstrap host/port/room, both legs at once)
#
# Balancers (BALANCERS, in this order by default):
#   kvlb-aggregated   kvlb serve (cache_aware) in front of the aggregated fleet
#   kvlb-pd           kvlb serve --disaggregate always in front of the vllm fleet
#   kvlb-pd-priced    kvlb serve (--disaggregate priced, the default) in front of the vllm
#                     fleet: a request may be computed on a decode replica when cheaper
#   vllm-router-pd    vllm-router --vllm-pd-disaggregation --policy cache_aware, vllm fleet
#   kvlb-pd-sglang    kvlb serve in front of the sglang fleet (bootstrap_port per prefill replica)
#   sglang-router-pd  sglang-router --pd-disaggregation --policy cache_aware, sglang fleet
#
# For each balancer in turn: the prefix caches of its fleet are reset, the balancer is started,
# the trace slice is replayed through it by `kvlb replay` (streaming chat, TTFT = first SSE
# event, ITL = mean time between a request's streamed tokens), and the balancer is stopped.
# hit_rate is read from the prefill replicas' own /metrics for the disaggregated fleets (the
# prefix cache that matters lives there) and from all four for the aggregated one; for
# kvlb-pd-priced it misses the prompts computed on decode replicas directly.
#
# Environment: TRACE (gen:agent-sessions; or a trace file such as
# traces/mooncake_conversation_trace.jsonl), START (0), DURATION (36 wall seconds of trace),
# LOAD (1), TIME_SCALE (5), WARMUP_START (200: the trace second of the warm-up traffic),
# WARMUP (10 wall seconds through each fleet before the runs), BALANCERS (all six), ROUNDS (1;
# more: each balancer's run with the lowest p99 TTFT is kept, all are listed), PIN (1),
# FLEET_CORE (1), BALANCER_CORE (0), KVLB_BIN, RESULTS_NAME (pd). Results:
# bench/results/RESULTS_NAME.{txt,json,svg}. Times are engine seconds (wall x TIME_SCALE).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=bench/lib/packages.sh
source bench/lib/packages.sh
# shellcheck source=bench/lib/peers.sh
source bench/lib/peers.sh

TRACE=${TRACE:-gen:agent-sessions}
START=${START:-0}
DURATION=${DURATION:-36}
LOAD=${LOAD:-1}
TIME_SCALE=${TIME_SCALE:-5}
WARMUP=${WARMUP:-10}
WARMUP_START=${WARMUP_START:-200}
BALANCERS=${BALANCERS:-kvlb-aggregated kvlb-pd kvlb-pd-priced vllm-router-pd kvlb-pd-sglang sglang-router-pd}
ROUNDS=${ROUNDS:-1}
PIN=${PIN:-1}
FLEET_CORE=${FLEET_CORE:-1}
BALANCER_CORE=${BALANCER_CORE:-0}
RESULTS_NAME=${RESULTS_NAME:-pd}
VENV=$ROOT/bench/.venv
LIB=$ROOT/bench/lib

kvlb_require number START DURATION LOAD TIME_SCALE WARMUP WARMUP_START
kvlb_require count ROUNDS
for b in $BALANCERS; do
    case $b in
    kvlb-aggregated | kvlb-pd | kvlb-pd-priced | vllm-router-pd | kvlb-pd-sglang | sglang-router-pd) ;;
    *)
        echo "error: unknown balancer '$b' in BALANCERS (known: kvlb-aggregated kvlb-pd" \
            "kvlb-pd-priced vllm-router-pd kvlb-pd-sglang sglang-router-pd)" >&2
        exit 2
        ;;
    esac
done
if [[ $TRACE != gen:* ]] && [ ! -r "$TRACE" ]; then
    echo "error: TRACE=$TRACE is not readable (see traces/README.md)" >&2
    exit 2
fi

kvlb_ensure_packages curl python3-venv
kvlb_peers_venv
kvlb_bench_binary
kvlb_peer_versions
kvlb_bench_bookkeeping pd
RESULTS_JSON=$ROOT/bench/results/$RESULTS_NAME.json
RESULTS_SVG=$ROOT/bench/results/$RESULTS_NAME.svg

# Starts `kvlb replica` fleet part $1 (a name) with the flags after it; its startup lines are in
# $TMP/$1.log.
start_fleet() {
    local name=$1
    shift
    on_core "$FLEET_CORE" "$KVLB" replica --listen 127.0.0.1:0 --time-scale "$TIME_SCALE" \
        --model sim "$@" 2>"$TMP/$name.log" &
    FLEET_PIDS+=($!)
    for _ in $(seq 150); do
        grep -q '^kvlb replica: ready' "$TMP/$name.log" && return 0
        sleep 0.1
    done
    echo "error: kvlb replica ($name) did not start:" >&2
    cat "$TMP/$name.log" >&2
    exit 1
}

# The replicas of fleet part $1: lines "URL EVENTS BOOTSTRAP_PORT" (- when none).
fleet_replicas() {
    grep '^kvlb replica: replica ' "$TMP/$1.log" | while read -r line; do
        local addr events=- boot=- w
        addr=$(echo "$line" | awk '{print $6}')
        for w in $line; do
            case $w in
            kv_events=*) events=${w#kv_events=} ;;
            bootstrap=*) boot=${w##*:} ;;
            esac
        done
        echo "http://$addr $events $boot"
    done
}

EVENTS=(--kv-events tcp://127.0.0.1:0)
start_fleet aggregated --count 4 "${EVENTS[@]}"
start_fleet vllm-prefill --count 2 --role prefill "${EVENTS[@]}"
start_fleet vllm-decode --count 2 --role decode
start_fleet sglang-prefill --count 2 --role prefill --pd-protocol sglang "${EVENTS[@]}"
start_fleet sglang-decode --count 2 --role decode --pd-protocol sglang
for part in aggregated vllm-prefill vllm-decode sglang-prefill sglang-decode; do
    fleet_replicas "$part" >"$TMP/$part.replicas"
done

SPEEDUP=$(python3 -c "print($LOAD * $TIME_SCALE)")
SLICE=$(python3 -c "print($DURATION * $LOAD * $TIME_SCALE)")
say "# Prefill/decode disaggregation, live ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $(uname -r))"
say "trace: ${TRACE#gen:}, trace seconds $START..$(python3 -c "print($START + $SLICE)"), load x$LOAD (engine time)"
say "fleets: 4 x kvlb replica (8B model on H100 timing, 400k KV tokens each), time scale $TIME_SCALE:"
say "  aggregated 4; vllm 2 prefill + 2 decode (kv_transfer_params); sglang 2 + 2 (bootstrap rooms);"
say "  KV moves at 128 KiB a token over 25 GB/s (kvlb replica defaults)"
say "replay: speedup $SPEEDUP wall, streaming chat; times in engine seconds (wall x $TIME_SCALE)"
say "pinning: $([ "$PIN" = 1 ] && echo "fleets on core $FLEET_CORE, balancer and replayer on core $BALANCER_CORE" || echo none)"
say "peers: sglang-router $SGLANG_VERSION, vllm-router $VLLM_ROUTER_VERSION"
say "rounds: $ROUNDS"
say ""

# The fleet part(s) balancer $1 fronts.
fleet_of() {
    case $1 in
    kvlb-aggregated) echo aggregated ;;
    kvlb-pd | kvlb-pd-priced | vllm-router-pd) echo vllm-prefill vllm-decode ;;
    kvlb-pd-sglang | sglang-router-pd) echo sglang-prefill sglang-decode ;;
    esac
}

# Starts balancer $1 on port $2 (metrics or admin port $3); sets BALANCER_PID.
start_balancer() {
    local name=$1 port=$2 mport=$3 args=() url events boot prefill decode
    case $name in
    kvlb-aggregated)
        while read -r url events _; do args+=(--replica "$url,kv_events=$events"); done <"$TMP/aggregated.replicas"
        ;;
    kvlb-pd | kvlb-pd-priced)
        prefill=vllm-prefill decode=vllm-decode
        ;;
    kvlb-pd-sglang)
        prefill=sglang-prefill decode=sglang-decode
        ;;
    esac
    case $name in
    kvlb-*)
        if [ -n "${prefill:-}" ]; then
            while read -r url events boot; do
                local spec="$url,kv_events=$events,role=prefill"
                [ "$boot" != - ] && spec+=",bootstrap_port=$boot"
                args+=(--replica "$spec")
            done <"$TMP/$prefill.replicas"
            while read -r url _ _; do args+=(--replica "$url,role=decode"); done <"$TMP/$decode.replicas"
        fi
        [ "$name" = kvlb-pd ] && args+=(--disaggregate always)
        on_core "$BALANCER_CORE" "$KVLB" serve --listen "127.0.0.1:$port" \
            --admin "127.0.0.1:$mport" --workers 1 --cores "$BALANCER_CORE" \
            "${args[@]}" >"$TMP/$name.log" 2>&1 &
        ;;
    vllm-router-pd)
        while read -r url _ _; do args+=(--prefill "$url"); done <"$TMP/vllm-prefill.replicas"
        while read -r url _ _; do args+=(--decode "$url"); done <"$TMP/vllm-decode.replicas"
        on_core "$BALANCER_CORE" "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$port" \
            --vllm-pd-disaggregation "${args[@]}" --policy cache_aware \
            --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warning >"$TMP/$name.log" 2>&1 &
        ;;
    sglang-router-pd)
        while read -r url _ boot; do args+=(--prefill "$url" "$boot"); done <"$TMP/sglang-prefill.replicas"
        while read -r url _ _; do args+=(--decode "$url"); done <"$TMP/sglang-decode.replicas"
        on_core "$BALANCER_CORE" "$VENV/bin/python" -m sglang_router.launch_router \
            --host 127.0.0.1 --port "$port" --pd-disaggregation "${args[@]}" \
            --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warn >"$TMP/$name.log" 2>&1 &
        ;;
    esac
    BALANCER_PID=$!
    wait_http "http://127.0.0.1:$port/v1/models" "$BALANCER_PID" 60
}

# Replays trace seconds $2.. for $3 trace seconds through the balancer on port $1 with the
# replay flags after them.
replay() {
    local port=$1 from=$2 span=$3
    shift 3
    on_core "$BALANCER_CORE" "$KVLB" replay --target "http://127.0.0.1:$port" --trace "$TRACE" \
        --start "$from" --duration "$span" --speedup "$SPEEDUP" --time-scale "$TIME_SCALE" \
        --model sim "$@"
}

# Warm-up: each fleet's first minute is not like the others (threads, pools), so WARMUP wall
# seconds of traffic from elsewhere in the trace go through each, by the kvlb balancer of it.
if [ "$WARMUP" != 0 ]; then
    for name in kvlb-aggregated kvlb-pd kvlb-pd-sglang; do
        mapfile -t ports < <(python3 "$LIB/procstat.py" ports 2)
        if start_balancer "$name" "${ports[0]}" "${ports[1]}"; then
            replay "${ports[0]}" "$WARMUP_START" "$(python3 -c "print($WARMUP * $LOAD * $TIME_SCALE)")" \
                --quiet --label warmup >"$TMP/warmup.txt" 2>&1 || true
            say "warm-up of $(fleet_of "$name" | tr ' ' '+'): $(grep -E "^warmup " "$TMP/warmup.txt" | awk '{print $2 " requests, " $3 " errors"}')"
        else
            say "warm-up of $name's fleet skipped: it did not start"
        fi
        stop_tree "$BALANCER_PID"
        BALANCER_PID=""
    done
fi

FAILED=()
NOTES=()
for round in $(seq "$ROUNDS"); do
    for name in $(round_order "$round"); do
        parts=$(fleet_of "$name")
        replicas=()
        for part in $parts; do
            while read -r url _ _; do
                curl -fsS -o /dev/null -X POST "$url/reset_prefix_cache"
                # The prefix cache that matters: the prefill pool's (all four when aggregated).
                case $part in *-decode) ;; *) replicas+=(--replica "$url") ;; esac
            done <"$TMP/$part.replicas"
        done
        mapfile -t ports < <(python3 "$LIB/procstat.py" ports 2)
        echo "== round $round/$ROUNDS, $name: starting on 127.0.0.1:${ports[0]}" >&2
        if ! start_balancer "$name" "${ports[0]}" "${ports[1]}"; then
            why="did not start (log: $(tail -n 3 "$TMP/$name.log" | tr '\n' ' ' | cut -c1-300))"
            say "FAILED: $name $why"
            FAILED+=(--failed "$name=$why")
            echo "$name" >>"$TMP/failed"
            stop_tree "$BALANCER_PID"
            BALANCER_PID=""
            continue
        fi
        if replay "${ports[0]}" "$START" "$SLICE" --label "$name" --json "$TMP/$name.r$round.json" \
            "${replicas[@]}" >"$TMP/$name.replay.txt" 2>"$TMP/$name.replay.log"; then
            NOTES+=("round $round, $name: $(python3 -c "
import json; s = json.load(open('$TMP/$name.r$round.json'))
f = lambda v: '-' if v is None else '%.3f' % v
print('TTFT p50 %s p99 %s, ITL p50 %s p99 %s, %d errors' % (f(s['ttft_p50_s']), f(s['ttft_p99_s']), f(s.get('itl_p50_s')), f(s.get('itl_p99_s')), s['errors']))")")
        else
            why="replay failed: $(tail -n 3 "$TMP/$name.replay.log" | tr '\n' ' ' | cut -c1-300)"
            say "FAILED: $name $why"
            FAILED+=(--failed "$name=$why")
            echo "$name" >>"$TMP/failed"
        fi
        if [[ $name == kvlb-pd* ]]; then
            NOTES+=("round $round, $name: $(curl -fsS --max-time 5 "http://127.0.0.1:${ports[1]}/metrics" |
                grep '^kvlb_pd_requests_total' | sed 's/kvlb_pd_requests_total//' | tr '\n' ' ')")
        fi
        stop_tree "$BALANCER_PID"
        BALANCER_PID=""
    done
done

# Each balancer's run with the lowest p99 TTFT (a busy machine only ever slows a run down).
mapfile -t SUMMARIES < <(kvlb_best_runs)

say ""
"$KVLB" replay report --title "Prefill/decode disaggregation, live: ${TRACE#gen:}, 4 GPUs, time scale $TIME_SCALE" \
    --kvlb kvlb-pd --baseline kvlb-aggregated --json "$RESULTS_JSON" --plot "$RESULTS_SVG" \
    "${FAILED[@]}" "${SUMMARIES[@]}" | tee -a "$RESULTS_TXT"
say ""
say "(times in engine seconds; itl = a request's mean time between streamed tokens; hit_rate and"
say " requests per replica from the prefill replicas' own /metrics for the disaggregated fleets,"
say " all four replicas' for the aggregated one)"
for n in "${NOTES[@]}"; do say "$n"; done
say "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
say "results: $RESULTS_TXT, $RESULTS_JSON, $RESULTS_SVG"
FINISHED=1
