#!/usr/bin/env bash
# The project's one test command: `bash tests/run.sh`.
#
# 1. Installs, only when missing, the Debian packages the tests use (nginx, haproxy, wrk, curl,
#    iproute2), and stops the services that
#    Debian starts on install: tests run their own instances on ephemeral loopback ports.
# 2. Keeps a Python venv at .venv with tests/py/requirements.txt (re-installed only when the
#    requirements or the interpreter change, tracked by a stamp file holding their hash).
# 3. Fetches the pinned vLLM and SGLang wheels the engine tests run (tests/py/engines/fetch.py:
#    PyPI once, then a cache outside the repository, ${XDG_CACHE_HOME:-~/.cache}/kvlb/engines)
#    and exports the extracted sources as KVLB_ENGINE_SRC.
# 4. Runs the whole Rust suite (`cargo test --release --workspace`: unit + integration of every
#    crate; release so that timing-sensitive tests are less noisy) with KVLB_PYTHON pointing at the venv's python.
# 5. Runs the Python tests in tests/py with pytest, when there are any.
# 6. Builds the fuzz targets (fuzz/, libFuzzer on stable) and runs each for KVLB_FUZZ_SECONDS
#    (default 20); each target counts as one test.
# Ends with one summary line: `tests: N passed, N failed, N skipped`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# shellcheck source=bench/lib/packages.sh
source bench/lib/packages.sh

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi

started=$(date +%s)
phase() { echo "==> [$(($(date +%s) - started))s] $*"; }

logdir=$(mktemp -d)
trap 'rm -rf "$logdir"' EXIT

# --- 1. system packages ------------------------------------------------------------------
phase "system packages"
# clang, llvm, libbpf-dev and bpftool join this list with the BPF programs of the L4 mode.
kvlb_ensure_packages nginx haproxy wrk curl iproute2
kvlb_ensure_packages clang llvm linux-libc-dev bpftool
kvlb_ensure_ops_packages

# --- 2. Python venv ----------------------------------------------------------------------
phase "python venv"
requirements=tests/py/requirements.txt
venv=$ROOT/.venv
host_python=""
for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then
        host_python=$(command -v "$candidate")
        break
    fi
done
if [ -z "$host_python" ]; then
    echo "error: no python3.11 or python3 found" >&2
    exit 1
fi
if ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    rm -rf "$venv"
    if ! "$host_python" -m venv "$venv" >"$logdir/venv.log" 2>&1; then
        # Debian's own python needs the venv module from a separate package.
        rm -rf "$venv"
        pyver=$("$host_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        kvlb_ensure_packages "python$pyver-venv"
        "$host_python" -m venv "$venv"
    fi
fi
stamp=$venv/.kvlb-requirements.sha256
want=$({
    cat "$requirements"
    "$venv/bin/python" -VV
} | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements"
    echo "$want" >"$stamp"
else
    echo "requirements already satisfied ($requirements unchanged)"
fi
export KVLB_PYTHON=$venv/bin/python

# --- 3. engine sources -------------------------------------------------------------------
phase "engine sources (vLLM, SGLang)"
# Without them the engine tests fail (they run fetch.py again and show why); the rest runs.
if engine_src=$("$venv/bin/python" tests/py/engines/fetch.py); then
    export KVLB_ENGINE_SRC=$engine_src
    echo "engine sources in $KVLB_ENGINE_SRC"
else
    echo "warning: fetching the engine wheels failed; tests/engine_events.rs will fail" >&2
fi

# --- 4. Rust suite -----------------------------------------------------------------------
phase "cargo test --release --workspace"
cargo_status=0
cargo test --release --workspace --no-fail-fast 2>&1 | tee "$logdir/cargo.log" || cargo_status=$?

# "test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; ..."
read -r rust_passed rust_failed rust_ignored < <(awk '
    /^test result: / {
        for (i = 1; i <= NF; i++) {
            if ($(i + 1) ~ /^passed/) p += $i
            if ($(i + 1) ~ /^failed/) f += $i
            if ($(i + 1) ~ /^ignored/) s += $i
        }
    }
    END { print p + 0, f + 0, s + 0 }' "$logdir/cargo.log")

# --- 5. Python tests ---------------------------------------------------------------------
py_passed=0 py_failed=0 py_skipped=0 py_status=0 py_note="no Python tests"
py_tests=$(find tests/py -name 'test_*.py' -o -name '*_test.py' 2>/dev/null | head -n 1)
if [ -n "$py_tests" ]; then
    phase "pytest tests/py"
    # Python tests drive the real binary: make sure it is built (cheap after cargo test).
    cargo build --release --bin kvlb
    export KVLB_BIN=$ROOT/target/release/kvlb
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/py 2>&1 | tee "$logdir/pytest.log" || py_status=$?
    # Last line like "3 failed, 40 passed, 2 skipped in 12.3s" (order varies).
    summary=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$logdir/pytest.log" |
        tail -n 1 || true)
    count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE '^[0-9]+' || echo 0; }
    py_passed=$(count passed)
    py_failed=$(($(count failed) + $(count errors?)))
    py_skipped=$(count skipped)
    py_note="pytest exit $py_status"
    # Exit 5 means no tests collected: a failure here, since test files exist.
fi

# --- 6. Fuzz targets ----------------------------------------------------------------------
phase "fuzz targets (${KVLB_FUZZ_SECONDS:-20}s each)"
fuzz_status=0
bash fuzz/run.sh "${KVLB_FUZZ_SECONDS:-20}" 2>&1 | tee "$logdir/fuzz.log" || fuzz_status=$?
fuzz_passed=$(grep -c '^fuzz .*: ok' "$logdir/fuzz.log" || true)
fuzz_failed=$(grep -c '^fuzz .*: FAILED' "$logdir/fuzz.log" || true)
if [ "$fuzz_status" -ne 0 ] && [ "$fuzz_failed" -eq 0 ]; then
    fuzz_failed=1
fi

passed=$((rust_passed + py_passed + fuzz_passed))
failed=$((rust_failed + py_failed + fuzz_failed))
skipped=$((rust_ignored + py_skipped))
elapsed=$(($(date +%s) - started))
echo
echo "cargo test --release --workspace: exit $cargo_status ($rust_passed passed, $rust_failed failed," \
    "$rust_ignored ignored); python: $py_note ($py_passed passed, $py_failed failed," \
    "$py_skipped skipped); fuzz: exit $fuzz_status ($fuzz_passed passed, $fuzz_failed failed);" \
    "${elapsed}s"
if [ "$cargo_status" -ne 0 ] || [ "$py_status" -ne 0 ] || [ "$fuzz_status" -ne 0 ]; then
    echo "FAILED"
    echo "tests: $passed passed, $failed failed, $skipped skipped"
    exit 1
fi
echo "OK"
echo "tests: $passed passed, $failed failed, $skipped skipped"
