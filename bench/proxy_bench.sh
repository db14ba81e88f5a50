#!/usr/bin/env bash
# L7 proxy overhead benchmark: kvlb vs nginx vs HAProxy, side by side in one invocation, with
# the floor beside them (examples/relay_floor.rs: io_uring receives and sends of each message
# once, nothing else: what any proxy here pays for the sockets alone).
#
# Every proxy runs alone on core PROXY_CORE (default 0) in front of the same static nginx
# backend; the backend and the load generator (wrk: keep-alive, 64 connections, POST of a
# ~2 KiB OpenAI chat-completions body) share core LOAD_CORE (default 1). For each proxy it
# reports req/s, p50 and p99 latency, and the proxy's CPU time per request, taken from
# /proc/PID/stat (utime+stime of all its processes and threads) before and after the run; the
# busy time of the proxy's core from /proc/stat is printed as a cross-check (it also holds the
# softirq work of loopback traffic, and any other process that happened to run there).
# Then it prints kvlb's ratios to nginx against the target (CPU/request <= 0.7x nginx, p99 no
# worse). Results also go to bench/results/proxy_bench-<date>.txt.
#
# Environment: DURATION (seconds per measured run, 10), WARMUP (seconds, 3), ROUNDS (1: measured
# runs per proxy, alternating between proxies; CPU is summed, latency is the median), CONNECTIONS (64),
# WRK_THREADS (1), PROXY_CORE (0), LOAD_CORE (1), PROXIES ("nginx haproxy kvlb floor"),
# KVLB_ARGS (extra flags for `kvlb serve`), KVLB_BIN (a kvlb binary to use instead of building
# target/release/kvlb), PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=bench/lib/packages.sh
source bench/lib/packages.sh

DURATION=${DURATION:-10}
DURATION=${DURATION%s}
WARMUP=${WARMUP:-3}
WARMUP=${WARMUP%s}
ROUNDS=${ROUNDS:-1}
CONNECTIONS=${CONNECTIONS:-64}
WRK_THREADS=${WRK_THREADS:-1}
PROXY_CORE=${PROXY_CORE:-0}
LOAD_CORE=${LOAD_CORE:-1}
PROXIES=${PROXIES:-nginx haproxy kvlb floor}
KVLB_ARGS=${KVLB_ARGS:-}
PYTHON=${PYTHON:-python3}
LIB=$ROOT/bench/lib
LUA=$LIB/chat_completion.lua
PATH_URI=/v1/chat/completions

for n in "$DURATION" "$WARMUP" "$ROUNDS" "$CONNECTIONS" "$WRK_THREADS" "$PROXY_CORE" "$LOAD_CORE"; do
    if ! [[ $n =~ ^[0-9]+$ ]]; then
        echo "error: DURATION, WARMUP, ROUNDS, CONNECTIONS, WRK_THREADS, PROXY_CORE, LOAD_CORE" \
            "must be whole numbers (got '$n')" >&2
        exit 2
    fi
done
if [ "$DURATION" -lt 1 ] || [ "$ROUNDS" -lt 1 ] || [ "$CONNECTIONS" -lt 1 ] || [ "$WRK_THREADS" -lt 1 ]; then
    echo "error: DURATION, ROUNDS, CONNECTIONS and WRK_THREADS must be at least 1" >&2
    exit 2
fi
for proxy in $PROXIES; do
    case $proxy in
    nginx | haproxy | kvlb | floor) ;;
    *)
        echo "error: unknown proxy '$proxy' in PROXIES (known: nginx haproxy kvlb floor)" >&2
        exit 2
        ;;
    esac
done
cores=$(nproc)
if [ "$PROXY_CORE" -ge "$cores" ] || [ "$LOAD_CORE" -ge "$cores" ]; then
    echo "error: PROXY_CORE=$PROXY_CORE / LOAD_CORE=$LOAD_CORE, but this machine has $cores cores" >&2
    exit 2
fi

kvlb_ensure_packages nginx haproxy wrk curl
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvlb-proxy-bench.XXXXXX")
chmod 755 "$TMP"
PIDS=()

