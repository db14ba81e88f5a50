//! The KV side channel of disaggregated prefill: a small HTTP/1.1 server on its own port per
//! prefill replica (`--side-channel-port`, vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT), where decode
//! replicas pull the KV a prefill holds for them, and the decode side's client. It stands in
//! for NIXL's handshake and RDMA read: one request names the KV, the answer hands it over and
//! the prefill side frees it; the decode side then waits out the transfer time the link
//! would take (`tokens x --kv-bytes-per-token / --kv-link-gbps`, wall seconds).
//!
//! The protocol (errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`):
//!
//! ```text
//! POST /kv/pull HTTP/1.1
//! content-type: application/json
//!
//! {"remote_engine_id": "<engine id>", "remote_request_id": "<request id>"}
//!
//! 200 {"remote_engine_id": "..", "remote_request_id": "..", "num_tokens": N,
//!      "block_ids": [..], "block_size": B}      the KV is the caller's; freed here
//! 404 NotFoundError                             no such engine here, or no KV held for the
//!                                               request (unknown, already pulled, expired)
//! 400 BadRequestError                           not JSON, or a field missing
//! ```
//!
//! The body may be the prefill answer's whole `kv_transfer_params`; other keys are ignored.
//! One side channel serves every data-parallel rank behind its HTTP port: the engine id
//! picks the rank. Keep-alive works as on the API port.
//!
//! Under `--pd-protocol sglang` the same server is the prefill replica's bootstrap server
//! (`--disaggregation-bootstrap-port`): its `POST /kv/pull` names a `bootstrap_room` instead
//! and may wait for the room's prefill (`bootstrap`). Both clients share [`exchange`] and,
//! once the KV is theirs, [`transfer`].

#![forbid(unsafe_code)]

use super::answer::{send_error, send_json};
use super::driver::Replica;
use super::http::{Connection, Method, ReadRequestError};
use super::openai::{self, type_name, ApiError};
use super::pd::{self, LocalPrefill, Protocol, RemoteKv, TransferFailure, MAX_ROOM};
use super::rooms::{Rooms, Taken, DEFAULT_WAIT, MAX_WAIT_S};
use serde_json::{json, Value};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The path of a pull.
pub const PULL_PATH: &str = "/kv/pull";
/// How long a pull may take to connect, and then to be answered.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest pull answer read (a block id per 16 tokens of a long prompt is far less).
const MAX_ANSWER_BYTES: u64 = 16 * 1024 * 1024;
/// How often a decode waiting out its transfer checks that its client is still there.
const CLIENT_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// Serve pulls of `protocol` forever, a thread per connection, for `engines` (the ranks
/// behind one port; under SGLang's protocol they share the rooms of their `Disagg`).
pub fn serve(listener: TcpListener, engines: Vec<Arc<Replica>>, protocol: Protocol) {
    let engines = Arc::new(engines);
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let for_connection = engines.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("replica{}-kv-pull", engines[0].index))
                    .stack_size(256 * 1024)
                    .spawn(move || handle_connection(stream, &for_connection, protocol));
                if spawned.is_err() {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::Interrupted {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}

fn handle_connection(stream: TcpStream, engines: &[Arc<Replica>], protocol: Protocol) {
    let mut conn = Connection::new(stream);
    loop {
        let req = match conn.read_request() {
            Ok(r) => r,
            Err(ReadRequestError::Closed) | Err(ReadRequestError::Io(_)) => return,
            Err(ReadRequestError::Bad { status, message }) => {
                let err = ApiError {
                    status,
                    kind: if status == 400 {
                        "BadRequestError"
                    } else {
                        "HTTPError"
                    },
                    message,
                    param: None,
                };
                let _ = send_error(&mut conn, &err, false);
                conn.lingering_close();
                return;
            }
        };
        let keep_alive = req.keep_alive;
        let path = req.path.trim_end_matches('/');
        let answer = match (path == PULL_PATH, req.method) {
            (true, Method::Post) => match (protocol, engines[0].disagg().rooms.as_deref()) {
                (Protocol::Sglang, Some(rooms)) => {
                    pull_room_answer(engines, rooms, &req.body, &conn)
                }
                _ => pull_answer(engines, &req.body),
            },
            (true, _) => Err(ApiError::method_not_allowed()),
            (false, _) => Err(ApiError::not_found("Not Found")),
        };
        let written = match answer {
            Ok(body) => send_json(&mut conn, &body, keep_alive),
            Err(e) => send_error(&mut conn, &e, keep_alive),
        };
        if written.is_err() || !keep_alive {
            return;
        }
    }
}

/// Answer one pull: hand over and free the KV held for the named request.
fn pull_answer(engines: &[Arc<Replica>], body: &[u8]) -> Result<String, ApiError> {
    let m = openai::parse_object(body)?;
    let text = |key: &'static str| match m.get(key) {
        Some(Value::String(s)) => Ok(s.as_str()),
        Some(v) if !v.is_null() => Err(ApiError {
            param: Some(key),
            ..ApiError::bad_request(format!("{key}: expected a string, got {}", type_name(v)))
        }),
        _ => Err(ApiError {
            param: Some(key),
            ..ApiError::bad_request(format!("{key}: field required"))
        }),
    };
    let engine_id = text("remote_engine_id")?;
    let request_id = text("remote_request_id")?;
    let replica = engines
        .iter()
        .find(|e| e.disagg().engine_id == engine_id)
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "remote_engine_id {engine_id:?}: not an engine of this replica"
            ))
        })?;
    let held = pd::engine_request(request_id).and_then(|id| replica.release_held(id));
    let Some(held) = held else {
        return Err(ApiError::not_found(format!(
            "remote_request_id {request_id:?}: no KV held for it (unknown, already pulled or expired)"
        )));
    };
    Ok(json!({
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "num_tokens": held.tokens,
        "block_ids": held.blocks,
        "block_size": replica.block_size(),
    })
    .to_string())
}

