#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/seeds/<target>/ (committed; re-run after changing this file).

Seeds are well-formed inputs of each parser from replica-interfaces.md and the unit tests:
HTTP request heads with every framing, chunked bodies, OpenAI completions and chat bodies, and
KV event batches in every engine variant (map and positional events, unsigned, signed and
32-byte digest hashes, map and positional batches). Standard library only: msgpack is written
by hand below.

DNS responses: A, AAAA, CNAME, SRV with its additionals, EDNS, NXDOMAIN, truncated, and hostile
ones (compression loops, pointers past the end, counts and rdlengths the packet cannot hold).

ZMTP streams from a PUB peer (ZMTP 3.0 and 3.1 handshakes, KV event messages, commands), and
hostile ones (frame sizes of 2^63 and around the message bound, malformed commands, reserved
flags).

Replica response heads of every framing, and the conflicting ones (duplicate or odd
Content-Length, Transfer-Encoding with a Content-Length or without a final chunked, HTTP/1.0
keep-alive with Transfer-Encoding, framing fields named in Connection).
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- msgpack ----------------------------------------------------------------------------
def mp(v):
    if v is None:
        return b"\xc0"
    if v is True:
        return b"\xc3"
    if v is False:
        return b"\xc2"
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, int):
        if 0 <= v < 128:
            return bytes([v])
        if 0 <= v < 2**16:
            return b"\xcd" + struct.pack(">H", v)
        if 0 <= v < 2**32:
            return b"\xce" + struct.pack(">I", v)
        if 0 <= v < 2**64:
            return b"\xcf" + struct.pack(">Q", v)
        if -32 <= v < 0:
            return struct.pack(">b", v)
        return b"\xd3" + struct.pack(">q", v)
    if isinstance(v, str):
        b = v.encode()
        if len(b) < 32:
            return bytes([0xA0 | len(b)]) + b
        return b"\xd9" + bytes([len(b)]) + b
    if isinstance(v, bytes):
        return b"\xc4" + bytes([len(v)]) + v
    if isinstance(v, list):
        head = bytes([0x90 | len(v)]) if len(v) < 16 else b"\xdc" + struct.pack(">H", len(v))
        return head + b"".join(mp(x) for x in v)
    if isinstance(v, dict):
        head = bytes([0x80 | len(v)]) if len(v) < 16 else b"\xde" + struct.pack(">H", len(v))
        return head + b"".join(mp(k) + mp(x) for k, x in v.items())
    raise TypeError(v)