procstat() { taskset -c "$LOAD_CORE" "$PYTHON" "$LIB/procstat.py" "$@"; }

# Stops a process we started and everything it forked (nginx master + workers).
stop_tree() {
    local root=$1 pid tree
    kill -0 "$root" 2>/dev/null || return 0
    tree=$(procstat tree "$root" 2>/dev/null || echo "$root")
    kill -TERM "$root" 2>/dev/null || true
    for _ in $(seq 30); do
        kill -0 "$root" 2>/dev/null || break
        sleep 0.1
    done
    for pid in $tree; do
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait "$root" 2>/dev/null || true
}

WRK_PID=""
FINISHED=""
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    local pid
    if [ -n "$WRK_PID" ]; then
        kill -TERM "$WRK_PID" 2>/dev/null || true
        wait "$WRK_PID" 2>/dev/null || true
    fi
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
        stop_tree "$pid"
    done
    rm -rf "$TMP"
    if [ -z "$FINISHED" ] && [ -n "${RESULTS:-}" ] && [ -f "$RESULTS" ]; then
        echo "(run aborted before completion)" >>"$RESULTS"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p bench/results
RESULTS=$ROOT/bench/results/proxy_bench-$(date -u +%Y%m%d-%H%M%S).txt
: >"$RESULTS"
say() { echo "$@" | tee -a "$RESULTS"; }

# Fills a config template: @TMP@, @PORT@, @BACKEND_PORT@, @USER@.
render() {
    local template=$1 out=$2 port=$3 user=""
    # Workers run as root when we are root, so they can use the temp dir we own.
    [ "$(id -u)" -eq 0 ] && user="user root root;"
    sed -e "s|@TMP@|$TMP|g" -e "s|@PORT@|$port|g" -e "s|@BACKEND_PORT@|$BACKEND_PORT|g" \
        -e "s|@USER@|$user|g" "$template" >"$out"
}

# Starts a command pinned to a core in the background; sets STARTED_PID.
start_pinned() {
    local core=$1 log=$2
    shift 2
    taskset -c "$core" "$@" >"$log" 2>&1 &
    STARTED_PID=$!
    PIDS+=("$STARTED_PID")
}

# POSTs the benchmark body once; prints the HTTP status (000 when nothing answered).
probe() {
    curl -s -o "$TMP/probe.body" -D "$TMP/probe.head" -w '%{http_code}' --max-time 2 \
        -H 'Content-Type: application/json' --data-binary "@$TMP/body.json" \
        "http://127.0.0.1:$1$PATH_URI" 2>/dev/null || true
}

# Waits until the server on port $2 (process $1) answers the POST with 200 and the backend body.
wait_ready() {
    local pid=$1 port=$2 log=$3 code=""
    for _ in $(seq 100); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "error: process exited during start-up; its output:" >&2
            tail -n 20 "$log" >&2
            return 1
        fi
        code=$(probe "$port")
        if [ "$code" = 200 ] && grep -q chatcmpl-bench0001 "$TMP/probe.body"; then
            return 0
        fi
        sleep 0.1
    done
    echo "error: no 200 answer on port $port after 10 s (last status $code); output:" >&2
    tail -n 20 "$log" >&2
    return 1
}

# The request body, as the wrk script sends it (for the start-up probes).
body=$(sed -n '/^wrk.body = \[==\[$/,/^\]==\]$/p' "$LUA" | sed '1d;$d')
printf '%s' "$body" >"$TMP/body.json"

# Runs wrk against a port for some seconds; the output file ends with the script's BENCH line.
run_wrk() {
    local port=$1 seconds=$2 out=$3 status=0
    # In the background so that a signal reaches our trap at once, not after the run.
    taskset -c "$LOAD_CORE" wrk -t "$WRK_THREADS" -c "$CONNECTIONS" -d "${seconds}s" \
        --timeout 5s --latency -s "$LUA" "http://127.0.0.1:$port$PATH_URI" >"$out" 2>&1 &
    WRK_PID=$!
    wait "$WRK_PID" || status=$?
    WRK_PID=""
    return "$status"
}

