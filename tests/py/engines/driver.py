#!/usr/bin/env python3
"""Runs the engines' own KV event code (vLLM 0.33.0, SGLang 0.5.23), unmodified, over real
ZeroMQ: the files fetch.py extracts, imported behind the stand-ins in shims/.

    driver.py publish --engine vllm [--bytes-hashes] [--topic T] [--dp-rank R --port P --replay-port Q]
    driver.py publish --engine sglang [--page-size N] [--topic T]
    driver.py decode --endpoint tcp://HOST:PORT [--topic T]

The engine sources are found in $KVLB_ENGINE_SRC (fetch.py's output); without it, fetch.py is
run first.

publish: creates the engine's real ZmqEventPublisher through its EventPublisherFactory (PUB and
replay ROUTER on 127.0.0.1, ephemeral ports), prints one JSON line
    {"ready": true, "engine": ..., "endpoint": "tcp://...", "replay": "tcp://...",
     "sources": {module: file}}
then reads one JSON command per line on stdin and answers each with one JSON line
({"ok": true, ...} or {"ok": false, "error": ...}):

    {"op": "publish", "events": [...]}   one KVEventBatch(ts=time.time(), events) published
                                         through the real publisher, answered once it is sent

vLLM events are built as vllm/v1/core/block_pool.py builds them, from a request's tokens (block
hashes chained from block 0: sha256 of (parent, tokens), published as the low 64 bits as with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default, or as the 32-byte digest with
--bytes-hashes):
    {"type": "store", "tokens": [...], "from": K, "to": M, "block_size": 16,
     "lora": null | "NAME", "cache_salt": null | "SALT", "mm": [[BLOCK, ID, OFFSET], ...]}
        cache_full_blocks: blocks K..M of the request newly cached, parent block K-1 (or None);
        a LoRA adapter, a salt and multimodal items enter the hashes and extra_keys as
        generate_block_hash_extra_keys and to_event_extra_keys make them (same keys for "reuse")
    {"type": "reuse", "tokens": [...], "blocks": N, "block_size": 16}
        emit_cached_block_events ("full" kv_cache_report_mode): BlockStored again for the N
        prefix-cache hits, parent None, from block 0
    {"type": "evict", "tokens": [...], "blocks": [I, ...], "block_size": 16}
        eviction: one BlockRemoved per block hash, as _emit_block_removed_events
    {"type": "clear"}                    AllBlocksCleared (reset_prefix_cache)
    {"type": "raw", "msgpack_hex": "c1"} bytes no engine writes, put in the events list

SGLang events come from its real KVCacheEventRecorder (mem_cache/events.py, page_size from
--page-size, 1 by default as in SGLang) driven by radix-node stand-ins, and are taken and
published as SchedulerKvEventsPublisher.publish_kv_events does:
    {"type": "store", "node": "a", "parent": "b" | null, "tokens": [...], "bigram": false,
     "extra_key": null, "cache_salt": null, "lora_name": null}
        a new radix node under node "b" (null: the root) with key tokens (for a bigram key, the
        raw tokens: N + 1 of them for N bigrams, as EAGLE's RadixKey), then record_store
    {"type": "remove", "node": "a"}      record_remove (eviction of the node)
    {"type": "clear"}                    record_all_cleared (reset)
The answer lists the events the recorder produced (type, block_size, hash count).

decode: subscribes to a publisher and decodes each message's payload with vLLM's own
msgspec.msgpack.Decoder(KVEventBatch), printing {"ready": true} once connected, then one line
per message: {"seq": N, "batch": {...}} or {"seq": N, "error": "..."}.
"""

import argparse
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
import types
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(HERE, "shims")
ENGINE_DIRS = {"vllm": "vllm-0.33.0", "sglang": "sglang-0.5.23"}


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def engine_src():
    src = os.environ.get("KVLB_ENGINE_SRC")
    if not src:
        out = subprocess.run(
            [sys.executable, os.path.join(HERE, "fetch.py")],
            stdout=subprocess.PIPE,
            check=True,
            text=True,
        )
        src = out.stdout.strip().splitlines()[-1]
    return src


