#!/usr/bin/env bash
# End to end against the peers: kvlb vs sglang-router vs vllm-router vs nginx, in front of the
# same simulated fleet, on the same slice of a real trace, in one invocation.
#
# One `kvlb replica --count REPLICAS` fleet (simulated vLLM replicas with KV cache events on)
# stays up for the whole run. For each balancer in turn: every replica's prefix cache is reset
# (POST /reset_prefix_cache), the balancer is started in front of the four replicas, the same
# trace slice is replayed through it by `kvlb replay` (streaming chat requests at the trace's
# arrival times, TTFT = first SSE event), and the balancer is stopped. `kvlb replay report` then
# prints the table and kvlb's ratios to round-robin and to the best peer, and writes
# bench/results/e2e-peers.{txt,json,svg}.
#
# Balancers (BALANCERS, in this order by default):
#   kvlb                     kvlb serve --policy cache_aware, subscribed to the replicas' KV events
#   kvlb-matched             the same, also given KVLB_MATCHED_ARGS (not by default: for timing
#                            constants that match the fleet, e.g. "--prefill-s-per-token 0.00009
#                            --decode-step-s 0.024" for SPEEDS=0.333)
#   kvlb-round_robin         kvlb serve --policy round_robin (the reference)
#   sglang-router            sglang-router (PyPI sglang-router), --policy cache_aware
#   vllm-router-cache_aware  vllm-router (PyPI vllm-router), --policy cache_aware
#   vllm-router-kv_aware     vllm-router --policy kv_aware --kv-event-source per replica
#   nginx                    nginx, round-robin upstream, proxy_buffering off
#   nginx-least_conn         the same with least_conn (fewest open connections)
#
# Time: the replicas run TIME_SCALE times faster than a real GPU; the trace's arrivals are
# compressed by LOAD in engine time, so by LOAD * TIME_SCALE in wall time. Reported times are
# engine seconds (wall seconds * TIME_SCALE). Each balancer gets DURATION wall seconds of trace
# (DURATION * LOAD * TIME_SCALE trace seconds, starting at START).
#
# Pinning (PIN=1, default): the fleet on core FLEET_CORE (1), the balancer and the replayer on
# core BALANCER_CORE (0), so a balancer's CPU use does not slow the simulated GPUs' clocks and
# every balancer gets the same fleet. PIN=0 leaves placement to the scheduler.
#
# ROUNDS=N measures every balancer N times, the order reversed every other round, and keeps each
# balancer's run with the lowest p99 TTFT (other processes on a shared machine only ever slow
# a run down); every run's TTFT is listed under the table.
#
# KV events: the fleet writes them as maps with every key present, nil values included
# (KV_EVENTS_FORMAT=map-nil), because vllm-router 0.1.17's kv_aware rejects maps that leave nil
# keys out (as vLLM 0.33 writes them: KV_EVENTS_FORMAT=map) and positional arrays
# (KV_EVENTS_FORMAT=array); kvlb reads all three.
#
# Mixed fleets: SPEEDS gives each replica a speed (`kvlb replica --speed`: one factor for all or
# one per replica, X or PxD, e.g. 1,1,0.333,0.333 for two replicas at a third of the prefill and
# decode speed), TIMING_SPREAD jitters every engine step (`--timing-spread`). Every balancer is
# told nothing of either: kvlb prices the replicas with its default timing and learns the rest.
#
# Balance: the replayer reads each replica's queue gauges every 100 ms; `idle_q` is the share of
# those moments with a replica idle while another had requests waiting, `min/mean` the idlest
# replica's computed prompt tokens over the mean.
#
# Environment: TRACE (traces/mooncake_conversation_trace.jsonl; a relative path is taken from
# the checkout's root; gen:agent-sessions for the generated agent sessions), START (0),
# DURATION (75), LOAD (1), TIME_SCALE (5), REPLICAS (4), SPEEDS (1), TIMING_SPREAD (0),
# MAX_OUTPUT (cap output tokens; default the trace's),
# BALANCERS (all six), ROUNDS (1), WARMUP (15: wall seconds of warm-up traffic through the fresh
# fleet before any measurement, from trace second WARMUP_START, 3000), PIN (1), FLEET_CORE (1), BALANCER_CORE (0), KVLB_BIN (a kvlb binary to
# use instead of building target/release/kvlb), RESULTS_NAME (e2e-peers), KVLB_ARGS (more
# `kvlb serve` flags for both kvlb balancers, e.g. "--config cost.toml"), KVLB_REPLICA_OPTS
# (appended to each of their --replica specs, e.g. ",metrics=off"), KVLB_EVENTS (1; 0: the
# kvlb balancers do not subscribe to the KV events and learn residency from routing alone),
# KVLB_MATCHED_ARGS (kvlb-matched's own flags), ACCESS_LOGS (a directory: the kvlb balancers
# write their access logs there, one file per balancer and round, for a tail analysis).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=bench/lib/packages.sh
source bench/lib/packages.sh
# shellcheck source=bench/lib/peers.sh
source bench/lib/peers.sh

