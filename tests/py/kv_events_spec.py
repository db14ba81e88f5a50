"""KV cache events as replica-interfaces.md section 1 specifies them, spoken with real libzmq
(pyzmq) and decoded with msgspec Structs written from that spec, not from kvlb's code.

tests/kv_events_interop.rs runs this script in three modes and reads JSON lines from stdout:

  subscribe ENDPOINT FORMAT COUNT PREFIX   SUB: decode COUNT messages (FORMAT map|array|map-nil;
                                           map forms also by vLLM 0.33's own classes)
  replay ENDPOINT FORMAT START             DEALER: ask a replay ROUTER for batches from START
  topics ENDPOINT COUNT PREFIX...          SUB: print the topic and frame sizes of COUNT messages
  serve                                    bind a PUB and a replay ROUTER that engines would run

Every batch is printed in one canonical JSON shape that the Rust side also builds:
  {"ts": float, "dp_rank": int|null, "events": [{"type": ..., fields...}]}
with block hashes as opaque unsigned 64-bit ids (signed ints keep their bit pattern, binary
digests give their last 8 bytes big-endian), as the spec says consumers must treat them.
"""

import json
import sys
import time
from typing import Optional, Union

import msgspec
import zmq

TIMEOUT_MS = 20_000
END_SEQ = 0xFFFFFFFFFFFFFFFF
Hash = Union[int, bytes]


# --- Events, newer engines: maps tagged by "type"; nil optional keys are left out. ---


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    block_hashes: list[Hash]
    token_ids: list[int]
    block_size: int
    parent_block_hash: Optional[Hash] = None
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[Hash]
    medium: Optional[str] = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


MapEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


# --- Events, older engines: positional arrays with the tag first. ---