def import_engine(name):
    """Put the shims and the engine's sources on sys.path; check each module comes from where
    it should (real engine files from the fetched sources, stand-ins from shims/)."""
    root = os.path.join(engine_src(), ENGINE_DIRS[name])
    if not os.path.isdir(root):
        raise SystemExit(f"driver.py: no {root}: run tests/py/engines/fetch.py")
    for path in (root, SHIMS):
        if path not in sys.path:
            sys.path.insert(0, path)
    if name == "vllm":
        real = ["vllm.distributed.kv_events", "vllm.config.kv_events"]
        shim = ["vllm.logger", "vllm.utils.network_utils", "vllm.v1.core.kv_cache_utils"]
    else:
        real = [
            "sglang.srt.disaggregation.kv_events",
            "sglang.srt.mem_cache.events",
            "sglang.srt.mem_cache.utils",
            "sglang.srt.mem_cache.cpp_utils.native_hash",
        ]
        shim = [
            "sglang.srt.runtime_context",
            "sglang.srt.utils.network",
            "sglang.srt.utils.cpp_extension_loader",
        ]
    import importlib

    sources = {}
    for mod in real + shim:
        m = importlib.import_module(mod)
        want = root if mod in real else SHIMS
        if not os.path.abspath(m.__file__).startswith(want + os.sep):
            raise SystemExit(f"driver.py: {mod} came from {m.__file__}, not from {want}")
        sources[mod] = m.__file__
    return sources


# --- vLLM ---------------------------------------------------------------------------------

# vLLM seeds the first block's parent with a fixed digest; any fixed 32 bytes do here.
NONE_HASH = hashlib.sha256(b"kvlb engine tests: vLLM NONE_HASH").digest()


def vllm_block_keys(spec, n):
    """Each block's extra keys as generate_block_hash_extra_keys builds them (kv_cache_utils.py):
    the LoRA key, the block's multimodal keys, the cache salt on block 0; None when empty."""
    lora = spec.get("lora")
    salt = spec.get("cache_salt")
    mm = {}
    for block, identifier, offset in spec.get("mm", []):
        mm.setdefault(block, []).append(("mm", identifier, offset))
    out = []
    for i in range(n):
        keys = [("lora", lora, "/adapters/" + lora)] if lora else []
        keys += mm.get(i, [])
        if i == 0 and salt:
            keys.append(("cache_salt", salt))
        out.append(tuple(keys) if keys else None)
    return out


def vllm_event_keys(keys):
    """to_event_extra_keys (kv_cache_utils.py): the untagged per-block list events carry."""
    if not keys:
        return None
    event_keys = [
        None if k is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in k)
        for k in keys
    ]
    return event_keys or None


def vllm_chain(tokens, block_size, keys=None):
    """Digest of each full block, chained as hash_block_tokens does (sha256 of the pickled
    (parent, tokens, extra_keys), vLLM's "sha256" hash function)."""
    out, parent = [], NONE_HASH
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        extra = keys[i] if keys else None
        parent = hashlib.sha256(pickle.dumps((parent, block, extra), protocol=5)).digest()
        out.append(parent)
    return out


