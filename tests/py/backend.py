#!/usr/bin/env python3
"""Test replica for the kvlb data-plane integration tests (standard library only).

Binds 127.0.0.1:0 (or the port given as the first argument), prints the port on stdout, and
serves HTTP/1.1 with keep-alive. Each path exercises one framing or failure mode the proxy must
handle:

  /echo                 the request body back (content-length) plus what arrived:
                        x-got-method, x-got-path, x-got-transfer-encoding, x-got-content-length,
                        x-got-x-forwarded-for, x-got-connection, x-got-expect,
                        x-got-header-names (comma list of lower-case names, in order),
                        x-got-headers-json (JSON list of [name, value] as received),
                        x-got-connection-count (requests carried by this TCP connection),
                        x-got-body-len, x-got-body-sha256
  /bytes?n=N            N deterministic bytes (content-length), x-body-sha256
  /chunked?n=N&size=S[&ext=1][&trailer=1]
                        chunked response of N chunks of S bytes, x-body-sha256; with chunk
                        extensions and/or a trailer field
  /close?size=S         close-delimited response (no content-length, no chunked)
  /sse?n=N&interval_ms=M
                        text/event-stream, chunked: N `data: {...}` events M ms apart,
                        then `data: [DONE]`
  /slow?ms=M            answers after M ms; notices and counts a peer that closes meanwhile
  /status?code=C[&cl=N] 204 / 304 (no body; a 304 may announce Content-Length N) or any other
                        code with a short body
  /hang                 never answers (gives up after 120 s or when the peer closes)
  /die?after=headers    writes the head and part of the body, then the process exits
  /die?after=nothing    the process exits without answering
  /bigheaders?size=N&fields=F
                        a response head of about N bytes in F x-pad-* fields (default 8)
  /raw?kind=K           exact, possibly malformed, response bytes, then the connection closes:
                        cl_te, dup_cl, bad_chunk, bad_status, garbage, short_cl, cut_chunk
                        (closed inside a chunk); late_bad_chunk (a good chunk, 200 ms, then
                        an invalid chunk size); reset_mid (part of the body, 200 ms, then a
                        reset instead of a close)
  /echo?conn_close=1    the echo answer with `Connection: close`; the connection then closes
  /echo?fin_with_body=1 the echo answer's head in one segment, then its body together with the
                        FIN in the next (the body is corked until the close adds the FIN), as
                        a server whose last write Nagle still holds when it closes
  /stats                JSON counters: connections_opened, connections_closed, requests,
                        aborted (slow/hang requests whose peer closed first)
  /health               200 (503 after /set_health?ok=0); not counted in requests
  GET /v1/models        404 (this backend lists no models); not counted in requests
  /set_health?ok=0|1    make /health fail or pass
  /set_mode?status=C    answer every other request with status C (0: back to normal)
Any other path is a 404 with x-got-path and x-got-headers-json.
HEAD on any path answers the head of a 11-byte response without the body; HEAD /chunked
announces Transfer-Encoding: chunked instead.

`--idle-close-ms N` closes a kept-alive connection that stays idle for N ms, without notice
(as real servers do), to exercise a proxy's handling of stale pooled connections.
"""

import hashlib
import json
import os
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

STATS_LOCK = threading.Lock()
STATS = {"connections_opened": 0, "connections_closed": 0, "requests": 0, "aborted": 0}
# Test knobs: /health passes; 0 = normal answers, else every request gets this status.
CONTROL = {"healthy": True, "status": 0}


def bump(key, by=1):
    with STATS_LOCK:
        STATS[key] += by


def pattern_bytes(n, seed=7):
    """Deterministic, non-repeating-looking bytes (so a misplaced slice changes the digest)."""
    block = hashlib.sha256(str(seed).encode()).digest()
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(block + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:n])


