//! `kvlb replay`: send a request trace through a balancer, live, and measure what its clients
//! get. Every request of the trace (Mooncake JSONL, Azure CSV or a built-in generator, read by
//! `crate::sim::trace`) leaves at its own arrival time divided by `--speedup`, as a streaming
//! chat, completions, Responses or Messages request whose prompt is built from the trace's
//! block ids (equal ids, equal text: the trace's prefix sharing is real shared text); per
//! request the replayer measures the time to the first server-sent event (TTFT; for Responses
//! and Messages, the first text delta) and to the end of the answer. Given the replicas' URLs,
//! it reads their own `/metrics` before and after, so requests, prompt tokens computed and the
//! prefix-cache hit rate per replica are what the engines report. The summary is printed and
//! written as JSON; `kvlb replay report` puts several summaries side by side (table, ratios,
//! combined JSON, SVG plot).
//!
//! * `client`: the HTTP side (one connection per request, streamed answers timed);
//! * `counters`: the replicas' `/metrics` counters;
//! * `summary`: one replay's numbers, and the side-by-side report.
//!
//! Open loop: a request is sent when its time comes whether or not earlier ones are answered,
//! each on its own thread (a few hundred in flight cost a few hundred small stacks); how late
//! the replayer itself sent is reported, so an overloaded load generator is visible.

pub mod client;
pub mod counters;
pub mod summary;

use crate::sim::trace::{self, TraceRequest};
use counters::{EngineCounters, Occupancy, QueueGauges};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};
use summary::{ReplaySummary, RequestRecord};

const AFTER_HELP: &str = "\
Summaries side by side:
kvlb replay report [--title T] [--kvlb LABEL] [--baseline LABEL] [--failed LABEL=WHY]...
                   [--json FILE] [--plot FILE.svg] SUMMARY.json...
  reads summaries written by --json, prints them side by side with the ratios of --kvlb
  (default: the first) to --baseline (default: a label containing round_robin) and to the best
  of the others (lowest p99 TTFT), and writes the combined JSON and an SVG (TTFT CDF per
  balancer, prompt tokens computed per replica). --failed names a balancer that could not run.";

/// `--api`.
#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
pub enum Api {
    /// /v1/chat/completions: the prompt as one user message; TTFT at the first event, the end
    /// at data: [DONE]
    Chat,
    /// /v1/completions: the prompt as text or token ids; TTFT at the first event, the end at
    /// data: [DONE]
    Completions,
    /// /v1/responses (OpenAI's Responses API): the prompt as the input string, store false;
    /// TTFT at the first response.output_text.delta, the end at response.completed or
    /// response.incomplete
    Responses,
    /// /v1/messages (Anthropic's Messages API): the prompt as one user message; TTFT at the
    /// first text content_block_delta, the end at message_stop
    Messages,
}

impl Api {
    /// The name `--api` takes and the summary's `api` field.
    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
        }
    }
}

/// `--prompt`.
#[derive(Debug, Clone, Copy, PartialEq, clap::ValueEnum)]
pub enum PromptForm {
    /// the prompt as text
    Text,
    /// for completions, the token ids the replicas' tokenizer gives that text
    TokenIds,
}

