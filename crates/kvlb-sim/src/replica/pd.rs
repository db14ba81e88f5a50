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
//!
//! With `--pd-protocol sglang` the legs are SGLang's instead ([`bootstrap_leg`]): its router
//! (sgl-router / SMG, mini_lb) injects `bootstrap_host`, `bootstrap_port` and `bootstrap_room`
//! into the client's body and sends that same body to the prefill and the decode replica at
//! once. A prefill replica computes the prompt and one token, answers it, and holds the KV
//! for the room ([`Leg::RoomPrefill`]); a decode replica fetches the room's KV from the
//! prefill replica's bootstrap server ([`Bootstrap`], `bootstrap`) and decodes. Choices:
//! a request without a room (as SGLang's scheduler refuses it) and a batch (the fields as
//! arrays, several prompts, or `n` > 1 with a room) are refused with a 400, on both roles; a null or absent `bootstrap_port` is the decode replica's own
//! `--disaggregation-bootstrap-port` (as SGLang's scheduler fills in its server's own), and a
//! 400 when that is 0; a fetch that fails fails the request (SGLang's decode has no local
//! fallback).

#![forbid(unsafe_code)]

use super::openai::{type_name, ApiError, BootstrapFields};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;

pub use kvlb_core::pd::Role;

/// `--kv-link-gbps`' default: GB/s between prefill and decode replicas (RDMA between nodes, as
/// NIXL reaches).
pub const DEFAULT_KV_LINK_GBPS: f64 = 25.0;

/// `--kv-hold-timeout`'s default: seconds a prefill's KV stays held for its decode's pull
/// (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
pub const DEFAULT_KV_HOLD_TIMEOUT_S: f64 = 480.0;

/// Seconds to move one token's KV of `kv_bytes_per_token` bytes over a link of `link_gbps`
/// GB/s (10^9 bytes a second).
pub fn transfer_s_per_token(kv_bytes_per_token: u64, link_gbps: f64) -> f64 {
    kv_bytes_per_token as f64 / (link_gbps * 1e9)
}

/// The disaggregation protocol of a prefill or decode replica (`--pd-protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    /// vLLM's NixlConnector: `kv_transfer_params`, the side channel.
    #[default]
    Vllm,
    /// SGLang's: `bootstrap_host` / `bootstrap_port` / `bootstrap_room`, the bootstrap server.
    Sglang,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Vllm => "vllm",
            Protocol::Sglang => "sglang",
        }
    }
}

/// Why a decode replica's fetch of remote KV failed (the `reason` of
/// `kvlb_replica_kv_transfer_failures_total`; both protocols).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferFailure {
    /// No connection to the side channel or bootstrap server (refused, unresolvable, reset).
    Unreachable,
    /// No answer in time: the bootstrap server's wait for the room's prefill ran out (its
    /// 504), or the answer itself did not come.
    Timeout,
    /// The KV is not there: unknown, already pulled, expired, or its prefill aborted (404).
    NotFound,
    /// Any other answer: another status, or one that is not a pull answer.
    BadAnswer,
}

impl TransferFailure {
    pub const ALL: [TransferFailure; 4] = [
        TransferFailure::Unreachable,
        TransferFailure::Timeout,
        TransferFailure::NotFound,
        TransferFailure::BadAnswer,
    ];

