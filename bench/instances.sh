#!/usr/bin/env bash
# Several kvlb instances at scale: one fleet of REPLICAS (64) simulated replicas, the same slice
# of a trace replayed through ONE `kvlb serve` instance and through INSTANCES (8) of them, each
# in front of every replica, subscribed to every replica's KV events and scraping its /metrics.
# The instances share nothing with each other: what they know of the fleet comes from the
# replicas' own reports. Does the fleet get the same balance and hit rate?
#
# One `kvlb replica --count REPLICAS` process stays up for the whole run. Per measured run: every
# replica's prefix cache is reset, the instances are started (cache_aware, --workers 1, access
# log on) and waited for until each has every replica's event stream and a fresh scrape, and a
# spreader is started in front of them: kvlb itself, `--policy round_robin` over the instances'
# listeners (with one instance too, so both runs cross the same two hops). The trace slice is
# replayed through the spreader by `kvlb replay` (streaming completions whose prompts are the
# replicas' token ids, so that the replicas' KV events name the blocks of the very prompts
# kvlb hashes: every instance learns where each prefix is resident; chat prompts hashed as text
# are not matched by events, see docs/design.md), which reads each replica's /metrics before
# and after: requests, prompt tokens computed and hit rate per replica.
#
# Agreement, with INSTANCES instances: every SAMPLE_EVERY seconds of the run, every instance's
# /replicas and every replica's /metrics are read at once: per replica, how far apart the
# instances' reported blocks (from KV events) and resident blocks (events and their own routing
# guesses) are, and how far each instance's view of its load (its own requests there plus the
# foreign ones of its last scrape) is from the replica's own running + waiting. After the run,
# PROBES prompts from just after the slice (continuing its conversations) are sent through each
# instance in turn, one at a time on an otherwise idle fleet (max 1 output token): how often all
# instances choose the same replica for the same prompt.
#
# Time: the replicas run TIME_SCALE times faster than a real GPU; the trace's arrivals are
# compressed by LOAD in engine time (LOAD x TIME_SCALE in wall time). Reported times are engine
# seconds. Each run gets DURATION wall seconds of trace from START. The replicas run at SPEED
# (kvlb replica --speed: 0.25, four times slower than an 8B model on one H100), so that 64 of
# them are as busy as the other benches' four replicas at LOAD 0.5 while the fleet, nine kvlb
# processes and the replayer fit on two cores; every instance is given that speed's timing.
#
# Environment: TRACE (traces/mooncake_conversation_trace.jsonl; gen:agent-sessions works too),
# START (0), DURATION (120 wall seconds per run), LOAD (2), TIME_SCALE (1), SPEED (0.25),
# REPLICAS (64),
# INSTANCES (8), MAX_OUTPUT (128: cap on output tokens), METRICS_INTERVAL (each
# instance's --metrics-interval, kvlb's default 1s), ROUNDS (1; the order one/many reversed
# every other round), WARMUP (10 wall seconds through the fresh fleet first, trace from
# WARMUP_START, 3000), SAMPLE_EVERY (5), PROBES (40), KVLB_ARGS (more flags for every instance),
# PIN (0; 1: the fleet on core FLEET_CORE, kvlb and the replayer on BALANCER_CORE), KVLB_BIN,
# RESULTS_NAME (instances-DATE), KEEP_DIR (a directory: the run's files, the instances' access
# logs, the samples and the replay summaries, are copied there at exit). Results: bench/results/RESULTS_NAME.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=bench/lib/peers.sh
source bench/lib/peers.sh

