#!/usr/bin/env bash
# The data plane at agent-sized prompts: bench/proxy_bench.sh run with BODY=256k and BODY=1m
# (chat bodies sharing a ~150 KB system prompt, bench/lib/chat_body.py) in front of the same
# static nginx backend, every proxy on PROXY_CORE, the backend and wrk on LOAD_CORE, then one
# side-by-side table of both sizes: req/s, p50, p99, CPU time per request and its ratio to the
# relay floor measured in the same run, and kvlb's target: within 1.2x of the floor's CPU per
# request, prompt scanning and hashing included (what kvlb hashed is printed with each size).
#
# Environment: as proxy_bench.sh (DURATION, WARMUP, ROUNDS, CONNECTIONS, PROXY_CORE, LOAD_CORE,
# KVLB_ARGS, KVLB_BIN, ...), with these defaults: DURATION 8, ROUNDS 2, CONNECTIONS 32,
# PROXIES "nginx haproxy sglang-router vllm-router kvlb floor"; SIZES ("256k 1m").
# Results: bench/results/long_prompts-<date>.txt (the table, then each size's full report).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=bench/lib/peers.sh
source bench/lib/peers.sh

export DURATION=${DURATION:-8}
export ROUNDS=${ROUNDS:-2}
export CONNECTIONS=${CONNECTIONS:-32}
export PROXIES=${PROXIES:-nginx haproxy sglang-router vllm-router kvlb floor}
SIZES=${SIZES:-256k 1m}
kvlb_require whole DURATION
kvlb_require count ROUNDS CONNECTIONS
for size in $SIZES; do
    case $size in
    256k | 1m) ;;
    *)
        echo "error: SIZES may hold 256k and 1m (got '$size')" >&2
        exit 2
        ;;
    esac
done

STAMP=$(date -u +%Y%m%d-%H%M%S)
mkdir -p bench/results
OUT=$ROOT/bench/results/long_prompts-$STAMP.txt
TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvlb-long-prompts.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

status=0
for size in $SIZES; do
    echo "== BODY=$size" >&2
    BODY=$size RESULTS_NAME=long_prompts-$STAMP-$size SUMMARY=$TMP/$size.txt \
        bash bench/proxy_bench.sh || status=$?
done

{
    echo "kvlb long prompts, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD)"
    echo "bench/long_prompts.sh: bench/proxy_bench.sh with BODY=$SIZES;" \
        "wrk -c$CONNECTIONS, ${DURATION}s x $ROUNDS round(s) per proxy; proxy on core" \
        "${PROXY_CORE:-0}, backend and wrk on core ${LOAD_CORE:-1}"
    echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    printf '%-6s %-13s %8s %8s %8s %11s %8s %7s\n' body proxy req/s p50_us p99_us cpu_us/req x_floor errors
    for size in $SIZES; do
        [ -s "$TMP/$size.txt" ] || continue
        floor=$(awk '$1 == "floor" { print $5 }' "$TMP/$size.txt")
        while read -r name rps p50 p99 cpu errs; do
            x=$(awk -v a="$cpu" -v f="${floor:-0}" 'BEGIN { if (f > 0) printf "%.2fx", a / f; else print "-" }')
            printf '%-6s %-13s %8s %8s %8s %11s %8s %7s\n' "$size" "$name" "$rps" "$p50" "$p99" "$cpu" "$x" "$errs"
        done <"$TMP/$size.txt"
        kvlb=$(awk '$1 == "kvlb" { print $5 }' "$TMP/$size.txt")
        if [ -n "$kvlb" ] && [ -n "$floor" ]; then
            echo "$size: kvlb cpu/request within 1.2x of the floor's:" \
                "$(awk -v a="$kvlb" -v f="$floor" 'BEGIN { printf "%s (%.2fx)", (a <= 1.2 * f) ? "PASS" : "FAIL", a / f }')"
        fi
    done
    echo
    echo "x_floor: cpu_us/req over the relay floor's (examples/relay_floor.rs) in the same run."
    for size in $SIZES; do
        echo
        echo "=== BODY=$size: the report of bench/proxy_bench.sh"
        cat "bench/results/long_prompts-$STAMP-$size.txt" 2>/dev/null || true
    done
} >"$OUT"
sed -n '1,/^x_floor:/p' "$OUT"
for size in $SIZES; do
    grep -h '^what kvlb hashed\|^the second of two\|^kvlb / floor' \
        "bench/results/long_prompts-$STAMP-$size.txt" 2>/dev/null | sed "s/^/$size: /" || true
    rm -f "bench/results/long_prompts-$STAMP-$size.txt"
done
echo "results written to ${OUT#"$ROOT"/}"
exit "$status"
