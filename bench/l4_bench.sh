#!/usr/bin/env bash
# L4 forwarding benchmark: kvlb L7 copying every byte through user space (kvlb-l7, the default),
# kvlb L7 splicing response bodies with 1 MiB or more to come (kvlb-l7-splice), kvlb L4 with io_uring
# splice, kvlb L4 with the BPF sockmap, HAProxy mode tcp, and HAProxy mode tcp with its splice
# options, side by side in one run, on the bulk shapes an LLM front door moves:
#
#   resp-1M, resp-64M   GET of a 1 MiB / 64 MiB response (nginx serving a file), keep-alive
#   prompt-256K         POST of a 256 KiB chat prompt, small answer, keep-alive
#   sse                 token streams (kvlb replica, time-scaled: ~0.5 ms per token, 1000
#                       tokens per stream), 32 streams at once
#
# Each proxy runs alone on core PROXY_CORE (0), the backends and wrk on LOAD_CORE (1). For each
# run: throughput (MiB/s moved through the proxy, requests/s), p99 latency (wrk), and CPU per
# GiB moved counted on ALL cores from /proc/stat (user+nice+system+irq+softirq), so kernel work
# charged to the sending cores (loopback softirq, sockmap redirects) is included. The backends'
# and wrk's work is in that figure too and is the same for every proxy: compare differences.
# The proxy process's own CPU per GiB (utime+stime) is printed next to it.
#
# Environment: DURATION (seconds per run, 4), SHAPES ("resp-1M resp-64M prompt-256K sse"),
# PROXIES ("kvlb-l7 kvlb-l7-splice kvlb-splice kvlb-sockmap haproxy-tcp haproxy-splice"), PROXY_CORE (0),
# LOAD_CORE (1), KVLB_BIN (default target/release/kvlb, built when missing).
# Results: bench/results/l4-<date>.txt. About 2.5 minutes with the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# shellcheck source=bench/lib/packages.sh
source bench/lib/packages.sh

DURATION=${DURATION:-4}
SHAPES=${SHAPES:-resp-1M resp-64M prompt-256K sse}
PROXIES=${PROXIES:-kvlb-l7 kvlb-l7-splice kvlb-splice kvlb-sockmap haproxy-tcp haproxy-splice}
PROXY_CORE=${PROXY_CORE:-0}
LOAD_CORE=${LOAD_CORE:-1}
PYTHON=${PYTHON:-python3}
KVLB=${KVLB_BIN:-$ROOT/target/release/kvlb}

kvlb_ensure_packages nginx haproxy wrk curl
if [ -z "${KVLB_BIN:-}" ] && [ ! -x "$KVLB" ]; then
    cargo build --release
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvlb-l4-bench.XXXXXX")
chmod 755 "$TMP"
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    sleep 0.3
    for pid in "${PIDS[@]+"${PIDS[@]}"}"; do
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$TMP"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p bench/results
RESULTS=$ROOT/bench/results/l4-$(date -u +%Y%m%d-%H%M%S).txt
: >"$RESULTS"
say() { echo "$@" | tee -a "$RESULTS"; }

ports() { taskset -c "$LOAD_CORE" "$PYTHON" bench/lib/procstat.py ports "$1" | tr '\n' ' '; }
read -r NGINX_PORT REPLICA_PORT P_L7 P_SPLICE P_SOCKMAP P_HTCP P_HSPLICE <<<"$(ports 7)"

# All-core busy and total ticks from the aggregate line of /proc/stat.
all_cores() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9; exit }' /proc/stat; }

start() {
    local core=$1 log=$2
    shift 2
    taskset -c "$core" "$@" >"$log" 2>&1 &
    PIDS+=($!)
}

wait_http() {
    local url=$1
    for _ in $(seq 100); do
        if curl -s -o /dev/null --max-time 2 -r 0-0 "$url"; then return 0; fi
        sleep 0.1
    done
    echo "error: nothing answers $url" >&2
    return 1
}

