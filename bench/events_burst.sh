#!/usr/bin/env bash
# Routing latency while one replica publishes a burst of KV events (requirement: 100k events/s
# from one replica must not raise routing latency). Runs benches/events.rs: a real ZeroMQ
# publisher (ZMTP over loopback, vLLM's frame layout) feeding kvlb's telemetry path
# (subscriber thread -> bounded channel -> residency writer), control side on core 1, and a
# worker-like thread on core 0 timing the routing step (candidates with reported loads +
# cache_aware lookup and cost model) quiet, under the burst, and quiet again. Prints p50/p99/
# p99.9/max per phase, the burst/quiet ratios, the measuring thread's preemptions (other
# processes on a shared machine show up there, not as kvlb's cost), events applied per second,
# and whether the writer kept up (published vs applied, sequence gaps, publisher drops).
#
# With PUBLISHERS > 1 that many replicas publish, round-robin, RATE events/s in all: how many
# events one kvlb absorbs from a fleet (e.g. `bench/events_burst.sh 3 1000000 1024`).
#
# usage: bench/events_burst.sh [SECONDS_PER_PHASE] [EVENTS_PER_SECOND] [PUBLISHERS]
#   env: ROUNDS=N repeats the whole run N times (default 1)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-4}
RATE=${2:-100000}
PUBLISHERS=${3:-1}
ROUNDS=${ROUNDS:-1}
# shellcheck source=bench/lib/peers.sh
source bench/lib/peers.sh
kvlb_require number SECS
kvlb_require count RATE PUBLISHERS ROUNDS
cargo bench --bench events --no-run >&2
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) cores"
for round in $(seq "$ROUNDS"); do
  [ "$ROUNDS" -gt 1 ] && echo "round $round:"
  cargo bench -q --bench events -- "$SECS" "$RATE" "$PUBLISHERS" 2>/dev/null
done
