//! Disaggregated prefill as vLLM's NixlConnector speaks it to a proxy (vLLM's
//! toy_proxy_server, vllm-router's vllm_pd_router): what `--role prefill|decode` makes of a
//! request's `kv_transfer_params`, and the params a prefill replica answers with. Pure: no I/O
//! (the side channel that moves the KV is `side_channel`).
//!
//! * **Prefill leg** (proxy -> prefill replica): the client's body with `max_tokens` 1,
//!   `stream` false and `kv_transfer_params.do_remote_decode` true. The replica computes the
//!   prompt, answers its one token with a top-level `kv_transfer_params` naming the blocks it
//!   keeps for the decode ([`prefill_answer`]), and holds them until pulled or timed out.
//! * **Decode leg** (proxy -> decode replica): the client's body with that answer copied in as
//!   its `kv_transfer_params`. Valid params ([`RemoteKv`], checked as NixlConnector's
//!   `update_state_after_alloc` does) make the replica pull the KV and skip the prefill; with
//!   none, or invalid ones, it prefills locally, as vLLM does.
//!
//! Choices: a prefill leg of several prompts or `n` > 1 is served whole and answers null
//! params (one set of params cannot name several requests' blocks; a proxy then sends the
//! decode the plain request). A decode leg with several prompts prefills locally.
//! `remote_block_ids` may be vLLM's flat list or its per-KV-cache-group lists; only its
//! non-emptiness matters here (the side channel names the blocks again).

#![forbid(unsafe_code)]

use super::openai::{type_name, ApiError};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;

/// A replica's part in disaggregated prefill (`--role`), vLLM's `kv_role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Whole requests; `kv_transfer_params` ignored (a replica without a KV connector).
    #[default]
    Both,
    /// Prefills for remote decodes (`kv_producer`).
    Prefill,
    /// Decodes of remote prefills (`kv_consumer`).
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Why a decode replica prefilled a request itself (the `reason` of
/// `kvlb_replica_kv_local_prefills_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalPrefill {
    /// A plain request: no `do_remote_prefill`.
    NoParams,
    /// `do_remote_prefill` with params that name no KV to pull.
    InvalidParams,
    /// The pull failed (side channel unreachable, KV unknown, already pulled or expired).
    PullFailed,
}

impl LocalPrefill {
    pub const ALL: [LocalPrefill; 3] = [
        LocalPrefill::NoParams,
        LocalPrefill::InvalidParams,
        LocalPrefill::PullFailed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            LocalPrefill::NoParams => "no_params",
            LocalPrefill::InvalidParams => "invalid_params",
            LocalPrefill::PullFailed => "pull_failed",
        }
    }
}

/// Where a decode pulls its prompt's KV from: the prefill answer's params.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteKv {
    pub engine_id: String,
    pub request_id: String,
    pub host: String,
    pub port: u16,
}

/// What a request is to a replica of some role.
#[derive(Debug, Clone, PartialEq)]
pub enum Leg {
    /// Served whole, as a replica of the default role serves everything.
    Whole,
    /// A prefill for a remote decode: hold the KV, answer params.
    Prefill,
    /// A decode of a remote prefill: pull the KV from there first.
    Decode(RemoteKv),
    /// A decode replica prefilling locally, and why (a message for the log).
    Local(LocalPrefill, String),
}