/// Replay a request trace through a balancer, live, and measure what its clients get.
///
/// Replays a request trace through the balancer at URL (http://HOST:PORT) in real time: each
/// request leaves at its trace arrival time divided by --speedup, streams its answer, and its
/// time to first token (first SSE event; with --api responses or messages, the first text
/// delta) and end-to-end time are measured.
#[derive(Debug, Clone, PartialEq, clap::Parser)]
#[command(
    name = "kvlb replay",
    after_help = AFTER_HELP,
    args_override_self = true,
    mut_args = crate::cli::hyphen_values
)]
pub struct Options {
    /// The balancer (or one replica) to send to
    #[arg(long, value_name = "URL", value_parser = http_url)]
    pub target: String,
    /// Mooncake JSONL or Azure CSV file, or gen:shared-prefix, gen:agent-sessions
    #[arg(long, value_name = "SPEC", value_parser = crate::cli::non_empty)]
    pub trace: String,
    /// Skip requests arriving before S trace seconds
    #[arg(long = "start", value_name = "S", default_value_t = 0.0,
          value_parser = crate::cli::non_negative)]
    pub start_s: f64,
    /// Only requests arriving within S trace seconds after --start
    #[arg(long = "duration", value_name = "S", value_parser = crate::cli::positive)]
    pub duration_s: Option<f64>,
    /// At most N requests (after --start / --duration)
    #[arg(long, value_name = "N", value_parser = crate::cli::int::<usize, 1, { u32::MAX as u64 }>)]
    pub limit: Option<usize>,
    /// Divide arrival times by X
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = crate::cli::positive)]
    pub speedup: f64,
    /// The replicas' --time-scale: reported times are wall seconds times X, in the simulated
    /// engine's seconds (1: wall seconds)
    #[arg(long, value_name = "X", default_value_t = 1.0, value_parser = crate::cli::positive)]
    pub time_scale: f64,
    /// The API to call
    #[arg(long, value_enum, default_value_t = Api::Chat)]
    pub api: Api,
    /// Prompts as text or, for completions, as token ids
    #[arg(long, value_enum, default_value_t = PromptForm::Text)]
    pub prompt: PromptForm,
    /// Cap each request's output tokens (default: the trace's)
    #[arg(long, value_name = "N", value_parser = crate::cli::int::<u32, 1, { u32::MAX as u64 }>)]
    pub max_output: Option<u32>,
    /// The model field of requests whose trace row names none (a Mooncake line's own
    /// "model" key is sent as it is)
    #[arg(long, value_name = "NAME", default_value = "sim")]
    pub model: String,
    /// Instead of --model, give rows naming no model one of these by weight, per session (e.g.
    /// Qwen/Qwen3-8B=0.6,Qwen/Qwen3-0.6B=0.3,sql-lora=0.1): a hash of the row's first block id
    /// past the prefix all rows share picks it, so a conversation keeps one model, the same in
    /// every run and slice
    #[arg(long, value_name = "NAME=W,...", conflicts_with = "model")]
    pub models: Option<trace::ModelMix>,
    /// A replica behind the balancer (repeatable): its /metrics is read before and after,
    /// giving requests, prompt tokens computed and hit rate per replica
    #[arg(long = "replica", value_name = "URL", value_parser = http_url)]
    pub replicas: Vec<String>,
    /// The name in the summary (default: the target URL)
    #[arg(long, value_name = "NAME")]
    pub label: Option<String>,
    /// Write the summary as JSON (- for stdout)
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
    /// Per-request limit in wall seconds
    #[arg(long = "timeout", value_name = "S", default_value_t = 600.0,
          value_parser = crate::cli::positive)]
    pub timeout_s: f64,
    /// Generator seed
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = crate::cli::int::<u64, 0, { u64::MAX }>)]
    pub seed: u64,
    /// No progress lines
    #[arg(long)]
    pub quiet: bool,
}

/// `--target`, `--replica`: http://HOST:PORT (resolved now, to check it), without a trailing /.
fn http_url(v: &str) -> Result<String, String> {
    client::base_addr(v).map_err(|e| match e.strip_prefix(&format!("{v:?}: ")) {
        Some(why) => why.to_string(),
        None => e,
    })?;
    Ok(v.trim_end_matches('/').to_string())
}

impl Options {
    /// The checks across flags; the error names the flags.
    pub fn validate(&self) -> Result<(), String> {
        if self.prompt == PromptForm::TokenIds && self.api != Api::Completions {
            return Err(format!(
                "--prompt token-ids needs --api completions ({} prompts are text)",
                self.api.name()
            ));
        }
        Ok(())
    }
}

/// Parse `kvlb replay` flags (without the `replay` word). `--help` comes back as an error of
/// kind `DisplayHelp` (exit status 0), like every parse error ready for `cli::exit_status`.
pub fn parse_args(args: &[String]) -> Result<Options, clap::Error> {
    crate::cli::parse("kvlb replay", args, Options::validate)
}

/// The requests of the trace slice `o` asks for, arrivals rebased to the slice's start (trace
/// seconds, not yet divided by the speedup), each with the model it is sent for (its row's,
/// else `--models`' pick over the whole trace, else `--model`).
pub fn select_requests(o: &Options) -> Result<Vec<TraceRequest>, String> {
    let mut t = trace::load(&o.trace, None, o.seed)?;
    if let Some(mix) = &o.models {
        mix.assign(&mut t.requests);
    }
    for r in &mut t.requests {
        r.model.get_or_insert_with(|| o.model.clone());
    }
    let end = o.duration_s.map(|d| o.start_s + d).unwrap_or(f64::INFINITY);
    let mut out: Vec<TraceRequest> = t
        .requests
        .into_iter()
        .filter(|r| r.arrival_s >= o.start_s && r.arrival_s < end)
        .collect();
    if let Some(n) = o.limit {
        out.truncate(n);
    }
    if out.is_empty() {
        return Err(format!(
            "--trace {:?}: no requests between {} s and {} s",
            o.trace, o.start_s, end
        ));
    }
    for r in &mut out {
        r.arrival_s -= o.start_s;
    }
    Ok(out)
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}

