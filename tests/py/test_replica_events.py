"""KV cache events of a simulated replica as a vLLM consumer sees them: a pyzmq SUB socket
(three frames: topic, u64 big-endian sequence, msgpack batch) decoded with msgspec structs
written from the wire spec (replica-interfaces.md section 1), in both the map and the array
encodings, plus replay through a DEALER. The structs come from kv_events_spec.py, which
was written from the spec, not from kvlb's code."""

import random
import time
import pytest
import requests
import zmq

from kv_events_spec import DECODERS, hash_id  # the spec's msgspec structs (map and array forms)
from test_replica_launch import ReplicaProcess

BLOCK = 16


def kind(event):
    """"BlockStored" | "BlockRemoved" | "AllBlocksCleared" for either encoding's struct."""
    return type(event).__name__.removesuffix("Array")


def hashes(event):
    return [hash_id(h) for h in event.block_hashes]


def complete(url, tokens, max_tokens=1):
    r = requests.post(f"{url}/v1/completions", json={"prompt": tokens, "max_tokens": max_tokens}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def receive_until(sub, decoder, done, timeout=10.0):
    """Collect (seq, batch) until done(batches) or timeout."""
    got = []
    deadline = time.time() + timeout
    while not done(got):
        left = deadline - time.time()
        assert left > 0, f"timed out; got {[(s, [kind(e) for e in b.events]) for s, b in got]}"
        if sub.poll(int(left * 1000)):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""
            assert len(seq) == 8
            got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_stored_then_removed_and_replay(fmt):
    decoder = DECODERS[fmt]
    rng = random.Random(fmt)
    with ReplicaProcess(
        "--time-scale", "100", "--kv-capacity-tokens", "256", "--block-size", str(BLOCK),
        "--kv-events", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0",
        "--kv-events-format", fmt,
    ) as r:
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(r.replicas[0]["kv_events"])
            time.sleep(0.5)  # let the subscription reach the publisher

            first = [rng.randrange(1, 150000) for _ in range(8 * BLOCK)]
            complete(r.url, first)
            batches = receive_until(
                sub, decoder,
                lambda got: sum(len(e.token_ids) for _, b in got for e in b.events if kind(e) == "BlockStored") >= len(first),
            )
            stored = [e for _, b in batches for e in b.events if kind(e) == "BlockStored"]
            assert stored[0].parent_block_hash is None
            for prev, e in zip(stored, stored[1:]):
                assert hash_id(e.parent_block_hash) == hashes(prev)[-1]
            assert stored[0].block_size == BLOCK
            for e in stored:
                assert len(e.token_ids) == len(e.block_hashes) * BLOCK
                assert e.medium in (None, "GPU")
            stored_tokens = [t for e in stored for t in e.token_ids]
            assert stored_tokens[: len(first)] == first
            first_hashes = {h for e in stored for h in hashes(e)}

            # A second, unrelated prompt that does not fit beside the first: its blocks go.
            second = [rng.randrange(1, 150000) for _ in range(12 * BLOCK)]
            complete(r.url, second)
            batches += receive_until(
                sub, decoder,
                lambda got: any(kind(e) == "BlockRemoved" for _, b in got for e in b.events),
            )
            removed = {h for _, b in batches for e in b.events if kind(e) == "BlockRemoved" for h in hashes(e)}
            all_stored = {h for _, b in batches for e in b.events if kind(e) == "BlockStored" for h in hashes(e)}
            assert removed and removed <= all_stored
            assert removed & first_hashes
            order = [kind(e) for _, b in batches for e in b.events]
            assert order.index("BlockStored") < order.index("BlockRemoved")

            seqs = [s for s, _ in batches]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            for _, b in batches:
                assert abs(b.ts - time.time()) < 60

            # Replay from sequence 0 through a DEALER.
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(r.replicas[0]["kv_replay"])
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = []
            deadline = time.time() + 10
            while True:
                assert dealer.poll(int(max(deadline - time.time(), 0.01) * 1000)), "replay timed out"
                frames = dealer.recv_multipart()
                assert frames[0] == b""
                if len(frames) == 4:  # vLLM 0.33: ["", topic, seq, payload]
                    _, topic, seq, payload = frames
                else:  # older: ["", seq, payload]
                    _, seq, payload = frames
                if seq == b"\xff" * 8:
                    break
                replayed.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
            assert replayed, "replay sent nothing"
            replay_seqs = [s for s, _ in replayed]
            assert replay_seqs == list(range(0, len(replayed)))
            live = dict(batches)
            assert set(live) <= set(replay_seqs)
            for s, b in replayed:
                if s in live:
                    assert b == live[s]
        finally:
            ctx.destroy(linger=0)


def test_reset_prefix_cache_publishes_all_blocks_cleared():
    decoder = DECODERS["map"]
    with ReplicaProcess("--time-scale", "100", "--kv-events", "tcp://127.0.0.1:0") as r:
        assert r.replicas[0]["kv_replay"] is None
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(r.replicas[0]["kv_events"])
            time.sleep(0.5)
            complete(r.url, list(range(100, 100 + 4 * BLOCK)))
            receive_until(sub, decoder, lambda got: any(kind(e) == "BlockStored" for _, b in got for e in b.events))
            assert requests.post(f"{r.url}/reset_prefix_cache", timeout=10).status_code == 200
            receive_until(sub, decoder, lambda got: any(kind(e) == "AllBlocksCleared" for _, b in got for e in b.events))
        finally:
            ctx.destroy(linger=0)


def test_each_replica_of_a_process_publishes_its_own_events():
    decoder = DECODERS["map"]
    with ReplicaProcess("--count", "2", "--time-scale", "100", "--kv-events", "tcp://127.0.0.1:0") as r:
        ctx = zmq.Context()
        try:
            subs = []
            for rep in r.replicas:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(rep["kv_events"])
                subs.append(sub)
            time.sleep(0.5)
            url1 = f"http://{r.replicas[1]['http']}"
            complete(url1, list(range(500, 500 + 4 * BLOCK)))
            got = receive_until(subs[1], decoder, lambda got: any(kind(e) == "BlockStored" for _, b in got for e in b.events))
            assert got[0][0] == 0  # each publisher numbers from 0
            assert not subs[0].poll(300), "replica 0 published events of replica 1's request"
        finally:
            ctx.destroy(linger=0)