/// Why an [`exchange`] brought no answer.
#[derive(Debug)]
pub enum ExchangeError {
    /// No answer: unreachable, cut off, late, or not an HTTP answer with a JSON body.
    Failed(TransferFailure, String),
    /// The client of the request waiting on the exchange went away.
    ClientGone,
}

/// One `POST /kv/pull` with JSON `body` to `host:port` (`what`: the server, named in
/// errors): the answer's status and JSON body, within `patience` of sending it. With `client`,
/// gives up as soon as that connection's peer goes away.
pub fn exchange(
    what: &str,
    host: &str,
    port: u16,
    body: &str,
    patience: Duration,
    client: Option<&Connection>,
) -> Result<(u16, Value), ExchangeError> {
    let unreachable = |e: String| ExchangeError::Failed(TransferFailure::Unreachable, e);
    let addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| unreachable(format!("{what}: {e}")))?;
    let mut stream = None;
    let mut failure = format!("{what}: no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => failure = format!("{what}: {e}"),
        }
    }
    let mut stream = stream.ok_or_else(|| unreachable(failure))?;
    let failed = |e: io::Error| unreachable(format!("{what}: {e}"));
    stream
        .set_write_timeout(Some(ANSWER_TIMEOUT))
        .map_err(failed)?;
    let _ = stream.set_nodelay(true);
    let request = format!(
        "POST {PULL_PATH} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).map_err(failed)?;
    let deadline = Instant::now() + patience;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(ExchangeError::Failed(
                TransferFailure::Timeout,
                format!("{what}: no answer within {} s", patience.as_secs_f64()),
            ));
        }
        let mut pause = deadline - now;
        if client.is_some() {
            pause = pause.min(CLIENT_CHECK_INTERVAL);
        }
        stream
            .set_read_timeout(Some(pause.max(Duration::from_millis(1))))
            .map_err(failed)?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                answer.extend_from_slice(&chunk[..n]);
                if answer.len() as u64 > MAX_ANSWER_BYTES {
                    return Err(ExchangeError::Failed(
                        TransferFailure::BadAnswer,
                        format!("{what}: answer over {MAX_ANSWER_BYTES} bytes"),
                    ));
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if client.is_some_and(Connection::peer_closed) {
                    return Err(ExchangeError::ClientGone);
                }
            }
            Err(e) => return Err(failed(e)),
        }
    }
    let bad = |e: String| ExchangeError::Failed(TransferFailure::BadAnswer, format!("{what}: {e}"));
    let (status, body) = split_answer(&answer).map_err(bad)?;
    let json: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("answer {status} is not JSON: {e}")))?;
    Ok((status, json))
}