/// The request path and JSON body for one trace request (streamed, with the usage that tells
/// the prompt tokens found cached: chat and completions ask for the usage event; the
/// Responses and Messages streams end with theirs).
pub fn request_body(req: &TraceRequest, o: &Options) -> (&'static str, Vec<u8>) {
    let mut text = String::new();
    trace::prompt_text(req, &mut text);
    let max_tokens = req
        .output_tokens
        .max(1)
        .min(o.max_output.unwrap_or(u32::MAX));
    let model = json_str(req.model.as_deref().unwrap_or(&o.model));
    match o.api {
        Api::Chat => (
            "/v1/chat/completions",
            format!(
                r#"{{"model":{model},"messages":[{{"role":"user","content":{}}}],"max_tokens":{max_tokens},"stream":true,"stream_options":{{"include_usage":true}},"ignore_eos":true}}"#,
                json_str(&text)
            )
            .into_bytes(),
        ),
        Api::Completions => {
            let prompt = match o.prompt {
                PromptForm::Text => json_str(&text),
                PromptForm::TokenIds => {
                    let mut ids = Vec::new();
                    crate::engine::tokenizer::encode(&text, &mut ids);
                    serde_json::to_string(&ids).expect("ids serialise")
                }
            };
            (
                "/v1/completions",
                format!(
                    r#"{{"model":{model},"prompt":{prompt},"max_tokens":{max_tokens},"stream":true,"stream_options":{{"include_usage":true}},"ignore_eos":true}}"#
                )
                .into_bytes(),
            )
        }
        Api::Responses => (
            "/v1/responses",
            format!(
                r#"{{"model":{model},"input":{},"max_output_tokens":{max_tokens},"stream":true,"store":false}}"#,
                json_str(&text)
            )
            .into_bytes(),
        ),
        Api::Messages => (
            "/v1/messages",
            format!(
                r#"{{"model":{model},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":{}}}],"stream":true}}"#,
                json_str(&text)
            )
            .into_bytes(),
        ),
    }
}

fn fetch_all(replicas: &[(String, SocketAddr)]) -> Result<Vec<EngineCounters>, String> {
    replicas
        .iter()
        .map(|(url, addr)| {
            EngineCounters::fetch(*addr).map_err(|e| format!("--replica {url}: {e}"))
        })
        .collect()
}

/// Replay `o` and summarise it.
pub fn run(o: &Options) -> Result<ReplaySummary, String> {
    let target = client::base_addr(&o.target)?;
    let replicas: Vec<(String, SocketAddr)> = o
        .replicas
        .iter()
        .map(|u| client::base_addr(u).map(|a| (u.clone(), a)))
        .collect::<Result<_, _>>()?;
    let requests = select_requests(o)?;
    let before = fetch_all(&replicas)?;
    let total = requests.len();
    let label = o.label.clone().unwrap_or_else(|| o.target.clone());
    if !o.quiet {
        eprintln!(
            "kvlb replay: {label}: {total} requests over {:.0} s of trace, {:.1} s of wall time at speedup {}",
            requests.last().map(|r| r.arrival_s).unwrap_or(0.0),
            requests.last().map(|r| r.arrival_s).unwrap_or(0.0) / o.speedup,
            o.speedup
        );
    }
    let timeout = Duration::from_secs_f64(o.timeout_s);
    let (tx, rx) = mpsc::channel::<RequestRecord>();
    let sampler = OccupancySampler::start(&replicas);
    let started = Instant::now();
    let mut last_progress = started;
    let mut records = Vec::with_capacity(total);
    for (index, req) in requests.iter().enumerate() {
        let due = started + Duration::from_secs_f64(req.arrival_s / o.speedup);
        loop {
            // Collect answers while waiting, so progress can be shown.
            let now = Instant::now();
            if now >= due {
                break;
            }
            match rx.recv_timeout(due - now) {
                Ok(r) => records.push(r),
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    std::thread::sleep(due.saturating_duration_since(Instant::now()))
                }
            }
        }
        let late_s = Instant::now().saturating_duration_since(due).as_secs_f64();
        let tx = tx.clone();
        let opts = o.clone();
        let req = req.clone();
        let spawned = std::thread::Builder::new()
            .name("replay-request".into())
            .stack_size(256 * 1024)
            .spawn(move || {
                let (path, body) = request_body(&req, &opts);
                let answer = client::stream(target, path, &body, opts.api, timeout, false);
                let _ = tx.send(RequestRecord::from_answer(index, late_s, answer));
            });
        if let Err(e) = spawned {
            records.push(RequestRecord::failed(
                index,
                late_s,
                format!("cannot start a request thread: {e}"),
            ));
        }
        if !o.quiet && last_progress.elapsed() >= Duration::from_secs(5) {
            last_progress = Instant::now();
            progress(&label, index + 1, records.len(), total, &records, started);
        }
    }
    drop(tx);
    for r in rx.iter() {
        records.push(r);
        if !o.quiet && last_progress.elapsed() >= Duration::from_secs(5) {
            last_progress = Instant::now();
            progress(&label, total, records.len(), total, &records, started);
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    let occupancy = sampler.finish();
    let after = fetch_all(&replicas)?;
    let per_replica: Vec<(String, EngineCounters)> = replicas
        .iter()
        .zip(after.iter().zip(&before))
        .map(|((url, _), (a, b))| (url.clone(), a.since(b)))
        .collect();
    Ok(summary::summarize(
        summary::RunInfo {
            label,
            target: o.target.clone(),
            trace: o.trace.clone(),
            api: o.api.name().into(),
            speedup: o.speedup,
            time_scale: o.time_scale,
            wall_s,
            cpu_s: own_cpu_s(),
        },
        &requests,
        &records,
        &per_replica,
        occupancy,
    ))
}

/// The replicas' queue gauges, read every [`OCCUPANCY_EVERY`] while a replay runs.
const OCCUPANCY_EVERY: Duration = Duration::from_millis(100);

/// A thread reading every `--replica`'s queue gauges at a fixed interval, so the summary can
/// tell how often a replica sat idle while another had a queue.
struct OccupancySampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Occupancy>>,
}