field() { sed -n "s/.* $2=\([0-9.]*\).*/\1/p" <<<"$1"; }

CLK_TCK=$(getconf CLK_TCK)
# Per proxy: process and port; sums over the measured runs; per-run latency percentiles.
declare -A PID_OF PORT_OF N_REQ N_DUR N_TICKS N_BUSY N_IRQ N_TOTAL N_ERRS P50S P99S
# Per proxy and round ("name:round"): CPU microseconds per request of that run.
declare -A RUN_CPU
# Per proxy, the figures reported.
declare -A RPS P50 P99 CPU CORE IRQ UTIL OTHER ERRS

# One measured run of proxy $1 (round $2): a warm-up run, then DURATION seconds between two
# CPU snapshots. Adds the run to the proxy's sums.
measure_run() {
    local name=$1 round=$2 pid=${PID_OF[$1]} port=${PORT_OF[$1]} out line req dur
    local ticks0 ticks1 busy0 total0 irq0 busy1 total1 irq1
    out=$TMP/$name-round$round.txt
    [ "$WARMUP" -eq 0 ] || run_wrk "$port" "$WARMUP" "$TMP/$name-warmup.txt" || true
    ticks0=$(procstat ticks "$pid")
    read -r busy0 total0 irq0 < <(procstat core "$PROXY_CORE")
    if ! run_wrk "$port" "$DURATION" "$out"; then
        echo "error: wrk failed against $name:" >&2
        cat "$out" >&2
        return 1
    fi
    ticks1=$(procstat ticks "$pid")
    read -r busy1 total1 irq1 < <(procstat core "$PROXY_CORE")
    line=$(grep '^BENCH ' "$out" || true)
    req=$(field "$line" requests)
    if [ -z "$line" ] || [ "${req:-0}" = 0 ]; then
        echo "error: wrk completed no request against $name:" >&2
        cat "$out" >&2
        return 1
    fi
    dur=$(field "$line" duration_us)
    N_REQ[$name]=$((${N_REQ[$name]:-0} + req))
    N_DUR[$name]=$((${N_DUR[$name]:-0} + dur))
    N_TICKS[$name]=$((${N_TICKS[$name]:-0} + ticks1 - ticks0))
    N_BUSY[$name]=$((${N_BUSY[$name]:-0} + busy1 - busy0))
    N_IRQ[$name]=$((${N_IRQ[$name]:-0} + irq1 - irq0))
    N_TOTAL[$name]=$((${N_TOTAL[$name]:-0} + total1 - total0))
    N_ERRS[$name]=$((${N_ERRS[$name]:-0} + $(field "$line" err_connect) + \
        $(field "$line" err_read) + $(field "$line" err_write) + $(field "$line" err_status) + \
        $(field "$line" err_timeout)))
    RUN_CPU[$name:$round]=$(per_request "$((ticks1 - ticks0))" "$req")
    P50S[$name]="${P50S[$name]:-} $(field "$line" p50_us)"
    P99S[$name]="${P99S[$name]:-} $(field "$line" p99_us)"
    {
        echo "--- wrk output, $name, round $round:" \
            "$(per_request "$((ticks1 - ticks0))" "$req") us of $name CPU per request ---"
        grep -v '^BENCH ' "$out"
    } >>"$TMP/raw.txt"
}

# Microseconds per request from clock ticks $1 over $2 requests.
per_request() { awk -v t="$1" -v hz="$CLK_TCK" -v r="$2" 'BEGIN { printf "%.1f", t * 1e6 / hz / r }'; }

