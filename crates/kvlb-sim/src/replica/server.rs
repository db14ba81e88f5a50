//! The HTTP side of one replica: an accept thread per listener and a thread per connection,
//! dispatching vLLM's endpoints (/v1/completions, /v1/chat/completions, /v1/responses,
//! /v1/messages, /v1/models, /health, /tokenize, /detokenize, /v1/embeddings, /rerank, /score,
//! /reset_prefix_cache, /metrics) onto the replica's engine. Generation answers either one JSON
//! body or a chunked server-sent-events stream written as the engine produces each token; a
//! client that goes away cancels its engine requests. With `--role prefill|decode` a
//! completion's `kv_transfer_params` makes it a leg of disaggregated prefill (`pd`): a
//! prefill holds its KV and answers where to pull it, a decode pulls it over the prefill
//! replica's side channel (`side_channel`) before it joins the engine. With `--pd-protocol
//! sglang` a completion's `bootstrap_room` makes it SGLang's leg instead: a prefill computes one
//! token and holds the room's KV, a decode fetches it from the prefill replica's bootstrap
//! server (`bootstrap`) or fails with a 500 before answering anything. The Responses API
//! (`responses`) and Anthropic's Messages API (`messages`) generate through `answer::Single`
//! (always whole requests); the pooling endpoints (`pooling`) answer at once, without the
//! engine.

#![forbid(unsafe_code)]

use super::answer::{engine_identity, next_outputs, send_error, send_json, unix_secs};
use super::driver::Replica;
use super::http::{self, Connection, Method, ReadRequestError};
use super::openai::{
    self, ApiError, ChoiceResult, Endpoint, GenerationRequest, ResponseMeta, Usage,
};
use super::pd::{self, Leg, Protocol};
use super::{bootstrap, messages, pooling, responses, side_channel};
use crate::engine::tokenizer;
use crate::engine::{
    EngineError, EngineOutput, EngineRequest, FinishReason, KvTransfer, RequestId,
};
use crossbeam::channel::{self, Receiver};
use std::io;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Stack of a connection thread: request handling is shallow (serde_json caps nesting at 128).
const CONNECTION_STACK_BYTES: usize = 512 * 1024;

/// The engines behind one HTTP port: one, or the ranks of a data-parallel engine
/// (`--dp-size`), each with its own KV cache and event stream.
pub struct Ranks {
    pub engines: Vec<Arc<Replica>>,
    /// The names served behind the port (base model, aliases, LoRA adapters).
    pub served: super::models::Served,
    /// Stored Responses API responses: one store per port, shared by its ranks, as vLLM's
    /// data-parallel ranks share their API server's.
    pub responses: responses::Store,
    /// Round-robin over the ranks for requests that name none (vLLM's internal load balancer
    /// balances by load; round-robin is its idle-fleet behaviour).
    next: AtomicUsize,
}

impl Ranks {
    pub fn new(engines: Vec<Arc<Replica>>, served: super::models::Served) -> Arc<Ranks> {
        Arc::new(Ranks {
            engines,
            served,
            responses: responses::Store::new(responses::STORE_CAPACITY),
            next: AtomicUsize::new(0),
        })
    }

