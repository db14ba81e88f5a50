//! Answering a request, for every endpoint module: JSON bodies and vLLM's errors, the Unix
//! clock of `created` fields, and one prompt on the engine ([`Single`]) for the agent APIs.

#![forbid(unsafe_code)]

use super::driver::Replica;
use super::http::{self, Connection};
use super::models::Named;
use super::openai::{ApiError, Usage};
use crate::engine::tokenizer;
use crate::engine::{EngineOutput, EngineRequest, FinishReason, LoraRef, RequestId};
use crossbeam::channel::{self, Receiver, RecvTimeoutError};
use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How often a waiting connection checks that its client is still there.
const CLIENT_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// `err` with vLLM's `{"error": {...}}` body.
pub(super) fn send_error(
    conn: &mut Connection,
    err: &ApiError,
    keep_alive: bool,
) -> io::Result<()> {
    send_json_status(conn, err.status, &err.body(), keep_alive)
}

/// A 200 with a JSON body.
pub(super) fn send_json(conn: &mut Connection, body: &str, keep_alive: bool) -> io::Result<()> {
    send_json_status(conn, 200, body, keep_alive)
}

/// A JSON body with `status`.
pub(super) fn send_json_status(
    conn: &mut Connection,
    status: u16,
    body: &str,
    keep_alive: bool,
) -> io::Result<()> {
    conn.write_all(&http::response(
        status,
        Some("application/json"),
        body.as_bytes(),
        keep_alive,
    ))
}

/// Unix seconds now (the `created` of answers).
pub(super) fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Wait for the next outputs, checking now and then that the client is still there.
pub(super) fn next_outputs(
    conn: &Connection,
    rx: &Receiver<Vec<EngineOutput>>,
) -> io::Result<Vec<EngineOutput>> {
    loop {
        match rx.recv_timeout(CLIENT_CHECK_INTERVAL) {
            Ok(batch) => return Ok(batch),
            Err(RecvTimeoutError::Timeout) => {
                if conn.peer_closed() {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "client went away",
                    ));
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "replica engine stopped",
                ))
            }
        }
    }
}

/// The salt and adapter an engine request of `named` runs under. An adapter's KV cache is kept
/// apart from the base model's and other adapters'; its KV events name the adapter, as vLLM's
/// do (`lora_id`, `lora_name`).
pub(super) fn engine_identity(
    named: &Named,
    cache_salt: Option<u64>,
) -> (Option<u64>, Option<LoraRef>) {
    match named {
        Named::Base => (cache_salt, None),
        Named::Adapter(name, salt, id) => (
            Some(cache_salt.map_or(*salt, |s| s ^ salt.rotate_left(17))),
            Some(LoraRef {
                id: *id as i64,
                name: name.as_str().into(),
            }),
        ),
    }
}

/// One prompt of the agent APIs on the engine: submitted by [`Single::start`], its tokens read
/// with [`Single::next`] as the engine produces them; cancelled when dropped unfinished (the
/// client went away or its connection failed).
pub(super) struct Single<'a> {
    replica: &'a Replica,
    rx: Receiver<Vec<EngineOutput>>,
    id: RequestId,
    /// Set once the engine finished the request.
    pub finish: Option<FinishReason>,
    /// Its token counts, once finished.
    pub usage: Usage,
}

impl<'a> Single<'a> {
    /// Submits `prompt` (`stream`: outputs are delivered token by token).
    pub(super) fn start(
        replica: &'a Replica,
        named: &Named,
        prompt: Vec<u32>,
        max_tokens: u32,
        cache_salt: Option<u64>,
        stream: bool,
    ) -> Result<Single<'a>, ApiError> {
        let (cache_salt, lora) = engine_identity(named, cache_salt);
        let (tx, rx) = channel::unbounded::<Vec<EngineOutput>>();
        let id = replica.next_request_id();
        let request = EngineRequest {
            id,
            prompt_tokens: prompt,
            max_tokens,
            cache_salt,
            lora,
        };
        replica
            .submit(vec![request], stream, &tx)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(Single {
            replica,
            rx,
            id,
            finish: None,
            usage: Usage::default(),
        })
    }

    /// The texts of the tokens produced since the last call (waiting for at least one output,
    /// and checking meanwhile that the client is still there); nothing once finished.
    pub(super) fn next(&mut self, conn: &Connection) -> io::Result<Vec<String>> {
        if self.finish.is_some() {
            return Ok(Vec::new());
        }
        let mut batch = next_outputs(conn, &self.rx)?;
        while let Ok(more) = self.rx.try_recv() {
            batch.extend(more);
        }
        let mut texts = Vec::new();
        for out in &batch {
            match *out {
                EngineOutput::FirstToken { id, token, .. }
                | EngineOutput::Token { id, token, .. }
                    if id == self.id =>
                {
                    let mut text = String::new();
                    tokenizer::decode_token(token, &mut text);
                    texts.push(text);
                }
                EngineOutput::Finished {
                    id,
                    reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    ..
                } if id == self.id => {
                    self.finish = Some(reason);
                    self.usage = Usage {
                        prompt_tokens: prompt_tokens as u64,
                        completion_tokens: completion_tokens as u64,
                        cached_tokens: cached_tokens as u64,
                    };
                }
                _ => {}
            }
        }
        Ok(texts)
    }
}

impl Drop for Single<'_> {
    fn drop(&mut self) {
        if self.finish.is_none() {
            self.replica.cancel(&[self.id]);
        }
    }
}
