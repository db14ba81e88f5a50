"""Starting `kvlb replica` from Python tests, and checks of its start-up contract.

Other test_replica_*.py files import `ReplicaProcess` from here. The binary is $KVLB_BIN, else
target/debug/kvlb under the repository root (built with `cargo build` when missing).
"""

import os
import pathlib
import subprocess
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kvlb_binary():
    env = os.environ.get("KVLB_BIN")
    if env:
        return env
    path = ROOT / "target" / "debug" / "kvlb"
    if not path.exists():
        subprocess.run(["cargo", "build", "--bin", "kvlb"], cwd=ROOT, check=True)
    return str(path)


class ReplicaProcess:
    """A running `kvlb replica --listen 127.0.0.1:0 ARGS`; killed on exit (with-statement)."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [kvlb_binary(), "replica", "--listen", "127.0.0.1:0", *map(str, args)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        # One dict per replica: http ("127.0.0.1:PORT"), kv_events, kv_replay (tcp://...) or None.
        self.replicas = []
        try:
            for line in self.proc.stderr:
                line = line.rstrip("\n")
                if line == "kvlb replica: ready":
                    break
                if line.startswith("kvlb replica: replica "):
                    words = line.split()
                    entry = {"http": words[5], "kv_events": None, "kv_replay": None}
                    for w in words[6:]:
                        key, _, value = w.partition("=")
                        entry[key] = value
                    self.replicas.append(entry)
            else:
                raise RuntimeError(f"kvlb replica exited with {self.proc.wait()} before ready")
        except BaseException:
            self.close()
            raise
        # Keep reading stderr so the child never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    @property
    def url(self):
        return f"http://{self.replicas[0]['http']}"

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_ready_lines_name_every_replica_and_socket():
    with ReplicaProcess(
        "--count", "3", "--kv-events", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0"
    ) as r:
        assert len(r.replicas) == 3
        assert len({e["http"] for e in r.replicas}) == 3
        for e in r.replicas:
            assert e["kv_events"].startswith("tcp://127.0.0.1:")
            assert e["kv_replay"].startswith("tcp://127.0.0.1:")


def test_bad_flag_names_flag_and_value():
    out = subprocess.run(
        [kvlb_binary(), "replica", "--listen", "127.0.0.1:0", "--kv-events-format", "xml"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "--kv-events-format" in out.stderr and "xml" in out.stderr


def test_bad_flag_exit_code_for_count():
    out = subprocess.run(
        [kvlb_binary(), "replica", "--listen", "127.0.0.1:0", "--count", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out.stderr
    assert "--count" in out.stderr


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