TRACE=${TRACE:-traces/mooncake_conversation_trace.jsonl}
START=${START:-0}
DURATION=${DURATION:-120}
DURATION=${DURATION%s}
LOAD=${LOAD:-2}
TIME_SCALE=${TIME_SCALE:-1}
SPEED=${SPEED:-0.25}
REPLICAS=${REPLICAS:-64}
INSTANCES=${INSTANCES:-8}
MAX_OUTPUT=${MAX_OUTPUT:-128}
METRICS_INTERVAL=${METRICS_INTERVAL:-1s}
ROUNDS=${ROUNDS:-1}
WARMUP=${WARMUP:-10}
WARMUP=${WARMUP%s}
WARMUP_START=${WARMUP_START:-3000}
SAMPLE_EVERY=${SAMPLE_EVERY:-5}
PROBES=${PROBES:-40}
KVLB_ARGS=${KVLB_ARGS:-}
PIN=${PIN:-0}
FLEET_CORE=${FLEET_CORE:-1}
BALANCER_CORE=${BALANCER_CORE:-0}
RESULTS_NAME=${RESULTS_NAME:-instances-$(date -u +%Y%m%d)}
KEEP_DIR=${KEEP_DIR:-}
LIB=$ROOT/bench/lib

kvlb_require number START DURATION LOAD TIME_SCALE SPEED WARMUP WARMUP_START SAMPLE_EVERY
kvlb_require count REPLICAS INSTANCES ROUNDS PROBES
kvlb_require whole FLEET_CORE BALANCER_CORE
[ -z "$MAX_OUTPUT" ] || kvlb_require count MAX_OUTPUT
if [ "$REPLICAS" -gt 64 ]; then
    # kvlb's default --max-replicas.
    echo "error: REPLICAS must be at most 64 (got $REPLICAS)" >&2
    exit 2
fi
if [[ $TRACE != gen:* ]] && [ ! -r "$TRACE" ]; then
    echo "error: TRACE=$TRACE is not readable (see traces/README.md)" >&2
    exit 2
fi
if [ "$PIN" = 1 ] && { [ "$FLEET_CORE" -ge "$(nproc)" ] || [ "$BALANCER_CORE" -ge "$(nproc)" ]; }; then
    echo "error: FLEET_CORE=$FLEET_CORE / BALANCER_CORE=$BALANCER_CORE, but this machine has $(nproc) cores" >&2
    exit 2
fi

kvlb_bench_binary
kvlb_bench_bookkeeping instances
# The instances, the spreader and the sampler: stopped at exit with the fleet.
INSTANCE_PIDS=()
SAMPLER_PID=""
stop_run() {
    local p
    [ -n "$SAMPLER_PID" ] && stop_tree "$SAMPLER_PID"
    SAMPLER_PID=""
    [ -n "$BALANCER_PID" ] && stop_tree "$BALANCER_PID"
    BALANCER_PID=""
    for p in "${INSTANCE_PIDS[@]}"; do stop_tree "$p"; done
    INSTANCE_PIDS=()
}
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    stop_run
    [ -n "$KEEP_DIR" ] && mkdir -p "$KEEP_DIR" && cp -r "$TMP"/. "$KEEP_DIR"/
    kvlb_bench_cleanup
}
trap cleanup EXIT
free_ports() { python3 "$LIB/procstat.py" ports "$1"; }

# --- the fleet ---------------------------------------------------------------------------
on_core "$FLEET_CORE" "$KVLB" replica --listen 127.0.0.1:0 --count "$REPLICAS" \
    --time-scale "$TIME_SCALE" --speed "$SPEED" --model sim --kv-events tcp://127.0.0.1:0 \
    2>"$TMP/fleet.log" &
FLEET_PID=$!
FLEET_PIDS+=("$FLEET_PID")
kvlb_fleet_ready "$TMP/fleet.log" "$FLEET_PID" "$REPLICAS" 300
REPLICA_LIST=$(IFS=,; echo "${REPLICA_ADDRS[*]}")

