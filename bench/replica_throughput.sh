#!/usr/bin/env bash
# Requests per second one `kvlb replica` process sustains at --time-scale 100 with short
# prompts (non-streaming completions, max_tokens 16), so a balancer benchmark knows the
# simulator is not its bottleneck. Uses wrk with a Lua script for the POST body.
#
# usage: bench/replica_throughput.sh [SECONDS] [CONNECTIONS]
#   env: KVLB_BIN (default target/release/kvlb, built if missing), STREAM=1 for SSE responses
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_RUN=${1:-10}
CONNS=${2:-64}
BIN=${KVLB_BIN:-target/release/kvlb}
if [ ! -x "$BIN" ]; then cargo build --release --bin kvlb >&2; fi
command -v wrk >/dev/null || { echo "wrk not found: apt-get install -y wrk" >&2; exit 1; }

tmp=$(mktemp -d)
log="$tmp/replica.log"
"$BIN" replica --listen 127.0.0.1:0 --time-scale 100 --served-model-name m 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 100); do grep -q "kvlb replica: ready" "$log" && break; sleep 0.05; done
addr=$(sed -n 's/^kvlb replica: replica 0 on \([^ ]*\).*/\1/p' "$log")
[ -n "$addr" ] || { echo "replica did not start:" >&2; cat "$log" >&2; exit 1; }

stream=false
[ "${STREAM:-0}" = 1 ] && stream=true
cat > "$tmp/post.lua" <<LUA
counter = 0
request = function()
  counter = counter + 1
  local body = '{"model":"m","prompt":"Question ' .. (counter % 500) .. ': what is the capital of France?","max_tokens":16,"stream":$stream}'
  return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end
LUA

cpu0=$(awk '{print $14+$15}' /proc/$pid/stat)
out=$(wrk -t2 -c"$CONNS" -d"${SECONDS_RUN}s" --latency -s "$tmp/post.lua" "http://$addr")
cpu1=$(awk '{print $14+$15}' /proc/$pid/stat)
echo "$out" >&2
rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
ticks=$(getconf CLK_TCK)
non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
cpu_s=$(awk -v a="$cpu0" -v b="$cpu1" -v t="$ticks" 'BEGIN {print (b-a)/t}')
total=$(echo "$out" | awk '/requests in/ {print $1}')
us_per_req=$(awk -v c="$cpu_s" -v n="$total" 'BEGIN {if (n>0) printf "%.0f", c*1e6/n; else print "n/a"}')
echo "replica throughput: ${rps} req/s (time-scale 100, ${CONNS} connections, stream=${stream}, max_tokens 16; replica CPU ${us_per_req} us/request; non-2xx: ${non2xx:-0})"