impl OccupancySampler {
    fn start(replicas: &[(String, SocketAddr)]) -> OccupancySampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let addrs: Vec<SocketAddr> = replicas.iter().map(|(_, a)| *a).collect();
        let flag = stop.clone();
        let thread = (!addrs.is_empty())
            .then(|| {
                std::thread::Builder::new()
                    .name("replay-occupancy".into())
                    .spawn(move || {
                        let mut o = Occupancy::new(addrs.len());
                        let mut fleet = Vec::with_capacity(addrs.len());
                        let mut next = Instant::now();
                        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                            fleet.clear();
                            for a in &addrs {
                                match client::http(*a, "GET", "/metrics", b"") {
                                    Ok((200, body)) => fleet
                                        .push(QueueGauges::parse(&String::from_utf8_lossy(&body))),
                                    _ => break,
                                }
                            }
                            // A moment counts only when every replica answered.
                            if fleet.len() == addrs.len() {
                                o.add(&fleet);
                            }
                            next += OCCUPANCY_EVERY;
                            std::thread::sleep(next.saturating_duration_since(Instant::now()));
                        }
                        o
                    })
                    .ok()
            })
            .flatten();
        OccupancySampler { stop, thread }
    }

    fn finish(mut self) -> Option<Occupancy> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().and_then(|t| t.join().ok())
    }
}