# The median of a space-separated list of numbers.
median() {
    tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -n |
        awk '{ a[NR] = $1 } END { if (NR % 2) print a[(NR + 1) / 2];
            else printf "%.0f\n", (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}

# Turns a proxy's sums into the reported figures.
summarise() {
    local name=$1 req=${N_REQ[$1]} busy=${N_BUSY[$1]} ticks=${N_TICKS[$1]}
    RPS[$name]=$(awk -v r="$req" -v d="${N_DUR[$name]}" 'BEGIN { printf "%.0f", r / (d / 1e6) }')
    P50[$name]=$(median "${P50S[$name]}")
    P99[$name]=$(median "${P99S[$name]}")
    CPU[$name]=$(per_request "$ticks" "$req")
    CORE[$name]=$(per_request "$busy" "$req")
    IRQ[$name]=$(per_request "${N_IRQ[$name]}" "$req")
    # Share of the core's busy time not charged to the proxy: other processes, and interrupt
    # work that did not run in the proxy's context.
    OTHER[$name]=$(awk -v b="$busy" -v p="$ticks" \
        'BEGIN { o = b - p; printf "%.0f", (b > 0 && o > 0) ? 100 * o / b : 0 }')
    UTIL[$name]=$(awk -v b="$busy" -v t="${N_TOTAL[$name]}" \
        'BEGIN { printf "%.0f", (t > 0) ? 100 * b / t : 0 }')
    ERRS[$name]=${N_ERRS[$name]}
}

# --- build kvlb first, so the compile does not overlap any measurement ------------------
KVLB=${KVLB_BIN:-$ROOT/target/release/kvlb}
kvlb_skip=""
if [[ " $PROXIES " == *" kvlb "* ]]; then
    if [ -n "${KVLB_BIN:-}" ]; then
        [ -x "$KVLB" ] || kvlb_skip="KVLB_BIN=$KVLB is not an executable file"
    elif ! command -v cargo >/dev/null 2>&1; then
        kvlb_skip="cargo not found"
    elif ! cargo build --release >"$TMP/cargo.log" 2>&1; then
        tail -n 20 "$TMP/cargo.log" >&2
        kvlb_skip="cargo build --release failed (output above)"
    fi
    if [ -z "$kvlb_skip" ]; then
        help=$("$KVLB" serve --help 2>&1) && help_rc=0 || help_rc=$?
        if [ "$help_rc" -ne 0 ] && [[ $help != *--replica* ]]; then
            kvlb_skip="this build has no 'kvlb serve' ('$KVLB serve --help' exited $help_rc)"
        fi
    fi
fi

FLOOR=$ROOT/target/release/examples/relay_floor
floor_skip=""
if [[ " $PROXIES " == *" floor "* ]]; then
    if ! command -v cargo >/dev/null 2>&1; then
        floor_skip="cargo not found"
    elif ! cargo build --release --example relay_floor >"$TMP/cargo-floor.log" 2>&1; then
        tail -n 20 "$TMP/cargo-floor.log" >&2
        floor_skip="cargo build --release --example relay_floor failed (output above)"
    fi
fi

read -r BACKEND_PORT NGINX_PORT HAPROXY_PORT KVLB_PORT FLOOR_PORT <<<"$(procstat ports 5 | tr "\n" " ")"

say "kvlb proxy benchmark, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
say "kvlb commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(
    git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
say "machine: $(uname -r), $cores cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
say "versions: $(nginx -v 2>&1 | sed 's/.*: //'), $(haproxy -v 2>&1 | head -n 1 |
    sed 's/ - .*//'), $(wrk -v 2>&1 | head -n 1 | cut -d' ' -f1-2)"
say "setup: proxy on core $PROXY_CORE; nginx backend and wrk on core $LOAD_CORE;" \
    "wrk -t$WRK_THREADS -c$CONNECTIONS keep-alive POST $PATH_URI with a $(wc -c <"$TMP/body.json")-byte body;" \
    "warm-up ${WARMUP}s, then ${DURATION}s measured per proxy, $ROUNDS round(s)"
say ""

# --- the backend ------------------------------------------------------------------------
render "$LIB/nginx-backend.conf.in" "$TMP/backend.conf" "$BACKEND_PORT"
start_pinned "$LOAD_CORE" "$TMP/backend.log" nginx -p "$TMP" -c "$TMP/backend.conf"
BACKEND_PID=$STARTED_PID
wait_ready "$BACKEND_PID" "$BACKEND_PORT" "$TMP/backend.log"