/// What `kv_transfer_params` (as sent; None when absent or null) makes of a request to a
/// replica of `role` with `prompts` prompts of `n` choices each. Only a replica of the default
/// role accepts params that are not an object (it ignores them, as it always did); the others
/// answer vLLM's 400.
pub fn leg(role: Role, params: Option<&Value>, prompts: usize, n: u32) -> Result<Leg, ApiError> {
    let params = match (role, params) {
        (Role::Both, _) => return Ok(Leg::Whole),
        (_, None) => None,
        (_, Some(Value::Object(m))) => Some(m),
        (_, Some(v)) => {
            return Err(ApiError::bad_request(format!(
                "kv_transfer_params: expected an object, got {}",
                type_name(v)
            )))
        }
    };
    let flag = |key: &str| params.and_then(|m| m.get(key)) == Some(&Value::Bool(true));
    Ok(match role {
        Role::Both => Leg::Whole,
        Role::Prefill if flag("do_remote_decode") && prompts == 1 && n == 1 => Leg::Prefill,
        Role::Prefill => Leg::Whole,
        Role::Decode => match params {
            Some(m) if flag("do_remote_prefill") => match remote_kv(m) {
                Ok(_) if prompts != 1 => Leg::Local(
                    LocalPrefill::InvalidParams,
                    format!("{prompts} prompts: remote KV is one prompt's"),
                ),
                Ok(remote) => Leg::Decode(remote),
                Err(why) => Leg::Local(LocalPrefill::InvalidParams, why),
            },
            _ => Leg::Local(LocalPrefill::NoParams, "no do_remote_prefill".to_string()),
        },
    })
}

/// The pull of `do_remote_prefill` params, or why there is none: like NixlConnector, a
/// non-empty `remote_block_ids` and every one of `remote_engine_id`, `remote_request_id`,
/// `remote_host` and `remote_port`.
fn remote_kv(m: &Map<String, Value>) -> Result<RemoteKv, String> {
    match m.get("remote_block_ids") {
        Some(Value::Array(ids)) if !ids.is_empty() => {}
        Some(Value::Array(_)) | None | Some(Value::Null) => {
            return Err("remote_block_ids: no blocks".to_string())
        }
        Some(v) => {
            return Err(format!(
                "remote_block_ids: expected a list, got {}",
                type_name(v)
            ))
        }
    }
    let text = |key: &str| match m.get(key) {
        Some(Value::String(s)) if s.is_empty() => Err(format!("{key}: missing")),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v) if !v.is_null() => Err(format!("{key}: expected a string, got {}", type_name(v))),
        _ => Err(format!("{key}: missing")),
    };
    let port = match m.get("remote_port") {
        Some(Value::Number(p)) => p
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|&p| p > 0)
            .ok_or_else(|| format!("remote_port: {p} is not a port"))?,
        Some(v) if !v.is_null() => {
            return Err(format!(
                "remote_port: expected an integer, got {}",
                type_name(v)
            ))
        }
        _ => return Err("remote_port: missing".to_string()),
    };
    Ok(RemoteKv {
        engine_id: text("remote_engine_id")?,
        request_id: text("remote_request_id")?,
        host: text("remote_host")?,
        port,
    })
}

/// The `remote_request_id` of engine request `id` answered as response `response_id`: vLLM
/// names its internal request after the response; the side channel reads the engine request
/// back from the last `-` field ([`engine_request`]).
pub fn remote_request_id(response_id: &str, id: u64) -> String {
    format!("{response_id}-{id}")
}

/// The engine request a `remote_request_id` names, if it is one of ours.
pub fn engine_request(remote_request_id: &str) -> Option<u64> {
    let (_, id) = remote_request_id.rsplit_once('-')?;
    id.parse().ok()
}

