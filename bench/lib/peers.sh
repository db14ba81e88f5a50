# shellcheck shell=bash
# Sourced by bench/e2e_peers.sh, bench/multi_model.sh and bench/pd.sh, which run kvlb and its
# peers (sglang-router, vllm-router) in front of simulated fleets: the checks of their numeric
# settings, the peers' venv, the kvlb binary, the process bookkeeping and the order of the
# rounds the scripts share. Expects ROOT, VENV, LIB and PIN (round_order: BALANCERS and TMP).

# The peers' venv (bench/requirements-e2e.txt), installed idempotently: a stamp of the
# requirements and the interpreter skips pip when nothing changed.
kvlb_peers_venv() {
    if ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
        rm -rf "$VENV"
        python3 -m venv "$VENV"
    fi
    # A venv has no business in git.
    [ -f "$VENV/.gitignore" ] || echo '*' >"$VENV/.gitignore"
    local requirements=$ROOT/bench/requirements-e2e.txt
    local stamp=$VENV/.kvlb-e2e-requirements.sha256 want
    want=$({
        cat "$requirements"
        "$VENV/bin/python" -VV
    } | sha256sum | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
        echo "installing $requirements into $VENV" >&2
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements"
        echo "$want" >"$stamp"
    fi
}

# Exits 2 unless each variable named after KIND holds one: number (decimal, >= 0), whole
# (>= 0) or count (whole, >= 1).
kvlb_require() {
    local kind=$1 name re what
    shift
    case $kind in
    number) re='^[0-9]+([.][0-9]+)?$' what="a number" ;;
    whole) re='^[0-9]+$' what="a whole number" ;;
    count) re='^[1-9][0-9]*$' what="a whole number of at least 1" ;;
    *)
        echo "kvlb_require: unknown kind '$kind'" >&2
        exit 2
        ;;
    esac
    for name in "$@"; do
        if ! [[ ${!name} =~ $re ]]; then
            echo "error: $name must be $what (got '${!name}')" >&2
            exit 2
        fi
    done
}

# Sets KVLB: KVLB_BIN when given, else target/release/kvlb, built.
kvlb_bench_binary() {
    if [ -n "${KVLB_BIN:-}" ]; then
        KVLB=$KVLB_BIN
        return
    fi
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    cargo build --release --bin kvlb >&2
    KVLB=$ROOT/target/release/kvlb
}

# Runs a command on core $1 when PIN=1.
on_core() {
    if [ "$PIN" = 1 ]; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi
}

# Stops a process we started and everything it forked (nginx master + workers, a Python
# launcher + its router threads).
stop_tree() {
    local root=$1 pid tree
    kill -0 "$root" 2>/dev/null || return 0
    tree=$(python3 "$LIB/procstat.py" tree "$root" 2>/dev/null || echo "$root")
    kill -TERM "$root" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$root" 2>/dev/null || break
        sleep 0.1
    done
    for pid in $tree; do
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait "$root" 2>/dev/null || true
}

# Waits until `curl URL` answers 200 while PID lives; fails after $3 seconds.
wait_http() {
    local url=$1 pid=$2 limit=$3
    for _ in $(seq $((limit * 10))); do
        kill -0 "$pid" 2>/dev/null || return 1
        if curl -fsS -o /dev/null --max-time 2 "$url" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    return 1
}

# The balancers of round $1 (counted from 1), in the order they run: BALANCERS in odd rounds,
# reversed in even ones (so no balancer always runs first on a fresh fleet), leaving out
# those named in $TMP/failed (one per line: did not start, or their replay failed).
round_order() {
    local order=$BALANCERS name
    if [ $(($1 % 2)) -eq 0 ]; then
        order=$(echo "$BALANCERS" | tr ' ' '\n' | grep . | tac | tr '\n' ' ')
    fi
    for name in $order; do
        grep -qx "$name" "$TMP/failed" 2>/dev/null || echo "$name"
    done
}

# Sets SGLANG_VERSION and VLLM_ROUTER_VERSION from the peers' venv.
# Waits up to TRIES tenths of a second for the `kvlb replica` process PID, logging to LOG, to
# say it is ready, then reads its replicas into REPLICA_ADDRS (host:port) and REPLICA_EVENTS
# (tcp://host:port), COUNT of each; exits with the log when it does not start.
kvlb_fleet_ready() {
    local log=$1 pid=$2 count=$3 tries=$4 addr events
    for _ in $(seq "$tries"); do
        grep -q '^kvlb replica: ready' "$log" && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if ! grep -q '^kvlb replica: ready' "$log"; then
        echo "error: kvlb replica did not start:" >&2
        cat "$log" >&2
        exit 1
    fi
    REPLICA_ADDRS=()
    REPLICA_EVENTS=()
    while read -r _ _ _ _ _ addr events _; do
        REPLICA_ADDRS+=("$addr")
        REPLICA_EVENTS+=("${events#kv_events=}")
    done < <(grep '^kvlb replica: replica ' "$log")
    if [ "${#REPLICA_ADDRS[@]}" -ne "$count" ]; then
        echo "error: expected $count replicas in:" >&2
        cat "$log" >&2
        exit 1
    fi
}

kvlb_peer_versions() {
    SGLANG_VERSION=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang-router"))')
    VLLM_ROUTER_VERSION=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-router"))')
}

# The run's bookkeeping: TMP (a directory named after $1, removed at exit), FLEET_PIDS and
# BALANCER_PID (stopped at exit), FINISHED (set it to 1 at the end: an unfinished run says so
# in RESULTS_TXT), RESULTS_TXT (bench/results/RESULTS_NAME.txt, emptied) and `say` (echo and
# append to it).
kvlb_bench_bookkeeping() {
    TMP=$(mktemp -d "${TMPDIR:-/tmp}/kvlb-$1.XXXXXX")
    FLEET_PIDS=()
    BALANCER_PID=""
    FINISHED=""
    trap kvlb_bench_cleanup EXIT
    trap 'exit 130' INT TERM
    mkdir -p "$ROOT/bench/results"
    RESULTS_TXT=$ROOT/bench/results/$RESULTS_NAME.txt
    : >"$RESULTS_TXT"
}

# shellcheck disable=SC2317 # called by the EXIT trap
kvlb_bench_cleanup() {
    [ -n "$BALANCER_PID" ] && stop_tree "$BALANCER_PID"
    local p
    for p in "${FLEET_PIDS[@]}"; do stop_tree "$p"; done
    if [ -z "$FINISHED" ] && [ -n "${RESULTS_TXT:-}" ] && [ -f "$RESULTS_TXT" ]; then
        echo "(run aborted before completion)" >>"$RESULTS_TXT"
    fi
    rm -rf "$TMP"
}

say() { echo "$@" | tee -a "$RESULTS_TXT"; }

# Prints, per balancer of BALANCERS, the summary of its run with the lowest p99 TTFT among
# $TMP/NAME.rROUND.json for rounds 1..ROUNDS (a busy machine only ever slows a run down).
kvlb_best_runs() {
    local name
    for name in $BALANCERS; do
        python3 - "$TMP" "$name" "$ROUNDS" <<'PY'
import json, os, sys
tmp, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = []
for r in range(1, rounds + 1):
    path = os.path.join(tmp, "%s.r%d.json" % (name, r))
    if os.path.exists(path):
        s = json.load(open(path))
        runs.append((s["ttft_p99_s"] if s["ttft_p99_s"] is not None else float("inf"), path))
if runs:
    print(min(runs)[1])
PY
    done
}
