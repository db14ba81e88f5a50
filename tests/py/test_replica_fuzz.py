"""Hostile input against a simulated replica: seeded random bytes, mutated requests and
wrong-typed fields. Every answer must be a well-formed 2xx/4xx (or a closed connection), and
the replica must keep serving."""

import json
import random
import socket

import requests

from test_replica_launch import ReplicaProcess

VALID = [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 2}),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                              "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 2}),
    ("/tokenize", {"prompt": "abc"}),
]
ODD_VALUES = [None, True, -1, 0, 2**64, 1.5, "", "x" * 100, [], [None], {}, {"a": []}, [[[]]], "\ud800"]


def raw_exchange(addr, data):
    host, port = addr.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not b:
                break
            chunks.append(b)
    return b"".join(chunks)


def request_bytes(path, body):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def check_answer(answer):
    if not answer:
        return  # closed without an answer: allowed for garbage
    head = answer.split(b"\r\n", 1)[0]
    assert head.startswith(b"HTTP/1.1 "), answer[:200]
    status = int(head.split()[1])
    assert status in (200, 400, 404, 405, 408, 413, 431, 501), answer[:300]
    if status >= 400:
        head, rest = answer.split(b"\r\n\r\n", 1)
        length = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:"))
        # Mutated lengths may leave bytes that read as a further request: only the first counts.
        assert json.loads(rest[:length])["error"]["code"] == status


def test_random_and_mutated_requests_never_break_the_replica():
    rng = random.Random(7)
    with ReplicaProcess("--time-scale", "100", "--max-model-len", "2048") as r:
        addr = r.replicas[0]["http"]
        for i in range(300):
            path, body = rng.choice(VALID)
            data = request_bytes(path, json.dumps(body).encode())
            mode = i % 5
            if mode == 0:
                data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            elif mode == 1:
                data = data[: rng.randrange(len(data))]
            elif mode == 2:
                b = bytearray(data)
                for _ in range(rng.randrange(1, 6)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                data = bytes(b)
            elif mode == 3:
                body = dict(body)
                body[rng.choice(list(body) + ["max_tokens", "n", "stream", "cache_salt", "messages", "prompt"])] = rng.choice(ODD_VALUES)
                data = request_bytes(path, json.dumps(body).encode())
            check_answer(raw_exchange(addr, data))
        assert r.proc.poll() is None, "replica died"
        assert requests.get(f"{r.url}/health", timeout=10).status_code == 200
        ok = requests.post(f"{r.url}/v1/completions", json={"prompt": "still here", "max_tokens": 1}, timeout=10)
        assert ok.status_code == 200