TRACE=${TRACE:-traces/mooncake_conversation_trace.jsonl}
START=${START:-0}
DURATION=${DURATION:-75}
DURATION=${DURATION%s}
LOAD=${LOAD:-1}
TIME_SCALE=${TIME_SCALE:-5}
REPLICAS=${REPLICAS:-4}
MAX_OUTPUT=${MAX_OUTPUT:-}
BALANCERS=${BALANCERS:-kvlb kvlb-round_robin sglang-router vllm-router-cache_aware vllm-router-kv_aware nginx}
SPEEDS=${SPEEDS:-1}
TIMING_SPREAD=${TIMING_SPREAD:-0}
KVLB_MATCHED_ARGS=${KVLB_MATCHED_ARGS:-}
ACCESS_LOGS=${ACCESS_LOGS:-}
ROUNDS=${ROUNDS:-1}
WARMUP=${WARMUP:-15}
WARMUP=${WARMUP%s}
WARMUP_START=${WARMUP_START:-3000}
PIN=${PIN:-1}
KV_EVENTS_FORMAT=${KV_EVENTS_FORMAT:-map-nil}
FLEET_CORE=${FLEET_CORE:-1}
BALANCER_CORE=${BALANCER_CORE:-0}
RESULTS_NAME=${RESULTS_NAME:-e2e-peers}
KVLB_ARGS=${KVLB_ARGS:-}
KVLB_REPLICA_OPTS=${KVLB_REPLICA_OPTS:-}
KVLB_EVENTS=${KVLB_EVENTS:-1}
VENV=$ROOT/bench/.venv
LIB=$ROOT/bench/lib

kvlb_require number START DURATION LOAD TIME_SCALE WARMUP WARMUP_START TIMING_SPREAD
kvlb_require whole ROUNDS REPLICAS FLEET_CORE BALANCER_CORE
[ -z "${MAX_OUTPUT:-}" ] || kvlb_require whole MAX_OUTPUT
if [ "$ROUNDS" -lt 1 ]; then
    echo "error: ROUNDS must be at least 1" >&2
    exit 2
fi
if [ "$(echo "$BALANCERS" | tr ' ' '\n' | grep -c .)" -ne "$(echo "$BALANCERS" | tr ' ' '\n' | grep . | sort -u | wc -l)" ]; then
    echo "error: a balancer appears twice in BALANCERS='$BALANCERS' (use ROUNDS to repeat runs)" >&2
    exit 2
fi
for b in $BALANCERS; do
    case $b in
    kvlb | kvlb-round_robin | sglang-router | vllm-router-cache_aware | vllm-router-kv_aware | nginx | nginx-least_conn) ;;
    kvlb-matched)
        if [ -z "$KVLB_MATCHED_ARGS" ]; then
            echo "error: kvlb-matched needs KVLB_MATCHED_ARGS (its timing flags)" >&2
            exit 2
        fi
        ;;
    *)
        echo "error: unknown balancer '$b' in BALANCERS (known: kvlb kvlb-matched kvlb-round_robin" \
            "sglang-router vllm-router-cache_aware vllm-router-kv_aware nginx nginx-least_conn)" >&2
        exit 2
        ;;
    esac
done
if [ -n "$ACCESS_LOGS" ]; then
    mkdir -p "$ACCESS_LOGS"
    ACCESS_LOGS=$(cd "$ACCESS_LOGS" && pwd)