failed=0
ACTIVE=()
for proxy in $PROXIES; do
    case $proxy in
    nginx)
        render "$LIB/nginx-proxy.conf.in" "$TMP/nginx-proxy.conf" "$NGINX_PORT"
        start_pinned "$PROXY_CORE" "$TMP/nginx.log" nginx -p "$TMP" -c "$TMP/nginx-proxy.conf"
        port=$NGINX_PORT
        ;;
    haproxy)
        render "$LIB/haproxy.cfg.in" "$TMP/haproxy.cfg" "$HAPROXY_PORT"
        start_pinned "$PROXY_CORE" "$TMP/haproxy.log" haproxy -db -f "$TMP/haproxy.cfg"
        port=$HAPROXY_PORT
        ;;
    kvlb)
        if [ -n "$kvlb_skip" ]; then
            say "kvlb: SKIPPED: $kvlb_skip"
            continue
        fi
        # shellcheck disable=SC2086 # KVLB_ARGS holds several flags
        start_pinned "$PROXY_CORE" "$TMP/kvlb.log" "$KVLB" serve --workers 1 \
            --cores "$PROXY_CORE" --listen "127.0.0.1:$KVLB_PORT" \
            --replica "http://127.0.0.1:$BACKEND_PORT" --admin 127.0.0.1:0 $KVLB_ARGS
        port=$KVLB_PORT
        ;;
    floor)
        if [ -n "$floor_skip" ]; then
            say "floor: SKIPPED: $floor_skip"
            continue
        fi
        start_pinned "$PROXY_CORE" "$TMP/floor.log" "$FLOOR" "127.0.0.1:$FLOOR_PORT" \
            "127.0.0.1:$BACKEND_PORT"
        port=$FLOOR_PORT
        ;;
    *)
        echo "error: unknown proxy '$proxy' in PROXIES (known: nginx haproxy kvlb floor)" >&2
        exit 2
        ;;
    esac
    pid=$STARTED_PID
    if ! wait_ready "$pid" "$port" "$TMP/$proxy.log"; then
        say "$proxy: FAILED to start (see above)"
        failed=1
        stop_tree "$pid"
        continue
    fi
    if [ "$proxy" = kvlb ] && ! grep -qi '^x-kvlb-replica:' "$TMP/probe.head"; then
        say "kvlb: warning: the response has no x-kvlb-replica header"
    fi
    PID_OF[$proxy]=$pid
    PORT_OF[$proxy]=$port
    ACTIVE+=("$proxy")
done

# The proxies stay up, idle, while another one is measured; with several rounds the order
# alternates so that no proxy always runs first or last.
declare -A BROKEN
order=("${ACTIVE[@]+"${ACTIVE[@]}"}")
for round in $(seq "$ROUNDS"); do
    for proxy in "${order[@]+"${order[@]}"}"; do
        [ -z "${BROKEN[$proxy]:-}" ] || continue
        echo "round $round/$ROUNDS: $proxy (port ${PORT_OF[$proxy]}, pid ${PID_OF[$proxy]}):" \
            "${WARMUP}s warm-up + ${DURATION}s ..." >&2
        if ! measure_run "$proxy" "$round"; then
            say "$proxy: FAILED during round $round (see above)"
            BROKEN[$proxy]=1
            failed=1
        fi
    done
    reversed=()
    for proxy in "${order[@]+"${order[@]}"}"; do reversed=("$proxy" "${reversed[@]+"${reversed[@]}"}"); done
    order=("${reversed[@]+"${reversed[@]}"}")
done
MEASURED=()
for proxy in "${ACTIVE[@]+"${ACTIVE[@]}"}"; do
    if [ -z "${BROKEN[$proxy]:-}" ] && [ -n "${N_REQ[$proxy]:-}" ]; then
        summarise "$proxy"
        MEASURED+=("$proxy")
    fi
done

say ""
row() { printf '%-8s %8s %8s %8s %11s %13s %12s %6s %7s' "$@"; }
say "$(row proxy req/s p50_us p99_us cpu_us/req "core${PROXY_CORE}_us/req" irq_us/req core% errors)"
for proxy in "${MEASURED[@]+"${MEASURED[@]}"}"; do
    say "$(row "$proxy" "${RPS[$proxy]}" "${P50[$proxy]}" "${P99[$proxy]}" "${CPU[$proxy]}" \
        "${CORE[$proxy]}" "${IRQ[$proxy]}" "${UTIL[$proxy]}" "${ERRS[$proxy]}")"
