"""Time to first token of a simulated replica as a client measures it (wall time to the first
SSE event): it grows with the uncached prompt tokens and with the queue ahead, and drops when
the prefix is warm. Timing coefficients are pinned by flags so the numbers are stable; the time
scale (5) keeps every wait well above scheduling noise."""

import http.client
import json
import random
import threading
import time
import urllib.parse

import pytest
import requests

from test_replica_launch import ReplicaProcess

SCALE = 5.0
FLAGS = [
    "--time-scale", str(SCALE),
    "--prefill-a-s", "0.005", "--prefill-b-s", "0.0001", "--prefill-c-s", "0",
    "--decode-base-s", "0.01", "--decode-per-seq-s", "0", "--decode-per-ctx-token-s", "0",
    "--max-num-batched-tokens", "8192",
]


def ttft(url, tokens, max_tokens=1):
    """Wall seconds from sending the request to its first SSE event."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"prompt": tokens, "max_tokens": max_tokens, "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    # Raw lines of the chunked body: chunk sizes, events and blank lines.
    first = None
    while True:
        line = resp.fp.readline()
        assert line, "stream ended without [DONE]"
        if line.startswith(b"data: ") and first is None:
            first = time.perf_counter() - t0
        if line.startswith(b"data: [DONE]"):
            break
    conn.close()
    return first


@pytest.fixture(scope="module")
def replica():
    with ReplicaProcess(*FLAGS) as r:
        yield r.url


def fresh(rng, n):
    return [rng.randrange(1, 150000) for _ in range(n)]


def test_ttft_grows_with_uncached_prompt_tokens(replica):
    rng = random.Random(1)
    short = min(ttft(replica, fresh(rng, 64)) for _ in range(3))
    long = min(ttft(replica, fresh(rng, 4096)) for _ in range(3))
    # Engine: 5 ms + 0.1 ms/token -> 11.4 ms vs 415 ms; wall / 5 -> 2.3 ms vs 83 ms.
    print(f"ttft short={short:.4f}s long={long:.4f}s")
    assert long > short + 0.05, (short, long)
    assert 0.06 < long < 0.3, long


def test_ttft_drops_for_a_warm_prefix(replica):
    rng = random.Random(2)
    prompt = fresh(rng, 4096)
    cold = ttft(replica, prompt)
    warm = min(ttft(replica, prompt[:-16] + fresh(rng, 16)) for _ in range(3))
    print(f"ttft cold={cold:.4f}s warm={warm:.4f}s")
    assert warm < cold / 3, (cold, warm)


def test_ttft_grows_with_queue_depth(replica):
    rng = random.Random(3)
    alone = min(ttft(replica, fresh(rng, 2048)) for _ in range(2))
    # Four 8k-token prompts ahead fill four whole steps of 8192 tokens.
    ahead = [fresh(rng, 8000) for _ in range(4)]
    threads = [threading.Thread(target=ttft, args=(replica, p)) for p in ahead]
    for t in threads:
        t.start()
    time.sleep(0.02)
    queued = ttft(replica, fresh(rng, 2048))
    for t in threads:
        t.join()
    print(f"ttft alone={alone:.4f}s queued={queued:.4f}s")
    assert queued > alone + 0.2, (alone, queued)


def test_metrics_ttft_is_in_engine_seconds(replica):
    text = requests.get(f"{replica}/metrics", timeout=10).text
    line = next(l for l in text.splitlines() if l.startswith("vllm:time_to_first_token_seconds_sum"))
    count = next(l for l in text.splitlines() if l.startswith("vllm:time_to_first_token_seconds_count"))
    assert float(line.rsplit(" ", 1)[1]) > 0 and float(count.rsplit(" ", 1)[1]) > 0