fi
if [[ $TRACE != gen:* ]] && [ ! -r "$TRACE" ]; then
    echo "error: TRACE=$TRACE is not readable (see traces/README.md)" >&2
    exit 2
fi
if [ "$PIN" = 1 ] && { [ "$FLEET_CORE" -ge "$(nproc)" ] || [ "$BALANCER_CORE" -ge "$(nproc)" ]; }; then
    echo "error: FLEET_CORE=$FLEET_CORE / BALANCER_CORE=$BALANCER_CORE, but this machine has $(nproc) cores" >&2
    exit 2
fi

# --- peers, installed idempotently -------------------------------------------------------
kvlb_ensure_packages nginx curl python3-venv
kvlb_peers_venv
kvlb_bench_binary
kvlb_peer_versions
NGINX_VERSION=$(nginx -v 2>&1 | sed 's/.*nginx\///')

# --- bookkeeping --------------------------------------------------------------------------
kvlb_bench_bookkeeping e2e
# nginx's workers (another user when not root) read the configuration written there.
chmod 755 "$TMP"
RESULTS_JSON=$ROOT/bench/results/$RESULTS_NAME.json
RESULTS_SVG=$ROOT/bench/results/$RESULTS_NAME.svg

free_port() { python3 "$LIB/procstat.py" ports 1; }

# --- the fleet ---------------------------------------------------------------------------
on_core "$FLEET_CORE" "$KVLB" replica --listen 127.0.0.1:0 --count "$REPLICAS" \
    --time-scale "$TIME_SCALE" --model sim --kv-events tcp://127.0.0.1:0 \
    --kv-events-format "$KV_EVENTS_FORMAT" --speed "$SPEEDS" --timing-spread "$TIMING_SPREAD" \
    2>"$TMP/fleet.log" &
FLEET_PID=$!
FLEET_PIDS+=("$FLEET_PID")
kvlb_fleet_ready "$TMP/fleet.log" "$FLEET_PID" "$REPLICAS" 150
REPLICA_URLS=("${REPLICA_ADDRS[@]/#/http://}")

SPEEDUP=$(python3 -c "print($LOAD * $TIME_SCALE)")
SLICE=$(python3 -c "print($DURATION * $LOAD * $TIME_SCALE)")
say "# kvlb end to end against the peers ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $(uname -r))"
say "trace: $(basename "$TRACE"), trace seconds $START..$(python3 -c "print($START + $SLICE)"), load x$LOAD (engine time)"
say "fleet: $REPLICAS x kvlb replica (8B model on H100 timing, 400k KV tokens each), time scale $TIME_SCALE, KV events on"
[ "$SPEEDS" = 1 ] || say "speeds: $SPEEDS (kvlb replica --speed; the balancers are not told)"
[ "$TIMING_SPREAD" = 0 ] || say "timing spread: $TIMING_SPREAD (each engine step's time jittered)"
[ -n "$KVLB_MATCHED_ARGS" ] && say "kvlb-matched: kvlb given '$KVLB_MATCHED_ARGS'"
say "rounds: $ROUNDS (order reversed every other round; with more than one, the table shows each balancer's run with the lowest p99 TTFT)"
[ -n "$KVLB_ARGS$KVLB_REPLICA_OPTS" ] && say "kvlb extra: flags '$KVLB_ARGS', replica options '$KVLB_REPLICA_OPTS'"
[ "$KVLB_EVENTS" = 1 ] || say "kvlb: not subscribed to the KV events (KVLB_EVENTS=0): residency learned from routing alone"
say "replay: speedup $SPEEDUP wall, streaming chat, ${MAX_OUTPUT:-trace} output tokens; times below are engine seconds (wall x $TIME_SCALE)"
if [ "$PIN" = 1 ]; then
    say "pinning: fleet on core $FLEET_CORE; each balancer and the replayer on core $BALANCER_CORE"
else
    say "pinning: none"
fi
say "peers: sglang-router $SGLANG_VERSION, vllm-router $VLLM_ROUTER_VERSION, nginx $NGINX_VERSION"
say "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
say ""