/// What a pull brought.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// Tokens of KV (the prefill's prompt).
    pub tokens: u32,
    pub blocks: usize,
}

/// Pull the KV `remote` names from its prefill replica's side channel. The error says why not
/// (unreachable, refused with the prefill side's message, a bad answer).
pub fn pull(remote: &RemoteKv) -> Result<Pulled, (TransferFailure, String)> {
    let target = format!("side channel {}:{}", remote.host, remote.port);
    let body = json!({
        "remote_engine_id": remote.engine_id,
        "remote_request_id": remote.request_id,
    })
    .to_string();
    let (status, json) = exchange(
        &target,
        &remote.host,
        remote.port,
        &body,
        ANSWER_TIMEOUT,
        None,
    )
    .map_err(|e| match e {
        ExchangeError::Failed(reason, why) => (reason, why),
        ExchangeError::ClientGone => (TransferFailure::Unreachable, format!("{target}: gone")),
    })?;
    if status != 200 {
        let message = json["error"]["message"].as_str().unwrap_or("no message");
        return Err((
            TransferFailure::of_status(status),
            format!("{target}: {status}: {message}"),
        ));
    }
    let tokens = json["num_tokens"]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            (
                TransferFailure::BadAnswer,
                format!("{target}: answer without num_tokens"),
            )
        })?;
    let blocks = json["block_ids"].as_array().map_or(0, Vec::len);
    Ok(Pulled { tokens, blocks })
}

/// The status and body of a whole HTTP/1.1 answer (read to its end: the pull asks to close).
fn split_answer(answer: &[u8]) -> Result<(u16, &[u8]), String> {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut head = httparse::Response::new(&mut headers);
    match head.parse(answer) {
        Ok(httparse::Status::Complete(n)) => {
            let status = head.code.unwrap_or(0);
            let length = head
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| {
                    std::str::from_utf8(h.value)
                        .ok()?
                        .trim()
                        .parse::<usize>()
                        .ok()
                });
            let body = &answer[n..];
            match length {
                Some(len) if len <= body.len() => Ok((status, &body[..len])),
                Some(len) => Err(format!(
                    "answer cut short: {} of {len} body bytes",
                    body.len()
                )),
                None => Ok((status, body)),
            }
        }
        Ok(httparse::Status::Partial) => Err("answer cut short in its head".to_string()),
        Err(e) => Err(format!("malformed answer: {e}")),
    }
}

/// The decode leg of a request: pull its KV from `remote`, count it, and wait out the
/// transfer (checking that the client is still there). Returns the tokens received, or None
/// when the pull failed (counted and logged: the request prefills locally). An error: the
/// client went away during the transfer; nothing was submitted, so nothing is left to free
/// here, and the prefill side freed its KV when it answered.
pub fn receive(conn: &Connection, replica: &Replica, remote: &RemoteKv) -> io::Result<Option<u32>> {
    let pulled = match pull(remote) {
        Ok(p) => p,
        Err((reason, why)) => {
            replica.transfer_failed(reason);
            replica.local_prefill(LocalPrefill::PullFailed, &why);
            return Ok(None);
        }
    };
    transfer(conn, replica, pulled.tokens)?;
    Ok(Some(pulled.tokens))
}

/// `tokens` tokens of KV are the decode's: count the transfer and wait out the time the link
/// takes to move them (`--kv-bytes-per-token / --kv-link-gbps` engine seconds, --time-scale
/// times fewer in wall time, as the engine's steps), checking that the client is still there
/// (an error if it went away).
pub fn transfer(conn: &Connection, replica: &Replica, tokens: u32) -> io::Result<()> {
    let d = replica.disagg();
    let bytes = tokens as u64 * d.kv_bytes_per_token;
    let seconds = tokens as f64 * d.transfer_s_per_token;
    replica.kv_pulled(tokens, bytes, seconds);
    let wall = seconds / d.time_scale;
    let end = Instant::now() + Duration::try_from_secs_f64(wall).unwrap_or(Duration::ZERO);
    loop {
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(CLIENT_CHECK_INTERVAL));
        if conn.peer_closed() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "client went away during the KV transfer",
            ));
        }
    }
}