    /// The engine a request goes to: rank `asked` (X-Data-Parallel-Rank), else the next.
    fn pick(&self, asked: Option<u32>) -> Result<&Replica, ApiError> {
        match asked {
            Some(r) => self.engines.get(r as usize).map(|e| &**e).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "X-Data-Parallel-Rank {r}: out of range (data parallel size {})",
                    self.engines.len()
                ))
            }),
            None => {
                let i = self.next.fetch_add(1, Relaxed) % self.engines.len();
                Ok(&self.engines[i])
            }
        }
    }

    /// `metrics_text`, and when LoRA is on vllm:lora_requests_info and the adapters loaded at
    /// run time. The ranks of a data-parallel replica share one vllm:lora_requests_info (no
    /// `engine` label): vLLM's ranks share one front end, whose adapters it lists.
    fn metrics_text_with_lora(&self) -> String {
        let mut text = self.metrics_text();
        if self.served.lora() {
            if let Some(info) = self.engines[0].lora_info() {
                info.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .render(&mut text);
            }
            text.push_str(&format!(
                "# HELP kvlb_replica_lora_loads_total LoRA adapters loaded through /v1/load_lora_adapter.\n\
                 # TYPE kvlb_replica_lora_loads_total counter\n\
                 kvlb_replica_lora_loads_total {}\n",
                self.served.runtime_loads.load(Relaxed)
            ));
        }
        text
    }

    /// /metrics of every rank in one exposition: each family's HELP and TYPE once, then the
    /// samples of every rank (told apart by their `engine` label).
    fn metrics_text(&self) -> String {
        if self.engines.len() == 1 {
            return self.engines[0].metrics_text();
        }
        // (family, its HELP and TYPE lines, its samples of every rank)
        let mut families: Vec<(String, String, String)> = Vec::new();
        for (rank, e) in self.engines.iter().enumerate() {
            let text = e.metrics_text();
            let mut current = None;
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix("# ") {
                    let name = rest.split_whitespace().nth(1).unwrap_or("");
                    let i = match families.iter().position(|f| f.0 == name) {
                        Some(i) => i,
                        None => {
                            families.push((name.to_string(), String::new(), String::new()));
                            families.len() - 1
                        }
                    };
                    if rank == 0 {
                        families[i].1.push_str(line);
                        families[i].1.push('\n');
                    }
                    current = Some(i);
                } else if let (false, Some(i)) = (line.is_empty(), current) {
                    families[i].2.push_str(line);
                    families[i].2.push('\n');
                }
            }
        }
        let mut out = String::new();
        for (_, head, samples) in &families {
            out.push_str(head);
            out.push_str(samples);
        }
        out
    }
}