# --- backends: nginx with files, kvlb replica for token streams ----------------------------
mkdir -p "$TMP/www"
head -c $((1 << 20)) /dev/urandom >"$TMP/www/1m.bin"
head -c $((64 << 20)) /dev/urandom >"$TMP/www/64m.bin"
user=""
[ "$(id -u)" -eq 0 ] && user="user root root;"
cat >"$TMP/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $TMP/nginx.pid;
error_log $TMP/nginx-error.log warn;
$user
events { worker_connections 4096; }
http {
    access_log off;
    sendfile on;
    keepalive_requests 10000000;
    keepalive_timeout 120s;
    client_body_temp_path $TMP/body;
    client_max_body_size 8m;
    proxy_temp_path $TMP/proxy;
    fastcgi_temp_path $TMP/fastcgi;
    uwsgi_temp_path $TMP/uwsgi;
    scgi_temp_path $TMP/scgi;
    server {
        listen 127.0.0.1:$NGINX_PORT backlog=4096;
        root $TMP/www;
        location = /v1/chat/completions {
            default_type application/json;
            return 200 '{"id":"chatcmpl-l4","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}';
        }
    }
}
EOF
start "$LOAD_CORE" "$TMP/nginx.log" nginx -p "$TMP" -c "$TMP/nginx.conf"
NGINX_PID=${PIDS[-1]}
start "$LOAD_CORE" "$TMP/replica.log" "$KVLB" replica --listen "127.0.0.1:$REPLICA_PORT" \
    --time-scale 16 --max-num-seqs 1024 --served-model-name Qwen/Qwen3-8B m
REPLICA_PID=${PIDS[-1]}
wait_http "http://127.0.0.1:$NGINX_PORT/1m.bin"
for _ in $(seq 100); do grep -q 'kvlb replica: ready' "$TMP/replica.log" && break; sleep 0.1; done

# --- proxies: one for nginx, one for the replica, per kind ---------------------------------
haproxy_cfg() {
    local port=$1 backend=$2 splice=$3
    cat <<EOF
global
    nbthread 1
    maxconn 4096
defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s
$([ "$splice" = 1 ] && printf '    option splice-request\n    option splice-response\n')
frontend l4
    bind 127.0.0.1:$port
    default_backend b
backend b
    server s0 127.0.0.1:$backend
EOF
}

declare -A PORT_OF PID_OF
start_proxy() {
    local name=$1 port=$2 backend=$3 admin
    case $name in
    kvlb-l7 | kvlb-l7-splice | kvlb-splice | kvlb-sockmap)
        local mode=() fwd=${name#kvlb-}
        case $name in
        kvlb-l7) ;;
        kvlb-l7-splice) mode=(--splice-responses-from 1MiB) ;;
        *) mode=(--mode l4 --l4-forwarding "$fwd") ;;
        esac
        start "$PROXY_CORE" "$TMP/$name-$port.log" "$KVLB" serve --workers 1 --cores "$PROXY_CORE" \
            --listen "127.0.0.1:$port" --admin 127.0.0.1:0 --replica "http://127.0.0.1:$backend" \
            --max-body-bytes 8MiB "${mode[@]}"
        ;;
    haproxy-tcp | haproxy-splice)
        local splice=0
        [ "$name" = haproxy-splice ] && splice=1
        haproxy_cfg "$port" "$backend" "$splice" >"$TMP/$name-$port.cfg"
        start "$PROXY_CORE" "$TMP/$name-$port.log" haproxy -db -f "$TMP/$name-$port.cfg"
        ;;
    esac
}

