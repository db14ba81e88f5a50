#!/usr/bin/env bash
# Mixed and mis-configured fleets, kvlb against the peers: `bench/e2e_peers.sh` three times on
# the generated agent sessions (shared tool preamble, per-session context, growing histories),
# then kvlb's ratios against the best peer and the balance checks, in one table.
#
#   uniform  four replicas at the speed kvlb's default timing assumes
#   mixed    two at that speed, two at a third of it (SPEEDS=1,1,0.333,0.333): two GPU
#            generations side by side
#   slow     all four at a third (SPEEDS=0.333): a fleet three times slower than the defaults
#            say; kvlb with its defaults against kvlb given matching constants (kvlb-matched)
#
# No balancer is told the speeds: kvlb prices replicas with its default timing and calibrates.
#
# Targets (the verdict lines): mixed p99 TTFT >= 2x and p90 >= 3x better than the best peer;
# uniform p99 >= 1.5x; in no fleet does kvlb leave a replica under a tenth of the mean work while
# another has a queue (min/mean of computed prompt tokens >= 0.1, or no moment with a replica
# idle while another queued); slow: kvlb's p99 no worse than kvlb-matched's.
#
# Environment: FLEETS ("uniform mixed slow"), DURATION (36 wall seconds of trace per balancer:
# 180 engine seconds at TIME_SCALE 5), ROUNDS (1), SEED (the generator's, 1), BALANCERS (the
# peers and kvlb; kvlb-matched is added in the slow fleet), ACCESS_LOGS (a directory for kvlb's
# access logs, per fleet), RESULTS_NAME (mixed-fleet); anything else e2e_peers.sh reads
# (TIME_SCALE, LOAD, PIN, KVLB_BIN, ...) is passed through. Results: bench/results/
# RESULTS_NAME-FLEET.{txt,json,svg} and RESULTS_NAME.txt (the verdict).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

FLEETS=${FLEETS:-uniform mixed slow}
RESULTS_NAME=${RESULTS_NAME:-mixed-fleet}
BALANCERS=${BALANCERS:-kvlb kvlb-round_robin sglang-router vllm-router-cache_aware vllm-router-kv_aware nginx nginx-least_conn}
ACCESS_LOGS=${ACCESS_LOGS:-}
export DURATION=${DURATION:-36}
export TRACE=gen:agent-sessions
export START=0
# Warm-up traffic from a later part of the trace (the prefix caches are reset before each run).
export WARMUP_START=${WARMUP_START:-200}
# The default timing is "an 8B model on one H100": a third of its speed takes three times its
# prefill seconds per token and decode step.
MATCHED_SLOW="--prefill-s-per-token 0.00009 --decode-step-s 0.024"

for f in $FLEETS; do
    case $f in
    uniform | mixed | slow) ;;
    *)
        echo "error: unknown fleet '$f' in FLEETS (known: uniform mixed slow)" >&2
        exit 2
        ;;
    esac
done

mkdir -p bench/results
VERDICT=$ROOT/bench/results/$RESULTS_NAME.txt
: >"$VERDICT"
for f in $FLEETS; do
    speeds=1 balancers=$BALANCERS matched=""
    case $f in
    mixed) speeds=1,1,0.333,0.333 ;;
    slow)
        speeds=0.333
        balancers="kvlb kvlb-matched $BALANCERS"
        balancers=$(echo "$balancers" | tr ' ' '\n' | awk 'NF && !seen[$0]++' | tr '\n' ' ')
        matched=$MATCHED_SLOW
        ;;
    esac
    echo "== fleet $f: speeds $speeds" >&2
    SPEEDS=$speeds BALANCERS=$balancers KVLB_MATCHED_ARGS=$matched \
        ACCESS_LOGS=${ACCESS_LOGS:+$ACCESS_LOGS/$f} RESULTS_NAME=$RESULTS_NAME-$f \
        bash bench/e2e_peers.sh
done

python3 - "$ROOT/bench/results" "$RESULTS_NAME" $FLEETS <<'PY' | tee "$VERDICT"
import json, os, sys