/// Accept connections forever, one thread each.
pub fn serve(listener: TcpListener, ranks: Arc<Ranks>) {
    let replica = ranks.engines[0].clone();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let for_connection = ranks.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("replica{}-conn", replica.index))
                    .stack_size(CONNECTION_STACK_BYTES)
                    .spawn(move || handle_connection(stream, &for_connection));
                if let Err(e) = spawned {
                    eprintln!(
                        "kvlb replica: replica {}: cannot start a connection thread: {e}",
                        replica.index
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                if e.kind() != io::ErrorKind::Interrupted {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}

fn handle_connection(stream: TcpStream, ranks: &Ranks) {
    let mut conn = Connection::new(stream);
    loop {
        let req = match conn.read_request() {
            Ok(r) => r,
            Err(ReadRequestError::Closed) | Err(ReadRequestError::Io(_)) => return,
            Err(ReadRequestError::Bad { status, message }) => {
                let kind = if status == 400 {
                    "BadRequestError"
                } else {
                    "HTTPError"
                };
                let err = ApiError {
                    status,
                    kind,
                    message,
                    param: None,
                };
                let _ = conn.write_all(&http::response(
                    status,
                    Some("application/json"),
                    err.body().as_bytes(),
                    false,
                ));
                conn.lingering_close();
                return;
            }
        };
        let keep_alive = req.keep_alive;
        let result = match ranks.pick(req.dp_rank) {
            Ok(replica) => dispatch(
                &mut conn, ranks, replica, req.method, &req.path, &req.body, keep_alive,
            ),
            Err(e) => send_error(&mut conn, &e, keep_alive),
        };
        if result.is_err() || !keep_alive {
            return;
        }
    }
}

fn dispatch(
    conn: &mut Connection,
    ranks: &Ranks,
    replica: &Replica,
    method: Method,
    path: &str,
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let path = if path.len() > 1 {
        path.trim_end_matches('/')
    } else {
        path
    };
    // GET /v1/responses/{id} and POST /v1/responses/{id}/cancel.
    if let Some(rest) = path.strip_prefix("/v1/responses/") {
        let (id, cancel) = match rest.strip_suffix("/cancel") {
            Some(id) => (id, true),
            None => (rest, false),
        };
        if id.is_empty() || id.contains('/') {
            return send_error(conn, &ApiError::not_found("Not Found"), keep_alive);
        }
        let allowed = if cancel { Method::Post } else { Method::Get };
        if method != allowed {
            return send_error(conn, &ApiError::method_not_allowed(), keep_alive);
        }
        let answer = if cancel {
            ranks.responses.cancel(id)
        } else {
            ranks.responses.retrieve(id)
        };
        return match answer {
            Ok(body) => send_json(conn, &body, keep_alive),
            Err(e) => send_error(conn, &e, keep_alive),
        };
    }
    let allowed = match path {
        "/v1/completions" | "/v1/chat/completions" | "/tokenize" | "/reset_prefix_cache" => {
            Method::Post
        }
        "/v1/responses"
        | "/v1/messages"
        | "/v1/messages/count_tokens"
        | "/v1/embeddings"
        | "/v1/rerank"
        | "/rerank"
        | "/v2/rerank"
        | "/v1/score"
        | "/score"
        | "/detokenize" => Method::Post,
        "/v1/models" | "/health" | "/metrics" | "/version" | "/ping" => Method::Get,
        "/v1/load_lora_adapter" | "/v1/unload_lora_adapter" if ranks.served.runtime_updates() => {
            Method::Post
        }
        _ => return send_error(conn, &ApiError::not_found("Not Found"), keep_alive),
    };
    if method != allowed {
        if path.starts_with("/v1/messages") {
            return messages::send_error(conn, &ApiError::method_not_allowed(), keep_alive);
        }
        return send_error(conn, &ApiError::method_not_allowed(), keep_alive);
    }
    match path {
        "/v1/responses" => responses::create(
            conn,
            &ranks.served,
            &ranks.responses,
            replica,
            body,
            keep_alive,
        ),
        "/v1/messages" => messages::create(conn, &ranks.served, replica, body, keep_alive),
        "/v1/messages/count_tokens" => match messages::count_tokens(&ranks.served, body) {
            Ok(text) => send_json(conn, &text, keep_alive),
            Err(e) => messages::send_error(conn, &e, keep_alive),
        },
        "/v1/embeddings" | "/v1/rerank" | "/rerank" | "/v2/rerank" | "/v1/score" | "/score"
        | "/detokenize" => {
            let ids = replica.response_random();
            let answer = match path {
                "/v1/embeddings" => pooling::embeddings(body, &ranks.served, ids, unix_secs()),
                "/v1/score" | "/score" => pooling::score(body, &ranks.served, ids, unix_secs()),
                "/detokenize" => pooling::detokenize(body, &ranks.served),
                _ => pooling::rerank(body, &ranks.served, ids),
            };
            match answer {
                Ok(text) => send_json(conn, &text, keep_alive),
                Err(e) => send_error(conn, &e, keep_alive),
            }
        }
        "/v1/completions" | "/v1/chat/completions" => {
            let parsed = match path {
                "/v1/completions" => openai::parse_completion(body),
                _ => openai::parse_chat(body),
            };
            match parsed.and_then(|req| Ok((ranks.served.check(req.model.as_deref())?, req))) {
                Ok((named, req)) => generate(conn, replica, &ranks.served, named, req, keep_alive),
                Err(e) => send_error(conn, &e, keep_alive),
            }
        }
        "/v1/load_lora_adapter" | "/v1/unload_lora_adapter" => {
            let done = match path {
                "/v1/load_lora_adapter" => ranks.served.load(body),
                _ => ranks.served.unload(body),
            };
            match done {
                Ok(text) => conn.write_all(&http::response(
                    200,
                    Some("text/plain; charset=utf-8"),
                    text.as_bytes(),
                    keep_alive,
                )),
                Err(e) => send_error(conn, &e, keep_alive),
            }
        }
        "/tokenize" => match openai::parse_tokenize(body) {
            Ok(tokens) => send_json(
                conn,
                &openai::tokenize_response(&tokens, replica.max_model_len),
                keep_alive,
            ),
            Err(e) => send_error(conn, &e, keep_alive),
        },
        "/reset_prefix_cache" => {
            // vLLM answers 200 even when running requests keep it from resetting.
            for e in &ranks.engines {
                e.reset_prefix_cache();
            }
            conn.write_all(&http::response(200, None, b"", keep_alive))
        }
        "/v1/models" => send_json(
            conn,
            &ranks
                .served
                .list_json(replica.created, replica.max_model_len),
            keep_alive,
        ),
        "/health" | "/ping" => conn.write_all(&http::response(200, None, b"", keep_alive)),
        "/version" => send_json(conn, "{\"version\":\"0.33.0\"}", keep_alive),
        "/metrics" => conn.write_all(&http::response(
            200,
            Some("text/plain; version=0.0.4; charset=utf-8"),
            ranks.metrics_text_with_lora().as_bytes(),
            keep_alive,
        )),
        _ => send_error(conn, &ApiError::not_found("Not Found"), keep_alive),
    }
}

/// Per-choice progress of one HTTP generation request.
struct Choice {
    id: RequestId,
    prompt_index: usize,
    text: String,
    /// A streamed token not yet written (held back to carry the finish reason with it).
    held: Option<String>,
    started: bool,
    finish: Option<FinishReason>,
}

fn generate(
    conn: &mut Connection,
    replica: &Replica,
    served: &super::models::Served,
    named: super::models::Named,
    req: GenerationRequest,
    keep_alive: bool,
) -> io::Result<()> {
    let d = replica.disagg();
    let leg = match d.protocol {
        Protocol::Vllm => pd::leg(
            d.role,
            req.kv_transfer_params.as_ref(),
            req.prompts.len(),
            req.n,
        ),
        Protocol::Sglang => pd::bootstrap_leg(
            d.role,
            &req.bootstrap,
            req.prompts.len(),
            req.n,
            d.null_port,
        ),
    };
    let leg = match leg {
        Ok(leg) => leg,
        Err(e) => return send_error(conn, &e, keep_alive),
    };
    let mut arrived = None;
    // SGLang's prefill leg: the room it holds KV for (aborted if dropped unfinished).
    let mut room = None;
    let mut max_tokens = req.max_tokens;
    let transfer = match &leg {
        Leg::Whole => KvTransfer::None,
        Leg::Prefill => KvTransfer::Hold { hold_s: d.hold_s },
        Leg::RoomPrefill(r) => {
            if let Some(rooms) = d.rooms.as_deref() {
                match rooms.begin(*r) {
                    Ok(lease) => room = Some(lease),
                    Err(e) => return send_error(conn, &e, keep_alive),
                }
            }
            // SGLang's prefill server produces the first token and ends the request.
            max_tokens = 1;
            KvTransfer::Hold { hold_s: d.hold_s }
        }
        Leg::RoomDecode(at) => {
            // A request the engine will refuse is refused before its KV is fetched, as SGLang
            // validates a request before its scheduler waits for the KV.
            let prompt_tokens = req.prompts.first().map_or(0, |p| p.len());
            let limit = replica.context_limit();
            if prompt_tokens == 0 {
                let e = EngineError::EmptyPrompt;
                return send_error(conn, &ApiError::bad_request(e.to_string()), keep_alive);
            }
            if prompt_tokens as u64 + req.max_tokens.max(1) as u64 > limit as u64 {
                let e = EngineError::ContextTooLong {
                    prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
                    max_tokens: req.max_tokens,
                    max_model_len: limit,
                };
                return send_error(conn, &ApiError::bad_request(e.to_string()), keep_alive);
            }
            arrived = Some(Instant::now());
            let fetched = bootstrap::fetch(conn, replica, at);
            if fetched.is_err() {
                replica.aborted_awaiting_kv();
            }
            match fetched? {
                Ok(tokens) => KvTransfer::Received { tokens },
                Err(e) => return send_error(conn, &e, keep_alive),
            }
        }
        Leg::Local(reason, why) => {
            replica.local_prefill(*reason, why);
            KvTransfer::None
        }
        Leg::Decode(remote) => {
            arrived = Some(Instant::now());
            let received = side_channel::receive(conn, replica, remote);
            if received.is_err() {
                replica.aborted_awaiting_kv();
            }
            match received? {
                Some(tokens) => KvTransfer::Received { tokens },
                None => KvTransfer::None,
            }
        }
    };
    let (cache_salt, lora) = engine_identity(&named, req.cache_salt);
    let (tx, rx) = channel::unbounded::<Vec<EngineOutput>>();
    let mut choices: Vec<Choice> = Vec::with_capacity(req.prompts.len() * req.n as usize);
    let mut engine_requests = Vec::with_capacity(choices.capacity());
    for (p, prompt) in req.prompts.iter().enumerate() {
        for _ in 0..req.n {
            let id = replica.next_request_id();
            choices.push(Choice {
                id,
                prompt_index: p,
                text: String::new(),
                held: None,
                started: false,
                finish: None,
            });
            engine_requests.push(EngineRequest {
                id,
                prompt_tokens: prompt.clone(),
                max_tokens,
                cache_salt,
                lora: lora.clone(),
            });
        }
    }
    if let Err(e) = replica.submit_with(engine_requests, req.stream, &tx, transfer, arrived) {
        return send_error(conn, &ApiError::bad_request(e.to_string()), keep_alive);
    }
    drop(tx);
    let meta = ResponseMeta::new(
        req.endpoint,
        replica.response_random(),
        unix_secs(),
        &served.response_name(&named),
    );
    let mut usage = Usage::default();
    let mut counted_prompt = vec![false; req.prompts.len()];
    let result = if req.stream {
        stream_choices(
            conn,
            &rx,
            &meta,
            &mut choices,
            &mut usage,
            &mut counted_prompt,
            req.include_usage,
            keep_alive,
        )
    } else {
        collect_choices(conn, &rx, &mut choices, &mut usage, &mut counted_prompt).and_then(|()| {
            let results: Vec<ChoiceResult> = choices
                .iter()
                .map(|c| ChoiceResult {
                    text: c.text.clone(),
                    finish_reason: c.finish,
                })
                .collect();
            // A prefill for a remote decode says where its KV waits (one choice: `pd::leg`).
            let kv_params = match (&leg, choices.first()) {
                (Leg::Prefill, Some(c)) => side_channel::answer_params(replica, &meta.id, c.id),
                _ => serde_json::Value::Null,
            };
            send_json(
                conn,
                &openai::full_response(&meta, &results, &usage, &kv_params),
                keep_alive,
            )
        })
    };
    // A finished prefill of a room: its KV waits for the room's fetch (held by the engine
    // whether or not its answer reached the router, as SGLang's prefill holds it).
    if let (Some(lease), Some(c)) = (room, choices.first()) {
        if matches!(c.finish, Some(FinishReason::Length | FinishReason::Stop)) {
            let rank = replica.dp_rank.unwrap_or(0) as usize;
            // At most a century: the engine's own timeout frees it anyway.
            let hold = Duration::from_secs_f64(d.hold_wall_s.clamp(0.0, 3.2e9));
            lease.finished(rank, c.id, replica.held_blocks(c.id).is_some(), hold);
        }
    }
    if result.is_err() {
        let open: Vec<RequestId> = choices
            .iter()
            .filter(|c| c.finish.is_none())
            .map(|c| c.id)
            .collect();
        if !open.is_empty() {
            replica.cancel(&open);
        }
    }
    result
}

/// Index of the choice an output belongs to, and account its usage when finished.
fn apply_output(
    out: &EngineOutput,
    choices: &mut [Choice],
    usage: &mut Usage,
    counted_prompt: &mut [bool],
) -> Option<(usize, Option<u32>)> {
    let (id, token) = match out {
        EngineOutput::FirstToken { id, token, .. } | EngineOutput::Token { id, token, .. } => {
            (*id, Some(*token))
        }
        EngineOutput::Finished { id, .. } => (*id, None),
    };
    let i = choices.iter().position(|c| c.id == id)?;
    if let EngineOutput::Finished {
        reason,
        prompt_tokens,
        completion_tokens,
        cached_tokens,
        ..
    } = out
    {
        let c = &mut choices[i];
        c.finish = Some(*reason);
        usage.completion_tokens += *completion_tokens as u64;
        if !counted_prompt[c.prompt_index] {
            counted_prompt[c.prompt_index] = true;
            usage.prompt_tokens += *prompt_tokens as u64;
            usage.cached_tokens += *cached_tokens as u64;
        }
    }
    Some((i, token))
}

fn collect_choices(
    conn: &Connection,
    rx: &Receiver<Vec<EngineOutput>>,
    choices: &mut [Choice],
    usage: &mut Usage,
    counted_prompt: &mut [bool],
) -> io::Result<()> {
    while choices.iter().any(|c| c.finish.is_none()) {
        for out in next_outputs(conn, rx)? {
            if let Some((i, Some(token))) = apply_output(&out, choices, usage, counted_prompt) {
                tokenizer::decode_token(token, &mut choices[i].text);
            }
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn stream_choices(
    conn: &mut Connection,
    rx: &Receiver<Vec<EngineOutput>>,
    meta: &ResponseMeta,
    choices: &mut [Choice],
    usage: &mut Usage,
    counted_prompt: &mut [bool],
    include_usage: bool,
    keep_alive: bool,
) -> io::Result<()> {
    conn.write_all(&http::event_stream_head(keep_alive))?;
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    while choices.iter().any(|c| c.finish.is_none()) {
        let mut batch = next_outputs(conn, rx)?;
        // Take whatever else is already there: one write for everything ready.
        while let Ok(more) = rx.try_recv() {
            batch.extend(more);
        }
        out.clear();
        for o in &batch {
            let Some((i, token)) = apply_output(o, choices, usage, counted_prompt) else {
                continue;
            };
            let c = &mut choices[i];
            if let Some(token) = token {
                if let Some(prev) = c.held.take() {
                    push_choice_chunk(&mut out, meta, i, c, &prev, None);
                }
                let mut text = String::new();
                tokenizer::decode_token(token, &mut text);
                c.held = Some(text);
            } else {
                let last = c.held.take().unwrap_or_default();
                let finish = c.finish;
                push_choice_chunk(&mut out, meta, i, c, &last, finish);
            }
        }
        for (i, c) in choices.iter_mut().enumerate() {
            if let Some(prev) = c.held.take() {
                push_choice_chunk(&mut out, meta, i, c, &prev, None);
            }
        }
        if !out.is_empty() {
            conn.write_all(&out)?;
        }
    }
    out.clear();
    if include_usage {
        http::push_sse_chunk(&mut out, &openai::usage_chunk(meta, usage));
    }
    http::push_sse_chunk(&mut out, "[DONE]");
    out.extend_from_slice(http::LAST_CHUNK);
    conn.write_all(&out)
}

fn push_choice_chunk(
    out: &mut Vec<u8>,
    meta: &ResponseMeta,
    index: usize,
    c: &mut Choice,
    text: &str,
    finish: Option<FinishReason>,
) {
    if !c.started && meta.endpoint == Endpoint::Chat {
        // vLLM's first chat chunk carries the role alone.
        http::push_sse_chunk(out, &openai::stream_chunk(meta, index, "", true, None));
    }
    c.started = true;
    http::push_sse_chunk(out, &openai::stream_chunk(meta, index, text, false, finish));
}