# The instances are told the replicas' speed (kvlb's default timing is an 8B model on one H100,
# --speed 1), so that one instance and several price them alike from the first request.
COST_ARGS="--prefill-s-per-token $(python3 -c "print('%.8f' % (0.00003 / $SPEED))") --decode-step-s $(python3 -c "print('%.6f' % (0.008 / $SPEED))")"
SPEEDUP=$(python3 -c "print($LOAD * $TIME_SCALE)")
SLICE=$(python3 -c "print($DURATION * $LOAD * $TIME_SCALE)")
PROBE_START=$(python3 -c "print($START + $SLICE)")
say "# kvlb: one instance against $INSTANCES in front of one fleet ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $(uname -r))"
say "trace: $(basename "$TRACE"), trace seconds $START..$PROBE_START, load x$LOAD (engine time), ${MAX_OUTPUT:-trace} output tokens"
say "fleet: $REPLICAS x kvlb replica (8B model on H100 timing at --speed $SPEED, 400k KV tokens each), time scale $TIME_SCALE, KV events on"
say "kvlb: each instance 'kvlb serve --policy cache_aware --workers 1 --metrics-interval $METRICS_INTERVAL $COST_ARGS $KVLB_ARGS', every replica with kv_events"
say "spreader: kvlb serve --policy round_robin --workers 1 over the instances' listeners (over the one instance too)"
say "replay: kvlb replay --api completions --prompt token-ids, streaming, speedup $SPEEDUP wall; times are engine seconds (wall x $TIME_SCALE)"
if [ "$PIN" = 1 ]; then
    say "pinning: fleet on core $FLEET_CORE; kvlb and the replayer on core $BALANCER_CORE"
else
    say "pinning: none"
fi
say "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

# --- warm-up ---------------------------------------------------------------------------------
# A fresh fleet's first seconds are not like the others (threads and pools made on demand):
# WARMUP wall seconds from elsewhere in the trace go through a round-robin kvlb first.
if [ "$WARMUP" != 0 ]; then
    mapfile -t ports < <(free_ports 2)
    warm_args=()
    for a in "${REPLICA_ADDRS[@]}"; do warm_args+=(--replica "http://$a"); done
    on_core "$BALANCER_CORE" "$KVLB" serve --listen "127.0.0.1:${ports[0]}" \
        --admin "127.0.0.1:${ports[1]}" --workers 1 --policy round_robin "${warm_args[@]}" \
        >"$TMP/warmup.log" 2>&1 &
    BALANCER_PID=$!
    if wait_http "http://127.0.0.1:${ports[0]}/v1/models" "$BALANCER_PID" 30; then
        on_core "$BALANCER_CORE" "$KVLB" replay --target "http://127.0.0.1:${ports[0]}" \
            --trace "$TRACE" --start "$WARMUP_START" \
            --duration "$(python3 -c "print($WARMUP * $LOAD * $TIME_SCALE)")" \
            --speedup "$SPEEDUP" --time-scale "$TIME_SCALE" --model sim --api completions \
            --prompt token-ids ${MAX_OUTPUT:+--max-output "$MAX_OUTPUT"} --quiet --label warmup \
            >"$TMP/warmup.txt" 2>&1 || true
        say "warm-up: $(grep -E "^warmup " "$TMP/warmup.txt" | awk '{print $2 " requests, " $3 " errors"}') in ${WARMUP} s (trace from $WARMUP_START s)"
    else
        say "warm-up: skipped, the warm-up balancer did not start"
    fi
    stop_tree "$BALANCER_PID"
    BALANCER_PID=""
fi
say ""