TS = 1764450000.25
tokens = list(range(1, 33))
stored_map = {
    "type": "BlockStored",
    "block_hashes": [8866452693264111234, 807986237951177663],
    "parent_block_hash": None,
    "token_ids": tokens,
    "block_size": 16,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "group_idx": 0,
}
removed_map = {"type": "BlockRemoved", "block_hashes": [807986237951177663], "medium": "GPU"}
cleared_map = {"type": "AllBlocksCleared"}
write("kv_events", "vllm_map_events", mp([TS, [stored_map, removed_map, cleared_map], 0]))
write("kv_events", "batch_as_map", mp({"ts": TS, "events": [stored_map], "data_parallel_rank": 1}))
write("kv_events", "batch_dp_rank_key", mp({"ts": TS, "events": [removed_map], "dp_rank": None}))
sglang = dict(stored_map)
sglang["block_hashes"] = [-8635429971592222890, 1256577331724852459]
sglang["medium"] = "CPU_PINNED"
write("kv_events", "sglang_signed_hashes", mp([TS, [sglang], None]))
digest = dict(stored_map)
digest["block_hashes"] = [bytes(range(32)), bytes(range(32, 64))]
digest["parent_block_hash"] = bytes(range(64, 96))
write("kv_events", "digest_hashes", mp([TS, [digest, {"type": "BlockRemoved", "block_hashes": [bytes(range(32))]}]]))
write(
    "kv_events",
    "positional_events",
    mp(
        [
            TS,
            [
                ["BlockStored", [1, 2], 7, tokens, 16, 3, "CPU", None, "extra"],
                ["BlockStored", [5], None, tokens[:16], 16, None],
                ["BlockRemoved", [1], "GPU"],
                ["BlockRemoved", [2]],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    ),
)
write("kv_events", "unknown_event", mp([TS, [{"type": "SomethingNew", "x": [1, {"y": 2}]}], 0]))
write("kv_events", "empty", mp([0.0, [], None]))

# --- HTTP request heads -------------------------------------------------------------------
heads = {
    "get": b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    "post_cl": b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvlb\r\nContent-Type: application/json\r\nContent-Length: 12\r\nConnection: keep-alive\r\n\r\n{\"model\":1}\n",
    "post_chunked": b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "http10": b"GET /x?y=1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    "xff": b"GET /p HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2\r\nConnection: close, x-hop\r\nx-hop: 1\r\nTE: trailers\r\nUpgrade: h2c\r\n\r\n",
    "absolute": b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
    "absolute_uri": b"GET http://a:80/v1/models HTTP/1.1\r\nHost: a:80\r\n\r\n",
    "cl_te": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    "dup_cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
    "bare_lf": b"POST /v1/completions HTTP/1.1\nHost: a\nContent-Length: 2\n\n{}",
    "obs_fold": b"GET / HTTP/1.1\r\nHost: a\r\nX: 1\r\n  2\r\n\r\n",
    "te_list": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
}
for name, data in heads.items():
    write("http_request", name, data)

# --- chunked bodies -------------------------------------------------------------------------
chunks = {
    "simple": b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    "ext_trailer": b"5;a=b;c=\"d\"\r\nhello\r\n0\r\nx-t: 1\r\ny: 2\r\n\r\n",
    "bare_lf": b"3\nabc\n0\n\n",
    "upper_hex": b"A\r\n0123456789\r\n00\r\n\r\nGET / HTTP/1.1\r\n",
    "size_ws": b"3 ;x\r\nabc\r\n0\r\n\r\n",
}
for name, data in chunks.items():
    write("chunked", name, data)

# --- prompt bodies (first byte: bit 0 = chat, bits 1-3 = scratch size) --------------------
chat = {
    "messages": [
        {"role": "system", "content": "You are helpful.\n\u00e9\ud83d\ude00"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "input_audio", "x": [1, 2.5e3, True, None]}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"},
    ],
    "model": "m",
    "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
    "cache_salt": "s",
    "stream": True,
}
write("prompt", "chat", b"\x01" + json.dumps(chat).encode())
write("prompt", "chat_escaped", b"\x07" + json.dumps(chat, ensure_ascii=True).encode())
write("prompt", "chat_keys_first", b"\x0b" + b'{"model":"m","messages":[{"content":"x\\u0041\\\\","role":"user"}]}')
write("prompt", "completions_text", b"\x00" + b'{"model":"m","prompt":"Hello \\"world\\"","max_tokens":8}')
write("prompt", "completions_list", b"\x02" + b'{"prompt":["a","b\\n"],"model":"m"}')
write("prompt", "completions_tokens", b"\x04" + b'{"model":"m","prompt":[1,2,3,4294967295]}')
write("prompt", "completions_token_lists", b"\x06" + b'{"model":"m","prompt":[[1,2],[3]]}')
write("prompt", "lone_surrogate", b"\x01" + b'{"model":"m","messages":[{"role":"user","content":"\\ud800x"}]}')
# Even first bytes read a body as completions and as the Responses API, odd ones as chat and as
# Anthropic's Messages API.
responses = {"model": "m", "instructions": "Be brief.", "tools": [{"type": "function", "name": "ls", "parameters": {}}],
             "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi \u00e9"}]},
                       {"type": "function_call", "call_id": "c", "name": "ls", "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c", "output": "a"}]}
