#!/usr/bin/env bash
# Ablation of cache_aware's cost-model parameters in `kvlb simulate`: for each parameter,
# each value of its sweep, on each trace, cache_aware's TTFT percentiles and hit rate next to
# the default's. docs/cost-model.md records a run and what it decided (which parameters
# `kvlb serve` lets an operator set, which are fixed).
#
#   bash bench/ablation.sh            # every parameter (about 10 min on 2 cores)
#   bash bench/ablation.sh recompute_weight backlog_weight
#
# Setups: "routing" (residency from routing alone, the simulator's default), "serve" (KV
# events fed back and a metrics scrape every second, as `kvlb serve` runs with telemetry),
# and for offload_load_cost "host" (serve, plus a 400k-token host KV tier per replica).
# Prints one line per (parameter, value, trace, setup); a value of "default" is the baseline.
# The pseudo-parameter "seed" runs the defaults with other seeds (other random tie-breaks; for
# the generators, other traces of the same shape): the spread of p99/default it shows is the
# noise the other sweeps are read against.
set -euo pipefail
cd "$(dirname "$0")/.."
kvlb=${KVLB:-target/release/kvlb}
[ -x "$kvlb" ] || cargo build --release --quiet
traces=(gen:agent-sessions gen:shared-prefix traces/mooncake_conversation_trace.jsonl
        traces/mooncake_synthetic_trace.jsonl)

# parameter: the values swept (the default is run once per trace and setup as the baseline).
declare -A sweep=(
    [seed]="2 3 4 5"
    [min_match_tokens]="0 64 1024 4096"
    [recompute_weight]="1 1.5 3 4"
    [backlog_weight]="0 0.05 0.3 1"
    [tie_epsilon_s]="0 0.0001 0.01 0.05"
    [hot_prefix_requests]="2 4 16 64"
    [hot_window_s]="1 3 30 100"
    [hot_spill_wait_s]="0.02 0.05 0.3 1"
    [kv_evict_from]="0.5 0.7 0.95 1"
    [kv_hit_keep_at_full]="0 0.25 0.75 1"
    [offload_load_cost]="0 0.1 0.5 1"
    [prefill_a_s]="0 0.004 0.016 0.032"
    [prefill_c_s]="0 0.0000000005 0.000000002 0.000000004"
    [chunk_tokens]="2048 4096 16384 32768"
    [queued_context_tokens]="0 1024 16384 65536"
    [decode_per_seq_s]="0 0.000015 0.00006 0.00012"
    [decode_per_ctx_token_s]="0 0.000000025 0.0000001 0.0000002"
    [context_tokens]="0 1024 16384 65536"
    [max_num_seqs]="64 128 512 1024"
    [mean_output_tokens]="0 64 1024 4096"
    [prefill_b_s]="0.000015 0.00006 0.00012"
    [decode_base_s]="0.002 0.004 0.016 0.032"
)
order=(seed min_match_tokens recompute_weight backlog_weight tie_epsilon_s hot_prefix_requests
       hot_window_s hot_spill_wait_s kv_evict_from kv_hit_keep_at_full offload_load_cost
       prefill_a_s prefill_b_s prefill_c_s chunk_tokens queued_context_tokens decode_base_s
       decode_per_seq_s decode_per_ctx_token_s context_tokens max_num_seqs mean_output_tokens)
if [ $# -gt 0 ]; then order=("$@"); fi

setup_args() {
    case $1 in
        routing) echo "" ;;
        serve) echo "--residency events --scrape-interval 1" ;;
        host) echo "--residency events --scrape-interval 1 --host-kv-tokens 400000" ;;
    esac
}
setups_for() {
    case $1 in
        offload_load_cost) echo host ;;
        kv_evict_from|kv_hit_keep_at_full) echo serve ;;
        *) echo "routing serve" ;;
    esac
}

run() { # trace setup [--set ...]
    local trace=$1 setup=$2; shift 2
    # shellcheck disable=SC2046
    "$kvlb" simulate --trace "$trace" --policies cache_aware --json $(setup_args "$setup") "$@" \
        2>/dev/null | python3 -c '
import json, sys
s = json.load(sys.stdin)[0]
print("%.3f %.3f %.3f %.3f" % (s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p99_s"], s["hit_rate"]))'
}

declare -A base
printf '%-24s %-12s %-18s %-7s %7s %7s %7s %6s   %s\n' parameter value trace setup p50 p90 p99 hit \
    "p99/default"
for p in "${order[@]}"; do
    for setup in $(setups_for "$p"); do
        for trace in "${traces[@]}"; do
            key="$trace $setup"
            if [ -z "${base[$key]:-}" ]; then base[$key]=$(run "$trace" "$setup"); fi
            short=${trace##*/}; short=${short%.jsonl}; short=${short#mooncake_}
            read -r b50 b90 b99 bhit <<<"${base[$key]}"
            printf '%-24s %-12s %-18s %-7s %7s %7s %7s %6s\n' "$p" default "$short" "$setup" \
                "$b50" "$b90" "$b99" "$bhit"
            for v in ${sweep[$p]}; do
                if [ "$p" = seed ]; then set_args=(--seed "$v"); else set_args=(--set "$p=$v"); fi
                read -r a50 a90 a99 ahit <<<"$(run "$trace" "$setup" "${set_args[@]}")"
                ratio=$(python3 -c "print('%.2f' % ($a99 / $b99 if $b99 > 0 else 0))")
                printf '%-24s %-12s %-18s %-7s %7s %7s %7s %6s   %s\n' "$p" "$v" "$short" \
                    "$setup" "$a50" "$a90" "$a99" "$ahit" "$ratio"
            done
        done
    done
done