# --- one run: $1 = one|many, $2 = round --------------------------------------------------
INSTANCE_LISTEN=()
INSTANCE_ADMIN=()
start_instances() {
    local n=$1 tag=$2 i args=() ports
    for i in "${!REPLICA_ADDRS[@]}"; do
        args+=(--replica "http://${REPLICA_ADDRS[$i]},kv_events=${REPLICA_EVENTS[$i]}")
    done
    INSTANCE_LISTEN=()
    INSTANCE_ADMIN=()
    mapfile -t ports < <(free_ports $((2 * n)))
    for i in $(seq 0 $((n - 1))); do
        INSTANCE_LISTEN+=("127.0.0.1:${ports[$((2 * i))]}")
        INSTANCE_ADMIN+=("127.0.0.1:${ports[$((2 * i + 1))]}")
        # shellcheck disable=SC2086 # KVLB_ARGS is a list of flags
        on_core "$BALANCER_CORE" "$KVLB" serve --listen "${INSTANCE_LISTEN[$i]}" \
            --admin "${INSTANCE_ADMIN[$i]}" --workers 1 --policy cache_aware --explain \
            --metrics-interval "$METRICS_INTERVAL" --access-log "$TMP/$tag.i$i.jsonl" \
            "${args[@]}" $COST_ARGS $KVLB_ARGS >"$TMP/$tag.i$i.log" 2>&1 &
        INSTANCE_PIDS+=($!)
    done
    for i in $(seq 0 $((n - 1))); do
        if ! wait_http "http://${INSTANCE_LISTEN[$i]}/v1/models" "${INSTANCE_PIDS[$i]}" 60; then
            echo "error: instance $i did not start:" >&2
            tail -n 20 "$TMP/$tag.i$i.log" >&2
            return 1
        fi
    done
    if ! python3 "$LIB/instances.py" ready 60 "${INSTANCE_ADMIN[@]}"; then
        echo "error: the instances did not all get every replica's events and metrics" >&2
        return 1
    fi
    # A subscription lands on the publisher a little after the connection.
    sleep 0.5
}