/// The prefill answer's `kv_transfer_params` for request `id` of response `response_id`, or
/// null when nothing is held for it (it timed out already) or there is no side channel.
pub fn answer_params(replica: &Replica, response_id: &str, id: u64) -> Value {
    let d = replica.disagg();
    match (replica.held_blocks(id), d.side_channel) {
        (Some(blocks), Some(addr)) => pd::prefill_answer(
            &blocks,
            &d.engine_id,
            &pd::remote_request_id(response_id, id),
            addr,
        ),
        _ => Value::Null,
    }
}

/// Answer one bootstrap pull on `conn` for the ranks `engines` of a port whose rooms are
/// `rooms`: hand over (and free) the room's KV, once its prefill finished.
fn pull_room_answer(
    engines: &[Arc<Replica>],
    rooms: &Rooms,
    body: &[u8],
    conn: &Connection,
) -> Result<String, ApiError> {
    let m = openai::parse_object(body)?;
    let bad = |param: &'static str, message: String| ApiError {
        param: Some(param),
        ..ApiError::bad_request(message)
    };
    let room = match m.get("bootstrap_room") {
        Some(Value::Number(n)) => n.as_u64().filter(|&r| r <= MAX_ROOM).ok_or_else(|| {
            bad(
                "bootstrap_room",
                format!("bootstrap_room: expected an integer in 0..={MAX_ROOM}, got {n}"),
            )
        })?,
        Some(v) if !v.is_null() => {
            return Err(bad(
                "bootstrap_room",
                format!("bootstrap_room: expected an integer, got {}", type_name(v)),
            ))
        }
        _ => {
            return Err(bad(
                "bootstrap_room",
                "bootstrap_room: field required".into(),
            ))
        }
    };
    let wait = match m.get("wait_s") {
        None | Some(Value::Null) => DEFAULT_WAIT,
        Some(Value::Number(n)) => match n.as_f64() {
            Some(s) if s >= 0.0 && s.is_finite() => Duration::from_secs_f64(s.min(MAX_WAIT_S)),
            _ => {
                return Err(bad(
                    "wait_s",
                    format!("wait_s: expected seconds, not negative, got {n}"),
                ))
            }
        },
        Some(v) => {
            return Err(bad(
                "wait_s",
                format!("wait_s: expected a number, got {}", type_name(v)),
            ))
        }
    };
    // Lock order: the rooms, then the replica (the driver never takes the rooms).
    let release = |rank: usize, id| {
        let e = engines.get(rank)?;
        Some((e.release_held(id)?, e.block_size()))
    };
    match rooms.take(room, wait, release, || conn.peer_closed()) {
        Taken::Kv(held, block_size) => Ok(json!({
            "bootstrap_room": room,
            "num_tokens": held.tokens,
            "block_ids": held.blocks,
            "block_size": block_size,
        })
        .to_string()),
        Taken::Ended(how) => Err(ApiError::not_found(format!(
            "bootstrap_room {room}: {}",
            how.says()
        ))),
        Taken::TimedOut => Err(ApiError {
            status: 504,
            kind: "GatewayTimeoutError",
            message: format!(
                "bootstrap_room {room}: no prefill of it finished within {} s",
                wait.as_secs_f64()
            ),
            param: None,
        }),
        Taken::Gone => Err(ApiError {
            status: 499,
            kind: "ClientClosedRequest",
            message: "the caller went away".into(),
            param: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_split_at_their_length() {
        let a = b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(split_answer(a), Ok((404, &b"{}"[..])));
        let cut = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n{}";
        assert!(split_answer(cut).unwrap_err().contains("cut short"));
        assert!(split_answer(b"HTTP/1.1 200").is_err());
        assert!(split_answer(b"nonsense\r\n\r\n").is_err());
    }

    #[test]
    fn a_pull_from_nowhere_fails_with_the_reason() {
        // A port just closed: nobody listens there.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let remote = RemoteKv {
            engine_id: "e".into(),
            request_id: "cmpl-1-1".into(),
            host: "127.0.0.1".into(),
            port,
        };
        let (reason, e) = pull(&remote).unwrap_err();
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
        assert_eq!(reason, TransferFailure::Unreachable);
    }
}