/// CPU seconds (user + system) this process used so far.
fn own_cpu_s() -> f64 {
    // Safety: getrusage(2) fills the zeroed struct we own; RUSAGE_SELF needs nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

fn progress(
    label: &str,
    sent: usize,
    answered: usize,
    total: usize,
    records: &[RequestRecord],
    started: Instant,
) {
    let errors = records.iter().filter(|r| r.error.is_some()).count();
    eprintln!(
        "kvlb replay: {label}: {:.0} s: sent {sent}/{total}, answered {answered}, in flight {}, errors {errors}",
        started.elapsed().as_secs_f64(),
        sent.saturating_sub(answered)
    );
}

pub fn main(args: Vec<String>) -> i32 {
    if args.first().map(String::as_str) == Some("report") {
        return summary::report_main(&args[1..]);
    }
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => return crate::cli::exit_status(&e),
    };
    let s = match run(&o) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvlb replay: {e}");
            return 1;
        }
    };
    print!("{}", summary::table(std::slice::from_ref(&s)));
    if let Some(path) = &o.json {
        let text = serde_json::to_string_pretty(&s).expect("summary serialises");
        if path == "-" {
            println!("{text}");
        } else if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("kvlb replay: --json {path:?}: cannot write: {e}");
            return 1;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn flags_parse_and_bad_ones_are_named() {
        // clap checks its definition in debug builds (`cargo test` without --release).
        <Options as clap::CommandFactory>::command().debug_assert();
        let o = parse_args(&args(
            "--target http://127.0.0.1:9/ --trace gen:shared-prefix --speedup 4 --replica http://127.0.0.1:10 --api completions --prompt token-ids",
        ))
        .unwrap();
        assert_eq!(o.target, "http://127.0.0.1:9");
        assert_eq!(o.speedup, 4.0);
        assert_eq!(o.replicas, vec!["http://127.0.0.1:10"]);
        for (bad, says) in [
            ("--trace x", "--target"),
            ("--target http://127.0.0.1:9", "--trace"),
            ("--target 127.0.0.1:9 --trace x", "--target"),
            (
                "--target http://127.0.0.1:9 --trace x --speedup 0",
                "--speedup",
            ),
            ("--target http://127.0.0.1:9 --trace x --api grpc", "--api"),
            (
                "--target http://127.0.0.1:9 --trace x --prompt token-ids",
                "token-ids",
            ),
            (
                "--target http://127.0.0.1:9 --trace x --api responses --prompt token-ids",
                "responses prompts are text",
            ),
            ("--target http://127.0.0.1:9 --trace x --bogus 1", "--bogus"),
            (
                "--target http://127.0.0.1:9 --trace x --limit",
                "a value is required for '--limit",
            ),
            (
                "--target http://127.0.0.1:9 --trace x --replica http://h/p",
                "'http://h/p' for '--replica <URL>': expected http://HOST:PORT with no path",
            ),
            (
                "--target http://127.0.0.1:9 --trace x --timeout -1",
                "'-1' for '--timeout <S>'",
            ),
            (
                "--target http://127.0.0.1:9 --trace x --start -1",
                "'-1' for '--start <S>'",
            ),
        ] {
            let e = parse_args(&args(bad)).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // Defaults, and repeats: --replica adds up, any other flag's last value wins.
        let o = parse_args(&args("--target http://127.0.0.1:9 --trace x")).unwrap();
        assert_eq!((o.start_s, o.duration_s, o.limit), (0.0, None, None));
        assert_eq!(
            (o.speedup, o.time_scale, o.timeout_s, o.seed),
            (1.0, 1.0, 600.0, 1)
        );
        assert_eq!(
            (o.api, o.prompt, o.max_output),
            (Api::Chat, PromptForm::Text, None)
        );
        assert_eq!(o.model, "sim");
        assert!(o.replicas.is_empty() && o.label.is_none() && o.json.is_none() && !o.quiet);
        let o = parse_args(&args(
            "--target http://127.0.0.1:9 --trace x --replica http://127.0.0.1:1 --replica=http://127.0.0.1:2/ --speedup 2 --speedup 3 --quiet",
        ))
        .unwrap();
        assert_eq!(o.replicas, ["http://127.0.0.1:1", "http://127.0.0.1:2"]);
        assert_eq!(o.speedup, 3.0);
        assert!(o.quiet);
        let e = parse_args(&args("--help")).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
    }

    #[test]
    fn slices_are_rebased_and_bodies_carry_the_shared_text() {
        let mut o = parse_args(&args(
            "--target http://127.0.0.1:9 --trace gen:shared-prefix --start 10 --duration 5",
        ))
        .unwrap();
        let reqs = select_requests(&o).unwrap();
        assert!(!reqs.is_empty());
        assert!(reqs.iter().all(|r| (0.0..5.0).contains(&r.arrival_s)));
        o.max_output = Some(7);
        let (path, body) = request_body(&reqs[0], &o);
        assert_eq!(path, "/v1/chat/completions");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["max_tokens"], 7);
        assert_eq!(v["stream"], true);
        let content = v["messages"][0]["content"].as_str().unwrap();
        assert_eq!(
            crate::engine::tokenizer::count_tokens(content),
            reqs[0].prompt_tokens as usize
        );
        o.api = Api::Responses;
        let (path, body) = request_body(&reqs[0], &o);
        assert_eq!(path, "/v1/responses");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["input"].as_str(), Some(content));
        assert_eq!(
            (&v["max_output_tokens"], &v["stream"], &v["store"]),
            (&7.into(), &true.into(), &false.into())
        );
        o.api = Api::Messages;
        let (path, body) = request_body(&reqs[0], &o);
        assert_eq!(path, "/v1/messages");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["messages"][0]["content"].as_str(), Some(content));
        assert_eq!(v["messages"][0]["role"], "user");
        assert_eq!((&v["max_tokens"], &v["stream"]), (&7.into(), &true.into()));
        o.api = Api::Completions;
        o.prompt = PromptForm::TokenIds;
        let (path, body) = request_body(&reqs[0], &o);
        assert_eq!(path, "/v1/completions");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v["prompt"].as_array().unwrap().len(),
            reqs[0].prompt_tokens as usize
        );
        o.start_s = 1e9;
        assert!(select_requests(&o).unwrap_err().contains("no requests"));
    }
}
