"""A KV event publisher written from replica-interfaces.md section 1 (not from kvlb's code):
real libzmq (pyzmq) sockets, msgpack by msgspec Structs, in either event encoding.

    kv_publisher.py --format map|array [--replay] [--port N] [--topic T]

Binds an XPUB socket on tcp://127.0.0.1 (a PUB that also reports subscriptions, so the test
can wait for its subscriber; the wire a SUB sees is the same) and, with --replay, a ROUTER that
answers replay requests the vLLM 0.33 / SGLang way. Prints one JSON line
{"endpoint": "tcp://...", "replay": "tcp://..." | null}, then reads JSON commands from stdin,
one per line, answering each with one JSON line:

    {"op": "wait_subscribed"}                       -> {"ok": true} once a SUB subscribed
    {"op": "publish", "seq": N, "events": [...], "send": true}
        events in the spec's map shape, e.g. {"type": "BlockStored", "block_hashes": [-5, 7],
        "parent_block_hash": null, "token_ids": [...], "block_size": 16, "medium": "GPU"};
        hashes are sent as given (negative ints as SGLang's signed hashes). The batch is kept
        for replay; "send": false keeps it without publishing (to make a gap).
    {"op": "publish_raw", "seq": N, "payload_hex": "..."}
        publishes (and keeps) the given bytes as the payload, e.g. a payload that is no batch.
"""

import argparse
import json
import sys
import threading
import time
from typing import Optional

import msgspec
import zmq

END_SEQ = 0xFFFFFFFFFFFFFFFF


# Newer engines: maps tagged by "type", nil optional keys left out.
class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    token_ids: list[int]
    block_size: int
    parent_block_hash: Optional[int] = None
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


# Older engines: positional arrays, tag first.
class BlockStoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class BlockRemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    # Events of one encoding: map-tagged or positional Structs.
    events: list
    data_parallel_rank: Optional[int] = None


def build_event(e, fmt):
    kind = e["type"]
    if kind == "BlockStored":
        args = dict(
            block_hashes=e["block_hashes"],
            parent_block_hash=e.get("parent_block_hash"),
            token_ids=e["token_ids"],
            block_size=e["block_size"],
            lora_id=e.get("lora_id"),
            medium=e.get("medium"),
        )
        return BlockStored(**args) if fmt == "map" else BlockStoredArray(**args)
    if kind == "BlockRemoved":
        args = dict(block_hashes=e["block_hashes"], medium=e.get("medium"))
        return BlockRemoved(**args) if fmt == "map" else BlockRemovedArray(**args)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared() if fmt == "map" else AllBlocksClearedArray()
    raise ValueError(f"unknown event type {kind!r}")


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", choices=["map", "array"], default="map")
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--topic", default="")
    ap.add_argument("--port", type=int, default=0, help="PUB port (0: any free one)")
    args = ap.parse_args()

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    if args.port:
        pub.bind(f"tcp://127.0.0.1:{args.port}")
        port = args.port
    else:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
    topic = args.topic.encode()
    kept = []  # (seq, payload)
    lock = threading.Lock()
    encoder = msgspec.msgpack.Encoder()

    replay_endpoint = None
    if args.replay:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        rport = router.bind_to_random_port("tcp://127.0.0.1")
        replay_endpoint = f"tcp://127.0.0.1:{rport}"

        def serve_replay():
            while True:
                frames = router.recv_multipart()
                ident, start = frames[0], frames[-1]
                start = int.from_bytes(start, "big") if len(start) == 8 else None
                with lock:
                    batches = [(s, p) for s, p in kept if start is not None and s >= start]
                for s, p in batches:
                    router.send_multipart([ident, b"", topic, s.to_bytes(8, "big"), p])
                router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

        threading.Thread(target=serve_replay, daemon=True).start()

    say({"endpoint": f"tcp://127.0.0.1:{port}", "replay": replay_endpoint})

    subscribed = False
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd["op"] == "wait_subscribed":
            deadline = time.time() + 20
            while not subscribed and time.time() < deadline:
                if pub.poll(100, zmq.POLLIN):
                    msg = pub.recv()
                    subscribed = subscribed or msg[:1] == b"\x01"
            say({"ok": subscribed})
        elif cmd["op"] == "publish":
            seq = cmd["seq"]
            events = [build_event(e, args.format) for e in cmd["events"]]
            payload = encoder.encode(EventBatch(ts=time.time(), events=events))
            with lock:
                kept.append((seq, payload))
            if cmd.get("send", True):
                pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            say({"ok": True, "seq": seq})
        elif cmd["op"] == "publish_raw":
            seq = cmd["seq"]
            payload = bytes.fromhex(cmd["payload_hex"])
            with lock:
                kept.append((seq, payload))
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            say({"ok": True, "seq": seq})
        else:
            say({"ok": False, "error": f"unknown op {cmd['op']!r}"})


if __name__ == "__main__":
    main()
