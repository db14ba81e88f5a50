# shellcheck shell=bash
# Sourced by tests/run.sh and bench/proxy_bench.sh: installs Debian packages the tests and
# benchmarks need, idempotently (nothing is fetched when everything is already installed), and
# makes sure the nginx/haproxy services that Debian's install scripts may start are stopped:
# tests and benchmarks start their own instances on ephemeral loopback ports.

# Runs a command as root (directly, or through sudo when not root).
kvlb_as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        echo "error: need root (or sudo) to run: $*" >&2
        return 1
    fi
}

# Prints the names, among the arguments, of the Debian packages that are not installed.
kvlb_missing_packages() {
    local pkg
    for pkg in "$@"; do
        if ! dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q ' installed$'; then
            echo "$pkg"
        fi
    done
}

# Stops a system service that a package's install script may have started.
kvlb_stop_service() {
    local name=$1 pidfile=$2 pid
    if command -v service >/dev/null 2>&1; then
        kvlb_as_root service "$name" stop >/dev/null 2>&1 || true
    fi
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        kvlb_as_root systemctl disable --now "$name" >/dev/null 2>&1 || true
    fi
    # Without an init system the service command may do nothing: fall back to the pid file.
    if [ -s "$pidfile" ]; then
        pid=$(cat "$pidfile" 2>/dev/null || true)
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            kvlb_as_root kill "$pid" 2>/dev/null || true
        fi
    fi
}

# Installs the given Debian packages if any is missing: `apt-get update` only then.
kvlb_ensure_packages() {
    local missing
    missing=$(kvlb_missing_packages "$@" | tr '\n' ' ')
    if [ -z "$missing" ]; then
        return 0
    fi
    echo "installing Debian packages: $missing" >&2
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: apt-get not found; install these packages by hand: $missing" >&2
        return 1
    fi
    local log
    log=$(mktemp)
    # shellcheck disable=SC2086 # one package name per word
    if ! { kvlb_as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
        kvlb_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends $missing; } >"$log" 2>&1; then
        tail -n 30 "$log" >&2
        rm -f "$log"
        echo "error: apt-get failed" >&2
        return 1
    fi
    rm -f "$log"
    missing=$(kvlb_missing_packages "$@" | tr '\n' ' ')
    if [ -n "$missing" ]; then
        echo "error: still missing after apt-get install: $missing" >&2
        return 1
    fi
    case " $* " in *" nginx "*) kvlb_stop_service nginx /run/nginx.pid ;; esac
    case " $* " in *" haproxy "*) kvlb_stop_service haproxy /run/haproxy.pid ;; esac
    return 0
}

# Tools of tests/systemd_unit.rs and fuzz/run.sh: systemd-analyze (package systemd; installing
# it in a container does not make it PID 1), strace, and a C++ compiler for libFuzzer.
kvlb_ensure_ops_packages() {
    kvlb_ensure_packages systemd strace g++
}