# --- balancers -----------------------------------------------------------------------------
# Starts balancer $1 on port $2 (metrics port $3); sets BALANCER_PID; its log is $TMP/$1.log.
start_balancer() {
    local name=$1 port=$2 mport=$3 args=() i
    case $name in
    kvlb | kvlb-matched | kvlb-round_robin)
        local policy=cache_aware extra=()
        [ "$name" = kvlb-round_robin ] && policy=round_robin
        # shellcheck disable=SC2206 # KVLB_MATCHED_ARGS is a list of flags
        [ "$name" = kvlb-matched ] && extra=($KVLB_MATCHED_ARGS)
        [ -n "$ACCESS_LOGS" ] && extra+=(--access-log "$ACCESS_LOGS/$name.r$round.jsonl")
        for i in "${!REPLICA_URLS[@]}"; do
            if [ "$KVLB_EVENTS" = 1 ]; then
                args+=(--replica "${REPLICA_URLS[$i]},kv_events=${REPLICA_EVENTS[$i]}$KVLB_REPLICA_OPTS")
            else
                args+=(--replica "${REPLICA_URLS[$i]}$KVLB_REPLICA_OPTS")
            fi
        done
        # shellcheck disable=SC2086 # KVLB_ARGS is a list of flags
        on_core "$BALANCER_CORE" "$KVLB" serve --listen "127.0.0.1:$port" \
            --admin "127.0.0.1:$mport" --workers 1 --cores "$BALANCER_CORE" \
            --policy "$policy" "${args[@]}" $KVLB_ARGS "${extra[@]}" >"$TMP/$name.log" 2>&1 &
        ;;
    sglang-router)
        on_core "$BALANCER_CORE" "$VENV/bin/python" -m sglang_router.launch_router \
            --host 127.0.0.1 --port "$port" --worker-urls "${REPLICA_URLS[@]}" \
            --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warn >"$TMP/$name.log" 2>&1 &
        ;;
    vllm-router-cache_aware)
        on_core "$BALANCER_CORE" "$VENV/bin/vllm-router" \
            --host 127.0.0.1 --port "$port" --worker-urls "${REPLICA_URLS[@]}" \
            --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warning >"$TMP/$name.log" 2>&1 &
        ;;
    vllm-router-kv_aware)
        for i in "${!REPLICA_URLS[@]}"; do
            args+=(--kv-event-source "${REPLICA_URLS[$i]}=${REPLICA_EVENTS[$i]}")
        done
        on_core "$BALANCER_CORE" "$VENV/bin/vllm-router" \
            --host 127.0.0.1 --port "$port" --worker-urls "${REPLICA_URLS[@]}" \
            --policy kv_aware "${args[@]}" --kv-event-model sim --kv-event-block-size 16 \
            --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
            --log-level warning >"$TMP/$name.log" 2>&1 &
        ;;
    nginx | nginx-least_conn)
        {
            echo "worker_processes 1; daemon off; pid $TMP/nginx.pid;"
            echo "error_log $TMP/nginx-error.log warn;"
            [ "$(id -u)" -eq 0 ] && echo "user root;"
            echo "events { worker_connections 8192; }"
            echo "http {"
            echo "  access_log off; client_max_body_size 0; client_body_buffer_size 1m;"
            echo "  client_body_temp_path $TMP/nginx-body; proxy_temp_path $TMP/nginx-proxy;"
            echo "  fastcgi_temp_path $TMP/nginx-fcgi; uwsgi_temp_path $TMP/nginx-uwsgi; scgi_temp_path $TMP/nginx-scgi;"
            echo "  upstream replicas {"
            [ "$name" = nginx-least_conn ] && echo "    least_conn;"
            for u in "${REPLICA_URLS[@]}"; do echo "    server ${u#http://};"; done
            echo "    keepalive 256;"
            echo "  }"
            echo "  server {"
            echo "    listen 127.0.0.1:$port backlog=4096;"
            echo "    location / {"
            echo "      proxy_pass http://replicas; proxy_http_version 1.1;"
            echo "      proxy_set_header Connection \"\"; proxy_buffering off;"
            echo "      proxy_read_timeout 3600s; proxy_send_timeout 3600s;"
            echo "    }"
            echo "  }"
            echo "}"
        } >"$TMP/nginx.conf"
        on_core "$BALANCER_CORE" nginx -c "$TMP/nginx.conf" -e "$TMP/nginx-error.log" \
            >"$TMP/$name.log" 2>&1 &
        ;;
    esac
    BALANCER_PID=$!
    # Ready when it answers /v1/models (every balancer forwards or serves it).
    if ! wait_http "http://127.0.0.1:$port/v1/models" "$BALANCER_PID" 60; then
        return 1
    fi
}