i=0
for p in $PROXIES; do
    case $p in kvlb-l7 | kvlb-l7-splice | kvlb-splice | kvlb-sockmap | haproxy-tcp | haproxy-splice) ;;
    *) echo "error: unknown proxy $p" >&2; exit 2 ;; esac
    read -r a b <<<"$(ports 2)"
    start_proxy "$p" "$a" "$NGINX_PORT"
    PID_OF[$p]=${PIDS[-1]}
    start_proxy "$p" "$b" "$REPLICA_PORT"
    PID_OF[$p-sse]=${PIDS[-1]}
    PORT_OF[$p]=$a
    PORT_OF[$p-sse]=$b
    wait_http "http://127.0.0.1:$a/1m.bin"
    i=$((i + 1))
done
sleep 0.5
if grep -q "sockmap forwarding unavailable" "$TMP"/kvlb-sockmap-*.log 2>/dev/null; then
    say "note: $(grep -h 'sockmap forwarding unavailable' "$TMP"/kvlb-sockmap-*.log | head -n 1)"
fi

# --- wrk scripts ---------------------------------------------------------------------------
done_fn='done = function(summary, latency, requests)
    io.write(string.format("BENCH requests=%d duration_us=%d bytes=%d p99_us=%.0f errors=%d\n",
        summary.requests, summary.duration, summary.bytes, latency:percentile(99),
        summary.errors.connect + summary.errors.read + summary.errors.write
        + summary.errors.status + summary.errors.timeout))
end'
printf '%s\n' "$done_fn" >"$TMP/get.lua"
{
    echo 'wrk.method = "POST"'
    echo 'wrk.headers["Content-Type"] = "application/json"'
    # A 256 KiB chat prompt: one user message of filler text.
    printf 'local filler = string.rep("The replica keeps the KV cache of prompts it has seen. ", %d)\n' $((262144 / 56))
    echo 'wrk.body = "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"" .. filler .. "\"}],\"max_tokens\":1}"'
    printf '%s\n' "$done_fn"
} >"$TMP/prompt.lua"
{
    echo 'wrk.method = "POST"'
    echo 'wrk.headers["Content-Type"] = "application/json"'
    echo 'wrk.body = "{\"model\":\"Qwen/Qwen3-8B\",\"messages\":[{\"role\":\"user\",\"content\":\"Stream a long answer.\"}],\"max_tokens\":1000,\"ignore_eos\":true,\"stream\":true}"'
    printf '%s\n' "$done_fn"
} >"$TMP/sse.lua"

field() { sed -n "s/.* $2=\([0-9.]*\).*/\1/p" <<<"$1"; }

say "kvlb L4 forwarding benchmark, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
say "kvlb commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(
    git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
say "machine: $(uname -r), $(nproc) cores, load average $(cut -d" " -f1-3 /proc/loadavg); proxy on core $PROXY_CORE, backends and wrk on core $LOAD_CORE; ${DURATION}s per run"
say "versions: $(haproxy -v 2>&1 | head -n 1 | sed 's/ - .*//'), $(nginx -v 2>&1 | sed 's/.*: //'), $(wrk -v 2>&1 | head -n 1 | cut -d' ' -f1-2)"
say "CPU/GiB: busy ticks of ALL cores (user+nice+system+irq+softirq, /proc/stat) per GiB moved"
say "         (backends and wrk included: the same for every proxy; compare differences;"
say "         on a shared machine other processes land in it too: see the load average)"
say "proxy_s/GiB: the proxy process's own CPU (utime+stime, io_uring worker threads included;"
say "         not the softirq and kworker time of sockmap redirects) per GiB moved"
say "wrk_s/GiB, backend_s/GiB: the same for the load generator and the backend (nginx or kvlb"
say "         replica): where the rest of CPU_s/GiB goes (with the interrupt time in between)"
say ""
printf '%-12s %-15s %9s %8s %9s %10s %10s %10s %10s %6s\n' shape proxy MiB/s req/s p99_ms \
    CPU_s/GiB proxy_s/GiB wrk_s/GiB backend_s/GiB errors | tee -a "$RESULTS"

