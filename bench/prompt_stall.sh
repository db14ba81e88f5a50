#!/usr/bin/env bash
# How long one huge prompt holds up the other clients of its worker: examples/prompt_stall.rs
# runs `kvlb serve --workers 1` (on core PROXY_CORE) in front of an in-process backend, sends
# small chat requests back to back on one connection and, on another, a 30 MB chat body of a
# million one-word messages: WARMUP times (not counted), then ROUNDS times to
# /v1/chat/completions and ROUNDS times to /v1/embeddings, which kvlb forwards without reading
# the prompt (the floor: receiving and forwarding 30 MB). Client and backend share core
# LOAD_CORE. It prints the small requests' worst and p99 latency during each and otherwise.
# With BEFORE_BIN set, the same run against that build too (e.g. one without prompt bounds), so
# both figures come from one invocation. Results also go to bench/results/prompt_stall-<date>.txt.
#
# usage: bench/prompt_stall.sh
#   env: KVLB_BIN (default target/release/kvlb, built), BEFORE_BIN (none), ROUNDS (5),
#        WARMUP (2), MESSAGES (1000000), PROXY_CORE (0), LOAD_CORE (1), REPEAT (1: runs per
#        build, alternating)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
WARMUP=${WARMUP:-2}
MESSAGES=${MESSAGES:-1000000}
PROXY_CORE=${PROXY_CORE:-0}
LOAD_CORE=${LOAD_CORE:-1}
REPEAT=${REPEAT:-1}
if [ -z "${KVLB_BIN:-}" ]; then
    cargo build --release >&2
    KVLB_BIN=target/release/kvlb
fi
cargo build --release --example prompt_stall >&2
mkdir -p bench/results
OUT=bench/results/prompt_stall-$(date -u +%Y%m%d-%H%M%S).txt
{
    echo "prompt_stall: $(date -u), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    for i in $(seq "$REPEAT"); do
        for bin in ${BEFORE_BIN:-} "$KVLB_BIN"; do
            taskset -c "$LOAD_CORE" target/release/examples/prompt_stall \
                "$bin" "$ROUNDS" "$MESSAGES" "$PROXY_CORE" "$WARMUP"
        done
    done
} | tee "$OUT"
