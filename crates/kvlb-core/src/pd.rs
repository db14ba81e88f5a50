//! Prefill/decode disaggregation: the request bodies of the two legs, as vLLM's disaggregated
//! serving speaks them (its NIXL, Mooncake and P2P connectors; the protocol of vLLM's own
//! example proxy and of vllm-router's PD mode).
//!
//! - **Prefill leg**: the client's body, not streamed, one token, with
//!   `"kv_transfer_params": {"do_remote_decode": true, ...}` (asking the prefill replica to
//!   keep the prompt's KV for a remote decode). `stream_options` goes (refused without
//!   `stream`), so do `min_tokens` and `max_completion_tokens` (`max_tokens` 1 bounds both).
//! - **The prefill answer** carries a top-level `kv_transfer_params` object (where the blocks
//!   are: engine id, request id, host, port, block ids), or none when the replica could not
//!   keep them.
//! - **Decode leg**: the client's body as sent, with that object as its `kv_transfer_params`;
//!   the decode replica pulls the blocks and streams the answer. Without the object it
//!   computes the prompt itself.
//!
//! SGLang's disaggregation (its router's PD mode, mini_lb) sends one body to both replicas
//! at once ([`sglang_body`]): the client's, with `bootstrap_host` and `bootstrap_port` (the
//! prefill replica's bootstrap server) and `bootstrap_room` (a number naming this request's
//! transfer) added. The decode replica fetches the room's KV from that server and streams
//! the answer; the prefill replica's own answer (one token) is only a verdict.
//!
//! Bodies are edited as bytes: members kept are copied as the client wrote them, members
//! replaced are left out and written once at the end (the engines' JSON parsers would keep the
//! last of duplicate keys; leaving them out does not depend on it). No allocation beyond the
//! caller's buffer.

#![forbid(unsafe_code)]

use crate::prompt::top_level_members;
use crate::select::PdPath;

/// A replica's part in prefill/decode disaggregation: `kvlb serve`'s replica option `role`,
/// `kvlb replica --role` (vLLM's `kv_role`), `kvlb simulate --roles`. A request whose model
/// has replicas of roles prefill and decode is computed on a prefill replica and continued
/// on a decode replica from the KV cache moved between them; every other request goes to the
/// replicas of role both or decode (a decode replica computes a prompt it was not sent the KV
/// of).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum Role {
    /// Prefill and decode, as a replica without disaggregation does.
    #[default]
    Both = 0,
    /// Computes prompts for decode replicas and holds their KV until pulled (`kv_producer`).
    Prefill = 1,
    /// Continues requests from the KV a prefill replica computed (`kv_consumer`).
    Decode = 2,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Both, Role::Prefill, Role::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role called `name` (`Role::as_str`).
    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// The role stored as `self as u8` (an atomic per replica slot).
    pub fn from_u8(v: u8) -> Role {
        match v {
            1 => Role::Prefill,
            2 => Role::Decode,
            _ => Role::Both,
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        Role::parse(s).ok_or_else(|| "expected prefill, decode or both".to_string())
    }
}

/// A file value through `FromStr`: `"value": why` on error.
impl<'de> serde::Deserialize<'de> for Role {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::text::from_text(d)
    }
}

/// What part of a request is routed, which decides the replicas' roles that may take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Leg {
    /// The whole request: replicas of role both, or decode (which compute what they were not
    /// sent the KV of).
    #[default]
    Whole,
    /// A request that may be disaggregated, before its prefill: replicas of role prefill (the
    /// disaggregated path) and decode (computed there directly); the candidates' `PdPath`
    /// says which, and `cache_aware` prices the two paths against each other.
    Split,
    /// The prefill leg of a disaggregated request: replicas of role prefill.
    Prefill,
    /// Its decode leg: replicas of role decode.
    Decode,
}

impl Leg {
    #[inline]
    pub fn admits(self, role: Role) -> bool {
        matches!(
            (self, role),
            (Leg::Whole, Role::Both | Role::Decode)
                | (Leg::Split, Role::Prefill | Role::Decode)
                | (Leg::Prefill, Role::Prefill)
                | (Leg::Decode, Role::Decode)
        )
    }

    /// How the request would run on a replica of `role` (`Candidate::pd`): a prefill
    /// replica's estimate adds the KV transfer (when the decode replica can start: the pair's
    /// estimate, on either leg that may take one), a decode replica of a split request
    /// computes it directly, the decode leg's replica receives the KV and decodes.
    #[inline]
    pub fn path(self, role: Role) -> PdPath {
        match (self, role) {
            (Leg::Split | Leg::Prefill, Role::Prefill) => PdPath::Prefill,
            (Leg::Split, _) => PdPath::Direct,
            (Leg::Decode, _) => PdPath::Decode,
            _ => PdPath::Whole,
        }
    }
}