/// A prefill replica's answer params: the held `blocks` of request `request_id` of engine
/// `engine_id`, to be pulled from `side_channel` (the 8 keys of NIXL_CONNECTOR_VERSION 2, and
/// `tp_size`).
pub fn prefill_answer(
    blocks: &[u32],
    engine_id: &str,
    request_id: &str,
    side_channel: SocketAddr,
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": blocks,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": side_channel.ip().to_string(),
        "remote_port": side_channel.port(),
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_params() -> Value {
        json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [3, 4], "remote_engine_id": "e", "remote_request_id": "cmpl-ab-7",
            "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1})
    }

    #[test]
    fn each_role_reads_its_legs() {
        let prefill = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null});
        let d = decode_params();
        // The default role ignores every form, even one vLLM would reject.
        for p in [Some(&prefill), Some(&d), Some(&json!(3)), None] {
            assert_eq!(leg(Role::Both, p, 1, 1), Ok(Leg::Whole));
        }
        assert_eq!(leg(Role::Prefill, Some(&prefill), 1, 1), Ok(Leg::Prefill));
        assert_eq!(leg(Role::Prefill, Some(&prefill), 2, 1), Ok(Leg::Whole));
        assert_eq!(leg(Role::Prefill, Some(&prefill), 1, 2), Ok(Leg::Whole));
        assert_eq!(leg(Role::Prefill, Some(&d), 1, 1), Ok(Leg::Whole));
        assert_eq!(leg(Role::Prefill, None, 1, 1), Ok(Leg::Whole));
        let remote = RemoteKv {
            engine_id: "e".into(),
            request_id: "cmpl-ab-7".into(),
            host: "127.0.0.1".into(),
            port: 5600,
        };
        assert_eq!(leg(Role::Decode, Some(&d), 1, 3), Ok(Leg::Decode(remote)));
        assert!(matches!(
            leg(Role::Decode, None, 1, 1),
            Ok(Leg::Local(LocalPrefill::NoParams, _))
        ));
        assert!(matches!(
            leg(Role::Decode, Some(&prefill), 1, 1),
            Ok(Leg::Local(LocalPrefill::NoParams, _))
        ));
        assert!(matches!(
            leg(Role::Decode, Some(&d), 2, 1),
            Ok(Leg::Local(LocalPrefill::InvalidParams, _))
        ));
        let e = leg(Role::Decode, Some(&json!("x")), 1, 1).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("kv_transfer_params"), "{}", e.message);
    }

    #[test]
    fn invalid_decode_params_say_why() {
        for (key, value, says) in [
            ("remote_block_ids", json!([]), "no blocks"),
            ("remote_block_ids", Value::Null, "no blocks"),
            ("remote_block_ids", json!("1,2"), "expected a list"),
            ("remote_engine_id", Value::Null, "remote_engine_id: missing"),
            ("remote_request_id", json!(7), "expected a string"),
            ("remote_host", json!(""), "remote_host: missing"),
            ("remote_port", json!(70000), "not a port"),
            ("remote_port", json!("5600"), "expected an integer"),
            ("remote_port", Value::Null, "remote_port: missing"),
        ] {
            let mut p = decode_params();
            p[key] = value;
            match leg(Role::Decode, Some(&p), 1, 1) {
                Ok(Leg::Local(LocalPrefill::InvalidParams, why)) => {
                    assert!(why.contains(says), "{key}: {why}")
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        // vLLM's per-group block lists are blocks too.
        let mut p = decode_params();
        p["remote_block_ids"] = json!([[3, 4]]);
        assert!(matches!(
            leg(Role::Decode, Some(&p), 1, 1),
            Ok(Leg::Decode(_))
        ));
    }

    #[test]
    fn answer_params_name_the_blocks_and_the_side_channel() {
        let id = remote_request_id("cmpl-0af3", 42);
        assert_eq!(engine_request(&id), Some(42));
        assert_eq!(engine_request("nodash"), None);
        assert_eq!(engine_request("cmpl-x"), None);
        let p = prefill_answer(&[7, 8, 9], "eng", &id, "127.0.0.1:5601".parse().unwrap());
        assert_eq!(
            p,
            json!({"do_remote_prefill": true, "do_remote_decode": false,
                "remote_block_ids": [7, 8, 9], "remote_engine_id": "eng",
                "remote_request_id": "cmpl-0af3-42", "remote_host": "127.0.0.1",
                "remote_port": 5601, "tp_size": 1})
        );
        // The answer, copied into the decode leg, is valid params.
        assert!(matches!(
            leg(Role::Decode, Some(&p), 1, 1),
            Ok(Leg::Decode(r)) if r.port == 5601 && r.request_id == id
        ));
    }
}