class Vllm:
    def __init__(self, args):
        self.sources = import_engine("vllm")
        from vllm.config.kv_events import KVEventsConfig
        from vllm.distributed import kv_events

        self.kv = kv_events
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            # tcp://*:0 binds the node IP (shims: 127.0.0.1) on an ephemeral port; with
            # --port, rank 0's ports, which the publisher offsets by its --dp-rank itself.
            endpoint=f"tcp://*:{args.port}",
            replay_endpoint=f"tcp://*:{args.replay_port}",
            topic=args.topic,
        )
        self.publisher = kv_events.EventPublisherFactory.create(
            config, data_parallel_rank=args.dp_rank
        )
        resolved = self.publisher.get_publisher_config()
        self.endpoint, self.replay = resolved.endpoint, resolved.replay_endpoint
        self.bytes_hashes = args.bytes_hashes
        self.medium = kv_events.MEDIUM_GPU

    def external(self, digest):
        # maybe_convert_block_hash
        if self.bytes_hashes:
            return digest
        return int.from_bytes(digest, byteorder="big") & ((1 << 64) - 1)

    def stored(self, hashes, parent, tokens, block_size, lora=None, keys=None):
        # BlockPool._build_block_stored_event without session or lookahead hashing, in KV
        # cache group 0: lora_id and lora_name from the request's LoRARequest, extra_keys
        # through to_event_extra_keys.
        return self.kv.BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=block_size,
            lora_id=(abs(hash(lora)) % 1000 + 1) if lora else None,
            medium=self.medium,
            lora_name=lora,
            extra_keys=vllm_event_keys(keys),
            group_idx=0,
            session_id=None,
            lookahead_token_ids=None,
        )

    def events(self, specs):
        import msgspec

        out = []
        for s in specs:
            kind = s["type"]
            bs = s.get("block_size", 16)
            tokens = s.get("tokens", [])
            keys = vllm_block_keys(s, len(tokens) // bs)
            chain = vllm_chain(tokens, bs, keys)
            lora = s.get("lora")
            if kind == "store":
                k, m = s["from"], s["to"]
                parent = self.external(chain[k - 1]) if k > 0 else None
                hashes = [self.external(h) for h in chain[k:m]]
                ev_keys = keys[k:m] if any(keys[k:m]) else None
                out.append(self.stored(hashes, parent, tokens[k * bs : m * bs], bs, lora, ev_keys))
            elif kind == "reuse":
                n = s["blocks"]
                hashes = [self.external(h) for h in chain[:n]]
                ev_keys = keys[:n] if any(keys[:n]) else None
                out.append(self.stored(hashes, None, tokens[: n * bs], bs, lora, ev_keys))
            elif kind == "evict":
                for i in s["blocks"]:
                    out.append(
                        self.kv.BlockRemoved(
                            block_hashes=[self.external(chain[i])],
                            medium=self.medium,
                            group_idx=0,
                        )
                    )
            elif kind == "clear":
                out.append(self.kv.AllBlocksCleared())
            elif kind == "raw":
                out.append(msgspec.Raw(bytes.fromhex(s["msgpack_hex"])))
            else:
                raise ValueError(f"unknown vLLM event {kind!r}")
        return out

    def batch(self, events):
        # The scheduler's KVEventBatch(ts=time.time(), events=...).
        return self.kv.KVEventBatch(ts=time.time(), events=events)


# --- SGLang -------------------------------------------------------------------------------


class RadixKey:
    """Stand-in for radix_cache.RadixKey (which imports torch): what the recorder and the real
    hash helpers read. As in SGLang, a bigram key holds raw tokens, N + 1 for N bigrams."""

    __slots__ = ("token_ids", "extra_key", "cache_salt", "is_bigram", "limit")

    def __init__(self, token_ids, extra_key=None, is_bigram=False, cache_salt=None):
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.cache_salt = cache_salt or None
        self.is_bigram = is_bigram
        self.limit = None

    def raw_token_ids(self):
        return self.token_ids

    def __len__(self):
        n = len(self.token_ids)
        if self.is_bigram:
            return n - 1 if n > 0 else 0
        return n


class TreeNode:
    """Stand-in for radix_cache.TreeNode: the fields the recorder and hash helpers use."""

    def __init__(self, parent, key):
        self.parent = parent
        self.key = key
        self.hash_value = None
        self.event_hash_value = None


def sglang_root():
    # RadixCache.reset
    root = TreeNode(None, RadixKey(array("q")))
    root.hash_value = []
    return root


class Sglang:
    def __init__(self, args):
        self.sources = import_engine("sglang")
        from sglang.srt.disaggregation import kv_events
        from sglang.srt.mem_cache.events import KVCacheEventRecorder

        self.kv = kv_events
        config = json.dumps(
            {
                "publisher": "zmq",
                "endpoint": "tcp://127.0.0.1:0",
                "bind": True,
                "replay_endpoint": "tcp://127.0.0.1:0",
                "topic": args.topic,
            }
        )
        self.publisher = kv_events.EventPublisherFactory.create(config, attn_dp_rank=0)
        source = self.publisher.describe_local_source(block_size=args.page_size)
        self.endpoint, self.replay = source["endpoint"], source.get("replay_endpoint")
        self.recorder = KVCacheEventRecorder(enabled=True, page_size=args.page_size)
        self.root = sglang_root()
        self.nodes = {}

    def events(self, specs):
        for s in specs:
            kind = s["type"]
            if kind == "store":
                parent = self.nodes[s["parent"]] if s.get("parent") else self.root
                if s.get("lora_name"):
                    # Scheduler admission: KvEventLoraNames.register(req, lora_name), the
                    # request's extra_key ending with its 32-character lora_id.
                    req = types.SimpleNamespace(
                        extra_key=s["extra_key"], lora_id=s["extra_key"][-32:]
                    )
                    self.recorder.lora_names.register(req, s["lora_name"])
                key = RadixKey(
                    array("q", s["tokens"]),
                    extra_key=s.get("extra_key"),
                    is_bigram=bool(s.get("bigram")),
                    cache_salt=s.get("cache_salt"),
                )
                node = TreeNode(parent, key)
                self.nodes[s["node"]] = node
                self.recorder.record_store(node)
            elif kind == "remove":
                self.recorder.record_remove(self.nodes.pop(s["node"]))
            elif kind == "clear":
                self.nodes.clear()
                self.root = sglang_root()
                self.recorder.record_all_cleared()
            else:
                raise ValueError(f"unknown SGLang event {kind!r}")
        return self.recorder.take()

    def batch(self, events):
        return self.kv.KVEventBatch(ts=time.time(), events=events)


def summary(events):
    out = []
    for e in events:
        d = {"type": type(e).__name__}
        if hasattr(e, "block_hashes"):
            d["hashes"] = len(e.block_hashes)
        if hasattr(e, "block_size"):
            d["block_size"] = e.block_size
        out.append(d)
    return out


def wait_sent(publisher, within=10.0):
    """Until the publisher thread has sent everything queued."""
    deadline = time.monotonic() + within
    q = publisher._event_queue
    while q.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.005)
    if q.unfinished_tasks:
        raise RuntimeError("the publisher thread did not send the batch")