write("prompt", "responses_items", b"\x00" + json.dumps(responses).encode())
messages = {"model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                       {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {"p": "/"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "bin"}], "cache_control": {"type": "ephemeral"}}]}]}
write("prompt", "messages_blocks", b"\x03" + json.dumps(messages).encode())

# --- DNS responses (the packet only: the check asks the question the packet answers) ------
def dns_name(n):
    out = b""
    for label in n.split("."):
        out += bytes([len(label)]) + label.encode()
    return out + b"\x00"


def dns_header(flags, qd, an, ns, ar, qid=0x1234):
    return struct.pack(">HHHHHH", qid, flags, qd, an, ns, ar)


def dns_question(name, qtype):
    return dns_name(name) + struct.pack(">HH", qtype, 1)


def dns_rr(owner, rtype, rdata, ttl=30, rclass=1):
    return owner + struct.pack(">HHIH", rtype, rclass, ttl, len(rdata)) + rdata


Q12 = b"\xc0\x0c"  # a pointer to the question name at offset 12
a_resp = dns_header(0x8180, 1, 2, 0, 0) + dns_question("svc.local", 1)
a_resp += dns_rr(Q12, 1, bytes([10, 0, 0, 1])) + dns_rr(Q12, 1, bytes([10, 0, 0, 2]))
write("dns", "a_two", a_resp)
aaaa = dns_header(0x8180, 1, 1, 0, 0) + dns_question("svc.local", 28)
aaaa += dns_rr(Q12, 28, bytes(15) + b"\x01")
write("dns", "aaaa", aaaa)
# CNAME to a name whose A record follows, the target named by a pointer into the CNAME data.
cname = dns_header(0x8180, 1, 2, 0, 0) + dns_question("www.example.org", 1)
cname_at = len(cname) + 12
cname += dns_rr(Q12, 5, b"\x04edge" + b"\xc0\x10")
cname += dns_rr(bytes([0xC0, cname_at]), 1, bytes([192, 0, 2, 9]))
write("dns", "cname_chain", cname)
# SRV with its targets' addresses in the additional section (what kvlb's discovery asks).
srv = dns_header(0x8180, 1, 2, 0, 2) + dns_question("_http._tcp.vllm.default.svc", 33)
t0 = len(srv) + 12 + 6
srv += dns_rr(Q12, 33, struct.pack(">HHH", 10, 5, 8000) + dns_name("pod-0.vllm.default.svc"))
t1 = len(srv) + 12 + 6
srv += dns_rr(Q12, 33, struct.pack(">HHH", 10, 5, 8000) + b"\x05pod-1\xc0" + bytes([t0 + 6]))
srv += dns_rr(bytes([0xC0, t0]), 1, bytes([10, 1, 0, 5]))
srv += dns_rr(bytes([0xC0, t1]), 28, bytes(range(16)))
write("dns", "srv_additional", srv)
write("dns", "nxdomain", dns_header(0x8183, 1, 0, 1, 0) + dns_question("gone.local", 1)
      + dns_rr(Q12, 6, b"\x00\x00" + bytes(20)))
write("dns", "servfail", dns_header(0x8182, 1, 0, 0, 0) + dns_question("x.local", 1))
write("dns", "truncated", dns_header(0x8380, 1, 9, 0, 0) + dns_question("big.local", 1) + b"\xff" * 5)
opt = dns_header(0x8180, 1, 1, 0, 1) + dns_question("svc.local", 1)
opt += dns_rr(Q12, 1, bytes([10, 0, 0, 3])) + b"\x00" + struct.pack(">HHIH", 41, 1232, 0, 0)
write("dns", "edns_opt", opt)
write("dns", "upper_case", dns_header(0x8180, 1, 1, 0, 0) + dns_question("SVC.Local", 1)
      + dns_rr(Q12, 1, bytes([10, 0, 0, 4]))) 
# Hostile: a pointer to itself, a label then a pointer back to it (a loop through a backward
# pointer), two pointers to each other, a pointer past the end, counts the packet cannot
# hold, rdlength past the end, A data of 5 bytes, a long chain of pointers.
base = dns_header(0x8180, 1, 1, 0, 0) + dns_question("a.local", 1)
here = len(base)
write("dns", "pointer_self", base + bytes([0xC0, here]) + struct.pack(">HHIH", 1, 1, 1, 4) + bytes(4))
write("dns", "pointer_loop_label", base + bytes([1, ord("x"), 0xC0, here]) + struct.pack(">HHIH", 1, 1, 1, 4) + bytes(4))
write("dns", "pointer_pair", base + bytes([0xC0, here + 2, 0xC0, here]) + struct.pack(">HHIH", 1, 1, 1, 4) + bytes(4))
write("dns", "pointer_past_end", base + b"\xff\xff" + struct.pack(">HHIH", 1, 1, 1, 4) + bytes(4))
write("dns", "counts_too_big", dns_header(0x8180, 1, 0xFFFF, 0xFFFF, 0xFFFF) + dns_question("a.local", 1))
write("dns", "rdlength_huge", base + Q12 + struct.pack(">HHIH", 1, 1, 1, 0xFFFF) + bytes(4))
write("dns", "a_five_bytes", base + dns_rr(Q12, 1, bytes(5)))
chain = base
for i in range(40):
    chain += bytes([0xC0, 12]) if i == 0 else bytes([0xC0, len(chain) - 2])
write("dns", "pointer_chain_40", chain + struct.pack(">HHIH", 1, 1, 1, 4) + bytes(4))
write("dns", "label_type_0x40", base + b"\x41\x00" + struct.pack(">HHIH", 1, 1, 1, 4) + bytes(4))
write("dns", "query_not_response", dns_header(0x0100, 1, 0, 0, 0) + dns_question("a.local", 1))

# --- ZMTP (first byte: bit 0 = the check writes a PUB peer's handshake first, bit 1 = its
# minor version, bit 2 = recycle messages, bits 4-7 = how many piece sizes follow) ----------
def zmtp_frame(body, more=False, command=False):
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_command(name, data=b""):
    return zmtp_frame(bytes([len(name)]) + name + data, command=True)


def zmtp_message(*frames):
    return b"".join(zmtp_frame(f, more=i < len(frames) - 1) for i, f in enumerate(frames))


def zmtp_greeting(minor=1):
    return b"\xff" + bytes(7) + b"\x01\x7f" + bytes([3, minor]) + b"NULL" + bytes(16) + b"\x01" + bytes(31)


def zmtp_ready(socket_type, identity=None):
    props = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    if identity is not None:
        props += b"\x08Identity" + struct.pack(">I", len(identity)) + identity
    return zmtp_command(b"READY", props)


event = mp([TS, [stored_map], 0])
kv_msg = zmtp_message(b"kv@pod-0@model", struct.pack(">Q", 7), event)
big_msg = zmtp_message(b"kv@pod-0@model", struct.pack(">Q", 8), bytes(range(256)) * 3)
raw_hs = zmtp_greeting() + zmtp_ready(b"PUB")
write("zmtp", "raw_handshake_events", b"\x30\x00\x05\x10" + raw_hs + kv_msg + big_msg)
write("zmtp", "raw_xpub_zmtp30", b"\x00" + zmtp_greeting(0) + zmtp_ready(b"XPUB", b"") + kv_msg)
write("zmtp", "raw_wrong_peer", b"\x00" + zmtp_greeting() + zmtp_ready(b"ROUTER") + kv_msg)
write("zmtp", "raw_plain_mechanism", b"\x00" + zmtp_greeting()[:12] + b"PLAIN" + bytes(15) + bytes(32) + zmtp_ready(b"PUB"))
write("zmtp", "raw_error_command", b"\x00" + zmtp_greeting() + zmtp_command(b"ERROR", b"\x04nope"))
write("zmtp", "events_pieces", b"\x21\x00\x02" + kv_msg + big_msg + kv_msg)
write("zmtp", "events_recycled", b"\x45\x00\x00\x00\x07" + kv_msg * 3 + big_msg)
write("zmtp", "ping_subscribe_cancel", b"\x13\x03" + zmtp_command(b"PING", b"\x00\x0actx")
      + zmtp_command(b"SUBSCRIBE", b"kv@") + zmtp_command(b"CANCEL", b"kv@") + kv_msg)
write("zmtp", "command_between_frames", b"\x01" + zmtp_frame(b"kv@x", more=True)
      + zmtp_command(b"PING", b"\x00\x01") + zmtp_frame(b"data"))
# Hostile: announced sizes of 2^63, just over and just under the 256 MiB message bound,
# a message growing over the bound, a command with MORE, an empty command, a command whose
# name runs past its frame, reserved flag bits, a partial frame at the end.
write("zmtp", "long_2_63", b"\x01" + b"\x02" + struct.pack(">Q", 1 << 63) + b"x" * 16)
write("zmtp", "long_over_bound", b"\x01" + b"\x02" + struct.pack(">Q", (256 << 20) + 1) + b"x" * 16)
write("zmtp", "long_under_bound", b"\x11\x00" + b"\x02" + struct.pack(">Q", 256 << 20) + b"x" * 16)
write("zmtp", "long_200mib_partial", b"\x21\xff\x07" + b"\x03" + struct.pack(">Q", 200 << 20) + b"y" * 600)
write("zmtp", "message_over_bound", b"\x01" + b"\x03" + struct.pack(">Q", 4) + b"abcd" + b"\x02" + struct.pack(">Q", 256 << 20))
write("zmtp", "command_more", b"\x01" + b"\x05\x05\x04PING")
write("zmtp", "command_empty", b"\x01" + b"\x04\x00")
write("zmtp", "command_name_past_frame", b"\x01" + b"\x04\x03\x09ab")
write("zmtp", "reserved_flags", b"\x01" + b"\x08\x01x")
write("zmtp", "partial_frame", b"\x01" + kv_msg + b"\x00\x20short")
write("zmtp", "long_command_2_63", b"\x00" + zmtp_greeting() + b"\x06" + struct.pack(">Q", (1 << 63) + 5) + b"READY")

# --- HTTP response heads (first byte: bit 0 = HEAD request, bit 1 = client closes, bit 2 =
# HTTP/1.0 client, bits 3-4 = head size limit 16/256/8192/1 MiB) ----------------------------
responses = {
    "cl": b"\x10HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"ok\": true}\n",
    "chunked_sse": b"\x10HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata: \r\n0\r\n\r\n",
    "chunked_http10_client": b"\x14HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "until_close": b"\x10HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nbody",
    "http10_keep_alive": b"\x10HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
    "continue_then_ok": b"\x10HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    "no_content": b"\x10HTTP/1.1 204 No Content\r\nContent-Length: 10\r\n\r\n",
    "not_modified": b"\x10HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
    "head_request": b"\x11HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
    "hop_by_hop": b"\x12HTTP/1.1 503 Service Unavailable\r\nKeep-Alive: timeout=5\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nTE: trailers\r\nTrailer: x\r\nUpgrade: h2c\r\nProxy-Connection: close\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n",
    "dup_cl_same": b"\x10HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    "dup_cl_conflict": b"\x10HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "cl_list": b"\x10HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\nabc",
    "cl_plus_sign": b"\x10HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\nabc",
    "cl_and_te": b"\x10HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te_gzip_chunked": b"\x10HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "te_chunked_gzip": b"\x10HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\nxx",
    "te_gzip_and_cl": b"\x10HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 2\r\n\r\nxx",
    "te_two_fields": b"\x10HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "http10_te": b"\x10HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "connection_names_cl": b"\x10HTTP/1.1 200 OK\r\nConnection: Content-Length\r\nContent-Length: 2\r\n\r\nok",
    "close_then_keep_alive": b"\x10HTTP/1.0 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n",
    "no_reason": b"\x10HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n",
    "bare_lf": b"\x10HTTP/1.1 200 OK\nContent-Length: 1\n\nx",
    "partial": b"\x10HTTP/1.1 200 OK\r\nContent-Len",
    "too_large": b"\x00HTTP/1.1 200 OK\r\nX-Padding: aaaaaaaaaaaaaaaa\r\n",
    "obs_fold": b"\x10HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 0\r\n\r\n",
    "status_999": b"\x10HTTP/1.1 999 Odd\r\nContent-Length: 0\r\n\r\n",
    "replica_header_echo": b"\x10HTTP/1.1 200 OK\r\nx-kvlb-replica: evil\r\nContent-Length: 0\r\n\r\n",
}
for name, data in responses.items():
    write("http_response", name, data)