/// What the prefill leg sets, after the client's members.
const PREFILL_MEMBERS: &[u8] = br#""stream":false,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// Members of the client's body the prefill leg replaces or drops.
const PREFILL_REPLACED: &[&[u8]] = &[
    b"stream",
    b"stream_options",
    b"max_tokens",
    b"max_completion_tokens",
    b"min_tokens",
    b"kv_transfer_params",
];

/// Write into `out` the client's members of `body` not named in `drop`, then the pieces of
/// `tail` one after the other (members written as JSON, without braces), as one object. False (and `out` unspecified) when `body`
/// is no JSON object.
fn rewrite(body: &[u8], drop: &[&[u8]], tail: &[&[u8]], out: &mut Vec<u8>) -> bool {
    out.clear();
    out.push(b'{');
    let mut members = 0;
    let whole = top_level_members(body, &mut |key, member, _| {
        if drop.contains(&key) {
            return;
        }
        if members > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&body[member]);
        members += 1;
    });
    if !whole {
        return false;
    }
    if members > 0 && !tail.is_empty() {
        out.push(b',');
    }
    for part in tail {
        out.extend_from_slice(part);
    }
    out.push(b'}');
    true
}

/// The prefill leg's body for the client's `body` (an OpenAI completions or chat completions
/// request), in `out`. False when `body` is no JSON object.
pub fn vllm_prefill_body(body: &[u8], out: &mut Vec<u8>) -> bool {
    rewrite(body, PREFILL_REPLACED, &[PREFILL_MEMBERS], out)
}