class BlockStoredArray(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemovedArray(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str] = None


class AllBlocksClearedArray(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


ArrayEvent = Union[BlockStoredArray, BlockRemovedArray, AllBlocksClearedArray]


# --- The batch: positional [ts, events, dp_rank]. ---


class MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: Optional[int] = None


class ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: Optional[int] = None


# --- vLLM 0.33's own classes (vllm/distributed/kv_events.py), for the fields they declare
# without a default: msgspec requires those keys (nil or not) in every map event. ---


class Vllm033BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class Vllm033BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str]


class Vllm033Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[Vllm033BlockStored, Vllm033BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


VLLM_0_33 = msgspec.msgpack.Decoder(Vllm033Batch)


def vllm_error(payload):
    """Why vLLM 0.33's classes refuse a map-event payload, or None."""
    try:
        VLLM_0_33.decode(payload)
        return None
    except msgspec.ValidationError as e:
        return str(e)


DECODERS = {
    "map": msgspec.msgpack.Decoder(MapBatch),
    "array": msgspec.msgpack.Decoder(ArrayBatch),
    # Maps with the nil keys written out decode into the same structs.
    "map-nil": msgspec.msgpack.Decoder(MapBatch),
}


def hash_id(h):
    """An engine hash as the opaque 64-bit id the spec says to use."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & 0xFFFFFFFFFFFFFFFF


def canonical_event(e):
    if isinstance(e, (BlockStored, BlockStoredArray)):
        return {
            "type": "BlockStored",
            "block_hashes": [hash_id(h) for h in e.block_hashes],
            "parent_block_hash": None if e.parent_block_hash is None else hash_id(e.parent_block_hash),
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_id": e.lora_id,
            "medium": e.medium,
        }
    if isinstance(e, (BlockRemoved, BlockRemovedArray)):
        return {
            "type": "BlockRemoved",
            "block_hashes": [hash_id(h) for h in e.block_hashes],
            "medium": e.medium,
        }
    return {"type": "AllBlocksCleared"}


def canonical_batch(b):
    return {
        "ts": b.ts,
        "dp_rank": b.data_parallel_rank,
        "events": [canonical_event(e) for e in b.events],
    }


def nil_keys(payload):
    """Keys of map events that carry nil (the spec says they are left out)."""
    raw = msgspec.msgpack.decode(payload)
    found = []
    for e in raw[1]:
        if isinstance(e, dict):
            found += [k for k, v in e.items() if v is None]
    return found


def emit(obj):
    print(json.dumps(obj), flush=True)


def subscribe(endpoint, fmt, count, prefix):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, prefix.encode())
    sub.connect(endpoint)
    for _ in range(count):
        frames = sub.recv_multipart()
        if len(frames) != 3:
            raise SystemExit(f"message of {len(frames)} frames, the spec says 3")
        topic, seq, payload = frames
        if len(seq) != 8:
            raise SystemExit(f"sequence frame of {len(seq)} bytes, the spec says 8")
        batch = DECODERS[fmt].decode(payload)
        emit(
            {
                "topic": topic.decode(),
                "seq": int.from_bytes(seq, "big"),
                "batch": canonical_batch(batch),
                "nil_keys": nil_keys(payload),
                "vllm_error": None if fmt == "array" else vllm_error(payload),
            }
        )
    sub.close()
    ctx.term()


def topics(endpoint, count, prefixes):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    for p in prefixes:
        sub.setsockopt(zmq.SUBSCRIBE, p.encode())
    sub.connect(endpoint)
    for _ in range(count):
        frames = sub.recv_multipart()
        emit({"topic": frames[0].decode(), "sizes": [len(f) for f in frames]})
    sub.close()
    ctx.term()


def replay(endpoint, fmt, start):
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    while True:
        frames = dealer.recv_multipart()
        if len(frames) != 4 or frames[0] != b"":
            raise SystemExit(f"replay reply {frames!r} is not ['', topic, seq, payload]")
        _, topic, seq, payload = frames
        seq = int.from_bytes(seq, "big")
        if seq == END_SEQ:
            emit({"end": [f.hex() for f in frames]})
            break
        batch = DECODERS[fmt].decode(payload)
        emit({"topic": topic.decode(), "seq": seq, "batch": canonical_batch(batch)})
    dealer.close()
    ctx.term()


# --- serve: what an engine binds, encoded the ways engines encode. ---


class EngineBlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    """vLLM 0.33's BlockStored plus a key this spec does not know (new ones keep appearing)."""

    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    group_idx: Optional[int] = None


class EngineBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


def served_batches():
    """(payload, canonical JSON) pairs covering the variants engines send."""
    digest = bytes(range(100, 132))
    sglang = [-8635429971592222890, 1256577331724852459]
    tokens = list(range(1, 33))
    batches = [
        # vLLM 0.33 map form, unsigned hashes, an unknown key, a LoRA name.
        EngineBatch(
            ts=1764000000.5,
            events=[
                EngineBlockStored(
                    block_hashes=[8866452693264111234, 807986237951177663],
                    parent_block_hash=None,
                    token_ids=tokens,
                    block_size=16,
                    medium="GPU",
                    lora_name="adapter",
                    group_idx=0,
                ),
                BlockRemoved(block_hashes=[807986237951177663], medium="GPU"),
            ],
            data_parallel_rank=0,
        ),
        # SGLang: signed hashes, no dp rank.
        EngineBatch(
            ts=1764000001.25,
            events=[
                BlockStored(block_hashes=sglang, token_ids=tokens, block_size=16, parent_block_hash=-1),
                AllBlocksCleared(),
            ],
        ),
        # vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: 32-byte digests; an offloaded tier.
        EngineBatch(
            ts=1764000002.0,
            events=[
                BlockStored(
                    block_hashes=[digest],
                    parent_block_hash=digest,
                    token_ids=tokens[:16],
                    block_size=16,
                    lora_id=4,
                    medium="CPU",
                )
            ],
            data_parallel_rank=1,
        ),
        # Older engine: positional events, BlockStored as short as vLLM 0.9's six elements.
        EngineBatch(
            ts=1764000003.0,
            events=[
                ("BlockStored", [11, 12], 10, tokens[:8], 4, None),
                ("BlockRemoved", [11], "GPU"),
                ("BlockRemoved", [12]),
                ("AllBlocksCleared",),
            ],
        ),
    ]
    out = []
    for b in batches:
        payload = msgspec.msgpack.encode(b)
        # The canonical view of what was sent, by decoding it back with the spec's structs
        # (map or array form, whichever each event uses).
        raw = msgspec.msgpack.decode(payload)
        events = []
        for e in raw[1]:
            spec_type = MapEvent if isinstance(e, dict) else ArrayEvent
            events.append(canonical_event(msgspec.convert(e, spec_type)))
        canon = {"ts": raw[0], "dp_rank": raw[2] if len(raw) > 2 else None, "events": events}
        out.append((payload, canon))
    return out


def serve():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router_port = router.bind_to_random_port("tcp://127.0.0.1")
    topic = b"kv@pod-0@Qwen/Qwen3-8B"
    batches = served_batches()
    emit(
        {
            "pub": pub_port,
            "router": router_port,
            "topic": topic.decode(),
            "batches": [c for _, c in batches],
        }
    )
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    requests = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # A publisher cannot tell when a subscription lands: publish rounds, each led by a
        # message on a topic nobody subscribes to (libzmq must filter it out).
        pub.send_multipart([b"other", (0).to_bytes(8, "big"), batches[0][0]])
        for seq, (payload, _) in enumerate(batches):
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        if not dict(poller.poll(50)):
            continue
        identity, *request = router.recv_multipart()
        if request[:1] != [b""] or len(request) != 2 or len(request[1]) != 8:
            emit({"bad_request": [f.hex() for f in request]})
            continue
        start = int.from_bytes(request[1], "big")
        emit({"request": start})
        new_layout = requests % 2 == 0
        requests += 1
        for seq, (payload, _) in enumerate(batches):
            if seq < start:
                continue
            if new_layout:  # vLLM 0.33, SGLang 0.5.23
                router.send_multipart([identity, b"", topic, seq.to_bytes(8, "big"), payload])
            else:  # older vLLM
                router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        if new_layout:
            router.send_multipart([identity, b"", b"", END_SEQ.to_bytes(8, "big"), b""])
        else:
            router.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])


def main(argv):
    mode = argv[1] if len(argv) > 1 else ""
    if mode == "subscribe":
        subscribe(argv[2], argv[3], int(argv[4]), argv[5])
    elif mode == "topics":
        topics(argv[2], int(argv[3]), argv[4:])
    elif mode == "replay":
        replay(argv[2], argv[3], int(argv[4]))
    elif mode == "serve":
        serve()
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