class BadRequest(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvlb-test-backend"
    sys_version = ""

    def version_string(self):
        return self.server_version

    def setup(self):
        super().setup()
        self.served_on_connection = 0
        bump("connections_opened")

    def finish(self):
        try:
            super().finish()
        finally:
            bump("connections_closed")

    def log_message(self, format, *args):
        if os.environ.get("KVLB_BACKEND_LOG"):
            sys.stderr.write("backend: " + (format % args) + "\n")

    # ----- request body -----

    def read_body(self):
        te = self.headers.get("Transfer-Encoding")
        if te is not None:
            if te.strip().lower() != "chunked":
                raise BadRequest("unsupported transfer-encoding %r" % te)
            return self.read_chunked()
        cl = self.headers.get("Content-Length")
        if cl is None:
            return b""
        n = int(cl)
        data = self.rfile.read(n)
        if len(data) != n:
            raise BadRequest("short body: %d of %d" % (len(data), n))
        return data

    def read_chunked(self):
        body = bytearray()
        while True:
            line = self.rfile.readline(1024)
            if not line.endswith(b"\n"):
                raise BadRequest("bad chunk size line %r" % line)
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                # trailers until an empty line
                while True:
                    t = self.rfile.readline(8192)
                    if t in (b"\r\n", b"\n", b""):
                        return bytes(body)
            chunk = self.rfile.read(size)
            if len(chunk) != size:
                raise BadRequest("short chunk")
            body += chunk
            if self.rfile.read(2) != b"\r\n":
                raise BadRequest("chunk not followed by CRLF")

    # ----- helpers -----

    def query(self):
        parts = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        return parts.path, q

    def send_simple(self, code, body, content_type="text/plain", extra=()):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def write_chunk(self, data):
        self.wfile.write(b"%x\r\n" % len(data) + data + b"\r\n")
        self.wfile.flush()

    def peer_closed(self, timeout):
        """Waits up to `timeout` seconds; True when the peer closed its side meanwhile."""
        try:
            readable, _, _ = select.select([self.connection], [], [], timeout)
            if not readable:
                return False
            data = self.connection.recv(1, socket.MSG_PEEK)
            if data == b"":
                return True
            # Bytes of a next request: not a close. Avoid spinning on them.
            time.sleep(timeout)
            return False
        except OSError:
            return True

    def wait_or_abort(self, seconds):
        """Sleeps `seconds`; returns False (and counts an abort) if the peer closes first."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            if self.peer_closed(min(left, 0.05)):
                bump("aborted")
                self.close_connection = True
                return False

    # ----- methods -----

    def do_HEAD(self):
        self.served_on_connection += 1
        bump("requests")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if urlsplit(self.path).path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", "11")
        self.send_header("x-got-method", "HEAD")
        self.send_header("x-got-connection-count", str(self.served_on_connection))
        self.end_headers()
        self.wfile.flush()

    def do_GET(self):
        self.dispatch()

    def do_POST(self):
        self.dispatch()

    def do_PUT(self):
        self.dispatch()

    def do_DELETE(self):
        self.dispatch()

    def do_OPTIONS(self):
        self.dispatch()

    def do_PATCH(self):
        self.dispatch()

    def dispatch(self):
        path, q = self.query()
        if path == "/health" and self.command == "GET":
            # The load balancer's health checks: not counted with the requests tests make.
            self.send_simple(200 if CONTROL["healthy"] else 503, b"")
            return
        if path == "/v1/models" and self.command == "GET":
            # The load balancer asking which models this backend serves: none listed (a plain
            # HTTP backend), and not counted with the requests tests make.
            self.send_simple(404, b"no model list\n")
            return
        if path == "/set_health":
            CONTROL["healthy"] = q.get("ok", "1") == "1"
            self.send_simple(200, b"ok\n")
            return
        if path == "/set_mode":
            CONTROL["status"] = int(q.get("status", "0"))
            self.send_simple(200, b"ok\n")
            return
        if CONTROL["status"] and path != "/stats":
            bump("requests")
            self.read_body()
            self.send_simple(CONTROL["status"], b"backend: forced status\n")
            return
        self.served_on_connection += 1
        bump("requests")
        try:
            body = self.read_body()
        except (BadRequest, ValueError) as e:
            self.close_connection = True
            self.send_simple(400, ("backend: %s\n" % e).encode(), extra=[("Connection", "close")])
            return
        path, q = self.query()
        route = {
            "/echo": self.route_echo,
            "/bytes": self.route_bytes,
            "/chunked": self.route_chunked,
            "/close": self.route_close,
            "/sse": self.route_sse,
            "/slow": self.route_slow,
            "/status": self.route_status,
            "/hang": self.route_hang,
            "/die": self.route_die,
            "/stats": self.route_stats,
            "/bigheaders": self.route_bigheaders,
            "/raw": self.route_raw,
        }.get(path)
        if route is None:
            # Says what was asked, for tests of how kvlb rewrites request targets.
            got = [
                ("x-got-path", self.path),
                ("x-got-headers-json", json.dumps([[k, v] for k, v in self.headers.items()])),
            ]
            self.send_simple(404, b"no such path\n", extra=got)
            return
        route(q, body)

    def route_echo(self, q, body):
        h = self.headers

        def got(name):
            values = h.get_all(name)
            return "<none>" if not values else ", ".join(values)

        names = ",".join(k.lower() for k in h.keys())
        if q.get("fin_with_body") == "1":
            self.close_connection = True
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
            self.wfile.write(body)
            return
        extra_close = []
        if q.get("conn_close") == "1":
            self.close_connection = True
            extra_close = [("Connection", "close")]
        self.send_simple(
            200,
            body,
            content_type="application/octet-stream",
            extra=[
                ("x-got-method", self.command),
                ("x-got-path", self.path),
                ("x-got-transfer-encoding", got("Transfer-Encoding")),
                ("x-got-content-length", got("Content-Length")),
                ("x-got-x-forwarded-for", got("X-Forwarded-For")),
                ("x-got-connection", got("Connection")),
                ("x-got-expect", got("Expect")),
                ("x-got-header-names", names),
                ("x-got-headers-json", json.dumps([[k, v] for k, v in h.items()])),
                ("x-got-connection-count", str(self.served_on_connection)),
                ("x-got-body-len", str(len(body))),
                ("x-got-body-sha256", hashlib.sha256(body).hexdigest()),
            ]
            + extra_close,
        )

    def route_bytes(self, q, body):
        data = pattern_bytes(int(q.get("n", "1024")), int(q.get("seed", "7")))
        self.send_simple(
            200,
            data,
            content_type="application/octet-stream",
            extra=[("x-body-sha256", hashlib.sha256(data).hexdigest())],
        )

    def route_chunked(self, q, body):
        n = int(q.get("n", "5"))
        size = int(q.get("size", "100"))
        data = pattern_bytes(n * size)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-body-sha256", hashlib.sha256(data).hexdigest())
        self.end_headers()
        ext = b";name=value" if q.get("ext") == "1" else b""
        for i in range(n):
            chunk = data[i * size : (i + 1) * size]
            self.wfile.write(b"%x%s\r\n" % (len(chunk), ext) + chunk + b"\r\n")
            self.wfile.flush()
        if q.get("trailer") == "1":
            self.wfile.write(b"0\r\nx-trailer: done\r\n\r\n")
        else:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def route_close(self, q, body):
        size = int(q.get("size", "1000"))
        data = pattern_bytes(size)
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Connection", "close")
        self.send_header("x-body-sha256", hashlib.sha256(data).hexdigest())
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def route_sse(self, q, body):
        n = int(q.get("n", "5"))
        interval = int(q.get("interval_ms", "400")) / 1000.0
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        start = time.monotonic()
        for i in range(n):
            event = {"i": i, "sent_ms": int((time.monotonic() - start) * 1000)}
            try:
                self.write_chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            except OSError:
                bump("aborted")
                self.close_connection = True
                return
            if i + 1 < n and not self.wait_or_abort(interval):
                return
        self.write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def route_slow(self, q, body):
        ms = int(q.get("ms", "1000"))
        if not self.wait_or_abort(ms / 1000.0):
            return
        self.send_simple(200, b"slow done\n", extra=[("x-slow-ms", str(ms))])

    def route_status(self, q, body):
        code = int(q.get("code", "204"))
        if code in (204, 304) or 100 <= code < 200:
            self.send_response(code)
            if code == 304:
                self.send_header("ETag", '"v1"')
                if "cl" in q:
                    self.send_header("Content-Length", q["cl"])
            self.end_headers()
            self.wfile.flush()
        else:
            self.send_simple(code, b"status %d\n" % code)

    def route_hang(self, q, body):
        self.wait_or_abort(120.0)
        self.close_connection = True

    def route_die(self, q, body):
        if q.get("after", "headers") == "headers":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"partial body")
            self.wfile.flush()
            time.sleep(0.05)
        os._exit(3)

    def route_bigheaders(self, q, body):
        size = int(q.get("size", "20000"))
        fields = max(1, int(q.get("fields", "8")))
        value = "p" * max(1, size // fields - 14)
        pad = [("x-pad-%04d" % i, value) for i in range(fields)]
        self.send_simple(200, b"big headers\n", extra=pad)

    RAW = {
        "cl_te": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nsmuggled",
        "dup_cl": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 13\r\n\r\n"
        b"hello smuggled",
        "bad_chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nhello\r\n0\r\n\r\n",
        "bad_status": b"HTTP/1.1 abc OK\r\nContent-Length: 2\r\n\r\nhi",
        "garbage": b"\x00\x01\x02 this is not http\r\n\r\n",
        "short_cl": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b",
        "cut_chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\na\r\nhel",
    }
    # Sent in two parts, 200 ms apart, so that the first has reached the client.
    RAW_LATER = {
        "late_bad_chunk": (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
            b"zz\r\nhello\r\n0\r\n\r\n",
        ),
        "reset_mid": (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b", None),
    }

    def route_raw(self, q, body):
        self.close_connection = True
        kind = q.get("kind", "garbage")
        if kind in self.RAW_LATER:
            first, second = self.RAW_LATER[kind]
            self.wfile.write(first)
            self.wfile.flush()
            time.sleep(0.2)
            if second is None:
                # A zero linger time turns the close into a reset.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                self.connection.close()
                return
            self.wfile.write(second)
            self.wfile.flush()
        else:
            self.wfile.write(self.RAW[kind])
            self.wfile.flush()
        try:
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def route_stats(self, q, body):
        with STATS_LOCK:
            snapshot = dict(STATS)
        self.send_simple(200, json.dumps(snapshot).encode(), content_type="application/json")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def main():
    args = sys.argv[1:]
    port = 0
    while args:
        arg = args.pop(0)
        if arg == "--idle-close-ms":
            Handler.timeout = int(args.pop(0)) / 1000.0
        else:
            port = int(arg)
    server = Server(("127.0.0.1", port), Handler)
    print(server.server_address[1], flush=True)
    # Exit when the parent closes our stdin (the test process died without killing us).
    def watch_stdin():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except Exception:
            pass
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    server.serve_forever(poll_interval=0.1)


if __name__ == "__main__":
    main()