    pub fn label(self) -> &'static str {
        match self {
            TransferFailure::Unreachable => "unreachable",
            TransferFailure::Timeout => "timeout",
            TransferFailure::NotFound => "not_found",
            TransferFailure::BadAnswer => "bad_answer",
        }
    }

    /// The failure an answer of `status` (not 200) reports.
    pub fn of_status(status: u16) -> TransferFailure {
        match status {
            404 => TransferFailure::NotFound,
            408 | 504 => TransferFailure::Timeout,
            _ => TransferFailure::BadAnswer,
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

/// Where a decode fetches its prompt's KV under SGLang's protocol: the bootstrap server at
/// `host:port` (the prefill replica's), the KV of `room`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: u16,
    pub room: u64,
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
    /// SGLang's prefill leg of a room: one token, then hold the KV for the room's fetch.
    RoomPrefill(u64),
    /// SGLang's decode leg: fetch the room's KV from the bootstrap server first, or fail.
    RoomDecode(Bootstrap),
}

/// The largest `bootstrap_room` (SGLang's routers draw it from [0, 2^63 - 1]).
pub const MAX_ROOM: u64 = i64::MAX as u64;

/// What SGLang's bootstrap `fields` make of a request to a replica of `role` with `prompts`
/// prompts of `n` choices each; `null_port` stands for a null or absent `bootstrap_port` (the
/// decode replica's own --disaggregation-bootstrap-port; None when it is 0). A request without
/// a room (SGLang's scheduler refuses it in either mode), a batch, or fields of the wrong form,
/// is answered 400.
pub fn bootstrap_leg(
    role: Role,
    fields: &BootstrapFields,
    prompts: usize,
    n: u32,
    null_port: Option<u16>,
) -> Result<Leg, ApiError> {
    let bad = |param: &'static str, message: String| ApiError {
        param: Some(param),
        ..ApiError::bad_request(message)
    };
    let room = match (role, &fields.room) {
        (Role::Both, _) => return Ok(Leg::Whole),
        // As SGLang's scheduler refuses it in either disaggregation mode.
        (_, None | Some(Value::Null)) => {
            return Err(bad(
                "bootstrap_room",
                "Invalid request: Disaggregated request received without bootstrap room id."
                    .to_string(),
            ))
        }
        (_, Some(Value::Array(_))) => {
            return Err(bad(
                "bootstrap_room",
                "bootstrap_room: a list (a batch request): batches are not supported by this \
                 simulator's SGLang disaggregation; send one prompt per request"
                    .to_string(),
            ))
        }
        (_, Some(Value::Number(r))) => r.as_u64().filter(|&r| r <= MAX_ROOM).ok_or_else(|| {
            bad(
                "bootstrap_room",
                format!("bootstrap_room: expected an integer in 0..={MAX_ROOM}, got {r}"),
            )
        })?,
        (_, Some(v)) => {
            return Err(bad(
                "bootstrap_room",
                format!("bootstrap_room: expected an integer, got {}", type_name(v)),
            ))
        }
    };
    if prompts != 1 || n != 1 {
        return Err(bad(
            "bootstrap_room",
            format!(
                "bootstrap_room with {prompts} prompts of n={n} (a batch request): batches are \
                 not supported by this simulator's SGLang disaggregation; send one prompt per \
                 request"
            ),
        ));
    }
    if role == Role::Prefill {
        return Ok(Leg::RoomPrefill(room));
    }
    let host = match &fields.host {
        Some(Value::String(h)) if !h.is_empty() => h.clone(),
        Some(v) if !v.is_null() && !v.is_string() => {
            return Err(bad(
                "bootstrap_host",
                format!("bootstrap_host: expected a string, got {}", type_name(v)),
            ))
        }
        _ => {
            return Err(bad(
                "bootstrap_host",
                "bootstrap_host: field required with bootstrap_room".to_string(),
            ))
        }
    };
    let port = match &fields.port {
        Some(Value::Number(p)) => p
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|&p| p > 0)
            .ok_or_else(|| {
                bad(
                    "bootstrap_port",
                    format!("bootstrap_port: {p} is not a port"),
                )
            })?,
        None | Some(Value::Null) => null_port.ok_or_else(|| {
            bad(
                "bootstrap_port",
                "bootstrap_port: null, and this decode replica has no \
                 --disaggregation-bootstrap-port to stand for it"
                    .to_string(),
            )
        })?,
        Some(v) => {
            return Err(bad(
                "bootstrap_port",
                format!("bootstrap_port: expected an integer, got {}", type_name(v)),
            ))
        }
    };
    // mini_lb wraps an IPv6 host in brackets.
    let host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(h) => h.to_string(),
        None => host,
    };
    Ok(Leg::RoomDecode(Bootstrap { host, port, room }))
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

    fn fields(host: Value, port: Value, room: Value) -> BootstrapFields {
        BootstrapFields {
            host: Some(host),
            port: Some(port),
            room: Some(room),
        }
    }

    #[test]
    fn bootstrap_fields_make_sglang_legs() {
        let f = fields(json!("10.0.0.1"), json!(8998), json!(MAX_ROOM));
        let none = BootstrapFields::default();
        for f in [&f, &none] {
            assert_eq!(bootstrap_leg(Role::Both, f, 1, 1, None), Ok(Leg::Whole));
        }
        assert_eq!(
            bootstrap_leg(Role::Prefill, &f, 1, 1, None),
            Ok(Leg::RoomPrefill(MAX_ROOM))
        );
        for role in [Role::Prefill, Role::Decode] {
            let e = bootstrap_leg(role, &none, 1, 1, Some(8998)).unwrap_err();
            assert_eq!(e.param, Some("bootstrap_room"));
            assert!(e.message.contains("without bootstrap room id"), "{e:?}");
        }
        assert_eq!(
            bootstrap_leg(Role::Decode, &f, 1, 1, None),
            Ok(Leg::RoomDecode(Bootstrap {
                host: "10.0.0.1".into(),
                port: 8998,
                room: MAX_ROOM
            }))
        );
        // A null room is no room; a null port is the decode replica's own default.
        let null_room = fields(json!("h"), json!(1), Value::Null);
        let e = bootstrap_leg(Role::Prefill, &null_room, 1, 1, None).unwrap_err();
        assert_eq!((e.status, e.param), (400, Some("bootstrap_room")));
        let null_port = fields(json!("[::1]"), Value::Null, json!(7));
        assert_eq!(
            bootstrap_leg(Role::Decode, &null_port, 1, 1, Some(9000)),
            Ok(Leg::RoomDecode(Bootstrap {
                host: "::1".into(),
                port: 9000,
                room: 7
            }))
        );
        let e = bootstrap_leg(Role::Decode, &null_port, 1, 1, None).unwrap_err();
        assert_eq!((e.status, e.param), (400, Some("bootstrap_port")));
        // Batches, on both roles.
        for role in [Role::Prefill, Role::Decode] {
            let batch = fields(json!(["h", "h"]), json!([1, 1]), json!([1, 2]));
            for (f, prompts, n) in [(&batch, 2, 1), (&f, 2, 1), (&f, 1, 2)] {
                let e = bootstrap_leg(role, f, prompts, n, None).unwrap_err();
                assert_eq!(e.status, 400);
                assert!(e.message.contains("not supported"), "{}", e.message);
            }
        }
        for (f, says) in [
            (
                fields(json!("h"), json!(1), json!(-1)),
                "bootstrap_room: expected an integer in",
            ),
            (
                fields(json!("h"), json!(1), json!(MAX_ROOM + 1)),
                "bootstrap_room: expected an integer in",
            ),
            (
                fields(json!("h"), json!(1), json!("5")),
                "bootstrap_room: expected an integer, got",
            ),
            (
                fields(json!(""), json!(1), json!(5)),
                "bootstrap_host: field required",
            ),
            (
                fields(json!(3), json!(1), json!(5)),
                "bootstrap_host: expected a string",
            ),
            (fields(json!("h"), json!(0), json!(5)), "not a port"),
            (fields(json!("h"), json!(70000), json!(5)), "not a port"),
            (
                fields(json!("h"), json!("1"), json!(5)),
                "bootstrap_port: expected an integer",
            ),
        ] {
            let e = bootstrap_leg(Role::Decode, &f, 1, 1, Some(1)).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(says), "{says}: {}", e.message);
        }
        assert_eq!(TransferFailure::of_status(404), TransferFailure::NotFound);
        assert_eq!(TransferFailure::of_status(504), TransferFailure::Timeout);
        assert_eq!(TransferFailure::of_status(500), TransferFailure::BadAnswer);
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
