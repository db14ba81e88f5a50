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
//! Bodies are edited as bytes: members kept are copied as the client wrote them, members
//! replaced are left out and written once at the end (the engines' JSON parsers would keep the
//! last of duplicate keys; leaving them out does not depend on it). No allocation beyond the
//! caller's buffer.

#![forbid(unsafe_code)]

use crate::prompt::top_level_members;

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