done
say ""
say "cpu_us/req: utime+stime of the proxy's processes and threads (/proc/PID/stat) per request."
say "core${PROXY_CORE}_us/req: busy time of core $PROXY_CORE (/proc/stat) per request: also holds" \
    "anything else that ran there."
say "irq_us/req: interrupt + softirq time of core $PROXY_CORE per request (loopback network work; the" \
    "part that ran in the proxy's context is in its cpu_us/req too)."
for proxy in "${MEASURED[@]+"${MEASURED[@]}"}"; do
    if [ "${OTHER[$proxy]}" -gt 15 ]; then
        say "warning: during the $proxy run ${OTHER[$proxy]}% of core $PROXY_CORE's busy time was not" \
            "charged to it: other processes ran there, so core${PROXY_CORE}_us/req and latency are" \
            "inflated (cpu_us/req is not)."
    fi
    if [ "${ERRS[$proxy]}" != 0 ]; then
        say "warning: $proxy had ${ERRS[$proxy]} errors (socket errors, timeouts or non-2xx)."
    fi
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", (b > 0) ? a / b : 0 }'; }
if [ -n "${CPU[kvlb]:-}" ]; then
    for ref in nginx haproxy; do
        [ -n "${CPU[$ref]:-}" ] || continue
        say "kvlb / $ref: cpu per request $(ratio "${CPU[kvlb]}" "${CPU[$ref]}")x," \
            "core busy per request $(ratio "${CORE[kvlb]}" "${CORE[$ref]}")x," \
            "p99 $(ratio "${P99[kvlb]}" "${P99[$ref]}")x, req/s $(ratio "${RPS[kvlb]}" "${RPS[$ref]}")x"
    done
    if [ -n "${CPU[nginx]:-}" ]; then
        cpu_ok=$(awk -v a="${CPU[kvlb]}" -v b="${CPU[nginx]}" 'BEGIN { print (a <= 0.7 * b) ? "PASS" : "FAIL" }')
        p99_ok=$(awk -v a="${P99[kvlb]}" -v b="${P99[nginx]}" 'BEGIN { print (a <= b) ? "PASS" : "FAIL" }')
        if [ "$ROUNDS" -gt 1 ]; then
            # The spread of the ratio over rounds: how much of the verdict is noise.
            for name in kvlb floor; do
                [ -n "${CPU[$name]:-}" ] || continue
                per_round=""
                for round in $(seq "$ROUNDS"); do
                    a=${RUN_CPU[$name:$round]:-} b=${RUN_CPU[nginx:$round]:-}
                    [ -n "$a" ] && [ -n "$b" ] && per_round="$per_round $(ratio "$a" "$b")x"
                done
                say "$name / nginx cpu per request, round by round:$per_round"
            done
        fi
        say "target: kvlb cpu/request <= 0.70x nginx: $cpu_ok; kvlb p99 <= nginx p99: $p99_ok"
        if [ -n "${CPU[floor]:-}" ]; then
            say "floor (sockets alone) / nginx: $(ratio "${CPU[floor]}" "${CPU[nginx]}")x;" \
                "0.70x nginx is $(awk -v b="${CPU[nginx]}" 'BEGIN { printf "%.1f", 0.7 * b }') us," \
                "the floor ${CPU[floor]} us, kvlb ${CPU[kvlb]} us: kvlb's own work" \
                "$(awk -v a="${CPU[kvlb]}" -v f="${CPU[floor]}" 'BEGIN { printf "%.1f", a - f }') us per request"
        fi
    fi
elif [ -n "$kvlb_skip" ]; then
    say "kvlb was not measured ($kvlb_skip): no ratios."
fi

if [ -s "$TMP/raw.txt" ]; then
    { echo; cat "$TMP/raw.txt"; } >>"$RESULTS"
fi
FINISHED=1
echo "results written to ${RESULTS#"$ROOT"/}"
exit "$failed"
