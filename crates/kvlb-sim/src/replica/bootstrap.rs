//! SGLang's bootstrap server and its client, as `kvlb replica --pd-protocol sglang` plays them.
//! SGLang's router sends the same body, with `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room` added, to a prefill and a decode replica at once (`pd::bootstrap_leg`). The
//! prefill replica registers the room ([`Rooms::begin`]), computes the prompt and one token,
//! answers, and holds the KV for the room ([`RoomLease::finished`]); the decode replica asks the
//! prefill replica's bootstrap server for the room's KV ([`fetch`]), which waits for that
//! prefill to finish if it has not yet (it may not even have arrived: the legs race), hands the
//! KV over and frees it ([`Rooms::take`]). It stands in for SGLang's bootstrap handshake and
//! Mooncake/NIXL transfer: one request names the room, the answer hands the KV over; the
//! decode side then waits out the transfer time as vLLM's path does (`side_channel::transfer`).
//!
//! The bootstrap server is the side channel's HTTP server (`side_channel::serve`) on its own
//! port (`--disaggregation-bootstrap-port`), answering (errors in OpenAI's shape):
//!
//! ```text
//! POST /kv/pull HTTP/1.1
//! content-type: application/json
//!
//! {"bootstrap_room": N, "wait_s": S}       wait_s optional: 30 s when absent, at most 3600
//!
//! 200 {"bootstrap_room": N, "num_tokens": T, "block_ids": [..], "block_size": B}
//!                                 the room's prefill finished (now, or within S seconds):
//!                                 the KV is the caller's, freed here
//! 404 NotFoundError               the room's KV was already fetched, its hold expired
//!                                 (--kv-hold-timeout), or its prefill was aborted
//! 504 GatewayTimeoutError         no prefill of the room finished within S seconds
//! 400 BadRequestError             not JSON, or bootstrap_room / wait_s missing or malformed
//! ```
//!
//! A waiting pull whose caller goes away gives up, leaving the KV (when its prefill finishes)
//! held for another fetch or its timeout. Rooms are per port: one bootstrap server serves every
//! data-parallel rank behind it, each hold naming its rank.

#![forbid(unsafe_code)]

use super::driver::Replica;
use super::http::Connection;
use super::openai::ApiError;
use super::pd::{Bootstrap, TransferFailure};
use super::rooms::{ANSWER_GRACE, DEFAULT_WAIT, MAX_WAIT_S};
use super::side_channel::{self, ExchangeError};
use serde_json::json;
use std::io;
use std::time::Duration;

/// The decode leg of a request under SGLang's protocol: fetch the room's KV from the prefill
/// replica's bootstrap server (waiting up to --kv-wait-timeout for its prefill), count it and
/// wait out the transfer. Ok(Ok(tokens)) received; Ok(Err(500)) the fetch failed (counted in
/// `kvlb_replica_kv_transfer_failures_total`; the request fails, as SGLang's decode fails
/// it); Err: the client went away meanwhile (nothing was submitted, nothing is left here).
pub fn fetch(
    conn: &Connection,
    replica: &Replica,
    at: &Bootstrap,
) -> io::Result<Result<u32, ApiError>> {
    let wait_s = replica.disagg().wait_s;
    let body = json!({"bootstrap_room": at.room, "wait_s": wait_s}).to_string();
    let patience = Duration::try_from_secs_f64(wait_s.min(MAX_WAIT_S))
        .unwrap_or(DEFAULT_WAIT)
        .saturating_add(ANSWER_GRACE);
    let target = format!("bootstrap server {}:{}", at.host, at.port);
    let failure = |reason: TransferFailure, why: String| {
        replica.transfer_failed(reason);
        replica.log_limited(&format!(
            "bootstrap_room {}: KV transfer failed ({}): {why}",
            at.room,
            reason.label()
        ));
        Ok(Err(ApiError {
            status: 500,
            kind: "InternalServerError",
            message: format!("KV transfer failed for bootstrap_room {}: {why}", at.room),
            param: None,
        }))
    };
    let (status, answer) =
        match side_channel::exchange(&target, &at.host, at.port, &body, patience, Some(conn)) {
            Ok(a) => a,
            Err(ExchangeError::ClientGone) => {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "client went away while the KV was awaited",
                ))
            }
            Err(ExchangeError::Failed(reason, why)) => return failure(reason, why),
        };
    if status != 200 {
        let message = answer["error"]["message"].as_str().unwrap_or("no message");
        return failure(
            TransferFailure::of_status(status),
            format!("{target}: {status}: {message}"),
        );
    }
    let Some(tokens) = answer["num_tokens"]
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
    else {
        return failure(
            TransferFailure::BadAnswer,
            format!("{target}: answer without num_tokens"),
        );
    };
    side_channel::transfer(conn, replica, tokens)?;
    Ok(Ok(tokens))
}
