#!/usr/bin/env python3
"""What request bodies can make kvlb hold: RSS while many clients send large bodies, and after.

    python3 bench/body_memory.py                       # target/release/kvlb
    KVLB_BIN=/path/to/other/kvlb python3 bench/body_memory.py   # another build, to compare
    CONNS=32 BODY_MIB=60 python3 bench/body_memory.py

Two rounds against one `kvlb serve --workers 1` in front of a replica that answers every
request at once (a small Python HTTP server in this script):

1. no key: API keys are configured and CONNS clients without one each announce a BODY_MIB body
   and send it, as fast as kvlb takes it. A kvlb that reads the body before checking the key
   buffers all of them.
2. keyed: the same clients with a valid key, kvlb started with `--max-body-memory
   BOUND_MIB` (default 256; 0: kvlb's default, for builds without the setting): what the bodies in flight may hold, beyond which kvlb answers 503
   before reading.

For each round it prints kvlb's RSS before, its peak while the clients send (sampled every
20 ms from /proc), and 3 s after every client closed, and how each client was answered.
Nothing here is a pass/fail: the figures go in docs and closing notes.
"""

import http.server
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVLB = os.environ.get("KVLB_BIN", os.path.join(ROOT, "target/release/kvlb"))
CONNS = int(os.environ.get("CONNS", "32"))
BODY = int(os.environ.get("BODY_MIB", "60")) << 20
BOUND_MIB = int(os.environ.get("BOUND_MIB", "256"))
KEY = "sk-bench-body-memory-0001"


class Replica(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        left = int(self.headers.get("content-length", "0"))
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                return
            left -= len(chunk)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def start_kvlb(replica, extra):
    keys = tempfile.NamedTemporaryFile("w", delete=False)
    keys.write(KEY + "\n")
    keys.close()
    args = [KVLB, "serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
            "--workers", "1", "--health-interval", "0", "--replica", replica,
            "--api-keys-file", keys.name, "--max-body-bytes", "64MiB"] + extra
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    listen = None
    said = []
    for line in p.stderr:
        said.append(line.rstrip())
        if line.startswith("kvlb: listening on "):
            listen = line.split()[-1]
        if line.startswith("kvlb: ready"):
            break
    if listen is None:
        p.wait()
        return p, None, said[-1] if said else "no output"
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    host, port = listen.rsplit(":", 1)
    return p, (host, int(port)), None


def client(addr, key, result, i):
    s = socket.create_connection(addr)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: kvlb\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {BODY}\r\n\r\n").encode()
    chunk = b"a" * (1 << 20)
    status = "no answer"
    try:
        s.sendall(head)
        s.settimeout(0.0)
        sent = 0
        got = b""
        while sent < BODY:
            try:
                s.sendall(chunk[: min(len(chunk), BODY - sent)])
                sent += min(len(chunk), BODY - sent)
            except BlockingIOError:
                time.sleep(0.001)
            try:
                got += s.recv(4096)
            except BlockingIOError:
                pass
            if got:
                break
        s.settimeout(30)
        while b"\r\n" not in got:
            more = s.recv(4096)
            if not more:
                break
            got += more
        status = got.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
        result[i] = (status, sent)
    except OSError as e:
        result[i] = (f"{type(e).__name__} after sending", 0)
    finally:
        s.close()


def round_(name, addr, pid, key):
    before = rss_mib(pid)
    result = [None] * CONNS
    threads = [threading.Thread(target=client, args=(addr, key, result, i)) for i in range(CONNS)]
    peak = before
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_mib(pid))
        time.sleep(0.02)
    for t in threads:
        t.join()
    time.sleep(3)
    after = rss_mib(pid)
    answers = {}
    for status, sent in result:
        answers.setdefault(status, []).append(sent)
    shown = "; ".join(f"{k}: {len(v)} (body sent before it: {min(v) >> 20}-{max(v) >> 20} MiB)"
                      for k, v in sorted(answers.items()))
    print(f"{name:8} RSS before {before:7.1f} MiB  peak {peak:7.1f} MiB  "
          f"3 s after {after:7.1f} MiB  | {shown}")


def main():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    replica = f"http://127.0.0.1:{srv.server_address[1]}"
    print(f"kvlb: {KVLB}; {CONNS} clients x {BODY >> 20} MiB bodies; "
          f"max_body_memory {BOUND_MIB} MiB in the keyed round")
    for name, key, extra in [("no key", None, []),
                             ("keyed", KEY, ["--max-body-memory", f"{BOUND_MIB}MiB"]
                              if BOUND_MIB else [])]:
        p, addr, why = start_kvlb(replica, extra)
        if addr is None:
            print(f"{name:8} not run: kvlb did not start ({why})")
            continue
        try:
            round_(name, addr, p.pid, key)
        finally:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
