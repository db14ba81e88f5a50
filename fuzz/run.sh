#!/usr/bin/env bash
# Builds kvlb's fuzz targets with libFuzzer on stable Rust and runs each for a bounded time.
#
#   bash fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]     (default: $KVLB_FUZZ_SECONDS or 20)
#
# cargo-fuzz is not needed: the SanitizerCoverage flags it passes are stable `-C` options. The
# build uses an explicit --target so build scripts and proc-macros are not instrumented, and
# its own target directory (fuzz/target) since its flags differ from the main build's.
# Each target starts from fuzz/seeds/<target> and fuzz/regressions/<target> plus the corpus
# it grew on earlier runs (fuzz/target/corpus/<target>). A crash is saved under
# fuzz/artifacts/<target>/; keep it as a regression by moving it to fuzz/regressions/<target>/
# once fixed (tests/ops_fuzz_corpus.rs replays that directory in `cargo test`).
# Prints one line per target, `fuzz <target>: ok (...)` or `fuzz <target>: FAILED (...)`, and
# exits 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")"
FUZZ=$PWD
seconds=${1:-${KVLB_FUZZ_SECONDS:-20}}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(http_request chunked prompt kv_events dns zmtp http_response)
fi
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
triple=$(rustc -vV | sed -n 's/^host: //p')
export CARGO_TARGET_DIR=$FUZZ/target
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cllvm-args=-sanitizer-coverage-stack-depth \
--cfg fuzzing -Cdebug-assertions -Coverflow-checks"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! cargo build --release --target "$triple" --bins >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    for t in "${targets[@]}"; do echo "fuzz $t: FAILED (build)"; done
    exit 1
fi

status=0
for t in "${targets[@]}"; do
    corpus=$CARGO_TARGET_DIR/corpus/$t
    artifacts=$FUZZ/artifacts/$t
    mkdir -p "$corpus" "$artifacts" "$FUZZ/seeds/$t" "$FUZZ/regressions/$t"
    if "$CARGO_TARGET_DIR/$triple/release/$t" -max_total_time="$seconds" -timeout=10 \
        -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "$corpus" "$FUZZ/seeds/$t" "$FUZZ/regressions/$t" \
        >"$log" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
        cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -n 1 || true)
        echo "fuzz $t: ok (${runs:-?} runs in ${seconds}s, ${cov:-cov: ?})"
    else
        status=1
        echo "fuzz $t: FAILED (artifact in fuzz/artifacts/$t/)"
        grep -E -A 12 'panicked|ERROR: libFuzzer|SUMMARY' "$log" | head -n 40 >&2 || tail -n 40 "$log" >&2
    fi
done
exit $status