HZ=$(getconf CLK_TCK)
for shape in $SHAPES; do
    case $shape in
    resp-1M) path=/1m.bin script=get.lua conns=16 ;;
    resp-64M) path=/64m.bin script=get.lua conns=4 ;;
    prompt-256K) path=/v1/chat/completions script=prompt.lua conns=16 ;;
    sse) path=/v1/chat/completions script=sse.lua conns=32 ;;
    *) echo "error: unknown shape $shape" >&2; exit 2 ;;
    esac
    for p in $PROXIES; do
        port=${PORT_OF[$p]}
        pid=${PID_OF[$p]}
        [ "$shape" = sse ] && port=${PORT_OF[$p-sse]} pid=${PID_OF[$p-sse]}
        url="http://127.0.0.1:$port$path"
        backend=$NGINX_PID
        [ "$shape" = sse ] && backend=$REPLICA_PID
        # Short warm-up (connections joined, pipes pooled), then the measured run.
        taskset -c "$LOAD_CORE" wrk -t1 -c"$conns" -d1s -s "$TMP/$script" "$url" >/dev/null 2>&1 || true
        read -r b0 t0 <<<"$(all_cores)"
        pt0=$(taskset -c "$LOAD_CORE" "$PYTHON" bench/lib/procstat.py ticks "$pid")
        bt0=$(taskset -c "$LOAD_CORE" "$PYTHON" bench/lib/procstat.py ticks "$backend")
        # wrk's own CPU: bash's `time` of the (exec'd) wrk, user and system seconds.
        { TIMEFORMAT='%U %S'; time taskset -c "$LOAD_CORE" wrk -t1 -c"$conns" -d"${DURATION}s" \
            --timeout 10s --latency -s "$TMP/$script" "$url" >"$TMP/wrk.out" 2>&1 || true; } \
            2>"$TMP/wrk.time"
        out=$(cat "$TMP/wrk.out")
        read -r b1 t1 <<<"$(all_cores)"
        pt1=$(taskset -c "$LOAD_CORE" "$PYTHON" bench/lib/procstat.py ticks "$pid")
        bt1=$(taskset -c "$LOAD_CORE" "$PYTHON" bench/lib/procstat.py ticks "$backend")
        wrk_s=$(awk '{ print $1 + $2 }' "$TMP/wrk.time")
        line=$(grep '^BENCH ' <<<"$out" || true)
        if [ -z "$line" ]; then
            printf '%-12s %-15s %s\n' "$shape" "$p" "FAILED: $(tail -n 3 <<<"$out" | tr '\n' ' ')" | tee -a "$RESULTS"
            continue
        fi
        req=$(field "$line" requests)
        dur=$(field "$line" duration_us)
        bytes=$(field "$line" bytes)
        # Bytes through the proxy: responses read, plus the prompts sent upstream.
        [ "$shape" = prompt-256K ] && bytes=$((bytes + req * 262144))
        awk -v s="$shape" -v p="$p" -v req="$req" -v dur="$dur" -v bytes="$bytes" \
            -v p99="$(field "$line" p99_us)" -v busy=$((b1 - b0)) -v hz="$HZ" -v own=$((pt1 - pt0)) \
            -v err="$(field "$line" errors)" -v wrk="$wrk_s" -v back=$((bt1 - bt0)) 'BEGIN {
                gib = bytes / 1073741824
                if (gib <= 0) gib = 1e30
                printf "%-12s %-15s %9.0f %8.0f %9.1f %10.2f %10.2f %10.2f %10.2f %6d\n", s, p,
                    bytes / 1048576 / (dur / 1e6), req / (dur / 1e6), p99 / 1000,
                    busy / hz / gib, own / hz / gib, wrk / gib, back / hz / gib, err
            }' | tee -a "$RESULTS"
    done
done
say ""
for p in kvlb-splice kvlb-sockmap; do
    [[ " $PROXIES " == *" $p "* ]] || continue
    for log in "$TMP"/$p-*.log; do
        grep -h 'l4:' "$log" | head -n 1 | sed "s/^/$p: /" | tee -a "$RESULTS"
    done
done
say "results: $RESULTS"