def publish_main(args):
    engine = Vllm(args) if args.engine == "vllm" else Sglang(args)
    emit(
        {
            "ready": True,
            "engine": args.engine,
            "endpoint": engine.endpoint,
            "replay": engine.replay,
            "sources": engine.sources,
        }
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            if cmd.get("op") != "publish":
                raise ValueError(f"unknown op {cmd.get('op')!r}")
            events = engine.events(cmd.get("events", []))
            if events or args.engine == "vllm":
                engine.publisher.publish(engine.batch(events))
                wait_sent(engine.publisher)
            emit({"ok": True, "events": summary(events)})
        except Exception as e:  # answered, so the test shows it
            emit({"ok": False, "error": f"{type(e).__name__}: {e}"})
    engine.publisher.shutdown()


def decode_main(args):
    import_engine("vllm")
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(args.endpoint)
    if not monitor.poll(10_000):
        raise SystemExit(f"driver.py: no connection to {args.endpoint}")
    emit({"ready": True, "endpoint": args.endpoint})
    while True:
        frames = sub.recv_multipart()
        seq = int.from_bytes(frames[-2], "big") if len(frames) >= 2 else None
        try:
            batch = decoder.decode(frames[-1])
            emit({"seq": seq, "batch": msgspec.to_builtins(batch)})
        except Exception as e:
            emit({"seq": seq, "error": f"{type(e).__name__}: {e}"})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    pub = sub.add_parser("publish")
    pub.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    pub.add_argument("--page-size", type=int, default=1)
    pub.add_argument("--bytes-hashes", action="store_true")
    pub.add_argument("--topic", default="")
    pub.add_argument("--dp-rank", type=int, default=0, help="vLLM: data_parallel_rank")
    pub.add_argument("--port", type=int, default=0, help="vLLM: rank 0's PUB port")
    pub.add_argument("--replay-port", type=int, default=0, help="vLLM: rank 0's replay port")
    dec = sub.add_parser("decode")
    dec.add_argument("--endpoint", required=True)
    dec.add_argument("--topic", default="")
    args = p.parse_args()
    if args.mode == "publish":
        publish_main(args)
    else:
        decode_main(args)


if __name__ == "__main__":
    main()