run() {
    local mode=$1 round=$2 n=1 tag ports spread_args=() i replay_args
    [ "$mode" = many ] && n=$INSTANCES
    tag=$mode.r$round
    for a in "${REPLICA_ADDRS[@]}"; do
        curl -fsS -o /dev/null -X POST "http://$a/reset_prefix_cache"
    done
    echo "== round $round/$ROUNDS: $n instance(s)" >&2
    start_instances "$n" "$tag"
    mapfile -t ports < <(free_ports 2)
    for i in $(seq 0 $((n - 1))); do spread_args+=(--replica "http://${INSTANCE_LISTEN[$i]}"); done
    on_core "$BALANCER_CORE" "$KVLB" serve --listen "127.0.0.1:${ports[0]}" \
        --admin "127.0.0.1:${ports[1]}" --workers 1 --policy round_robin --slow-start 0 --health-interval off --max-fails 0 \
        "${spread_args[@]}" >"$TMP/$tag.spreader.log" 2>&1 &
    BALANCER_PID=$!
    if ! wait_http "http://127.0.0.1:${ports[0]}/v1/models" "$BALANCER_PID" 30; then
        echo "error: the spreader did not start:" >&2
        tail -n 20 "$TMP/$tag.spreader.log" >&2
        return 1
    fi
    python3 "$LIB/instances.py" sample "$TMP/$tag.samples.jsonl" "$SAMPLE_EVERY" \
        "$(IFS=,; echo "${INSTANCE_ADMIN[*]}")" "$REPLICA_LIST" &
    SAMPLER_PID=$!
    local load_before ticks_before fleet_before wall_before
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    ticks_before=$(python3 "$LIB/procstat.py" ticks "${INSTANCE_PIDS[@]}")
    fleet_before=$(python3 "$LIB/procstat.py" ticks "$FLEET_PID")
    wall_before=$(date +%s.%N)
    replay_args=(replay --target "http://127.0.0.1:${ports[0]}" --trace "$TRACE"
        --start "$START" --duration "$SLICE" --speedup "$SPEEDUP" --time-scale "$TIME_SCALE"
        --model sim --api completions --prompt token-ids --label "$mode" --quiet
        --json "$TMP/$tag.json")
    [ -n "$MAX_OUTPUT" ] && replay_args+=(--max-output "$MAX_OUTPUT")
    for a in "${REPLICA_ADDRS[@]}"; do replay_args+=(--replica "http://$a"); done
    if ! on_core "$BALANCER_CORE" "$KVLB" "${replay_args[@]}" >"$TMP/$tag.replay.txt" 2>&1; then
        say "FAILED: $n instance(s), round $round: replay: $(tail -n 3 "$TMP/$tag.replay.txt" | tr '\n' ' ' | cut -c1-300)"
        stop_run
        return 0
    fi
    stop_tree "$SAMPLER_PID"
    SAMPLER_PID=""
    local ticks_after fleet_after hz wall spread
    ticks_after=$(python3 "$LIB/procstat.py" ticks "${INSTANCE_PIDS[@]}")
    fleet_after=$(python3 "$LIB/procstat.py" ticks "$FLEET_PID")
    wall=$(python3 -c "print('%.1f' % ($(date +%s.%N) - $wall_before))")
    hz=$(getconf CLK_TCK)
    python3 "$LIB/instances.py" expected "$TMP/$tag.expected.json" "${INSTANCE_ADMIN[@]}"
    # How the spreader shared the requests among the instances (its responses per instance).
    spread=$(curl -fsS "http://127.0.0.1:${ports[1]}/replicas" |
        python3 -c "import json, sys; print(' '.join(str(r['responses']) for r in json.load(sys.stdin)['replicas']))")
    NOTES+=("round $round, $n instance(s): load average $load_before -> $(cut -d' ' -f1-3 /proc/loadavg); $(python3 -c "print('instances CPU %.1f s, fleet CPU %.1f s' % (($ticks_after - $ticks_before) / $hz, ($fleet_after - $fleet_before) / $hz))"), replayer CPU $(python3 -c "import json; print('%.1f' % json.load(open('$TMP/$tag.json'))['replayer_cpu_s'])") s, in $wall s wall; responses per instance (spreader): $spread")

    if [ "$mode" = many ]; then
        # The same prompts through each instance in turn; each instance's probe lines are the
        # access log lines after those of the run (written within a second).
        sleep 1.5
        local skip=()
        for i in $(seq 0 $((n - 1))); do
            skip+=("$(wc -l <"$TMP/$tag.i$i.jsonl")")
        done
        local probe_speedup
        probe_speedup=$(python3 -c "print(max(1.0, $LOAD * $TIME_SCALE / 8))")
        for i in $(seq 0 $((n - 1))); do
            on_core "$BALANCER_CORE" "$KVLB" replay --target "http://${INSTANCE_LISTEN[$i]}" \
                --trace "$TRACE" --start "$PROBE_START" --limit "$PROBES" \
                --speedup "$probe_speedup" --time-scale "$TIME_SCALE" --model sim \
                --api completions --prompt token-ids --max-output 1 --quiet \
                --label "probe$i" >"$TMP/$tag.probe$i.txt" 2>&1 || true
            # Its last blocks reach the other instances as KV events.
            sleep 0.5
        done
        sleep 1.5
        local logs=()
        for i in $(seq 0 $((n - 1))); do logs+=("$TMP/$tag.i$i.jsonl"); done
        python3 "$LIB/instances.py" probes "${logs[@]}" --skip "${skip[@]}" >"$TMP/$tag.probes.json"
    fi
    stop_run
}

NOTES=()
for round in $(seq "$ROUNDS"); do
    order="one many"
    [ $((round % 2)) -eq 0 ] && order="many one"
    for mode in $order; do
        run "$mode" "$round"
    done
done

# --- report --------------------------------------------------------------------------------
say ""
python3 "$LIB/instances.py" report "$TMP" "$ROUNDS" "$INSTANCES" | tee -a "$RESULTS_TXT"
say ""
say "(max/mean and cv: the busiest replica's requests or computed prompt tokens over the mean,"
say " and the standard deviation over the mean, from the replicas' own counters; idle: replicas"
say " sent nothing; hit = prompt tokens found in the replicas' prefix caches / prompt tokens"
say " looked up, from their /metrics; kvlb_hit = what the instances counted as resident where"
say " they sent each prompt (kvlb_model_matched_tokens_total / kvlb_model_prompt_tokens_total);"
say " TTFT in engine seconds, first streamed event)"
for n in "${NOTES[@]}"; do say "$n"; done
say "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
say "results: $RESULTS_TXT"
FINISHED=1