# Warm-up: a fresh fleet's first minute is not like the others (threads, pages and pools are
# created on demand), so WARMUP wall seconds of traffic from elsewhere in the trace go through
# a round-robin kvlb first; the prefix caches are reset before every measured run anyway.
if [ "$WARMUP" != 0 ]; then
    mapfile -t ports < <(python3 "$LIB/procstat.py" ports 2)
    warm_args=()
    for u in "${REPLICA_URLS[@]}"; do warm_args+=(--replica "$u"); done
    on_core "$BALANCER_CORE" "$KVLB" serve --listen "127.0.0.1:${ports[0]}" \
        --admin "127.0.0.1:${ports[1]}" --workers 1 --cores "$BALANCER_CORE" \
        --policy round_robin "${warm_args[@]}" >"$TMP/warmup.log" 2>&1 &
    BALANCER_PID=$!
    if wait_http "http://127.0.0.1:${ports[0]}/v1/models" "$BALANCER_PID" 30; then
        on_core "$BALANCER_CORE" "$KVLB" replay --target "http://127.0.0.1:${ports[0]}" \
            --trace "$TRACE" --start "$WARMUP_START" \
            --duration "$(python3 -c "print($WARMUP * $LOAD * $TIME_SCALE)")" \
            --speedup "$SPEEDUP" --time-scale "$TIME_SCALE" --model sim --quiet --label warmup \
            >"$TMP/warmup.txt" 2>&1 || true
        say "warm-up: $(grep -E "^warmup " "$TMP/warmup.txt" | awk '{print $2 " requests, " $3 " errors"}') in ${WARMUP} s through a round-robin kvlb (trace from $WARMUP_START s)"
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
    mapfile -t ports < <(python3 "$LIB/procstat.py" ports 2)
    port=${ports[0]}
    mport=${ports[1]}
    echo "== round $round/$ROUNDS, $name: starting on 127.0.0.1:$port" >&2
    if ! start_balancer "$name" "$port" "$mport"; then
        why="did not start (log: $(tail -n 3 "$TMP/$name.log" "$TMP/nginx-error.log" 2>/dev/null | tr '\n' ' ' | cut -c1-300))"
        say "FAILED: $name $why"
        FAILED+=(--failed "$name=$why")
        echo "$name" >>"$TMP/failed"
        stop_tree "$BALANCER_PID"
        BALANCER_PID=""
        continue
    fi
    load_before=$(cut -d' ' -f1 /proc/loadavg)
    ticks_before=$(python3 "$LIB/procstat.py" ticks "$BALANCER_PID")
    fleet_before=$(python3 "$LIB/procstat.py" ticks "$FLEET_PID")
    wall_before=$(date +%s.%N)
    replay_args=(replay --target "http://127.0.0.1:$port" --trace "$TRACE"
        --start "$START" --duration "$SLICE" --speedup "$SPEEDUP" --time-scale "$TIME_SCALE"
        --model sim --label "$name" --json "$TMP/$name.r$round.json")
    [ -n "$MAX_OUTPUT" ] && replay_args+=(--max-output "$MAX_OUTPUT")
    for u in "${REPLICA_URLS[@]}"; do replay_args+=(--replica "$u"); done
    if on_core "$BALANCER_CORE" "$KVLB" "${replay_args[@]}" >"$TMP/$name.replay.txt" 2>"$TMP/$name.replay.log"; then
        ticks_after=$(python3 "$LIB/procstat.py" ticks "$BALANCER_PID")
        fleet_after=$(python3 "$LIB/procstat.py" ticks "$FLEET_PID")
        wall=$(python3 -c "print($(date +%s.%N) - $wall_before)")
        cpu=$(python3 -c "
hz = $(getconf CLK_TCK)
print('balancer CPU %.1f s, fleet CPU %.1f s, replayer CPU %.1f s, in %.1f s wall'
      % (($ticks_after - $ticks_before) / hz, ($fleet_after - $fleet_before) / hz,
         $(python3 -c "import json; print(json.load(open('$TMP/$name.r$round.json'))['replayer_cpu_s'])"), $wall))")
        ttft=$(python3 -c "import json; s = json.load(open('$TMP/$name.r$round.json')); print('p50 %.3f p99 %.3f' % (s['ttft_p50_s'] or 0, s['ttft_p99_s'] or 0))")
        NOTES+=("round $round, $name: TTFT $ttft; $cpu; load average ${load_before} -> $(cut -d' ' -f1 /proc/loadavg)")
    else
        why="replay failed: $(tail -n 3 "$TMP/$name.replay.log" | tr '\n' ' ' | cut -c1-300)"
        say "FAILED: $name $why"
        FAILED+=(--failed "$name=$why")
        echo "$name" >>"$TMP/failed"
    fi
    if [ "$name" = vllm-router-kv_aware ]; then
        lookups=$(curl -fsS --max-time 5 "http://127.0.0.1:$mport/metrics" 2>/dev/null |
            grep '^vllm_router_kv_placement_lookups_total' | sed 's/vllm_router_kv_placement_lookups_total//' | tr '\n' ' ' || true)
        rejected=$(grep -c 'kv_index decode batch' "$TMP/$name.log" || true)
        reason=$(sed 's/\x1b\[[0-9;]*m//g' "$TMP/$name.log" | grep -o 'kv_index decode batch: .*' | head -n 1 || true)
        NOTES+=("round $round, vllm-router-kv_aware: KV placement lookups ${lookups:-none reported}; event batches it could not decode: $rejected${reason:+ ($reason)}")
    fi
    stop_tree "$BALANCER_PID"
    BALANCER_PID=""
done
done

# With several rounds, each balancer's run with the lowest p99 TTFT goes in the table (a busy
# machine only ever slows a run down); every run is listed in the notes below it.
mapfile -t SUMMARIES < <(kvlb_best_runs)
FAILED_UNIQUE=()
for name in $BALANCERS; do
    if grep -q "^$name\$" "$TMP/failed" 2>/dev/null; then
        for ((i = 0; i < ${#FAILED[@]}; i += 2)); do
            case ${FAILED[$((i + 1))]} in "$name="*)
                FAILED_UNIQUE+=(--failed "${FAILED[$((i + 1))]}")
                break
                ;;
            esac
        done
    fi
done

# --- report --------------------------------------------------------------------------------
say ""
title="kvlb vs peers, live: $(basename "$TRACE" .jsonl), $REPLICAS replicas, load x$LOAD, time scale $TIME_SCALE"
"$KVLB" replay report --title "$title" --kvlb kvlb --json "$RESULTS_JSON" --plot "$RESULTS_SVG" \
    "${FAILED_UNIQUE[@]}" "${SUMMARIES[@]}" | tee -a "$RESULTS_TXT"
say ""
say "(times in engine seconds; hit_rate = prompt tokens found in the replicas' prefix caches /"
say " prompt tokens looked up, from their own /metrics; max/mean = busiest replica's prompt tokens"
say " computed over the mean; requests per replica also from the replicas' counters)"
for n in "${NOTES[@]}"; do say "$n"; done
# The simulator's prediction for the same requests: how far the live fleet was from its model
# (a busy machine slows the simulated GPUs' clocks and shows up as a gap here).
if [ "$START" = 0 ] && [ "${#SUMMARIES[@]}" -gt 0 ]; then
    n=$(python3 -c "import json; print(json.load(open('${SUMMARIES[0]}'))['requests'])")
    say ""
    say "kvlb simulate on the same $n requests (no live noise; engine seconds):"
    "$KVLB" simulate --trace "$TRACE" --replicas "$REPLICAS" --speedup "$LOAD" --limit "$n" \
        --speeds "$SPEEDS" --timing-spread "$TIMING_SPREAD" \
        --policies round_robin,sglang_cache_aware,cache_aware 2>/dev/null | tail -n +2 | head -n 4 |
        tee -a "$RESULTS_TXT"
fi
say "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
say "results: $RESULTS_TXT, $RESULTS_JSON, $RESULTS_SVG"
FINISHED=1