results, name, fleets = sys.argv[1], sys.argv[2], sys.argv[3:]
targets = {"uniform": {"p99": 1.5}, "mixed": {"p99": 2.0, "p90": 3.0}, "slow": {}}
ours = ("kvlb", "kvlb-matched", "kvlb-round_robin")
print("kvlb on the agent sessions: ratios are the best peer's TTFT over kvlb's (above 1: kvlb lower)")
print("%-8s %-26s %8s %8s %8s  %8s %8s %8s  %s" % (
    "fleet", "best peer (p99)", "kvlb_p90", "kvlb_p99", "peer_p99", "p90_x", "p99_x",
    "min/mean", "idle_q (kvlb; peers)"))
verdicts = []
for f in fleets:
    path = os.path.join(results, "%s-%s.json" % (name, f))
    if not os.path.exists(path):
        print("%-8s (no results: %s)" % (f, path))
        continue
    runs = {b["label"]: b for b in json.load(open(path))["balancers"]}
    k = runs.get("kvlb")
    peers = [b for l, b in runs.items()
             if l not in ours and b["errors"] == 0 and b["ttft_p99_s"] is not None]
    if k is None or not peers:
        print("%-8s (kvlb or every peer missing)" % f)
        continue
    best99 = min(peers, key=lambda b: b["ttft_p99_s"])
    best90 = min(peers, key=lambda b: b["ttft_p90_s"])
    x99 = best99["ttft_p99_s"] / k["ttft_p99_s"]
    x90 = best90["ttft_p90_s"] / k["ttft_p90_s"]
    fmt = lambda v: "-" if v is None else "%.1f%%" % (100 * v)
    idle = "; ".join("%s %s" % (b["label"], fmt(b.get("idle_while_queued"))) for b in peers)
    print("%-8s %-26s %8.3f %8.3f %8.3f  %7.2fx %7.2fx %8.2f  %s; %s" % (
        f, best99["label"], k["ttft_p90_s"], k["ttft_p99_s"], best99["ttft_p99_s"], x90, x99,
        k.get("min_mean_load") or 0.0, fmt(k.get("idle_while_queued")), idle))
    t = targets[f]
    if "p99" in t:
        verdicts.append("%s: p99 %.2fx the best peer's (%s), target >= %.1fx: %s" % (
            f, x99, best99["label"], t["p99"], "met" if x99 >= t["p99"] else "NOT MET"))
    if "p90" in t:
        verdicts.append("%s: p90 %.2fx the best peer's (%s), target >= %.1fx: %s" % (
            f, x90, best90["label"], t["p90"], "met" if x90 >= t["p90"] else "NOT MET"))
    # A replica under a tenth of the mean work is a fault only while another queues.
    low = (k.get("min_mean_load") or 0.0) < 0.1
    queued = (k.get("idle_while_queued") or 0.0) > 0.0
    verdicts.append("%s: idlest replica %.2f of the mean work, a replica idle while another "
                    "queued in %s of the moments: %s" % (
                        f, k.get("min_mean_load") or 0.0, fmt(k.get("idle_while_queued")),
                        "NOT MET" if low and queued else "met"))
    m = runs.get("kvlb-matched")
    if f == "slow" and m is not None:
        r = m["ttft_p99_s"] / k["ttft_p99_s"]
        per = lambda b: " ".join("%.0f" % x["requests"] for x in b["replicas"])
        verdicts.append("slow: kvlb (default timing) p99 %.3f vs kvlb-matched %.3f (%.2fx), "
                        "hit rate %s vs %s, requests per replica [%s] vs [%s]: %s" % (
                            k["ttft_p99_s"], m["ttft_p99_s"], r, fmt(k["hit_rate"]),
                            fmt(m["hit_rate"]), per(k), per(m),
                            "no worse" if r >= 0.95 else "WORSE"))
print()
for v in verdicts:
    print(v)
PY
echo "results: $VERDICT and bench/results/$RESULTS_NAME-{$(echo "$FLEETS" | tr ' ' ',')}.txt"