/// The decode leg's body: the client's `body` with `params` (the prefill answer's
/// `kv_transfer_params` value, as it came) as its `kv_transfer_params`, in `out`. False when
/// `body` is no JSON object.
pub fn vllm_decode_body(body: &[u8], params: &[u8], out: &mut Vec<u8>) -> bool {
    rewrite(
        body,
        &[b"kv_transfer_params"],
        &[br#""kv_transfer_params":"#, params],
        out,
    )
}

/// Members of the client's body SGLang's legs replace: a client may not choose the room (a
/// room already in use fails both replicas' transfers) nor the bootstrap server.
const SGLANG_REPLACED: &[&[u8]] = &[b"bootstrap_host", b"bootstrap_port", b"bootstrap_room"];

/// The largest `bootstrap_room` (SGLang's routers draw it from 0 to 2^63 - 1).
pub const MAX_BOOTSTRAP_ROOM: u64 = (1 << 63) - 1;

/// SGLang's body for both legs: the client's `body` with `bootstrap_host` (`host`, written as
/// a JSON string: a host name or address, which needs no escaping; others are refused),
/// `bootstrap_port` and `bootstrap_room` (`room`, at most [`MAX_BOOTSTRAP_ROOM`]) set, in
/// `out`. False when `body` is no JSON object or `host` holds a character a host name cannot.
pub fn sglang_body(body: &[u8], host: &str, port: u16, room: u64, out: &mut Vec<u8>) -> bool {
    use std::io::Write;
    let plain = |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_' | b':' | b'%');
    if host.is_empty() || !host.bytes().all(plain) || room > MAX_BOOTSTRAP_ROOM {
        return false;
    }
    // The numbers' digits, written into a stack buffer: nothing allocated.
    let mut num = [0u8; 64];
    let n = {
        let mut cur = std::io::Cursor::new(&mut num[..]);
        let _ = write!(cur, ",\"bootstrap_port\":{port},\"bootstrap_room\":{room}");
        cur.position() as usize
    };
    rewrite(
        body,
        SGLANG_REPLACED,
        &[br#""bootstrap_host":""#, host.as_bytes(), b"\"", &num[..n]],
        out,
    )
}

/// Where the prefill answer `body` holds its `kv_transfer_params` object (the last such
/// member, as the engines' parsers keep it): None when it has none, or `null`, or the answer
/// is no JSON object.
pub fn kv_transfer_params(body: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut found = None;
    let whole = top_level_members(body, &mut |key, _, value| {
        if key == b"kv_transfer_params" {
            found = Some(value);
        }
    });
    match found {
        Some(v) if whole && body.get(v.start) == Some(&b'{') => Some(v),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn parsed(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
    }

    #[test]
    fn the_prefill_leg_asks_for_one_token_and_the_kv_kept() {
        let client = br#"{ "model": "m", "messages": [{"role": "user", "content": "hi, \"you\""}],
            "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 300,
            "min_tokens": 5, "temperature": 0.5 }"#;
        let mut out = Vec::new();
        assert!(vllm_prefill_body(client, &mut out));
        let v = parsed(&out);
        assert_eq!(v["stream"], json!(false));
        assert_eq!(v["max_tokens"], json!(1));
        assert!(v.get("stream_options").is_none() && v.get("min_tokens").is_none());
        assert_eq!(v["temperature"], json!(0.5));
        assert_eq!(v["messages"][0]["content"], json!("hi, \"you\""));
        let p = &v["kv_transfer_params"];
        assert_eq!(p["do_remote_decode"], json!(true));
        assert_eq!(p["do_remote_prefill"], json!(false));
        assert_eq!(p["remote_block_ids"], Value::Null);
        // Each key once: nothing relies on the parser keeping the last duplicate.
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.matches("\"stream\"").count(), 1);
        assert_eq!(text.matches("\"max_tokens\"").count(), 1);
    }

    #[test]
    fn max_completion_tokens_gives_way_to_one_token() {
        let mut out = Vec::new();
        assert!(vllm_prefill_body(
            br#"{"model":"m","prompt":"x","max_completion_tokens":9}"#,
            &mut out
        ));
        let v = parsed(&out);
        assert!(v.get("max_completion_tokens").is_none());
        assert_eq!(v["max_tokens"], json!(1));
        assert_eq!(v["prompt"], json!("x"));
    }

    #[test]
    fn the_decode_leg_carries_the_prefill_answers_params() {
        let answer = br#"{"id":"cmpl-1","choices":[{"text":" "}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1},"usage":{"prompt_tokens":3}}"#;
        let at = kv_transfer_params(answer).expect("params");
        let client =
            br#"{"model":"m","prompt":"x","stream":true,"kv_transfer_params":{"stale":1}}"#;
        let mut out = Vec::new();
        assert!(vllm_decode_body(client, &answer[at], &mut out));
        let v = parsed(&out);
        assert_eq!(v["stream"], json!(true));
        assert_eq!(v["kv_transfer_params"]["remote_request_id"], json!("r"));
        assert_eq!(v["kv_transfer_params"]["remote_block_ids"], json!([[1, 2]]));
        assert!(v["kv_transfer_params"].get("stale").is_none());
    }

    #[test]
    fn an_answer_without_params_has_none() {
        for answer in [
            &br#"{"id":"x","choices":[]}"#[..],
            br#"{"id":"x","kv_transfer_params":null}"#,
            br#"{"id":"x","kv_transfer_params":{"a":1}"#,
            br#"[1,2]"#,
            b"",
        ] {
            assert_eq!(kv_transfer_params(answer), None, "{answer:?}");
        }
    }

    #[test]
    fn sglangs_legs_carry_the_bootstrap_server_and_a_room_of_kvlbs() {
        let client = br#"{"model":"m","messages":[],"stream":true,"bootstrap_room":7,"bootstrap_host":"evil","bootstrap_port":1}"#;
        let mut out = Vec::new();
        assert!(sglang_body(
            client,
            "10.0.0.5",
            8998,
            MAX_BOOTSTRAP_ROOM,
            &mut out
        ));
        let v = parsed(&out);
        assert_eq!(v["bootstrap_host"], json!("10.0.0.5"));
        assert_eq!(v["bootstrap_port"], json!(8998));
        assert_eq!(v["bootstrap_room"], json!(MAX_BOOTSTRAP_ROOM));
        assert_eq!(v["stream"], json!(true));
        let text = String::from_utf8(out.clone()).unwrap();
        assert_eq!(text.matches("bootstrap_room").count(), 1);
        // Applied to its own output, it replaces the room (a retry on another prefill).
        let first = out.clone();
        assert!(sglang_body(&first, "p2.local", 9000, 0, &mut out));
        let v = parsed(&out);
        assert_eq!(
            (v["bootstrap_host"].as_str(), v["bootstrap_room"].as_u64()),
            (Some("p2.local"), Some(0))
        );
        assert!(sglang_body(b"{}", "fe80::1%eth0", 1, 3, &mut out));
        assert_eq!(parsed(&out)["bootstrap_port"], json!(1));
        for host in ["", "a\"b", "a b", "a\\b"] {
            assert!(!sglang_body(b"{}", host, 1, 1, &mut out), "{host:?}");
        }
        assert!(!sglang_body(
            b"{}",
            "h",
            1,
            MAX_BOOTSTRAP_ROOM + 1,
            &mut out
        ));
        assert!(!sglang_body(b"[]", "h", 1, 1, &mut out));
    }

    #[test]
    fn a_body_that_is_no_object_is_refused() {
        let mut out = Vec::new();
        for body in [&b"[1]"[..], b"{\"a\":", b"", b"{\"a\":1} x"] {
            assert!(!vllm_prefill_body(body, &mut out), "{body:?}");
            assert!(!vllm_decode_body(body, b"{}", &mut out), "{body:?}");
        }
        assert!(vllm_prefill_body(b"{}", &mut out));
        assert_eq!(parsed(&out)["max_tokens"], json!(1));
        assert!(vllm_decode_body(b" {} ", b"{\"a\":1}", &mut out));
        assert_eq!(parsed(&out)["kv_transfer_params"]["a"], json!(1));
    }
}
